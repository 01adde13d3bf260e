"""The soak's vLLM engines: `pdstor.vllm.PdstorConnector`, both halves,
under vLLM's real scheduler.

    driver.py vllm-prefill --id N ...   (a kv_producer engine prefilling prompts)
    driver.py vllm-decode --id N ...    (a kv_consumer engine decoding them)

Each engine is the one the connector's tests drive (`python/tests/
vllm_harness.py`): vLLM's `Scheduler`, a worker-role connector over paged
KV caches on the CPU, and a stand-in forward pass that writes, for every
token, KV that is a function of the token and its position alone — so the
decode checks every restored block byte for byte against what the prompt
says, without pdstor. Prompts are 1 to 2,000 tokens, long-tailed; one in
ten is never decoded (an orphan the connector's `unread_release_s`
releases). The prefill hands each request's `kv_transfer_params` to the
decode through `D/queue-vllm-<id>.jsonl`, as a proxy does.

A request whose load fails (the daemon went away, or its restart fenced the
claim) fails through vLLM's load-error path; its publication is then looked
for by name: READY, decoded again; claimed, reclaimed by the operator;
gone, acknowledged before the answer was lost.
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pdstor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python" / "tests"))

from vllm.v1.engine import FinishReason  # noqa: E402
from vllm_harness import Engine, engine_config, tiny_model  # noqa: E402

WINDOW_S = 120
MAX_TOKENS = 2000


def engine(args: Any, role: str) -> Engine:
    model = tiny_model(Path(args.dir) / "tiny-vllm")
    daemon = SimpleNamespace(server=args.server, data_socket=args.data_socket)
    name = f"soak-{role}-{args.id}"
    config = engine_config(model, daemon, role, name, extra={"unread_release_s": WINDOW_S})
    return Engine(config, 512)


def forget(e: Engine) -> None:
    """What the harness keeps per request, dropped once read: an hour of
    requests would otherwise grow this process, not the daemon."""
    for kept in (e.finished, e.generated, e.fills, e.restored_checked, e.loads, e.failed_blocks):
        kept.clear()
    e.connector_stats.clear()


def vllm_prefill(args: Any, ledger_cls: Any, stopping: Any) -> None:
    dir = Path(args.dir)
    rng = random.Random(args.seed * 37 + args.id + os.getpid())
    ledger = ledger_cls(dir / f"ledger-vllm-prefill-{args.id}.jsonl")
    queue = ledger_cls(dir / f"queue-vllm-{args.id}.jsonl")
    p = engine(args, "kv_producer")
    client = pdstor.Client(args.server, args.data_socket)
    n = 0
    while not stopping(dir):
        prompts = {}
        for _ in range(rng.randint(1, 4)):
            tokens = min(MAX_TOKENS, int(1.0 / (1.0 - rng.random()) ** (1.0 / 1.1) * 16))
            prompts[f"v{args.id}-{os.getpid()}-{n}"] = [10 + rng.randrange(400) for _ in range(tokens)]
            n += 1
        for rid, toks in prompts.items():
            p.add(rid, toks, max_tokens=1)
        p.run(timeout_s=300)
        # The engine answers before its stores are durable: a proxy hands
        # the decode over once the publication is READY, and so does this.
        names = [((p.finished[rid].params or {}).get("pdstor") or {}).get("req", "") for rid in prompts]
        ready = await_ready(client, names)
        for (rid, toks), name in zip(prompts.items(), names):
            f = p.finished[rid]
            handed = (f.params or {}).get("pdstor") or {}
            if f.reason != FinishReason.LENGTH or "error" in handed or name not in ready:
                ledger.put(ev="refused", req=rid, code="prefill_failed", why=f"{f.reason} {handed}"[:300])
                continue
            kind = "orphan" if rng.random() < 0.1 else "handoff"
            if kind == "handoff":
                queue.put(rid=rid, req=handed["req"], tokens=toks, params=f.params)
            ledger.put(ev="ready", req=handed["req"], chunks=-(-len(toks) // 16), kind=kind)
        forget(p)
    p.shutdown()
    (dir / f"vllm-prefill-{args.id}.done").touch()


def await_ready(client: pdstor.Client, names: list[str]) -> set[str]:
    """Which of `names` are READY within 30 s (the daemon may be restarting)."""
    ready: set[str] = set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        asked = [n for n in names if n and n not in ready]
        if not asked:
            break
        try:
            ready |= {n for n, r in zip(asked, client.lookup(asked)) if r is not None}
        except pdstor.Error:
            pass
        time.sleep(0.02)
    return ready


def vllm_decode(args: Any, ledger_cls: Any, queued: Any) -> None:
    dir = Path(args.dir)
    ledger = ledger_cls(dir / f"ledger-vllm-decode-{args.id}.jsonl")
    c = engine(args, "kv_consumer")
    client = pdstor.Client(args.server, args.data_socket)
    # A decode started in place of one that died takes up where it stopped.
    done = {e["req"] for e in ledger_cls.read(ledger.path)}
    for e in queued(dir, f"vllm-{args.id}", f"vllm-prefill-{args.id}.done"):
        if e["req"] not in done:
            decode(c, client, e, ledger)
    c.shutdown()


def decode(c: Engine, client: pdstor.Client, e: dict[str, Any], ledger: Any) -> None:
    """One handoff decoded as the proxy sends it (the prompt and the
    producer's first token); its restored KV checked by the engine."""
    toks, params = e["tokens"], e["params"]
    for attempt in range(10):
        rid = f"{e['rid']}-{attempt}"
        c.add(rid, toks + [params["pdstor"]["first_token"]], max_tokens=2, params=params)
        try:
            c.run(timeout_s=300)
        except AssertionError as bad:
            if "differs" not in str(bad):
                raise  # not the restored KV's check: the engine itself failed
            ledger.put(ev="corrupt", req=e["req"], why=str(bad)[:300])
            forget(c)
            return
        f, checked = c.finished[rid], c.restored_checked.get(rid, 0)
        forget(c)
        if f.reason == FinishReason.LENGTH and checked >= len(toks):
            ledger.put(ev="acked", req=e["req"], chunks=-(-len(toks) // 16))
            return
        if f.reason == FinishReason.LENGTH:
            # Decoded, but its restored KV was not all checked: not a verdict's "acked".
            ledger.put(ev="unchecked", req=e["req"], why=f"{checked} of {len(toks)} tokens checked")
            return
        # Its load failed: what became of the publication, by name.
        state = held(client, e["req"])
        if state is None:
            ledger.put(ev="acked_unrecorded", req=e["req"])
            return
        if state[0] != "READY":
            try:
                client.reclaim_publication(state[1], f"soak: its vLLM load failed ({state[0]})")
                ledger.put(ev="reclaimed", req=e["req"], code=state[0])
                return
            except pdstor.Error:
                pass  # acked or gone meanwhile, or the daemon away: looked at again
        time.sleep(1)
    ledger.put(ev="lost", req=e["req"], why="READY, and its load failed ten times")


def held(client: pdstor.Client, req: str) -> tuple[str, int] | None:
    """`req`'s publication's state and number, once the daemon answers."""
    while True:
        try:
            found = [(p["state"], p["publication"]) for p in client.publications() if p["req_id"] == req]
            return found[0] if found else None
        except pdstor.Error:
            time.sleep(0.5)
