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

    @property
    def session(self) -> str:
        """The session this engine's claims bind (the same in both halves)."""
        return f"vllm-{self.engine_id}"

    def note(self, event: str, **fields: Any) -> None:
        """A timeline line, where the engine keeps one."""
        if self.timeline is not None:
            self.timeline.emit(event, **fields)
