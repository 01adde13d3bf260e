"""Storage P/D between tensor-parallel engines under ``vllm serve``: a
prefill and a decode server, each ``--tensor-parallel-size 2`` (one rank
per core), ``python -m pdstor.proxy`` between them, and a TP 2 server with
no connector as the oracle.

Checks, every request over HTTP:

- completions (token-id prompts: shorter than a block, exact blocks, a
  partial last block; 1 and 4 at once) through the proxy equal the TP 2
  oracle's token for token, the chosen tokens' log-probabilities within
  0.02; each request handed over as one publication per rank
  (``<name>.tp0``, ``<name>.tp1``), every one restored and consumed;
- a decode of another parallel layout (TP 1) given a TP 2 prefill's
  handoff fails that request (HTTP 500 under ``kv_load_failure_policy=fail``):
  its claim is refused, ``layout_mismatch`` naming both layouts, and the
  shards stay READY — never restored wrong.

The oracle runs first and alone, the two connector servers after it. Every
rank is bound to one core, the same one, a core that does not take the
disk's interrupts (``serving.server_cores``): measured on a 2-core VM, ranks
bound to the interrupts' core starved its kernel workers (two ``workqueue
lockup`` of 45 and 76 s, the daemon's O_DIRECT completions among the work
held) and requests took 40-90 s; on one quiet core each case takes 1-3 s.
Writes
``report.json`` and ``report.md`` to ``--out``; exits 1 on any failure. Run
by ``cargo xtask vllm`` after ``vllm_pd.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import serving
from serving import BLOCK, Process, post
from vllm_pd import COMPLETIONS, GROUPS, MAX_DELTA, completion, prompt

BATCHES = (1, 4)


def cases() -> list[tuple[str, list[list[int]]]]:
    out, seed = [], 0
    for group, length in GROUPS.items():
        for batch in BATCHES:
            out.append((f"{group} ({length} tokens) x{batch}", [prompt(length, seed + i) for i in range(batch)]))
            seed += batch
    return out


def ask_all(url: str, prompts: list[list[int]]) -> list[tuple[int, dict, dict[str, str]]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: post(url, COMPLETIONS, completion(p)), prompts))


class Run:
    def __init__(self) -> None:
        self.failures: list[str] = []
        self.compared = self.logprobs = 0
        self.max_delta = 0.0
        self.publications: list[str] = []

    def fail(self, what: str) -> None:
        print(f"vllm tp e2e: FAILED: {what}", flush=True)
        self.failures.append(what)

    def compare(self, case: str, oracle: tuple[int, dict, dict], split: tuple[int, dict, dict]) -> None:
        (os_, oa, _), (ss, sa, sh) = oracle, split
        if os_ != 200 or ss != 200:
            self.fail(f"{case}: oracle {os_}, proxy {ss}: {sa}")
            return
        name = sh.get("x-pdstor-publication")
        if name is None:
            self.fail(f"{case}: the proxy's answer names no publication (nothing was handed over)")
        else:
            self.publications.append(name)
        want, got = oa["choices"][0], sa["choices"][0]
        self.compared += len(want.get("token_ids") or [])
        if got.get("token_ids") != want.get("token_ids") or got.get("finish_reason") != "length":
            self.fail(f"{case}: split {got.get('token_ids')} != oracle {want.get('token_ids')}")
            return
        for a, b in zip(got["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"], strict=True):
            self.logprobs += 1
            if a is None or b is None:
                self.fail(f"{case}: a chosen token has no log-probability")
                return
            self.max_delta = max(self.max_delta, abs(a - b))


def handed_over(run: Run, prefill: Process, decode: Process, daemon: Any, oracle: dict[str, list]) -> None:
    """Every case through the proxy, against the oracle's answers; then
    every shard publication consumed."""
    proxy = serving.proxy(prefill, decode, prefill.log.parent, daemon.server)
    try:
        proxy.wait_healthy()
        for case, prompts in cases():
            t0 = time.monotonic()
            split = ask_all(proxy.url, prompts)
            for i, (o, s) in enumerate(zip(oracle[case], split)):
                run.compare(f"{case}#{i}", o, s)
            print(f"vllm tp e2e: {case}: {time.monotonic() - t0:.1f} s through the proxy", flush=True)
    finally:
        proxy.stop()
    client = daemon.client()
    left = client.publications()
    if left:
        run.fail(f"publications left after every decode: {[(x['req_id'], x['state']) for x in left]}")
    restored = serving.metric(decode.url, "vllm:pdstor_restored_total") or 0.0
    # Every rank restores its own shard of every request.
    if restored != 2 * len(run.publications):
        run.fail(f"the decode's ranks restored {restored} shards of {len(run.publications)} requests, not 2 each")


def other_layout(run: Run, prefill: Process, narrow: Process, daemon: Any) -> dict:
    """A TP 2 prefill's handoff sent to a TP 1 decode: refused at claim."""
    ids = prompt(GROUPS["partial"], 50_000)
    status, pre, _ = post(prefill.url, COMPLETIONS, {**completion(ids), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    params = (pre.get("kv_transfer_params") or {}) if status == 200 else {}
    name = (params.get("pdstor") or {}).get("req")
    if name is None:
        run.fail(f"other layout: the prefill handed nothing over ({status}: {pre})")
        return {}
    client = daemon.client()
    shards = [f"{name}.tp0", f"{name}.tp1"]
    deadline = time.monotonic() + 60
    while None in client.lookup(shards) and time.monotonic() < deadline:
        time.sleep(0.05)
    status, answer, _ = post(narrow.url, COMPLETIONS, {**completion(ids), "kv_transfer_params": params})
    states = sorted((x["req_id"], x["state"]) for x in client.publications() if x["req_id"] in shards)
    log = narrow.log.read_text(errors="replace")
    refused = [line for line in log.splitlines() if "layout_mismatch" in line]
    result = {"decode_status": status, "shards": states, "refusal": (refused[-1][-600:] if refused else None)}
    named = bool(refused) and "tp=0/2" in refused[-1] and "tp=0/1" in refused[-1]
    if status == 200 or states != [(s, "READY") for s in shards] or not named:
        run.fail(f"a TP 1 decode of a TP 2 handoff was not refused at claim naming both layouts: {result} {answer}")
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--pdstor", required=True, help="the pdstor binary")
    args = ap.parse_args()
    from pdstor.testing import Daemon, format_target

    started = time.monotonic()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.log"):
        old.unlink()
    weights = serving.make_model(out / "tiny-llama")
    model = out / "tiny-llama"
    target = out / "target.img"
    serving.written(target, 128 << 20)
    format_target(args.pdstor, target, slot="64K", size="128M")
    daemon = Daemon(args.pdstor, out, target)
    daemon.start()

    def connector(role: str) -> dict:
        return serving.connector_config(role, daemon, weights)

    run, refusal, procs = Run(), {}, []
    quiet, _ = serving.server_cores(out)
    ranks = f"{quiet}|{quiet}"
    print(f"vllm tp e2e: both ranks of every server on core {quiet}", flush=True)
    try:
        oracle = serving.vllm_serve("oracle-tp2", model, out, None, cores=ranks, tp=2)
        procs.append(oracle)
        oracle.wait_healthy()
        answers = {case: ask_all(oracle.url, prompts) for case, prompts in cases()}
        oracle.stop()
        prefill = serving.vllm_serve("prefill-tp2", model, out, connector("kv_producer"), cores=ranks, tp=2)
        decode = serving.vllm_serve("decode-tp2", model, out, connector("kv_consumer"), cores=ranks, tp=2)
        procs += [prefill, decode]
        prefill.wait_healthy()
        decode.wait_healthy()
        print(f"vllm tp e2e: oracle answered, prefill and decode up in {time.monotonic() - started:.0f} s", flush=True)
        handed_over(run, prefill, decode, daemon, answers)
        decode.stop()
        narrow = serving.vllm_serve("decode-tp1", model, out, connector("kv_consumer"), cores=quiet)
        procs.append(narrow)
        narrow.wait_healthy()
        refusal = other_layout(run, prefill, narrow, daemon)
    except Exception as e:  # noqa: BLE001 - reported as the run's failure, with the servers' logs
        run.fail(f"{type(e).__name__}: {e}")
    finally:
        for p in procs:
            p.stop()
        daemon.stop()
    if run.max_delta > MAX_DELTA:
        run.fail(f"chosen-token log-probability delta {run.max_delta:.4f} > {MAX_DELTA}")
    return report(out, run, refusal, time.monotonic() - started)


def report(out: Path, run: Run, refusal: dict, seconds: float) -> int:
    result = {
        "tensor_parallel_size": 2,
        "block_tokens": BLOCK,
        "requests": len(run.publications),
        "tokens_compared": run.compared,
        "logprobs_compared": run.logprobs,
        "max_logprob_delta": round(run.max_delta, 5),
        "other_layout_control": refusal,
        "seconds": round(seconds, 1),
        "failures": run.failures,
    }
    (out / "report.json").write_text(json.dumps(result, indent=2))
    lines = [
        "# vLLM storage P/D at tensor parallelism 2 (vllm serve, pdstor.proxy)",
        "",
        f"- requests through the proxy: {result['requests']}, tokens compared with the TP 2 oracle: {run.compared}",
        f"- chosen-token log-probabilities compared: {run.logprobs}, maximum delta {run.max_delta:.5f} (limit {MAX_DELTA})",
        f"- a TP 1 decode of a TP 2 handoff: {refusal}",
        f"- time: {result['seconds']} s",
        "",
        *(f"- FAILED: {f}" for f in run.failures),
    ]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if run.failures else 0


if __name__ == "__main__":
    sys.exit(main())
