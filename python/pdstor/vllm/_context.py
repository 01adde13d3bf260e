"""What both halves of one engine's connector share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pdstor

from ._format import Shape
from ._recorder import Recorder


@dataclass(frozen=True)
class Context:
    client: pdstor.Client
    # The pdstor layout both engines must agree on (_identity.engine_layout).
    layout: dict
    shape: Shape
    # The connector's Config.
    cfg: Any
    engine_id: str
    timeline: pdstor.Timeline | None
    # This half's counts and latencies, for vLLM's connector stats.
    stats: Recorder = field(default_factory=Recorder)
    # Every tensor-parallel rank's layout, by rank (the scheduler prepares
    # each rank's shard publication); empty: one rank, `layout`.
    layouts: tuple[dict, ...] = ()
    # This worker's tensor-parallel rank (0 in the scheduler).
    rank: int = 0

    @property
    def shard_layouts(self) -> tuple[dict, ...]:
        return self.layouts or (self.layout,)

    @property
    def tp_size(self) -> int:
        return len(self.shard_layouts)

    @property
    def session(self) -> str:
        """The session this engine's claims bind (the same in both halves;
        a tensor-parallel rank's own)."""
        return f"vllm-{self.engine_id}" + (f".tp{self.rank}" if self.tp_size > 1 else "")

    def note(self, event: str, **fields: Any) -> None:
        """A timeline line, where the engine keeps one."""
        if self.timeline is not None:
            self.timeline.emit(event, **fields)
