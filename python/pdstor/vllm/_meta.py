"""What the scheduler half tells the worker half each step (pickled between
processes by vLLM): plain data only."""

from __future__ import annotations

from dataclasses import dataclass, field

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
except ModuleNotFoundError as e:
    if e.name is None or e.name.split(".")[0] != "vllm":
        raise

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """vLLM's (empty) base of connector metadata, where vLLM is not
        installed: the worker half alone, driven by the GPU bundle."""


@dataclass
class SaveSpec:
    """Blocks of one request's prompt to store this step."""

    req_id: str
    # Writer.handoff() of the request's publication (carries the writer's token).
    handoff: str
    prompt_tokens: int
    digest: bytes
    # (chunk index, block id), in chunk order.
    chunks: list[tuple[int, int]]
    # After these, every chunk of the publication is stored.
    last: bool


@dataclass
class LoadSpec:
    """One handed-over request to restore this step, or to fail."""

    req_id: str
    # The claim receipt (JSON), when the claim was granted.
    claim: str | None
    # Why it cannot be loaded, when it cannot.
    error: str | None
    prompt_tokens: int
    digest: bytes
    # The producer's first token, which the manifest must carry.
    expect_token: int
    # (chunk index, block id) to fill; chunks before the first are in the
    # local prefix cache (loaded and verified all the same, never copied).
    fill: list[tuple[int, int]]


@dataclass
class PdstorMetadata(KVConnectorMetadata):
    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
