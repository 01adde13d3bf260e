"""The connector's scheduler half: which requests are handed over, and the
protocol steps that decide ownership — prepare, publish, claim — while the
worker half moves the bytes.

Producer: a request is prepared when the scheduler first considers it (its
chunks from its prompt; a full store waits at admission by being asked
again next step, up to ``admission_timeout_s``, never by blocking the
scheduler); each step hands the worker the blocks its prompt completed;
``request_finished`` publishes READY with the first output token and returns
the READY receipt in ``kv_transfer_params``. An aborted request's
publication is aborted; a preempted one's too, and it is prepared anew when
it is scheduled again.

Consumer: a request whose ``kv_transfer_params`` carry a handoff advertises
the producer's prompt tokens as external; after allocation it is claimed
for this engine's reader and session with this engine's layout. Two
requests carry a handoff: the stock one (vLLM's disaggregated proxies, and
``python -m pdstor.proxy``) sends the **original prompt** — every chunk is
restored and verified, and the last prompt token is computed again, as vLLM
does for every full-prompt hit, so the decode's first token is checked
against the producer's (a mismatch counted and logged; the timeline's
continuation starts with the decode's own token); the other sends the prompt
with the producer's first token appended, and the decode continues from it.
Whatever goes wrong — no receipt, a forged one, another model, a prompt that
is not the producer's, a refused claim — still advertises the tokens, so
the worker reports the blocks through vLLM's load-error path
(``kv_load_failure_policy``): the request fails under ``"fail"`` and is
recomputed (and counted) under ``"recompute"``, never silently.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import pdstor

from ._context import Context
from ._format import prompt_digest
from ._meta import LoadSpec, PdstorMetadata, SaveSpec

log = logging.getLogger("pdstor.vllm")

PARAMS = "pdstor"
"""The key of pdstor's entry in a request's ``kv_transfer_params``."""


@dataclass
class _Pub:
    """A request this engine prefills for another: its open publication."""

    writer: pdstor.Writer
    handoff: str
    name: str
    prompt_tokens: int
    digest: bytes
    total: int
    block_ids: list[int] = field(default_factory=list)
    next_chunk: int = 0


@dataclass
class _Plan:
    """A handed-over request this engine decodes, between its match and its claim."""

    prompt_tokens: int
    digest: bytes
    expect_token: int
    local_tokens: int
    ready: pdstor.Receipt | None
    error: str | None
    # The producer's first token follows its prompt in this request's prompt
    # (else the request is the stock one: the producer's prompt, unchanged).
    spliced: bool = True
    # Tokens this engine may take from the handoff: vLLM computes at least
    # one token of every prompt, so the stock request's last is computed again.
    usable: int = 0


@dataclass
class Counters:
    """What this scheduler half did, for the operator and the tests."""

    prepared: int = 0
    published: int = 0
    aborted: int = 0
    admission_waits: int = 0
    claimed: int = 0
    load_refused: int = 0
    # Stock requests whose decode's first token differed from the producer's.
    first_token_mismatches: int = 0


class SchedulerSide:
    def __init__(self, ctx: Context, roles: tuple[bool, bool]):
        self.ctx = ctx
        self.client, self.layout, self.shape, self.cfg = ctx.client, ctx.layout, ctx.shape, ctx.cfg
        self.producer, self.consumer = roles
        self.reader = pdstor.Reader(ctx.client, ctx.cfg.reader_id, session=ctx.session)
        self.pubs: dict[str, _Pub] = {}
        # Preempted requests prepared anew and not scheduled since: their
        # publication is the one to store, whatever the step reports.
        self.fresh: set[str] = set()
        self.attempts: dict[str, int] = {}
        self.waiting_since: dict[str, float] = {}
        self.store_failed: dict[str, str] = {}
        self.plans: dict[str, _Plan] = {}
        self.consumed: set[str] = set()
        self.pending_loads: list[LoadSpec] = []
        self.counters = Counters()
        # Decode requests restored from a publication: request id -> (its name,
        # the producer's token, whether the prompt carries it).
        self.handed: dict[str, tuple[str, int, bool]] = {}

    # -- matching -----------------------------------------------------------

    def match(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = (request.kv_transfer_params or {}).get(PARAMS)
        if params is not None and self.consumer:
            # Handed over — or the producer said it could not be (an
            # "error" entry): a strict consumer fails that like any miss.
            return self._match_load(request, num_computed_tokens, params)
        if self._stores(request):
            return self._admit(request)
        return 0, False

    def _stores(self, request: Any) -> bool:
        if not self.producer:
            return False
        if not self.consumer:
            return True
        return bool((request.kv_transfer_params or {}).get("do_remote_decode"))

    def _admit(self, request: Any) -> tuple[int | None, bool]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        if rid in self.pubs:
            if request.status != RequestStatus.PREEMPTED or rid in self.fresh:
                return 0, False
            # Preempted, and resumed in the same schedule() that preempted
            # it (before build_meta saw it): its blocks were freed, it is
            # recomputed from its first token, so it is stored anew.
            self._abort(rid, "preempted: it is prepared anew and stored again")
        if rid in self.store_failed:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        total = self.shape.chunks_for(len(prompt))
        attempt = self.attempts.get(rid, 0)
        name = f"vllm-{self.ctx.engine_id}-{rid}" + (f"-{attempt}" if attempt else "")
        writer = pdstor.Writer(self.client, self.cfg.writer_id)
        try:
            writer.prepare(name, self.layout, total, timeout_ms=0)
        except pdstor.AdmissionTimeout as e:
            first = self.waiting_since.setdefault(rid, time.monotonic())
            self.counters.admission_waits += 1
            if time.monotonic() - first < self.cfg.admission_timeout_s:
                return None, False
            self.store_failed[rid] = (
                f"no room for {total} chunks within admission_timeout_s={self.cfg.admission_timeout_s}: {e}"
            )
            log.error("pdstor.vllm: request %s is not handed over: %s", rid, self.store_failed[rid])
            return 0, False
        except pdstor.Error as e:
            self.store_failed[rid] = f"prepare refused: {e}"
            log.error("pdstor.vllm: request %s is not handed over: %s", rid, self.store_failed[rid])
            return 0, False
        self.waiting_since.pop(rid, None)
        self.attempts[rid] = attempt + 1
        self.counters.prepared += 1
        self.pubs[rid] = _Pub(writer, writer.handoff(), name, len(prompt), prompt_digest(prompt), total)
        if request.status == RequestStatus.PREEMPTED:
            self.fresh.add(rid)
        detail = f"prefill {rid}: {len(prompt)} tokens, {total} chunks"
        self.ctx.note("schedule", req_id=name, publication=writer.publication, detail=detail)
        return 0, False

    def _match_load(self, request: Any, num_computed_tokens: int, params: dict) -> tuple[int | None, bool]:
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
        return max(plan.usable - num_computed_tokens, 0), False

    def _plan(self, request: Any, params: dict) -> _Plan:
        prompt = list(request.prompt_token_ids or [])
        tokens, token = params.get("prompt_tokens"), params.get("first_token")
        # vLLM computes at least the last token of a prompt itself.
        usable = max(len(prompt) - 1, 0)
        error = params.get("error")
        if error is not None:
            error = f"the producer did not hand this request over: {error}"
        elif not isinstance(tokens, int) or not 0 < tokens <= len(prompt):
            error = (
                f"kv_transfer_params.pdstor.prompt_tokens={tokens!r} does not fit this prompt of {len(prompt)} tokens"
            )
        elif not isinstance(token, int):
            error = f"kv_transfer_params.pdstor.first_token={token!r} is not a token id"
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
        if error is not None:
            return _Plan(usable, prompt_digest(prompt[:usable]), -1, 0, None, error, usable=usable)
        ready, error = self._ready(params)
        spliced = tokens < len(prompt)
        return _Plan(tokens, prompt_digest(prompt[:tokens]), token, 0, ready, error, spliced, min(tokens, usable))

    def _ready(self, params: dict) -> tuple[pdstor.Receipt | None, str | None]:
        text = params.get("receipt")
        if text is not None:
            try:
                return pdstor.Receipt.from_json(text), None
            except (ValueError, TypeError) as e:
                return None, f"kv_transfer_params.pdstor.receipt is not a receipt: {e}"
        name = params.get("req")
        if not isinstance(name, str):
            return None, "kv_transfer_params.pdstor has neither a receipt nor a request name (req)"
        try:
            [found] = self.client.lookup([name])
        except pdstor.Error as e:
            return None, f"lookup of {name!r} refused: {e}"
        if found is None:
            return None, f"no READY publication is named {name!r}"
        return found, None

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        plan = self.plans.pop(rid, None)
        if plan is None:
            return
        block_ids = list(blocks.get_block_ids()[0])
        bs = self.shape.block_tokens
        first = plan.local_tokens // bs
        last = -(-(plan.local_tokens + num_external_tokens) // bs)
        fill = [(i, block_ids[i]) for i in range(first, min(last, len(block_ids)))]
        claim = None
        error = plan.error
        if error is None and plan.ready is not None:
            try:
                claim = self.reader.claim(plan.ready, lease_ms=self.cfg.lease_ms, layout=self.layout)
                self.counters.claimed += 1
                self.ctx.note("claim", receipt=claim)
                self.handed[rid] = (claim.req_id, plan.expect_token, plan.spliced)
            except pdstor.Error as e:
                error = f"claim refused: {e}"
        if error is not None:
            self.counters.load_refused += 1
            log.error("pdstor.vllm: request %s: its handed-over KV cannot be loaded: %s", rid, error)
            if not fill:
                log.error("pdstor.vllm: request %s: every prompt token was in the local prefix cache", rid)
        self.consumed.add(rid)
        self.pending_loads.append(
            LoadSpec(
                req_id=rid,
                claim=claim.to_json() if claim is not None else None,
                error=error,
                prompt_tokens=plan.prompt_tokens,
                digest=plan.digest,
                expect_token=plan.expect_token,
                fill=fill,
            )
        )

    # -- each step ----------------------------------------------------------

    def build_meta(self, so: Any) -> PdstorMetadata:
        meta = PdstorMetadata()
        for rid in so.preempted_req_ids or ():
            if rid not in self.fresh:
                self._abort(rid, "preempted: it will be prepared anew and stored again")
        for new in so.scheduled_new_reqs:
            self.fresh.discard(new.req_id)
            pub = self.pubs.get(new.req_id)
            if pub is not None:
                pub.block_ids = list(new.block_ids[0])
                self._plan_saves(meta, new.req_id, pub, new.num_computed_tokens + so.num_scheduled_tokens[new.req_id])
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            self.fresh.discard(rid)
            pub = self.pubs.get(rid)
            if pub is None:
                continue
            added = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                pub.block_ids = list(added[0]) if added else []
            elif added:
                pub.block_ids.extend(added[0])
            self._plan_saves(meta, rid, pub, cached.num_computed_tokens[i] + so.num_scheduled_tokens[rid])
        meta.loads, self.pending_loads = self.pending_loads, []
        return meta

    def _plan_saves(self, meta: PdstorMetadata, rid: str, pub: _Pub, computed: int) -> None:
        computed = min(computed, pub.prompt_tokens)
        done = pub.total if computed >= pub.prompt_tokens else computed // self.shape.block_tokens
        if done <= pub.next_chunk:
            return
        chunks = [(i, pub.block_ids[i]) for i in range(pub.next_chunk, done)]
        meta.saves.append(
            SaveSpec(
                req_id=rid,
                handoff=pub.handoff,
                prompt_tokens=pub.prompt_tokens,
                digest=pub.digest,
                chunks=chunks,
                last=done == pub.total,
            )
        )
        pub.next_chunk = done

    def _abort(self, rid: str, why: str) -> str | None:
        pub = self.pubs.pop(rid, None)
        if pub is None:
            return None
        try:
            outcome = pub.writer.abort()
        except pdstor.Error as e:
            outcome = f"abort refused: {e}"
        self.counters.aborted += 1
        log.info("pdstor.vllm: request %s (%s) %s: publication %s", rid, pub.name, why, outcome)
        return outcome

    # -- the end ------------------------------------------------------------

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
                "the two engines do not compute alike (model, dtype, sampling) or the restored KV is not the producer's",
                rid, name, outputs[0], token,
            )
        self.ctx.note("continuation", req_id=name, tokens=outputs)

    def finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        self.plans.pop(rid, None)
        self.consumed.discard(rid)
        handed = self.handed.pop(rid, None)
        if handed is not None and request.status not in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
            self._continuation(rid, *handed, list(request.output_token_ids))
        self.waiting_since.pop(rid, None)
        self.attempts.pop(rid, None)
        self.fresh.discard(rid)
        failed = self.store_failed.pop(rid, None)
        pub = self.pubs.get(rid)
        if pub is None:
            return False, ({PARAMS: {"error": failed}} if failed else None)
        status = request.status
        outputs = list(request.output_token_ids or [])
        if status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR) or not outputs:
            outcome = self._abort(rid, f"finished {status.name} before it was handed over")
            return False, {PARAMS: {"error": f"request {status.name}: publication {pub.name} {outcome}"}}
        if pub.next_chunk < pub.total:
            outcome = self._abort(rid, f"finished with {pub.next_chunk}/{pub.total} chunks stored")
            return False, {PARAMS: {"error": f"only {pub.next_chunk}/{pub.total} chunks stored: {outcome}"}}
        self.pubs.pop(rid, None)
        try:
            ready = pub.writer.publish(first_token=outputs[0])
        except pdstor.Error as e:
            try:
                pub.writer.abort()
            except pdstor.Error:
                pass
            log.error("pdstor.vllm: request %s: publish of %s refused: %s", rid, pub.name, e)
            return False, {PARAMS: {"error": f"publish refused: {e}"}}
        self.counters.published += 1
        self.ctx.note("publish", receipt=ready)
        return False, {
            PARAMS: {
                "receipt": ready.to_json(),
                "req": pub.name,
                "prompt_tokens": pub.prompt_tokens,
                "prompt_digest": pub.digest.hex(),
                "first_token": outputs[0],
            }
        }
