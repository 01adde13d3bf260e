"""The scheduler half of a decode engine (``kv_consumer``): which requests
are restored from a handoff, decided from the request alone — no daemon
round trip on the scheduler's thread.

A request whose ``kv_transfer_params`` carry a handoff advertises the
producer's prompt as external tokens to load asynchronously: vLLM parks it
(``WAITING_FOR_REMOTE_KVS``) while the worker's mover finds the
publication READY by name, claims it for this engine's reader and session
with this engine's layout, and restores it; the engine steps its other
requests meanwhile. Two requests carry a handoff: the stock one (vLLM's
disaggregated proxies, and ``python -m pdstor.proxy``) sends the
**original prompt** — every chunk is restored and verified, and vLLM
computes the last prompt token again, as it does for every full-prompt hit,
so the decode's first token is checked against the producer's (a mismatch
counted and logged; the timeline's continuation starts with the decode's
own token); the other sends the prompt with the producer's first token
appended, and the decode continues from it. Whatever goes wrong — no
publication, a forged receipt, another model, a prompt that is not the
producer's, a refused claim — still advertises the tokens, so the worker
reports the blocks through vLLM's load-error path
(``kv_load_failure_policy``): the request fails under ``"fail"`` and is
recomputed (and counted) under ``"recompute"``, never silently.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import pdstor

from ._context import Context
from ._format import prompt_digest
from ._meta import LoadSpec

log = logging.getLogger("pdstor.vllm")


@dataclass
class _Plan:
    """A handed-over request this engine decodes, between its match and its
    allocation."""

    prompt_tokens: int
    digest: bytes
    expect_token: int
    # Tokens advertised: the whole prompt (stock; vLLM computes the last
    # again) or the producer's prompt (spliced: the first token follows).
    advertised: int
    local_tokens: int
    name: str | None
    ready: str | None
    error: str | None
    # The producer's first token follows its prompt in this request's prompt.
    spliced: bool = True
    # The producer's tensor-parallel size: how many shard publications it made.
    producer_tp: int = 1


class Consumer:
    def __init__(self, ctx: Context, counters: Any):
        self.ctx, self.counters, self.shape = ctx, counters, ctx.shape
        self.plans: dict[str, _Plan] = {}
        self.consumed: set[str] = set()
        self.loads: list[LoadSpec] = []
        # Requests being restored: request id -> the blocks the restore fills,
        # and since when (for the load_wait latency).
        self.loading: dict[str, tuple[list[int], float]] = {}
        # Decode requests restored from a publication: request id -> (its
        # name, the producer's token, whether the prompt carries it).
        self.handed: dict[str, tuple[str, int, bool]] = {}

    def match(self, request: Any, num_computed_tokens: int, params: dict) -> tuple[int | None, bool]:
        rid = request.request_id
        if rid in self.consumed:
            # Restored and acknowledged before a preemption: vLLM recomputes
            # or finds its own prefix cache; the publication is gone.
            return 0, False
        plan = self.plans.get(rid)
        if plan is None:
            plan = self._plan(request, params)
            self.plans[rid] = plan
        plan.local_tokens = num_computed_tokens
        n = max(plan.advertised - num_computed_tokens, 0)
        return n, n > 0

    def _plan(self, request: Any, params: dict) -> _Plan:
        prompt = list(request.prompt_token_ids or [])
        tokens, token, tp = params.get("prompt_tokens"), params.get("first_token"), params.get("tp", 1)
        error = params.get("error")
        if error is not None:
            error = f"the producer did not hand this request over: {error}"
        elif not isinstance(tokens, int) or not 0 < tokens <= len(prompt):
            error = (
                f"kv_transfer_params.pdstor.prompt_tokens={tokens!r} does not fit this prompt of {len(prompt)} tokens"
            )
        elif not isinstance(token, int):
            error = f"kv_transfer_params.pdstor.first_token={token!r} is not a token id"
        elif not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            error = f"kv_transfer_params.pdstor.tp={tp!r} is not a tensor-parallel size"
        elif tokens < len(prompt) and prompt[tokens] != token:
            error = (
                f"the prompt carries {prompt[tokens]} at position {tokens}, not the producer's first token {token}: "
                "send the producer's prompt unchanged (or with its first token appended)"
            )
        elif "prompt_digest" in params and params["prompt_digest"] != prompt_digest(prompt[:tokens]).hex():
            error = (
                f"the first {tokens} tokens of this prompt are not the producer's (their SHA-256 differs from "
                "kv_transfer_params.pdstor.prompt_digest): send the producer's prompt unchanged"
            )
        name, ready = params.get("req"), params.get("receipt")
        if error is None and not isinstance(ready, str) and not isinstance(name, str):
            error = "kv_transfer_params.pdstor has neither a receipt nor a request name (req)"
        if error is None and isinstance(ready, str):
            try:
                name = pdstor.Receipt.from_json(ready).req_id
            except (ValueError, TypeError) as e:
                error = f"kv_transfer_params.pdstor.receipt is not a receipt: {e}"
        if error is not None:
            return _Plan(len(prompt), prompt_digest(prompt), -1, len(prompt), 0, None, None, error)
        assert isinstance(tokens, int) and isinstance(token, int)
        return _Plan(
            tokens,
            prompt_digest(prompt[:tokens]),
            token,
            tokens,
            0,
            name if isinstance(name, str) else None,
            ready if isinstance(ready, str) else None,
            None,
            spliced=tokens < len(prompt),
            producer_tp=tp,
        )

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        plan = self.plans.pop(rid, None)
        if plan is None:
            # A second call, for the blocks of the tokens computed after a restore.
            return
        block_ids = list(blocks.get_block_ids()[0])
        bs = self.shape.block_tokens
        first = plan.local_tokens // bs
        last = -(-(plan.local_tokens + num_external_tokens) // bs)
        fill = [(i, block_ids[i]) for i in range(first, min(last, len(block_ids)))]
        if plan.error is not None:
            self.counters.load_refused += 1
            log.error("pdstor.vllm: request %s: its handed-over KV cannot be loaded: %s", rid, plan.error)
        else:
            self.handed[rid] = (plan.name or "", plan.expect_token, plan.spliced)
        report = num_external_tokens > 0
        if report:
            self.loading[rid] = ([b for _, b in fill], time.monotonic())
        self.consumed.add(rid)
        self.loads.append(
            LoadSpec(
                req_id=rid,
                name=plan.name,
                ready=plan.ready,
                error=plan.error,
                prompt_tokens=plan.prompt_tokens,
                digest=plan.digest,
                expect_token=plan.expect_token,
                fill=fill,
                report=report,
                producer_tp=plan.producer_tp,
            )
        )

    def take_loads(self) -> list[LoadSpec]:
        out, self.loads = self.loads, []
        return out

    def update_output(self, out: Any) -> None:
        """The worker's report of finished restores (and the blocks of the
        failed ones, in the same step)."""
        invalid = set(out.invalid_block_ids or ())
        for rid in out.finished_recving or ():
            loading = self.loading.pop(rid, None)
            if loading is None:
                continue
            blocks, since = loading
            self.ctx.stats.time("load_wait", time.monotonic() - since)
            if invalid.intersection(blocks):
                self.counters.load_failed += 1
                self.handed.pop(rid, None)
            else:
                self.counters.restored += 1

    def finished(self, request: Any) -> None:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        self.plans.pop(rid, None)
        self.consumed.discard(rid)
        # (A request finished while its restore runs stays in `loading`:
        # the worker reports that restore all the same.)
        handed = self.handed.pop(rid, None)
        if handed is not None and request.status not in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
            self._continuation(rid, *handed, list(request.output_token_ids))

    def _continuation(self, rid: str, name: str, token: int, spliced: bool, outputs: list[int]) -> None:
        """The whole generation from the handoff, on the timeline: the
        producer's token and then this decode's, or (stock) this decode's
        own, its first checked against the producer's."""
        if spliced:
            self.ctx.note("continuation", req_id=name, tokens=[token, *outputs])
            return
        if outputs and outputs[0] != token:
            self.counters.first_token_mismatches += 1
            log.error(
                "pdstor.vllm: request %s (%s): the decode's first token %d differs from the producer's %d: "
                "the two engines do not compute alike (model, dtype, sampling) "
                "or the restored KV is not the producer's",
                rid,
                name,
                outputs[0],
                token,
            )
        self.ctx.note("continuation", req_id=name, tokens=outputs)
