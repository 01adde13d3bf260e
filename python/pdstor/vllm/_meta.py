"""What the scheduler half tells the worker half each step (pickled between
processes by vLLM): plain data only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    # Writer.handoff() of the request's publication of each tensor-parallel
    # rank's shard, by rank (each carries its writer's token).
    handoffs: tuple[str, ...]
    prompt_tokens: int
    digest: bytes
    # (chunk index, block id), in chunk order.
    chunks: list[tuple[int, int]]
    # After these, every chunk of the publication is stored.
    last: bool
    # Set by the worker, never sent: what the copy waits for (a CUDA event
    # recorded on the engine's stream after the forward pass that wrote
    # these blocks was queued).
    after: Any = field(default=None, repr=False, compare=False)


@dataclass
class EndSpec:
    """The end of one request's publication, once its stores are done:
    published READY with the producer's first token, or rolled back."""

    req_id: str
    # Writer.handoff() of each rank's shard publication, by rank.
    handoffs: tuple[str, ...]
    # The first output token to publish with; None rolls the publication back.
    first_token: int | None
    # Why it is rolled back (for the log).
    why: str
    # The scheduler held the request's blocks for its stores
    # (request_finished answered True): report it through get_finished.
    release: bool


@dataclass
class LoadSpec:
    """One handed-over request to restore in the background, or to fail."""

    req_id: str
    # The publication's name (looked up until it is READY), or its READY
    # receipt (JSON) where the producer's kv_transfer_params carried one.
    name: str | None
    ready: str | None
    # Why it cannot be loaded, when it cannot.
    error: str | None
    prompt_tokens: int
    digest: bytes
    # The producer's first token, which the manifest must carry.
    expect_token: int
    # (chunk index, block id) to fill; chunks before the first are in the
    # local prefix cache (loaded and verified all the same, never copied).
    fill: list[tuple[int, int]]
    # vLLM waits for it (WAITING_FOR_REMOTE_KVS): report it through
    # get_finished. False where every token was in the local prefix cache:
    # the publication is still claimed, verified and acknowledged.
    report: bool = True
    # The producer's tensor-parallel size (its kv_transfer_params "tp"):
    # rank r restores shard r's publication (shard_name).
    producer_tp: int = 1


@dataclass
class PdstorMetadata(KVConnectorMetadata):
    saves: list[SaveSpec] = field(default_factory=list)
    ends: list[EndSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
