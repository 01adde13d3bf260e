"""``pdstor.vllm.PdstorConnector`` driven by vLLM's real ``Scheduler`` (and a
real worker-role connector over paged KV tensors on the CPU) against a live
``pdstor serve``: every per-request protocol step, byte-exact restores, and
the failure controls of storage P/D — each failure fails the request through
vLLM's own load-error path, never a silent recompute."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="SKIP: vLLM is not installed (cargo xtask python installs vllm==0.33.0)")

import pdstor  # noqa: E402
from conftest import Daemon, pdstor_bin, serve  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_harness import Engine, NoDaemonCalls, engine_config, next_token, tiny_model  # noqa: E402

BLOCK = 16
# Shorter than a block, exact multiples, partial last blocks, and longer
# than one step's 64-token budget (chunked prefill).
PROMPT_LENGTHS = [5, 16, 32, 45, 100, 150]


def prompt(n: int, seed: int) -> list[int]:
    return [10 + (seed * 97 + i * 13) % 400 for i in range(n)]


@pytest.fixture
def daemon(tmp_path: Path):
    d = serve(tmp_path, "64M", "64K")
    yield d
    d.stop()


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return tiny_model(tmp_path / "tiny")


def producer(model: Path, daemon: Daemon, num_blocks: int = 256, **kw) -> Engine:
    return Engine(engine_config(model, daemon, "kv_producer", "prefill-0", **kw), num_blocks)


def consumer(model: Path, daemon: Daemon, num_blocks: int = 256, engine_id: str = "decode-0", **kw) -> Engine:
    return Engine(engine_config(model, daemon, "kv_consumer", engine_id, **kw), num_blocks)


def prefill(p: Engine, prompts: dict[str, list[int]]) -> dict[str, dict]:
    """Each prompt through the producer with max_tokens=1; its kv_transfer_params."""
    for rid, toks in prompts.items():
        p.add(rid, toks, max_tokens=1)
    p.run()
    out = {}
    for rid in prompts:
        f = p.finished[rid]
        assert f.reason == FinishReason.LENGTH, (rid, f)
        params = f.params["pdstor"]
        assert "error" not in params, params
        assert params["first_token"] == f.tokens[0] == next_token(prompts[rid])
        assert params["prompt_tokens"] == len(prompts[rid])
        out[rid] = f.params
    return out


def decode_request(c: Engine, rid: str, toks: list[int], params: dict, max_tokens: int = 4) -> None:
    """What the proxy sends the decode engine: the prompt with the producer's token appended."""
    c.add(rid, toks + [params["pdstor"]["first_token"]], max_tokens=max_tokens, params=params)


@pytest.mark.parametrize("staging", [64 << 20, 16 << 10], ids=["staging-64MiB", "staging-2-chunks"])
def test_requests_are_handed_over_through_the_real_scheduler_byte_for_byte(model, daemon, staging):
    p = producer(model, daemon, extra={"staging_bytes": staging})
    prompts = {f"r{n}": prompt(n, n) for n in PROMPT_LENGTHS}
    handed = prefill(p, prompts)
    client = daemon.client()
    ready = client.publications()
    assert sorted(x["state"] for x in ready) == ["READY"] * len(prompts)
    assert p.connector.scheduler_side.counters.published == len(prompts)

    c = consumer(model, daemon, extra={"staging_bytes": staging})
    for rid, toks in prompts.items():
        decode_request(c, rid, toks, handed[rid])
    c.run()
    for rid, toks in prompts.items():
        f = c.finished[rid]
        assert f.reason == FinishReason.LENGTH, (rid, f)
        # Restored byte for byte (checked in the step, against the prompt alone).
        assert c.restored_checked[rid] == len(toks)
        # The decode continued from the producer's token.
        assert f.tokens[0] == next_token(toks + [handed[rid]["pdstor"]["first_token"]])
    # Every publication claimed, adopted, loaded, verified and acknowledged: the slots are free.
    assert client.publications() == []
    assert c.worker.worker_side.restored == len(prompts)
    # What each engine told vLLM's stats (and so its logs and /metrics).
    made, got = merged_stats(p), merged_stats(c)
    chunks = sum(-(-len(t) // BLOCK) for t in prompts.values())
    assert (made["prepared"], made["published"], made["stored_chunks"]) == (len(prompts), len(prompts), chunks)
    assert len(made["publish"]) == len(prompts) and made["store"] and not made["restored"]
    assert (got["restored"], got["restore_failures"], len(got["restore"])) == (len(prompts), 0, len(prompts))
    # The scheduler's view of each restore (blocks allocated to the report) holds the mover's.
    assert len(got["load_wait"]) == len(prompts) and not made["load_wait"]
    assert sorted(got["load_wait"])[-1] >= sorted(got["restore"])[-1] > 0
    assert got["restored_bytes"] == chunks * c.worker.worker_side.shape.chunk_bytes
    # On a CPU each chunk was checked as it was copied into its blocks.
    assert got["restored_checked_in_copy_bytes"] == got["restored_bytes"]


def merged_stats(e: Engine) -> dict:
    """The connector stats an engine's steps reported, merged as vLLM's stat loggers do."""
    from pdstor.vllm import PdstorConnector

    total = PdstorConnector.build_kv_connector_stats()
    for data in e.connector_stats:
        total.aggregate(PdstorConnector.build_kv_connector_stats(data))
    return total.data


def test_the_connector_stats_reach_prometheus_as_vllm_records_them(model, daemon):
    """build_prom_metrics with prometheus_client's own classes (a registry of
    the test's): every count a counter, every latency a histogram."""
    import functools

    import prometheus_client as prom

    from pdstor.vllm import PdstorConnector

    reg = prom.CollectorRegistry()
    types = {t: functools.partial(t, registry=reg) for t in (prom.Gauge, prom.Counter, prom.Histogram)}
    config = engine_config(model, daemon, "kv_consumer", "decode-0")
    metrics = PdstorConnector.build_prom_metrics(config, types, ["model_name", "engine"], {0: ["tiny", "0"]})
    stats = PdstorConnector.build_kv_connector_stats({"restored": 3, "restored_bytes": 4096, "restore": [0.002, 0.004]})
    metrics.observe(stats.to_dict(), 0)
    metrics.observe({"restore_failures": 1}, 0)
    text = prom.generate_latest(reg).decode()
    assert 'vllm:pdstor_restored_total{engine="0",model_name="tiny"} 3.0' in text
    assert 'vllm:pdstor_restore_failures_total{engine="0",model_name="tiny"} 1.0' in text
    assert 'vllm:pdstor_restore_seconds_count{engine="0",model_name="tiny"} 2.0' in text
    assert "vllm:pdstor_ready_wait_seconds_bucket" in text


def test_the_stock_protocol_restores_the_original_prompt_and_checks_the_first_token(model, daemon, tmp_path):
    """What vLLM's disaggregated proxies send (and pdstor.proxy): the
    decode request is the original prompt with the prefill's
    kv_transfer_params. Every chunk is restored and verified; vLLM computes
    the last prompt token again, and the decode's first token is the
    producer's."""
    timeline = tmp_path / "stock.jsonl"
    p = producer(model, daemon)
    prompts = {f"s{n}": prompt(n, 200 + n) for n in PROMPT_LENGTHS}
    handed = prefill(p, prompts)
    c = consumer(model, daemon, extra={"timeline": str(timeline)})
    for rid, toks in prompts.items():
        c.add(rid, toks, max_tokens=4, params=handed[rid])
    c.run()
    side = c.connector.scheduler_side
    for rid, toks in prompts.items():
        f = c.finished[rid]
        assert f.reason == FinishReason.LENGTH, (rid, f)
        # Every prompt token but the last taken from the handoff, byte for byte.
        assert c.restored_checked[rid] == len(toks) - 1
        assert f.tokens[0] == handed[rid]["pdstor"]["first_token"]
    assert side.counters.first_token_mismatches == 0 and side.counters.load_refused == 0
    assert c.worker.worker_side.restored == len(prompts)
    assert daemon.client().publications() == []
    # The continuation is the decode's own generation, led by the producer's token.
    records = [json.loads(line) for line in timeline.read_text().splitlines()]
    conts = {r["req_id"]: r["tokens"] for r in records if r["event"] == "continuation"}
    for rid in prompts:
        assert conts[handed[rid]["pdstor"]["req"]] == c.finished[rid].tokens


def test_the_engine_thread_guard_sees_every_daemon_round_trip(daemon):
    """Every engine step of these tests runs under NoDaemonCalls, which
    fails the step on any Client, Writer or Reader call on the engine's
    thread: it does see them."""
    client = daemon.client()
    with NoDaemonCalls() as guard:
        client.namespace()
        client.lookup(["x"])
        try:
            pdstor.Writer.resume(client, "not a handoff")
        except ValueError:
            pass
        pdstor.Receipt  # local types are not round trips
    assert guard.calls == ["Client.namespace", "Client.lookup", "Writer.resume"]


def test_a_decode_engine_steps_its_other_requests_while_a_handoff_loads(model, daemon):
    """A handed-over request waits in WAITING_FOR_REMOTE_KVS while its
    publication is made READY and restored; the engine's other requests
    keep generating meanwhile, and the restore is byte-exact."""
    p = producer(model, daemon)
    toks = prompt(100, 31)
    gate = threading.Event()
    side = p.worker.worker_side
    publish_all = side.publish_all

    def held_publish(specs):  # the producer's publish, held until the test lets it go
        assert gate.wait(30)
        publish_all(specs)

    side.publish_all = held_publish
    p.add("slow", toks, max_tokens=1)
    p.step_until(lambda: "slow" in p.finished)
    handed = p.finished["slow"].params
    (pub,) = daemon.client().publications()
    assert pub["state"] == "PREPARED"  # answered before its publish

    c = consumer(model, daemon)
    c.add("other", prompt(20, 32), max_tokens=40)
    c.add("slow", toks, max_tokens=4, params=handed)
    c.step_until(lambda: len(c.generated.get("other", [])) >= 12)
    # The other request advanced twelve tokens while the handoff waited.
    assert c.scheduler.requests["slow"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert "slow" not in c.generated
    gate.set()
    p.run()
    c.run()
    assert c.finished["slow"].reason == FinishReason.LENGTH
    assert c.restored_checked["slow"] == len(toks) - 1
    assert c.finished["slow"].tokens[0] == handed["pdstor"]["first_token"]
    assert c.finished["other"].reason == FinishReason.LENGTH and len(c.finished["other"].tokens) == 40
    assert daemon.client().publications() == []


def test_a_decode_engine_steps_while_a_long_restore_runs(model, daemon):
    """A restore that takes a while (the mover held inside it) does not
    hold the engine's steps either."""
    p = producer(model, daemon)
    toks = prompt(150, 41)
    handed = prefill(p, {"r": toks})
    c = consumer(model, daemon)
    entered, gate = threading.Event(), threading.Event()
    side = c.worker.worker_side
    restore = side._restore

    def held_restore(claim, spec):
        entered.set()
        assert gate.wait(30)
        restore(claim, spec)

    side._restore = held_restore
    c.add("r", toks, max_tokens=3, params=handed["r"])
    # Claimed, the mover inside the restore (however long the claim took),
    # then another request arrives and advances twelve tokens meanwhile.
    c.step_until(entered.is_set)
    c.add("other", prompt(30, 42), max_tokens=40)
    c.step_until(lambda: len(c.generated.get("other", [])) >= 12)
    (pub,) = daemon.client().publications()
    assert pub["state"] == "CLAIMED" and "r" not in c.generated
    gate.set()
    c.run()
    assert c.finished["r"].reason == FinishReason.LENGTH and c.restored_checked["r"] == len(toks) - 1
    assert daemon.client().publications() == []


def test_a_decode_whose_first_token_differs_from_the_producers_is_counted_and_logged(model, daemon, caplog):
    p = producer(model, daemon)
    toks = prompt(45, 77)
    handed = prefill(p, {"m": toks})
    c = Engine(
        engine_config(model, daemon, "kv_consumer", "decode-unlike"), 256, sample=lambda t: next_token(t) + 1
    )
    c.add("m", toks, max_tokens=3, params=handed["m"])
    with caplog.at_level("ERROR", logger="pdstor.vllm"):
        c.run()
    # Restored and acknowledged (the bytes were the producer's); the unlike
    # engine's token is the evidence, counted and logged.
    assert c.finished["m"].reason == FinishReason.LENGTH and c.restored_checked["m"] == 44
    assert c.connector.scheduler_side.counters.first_token_mismatches == 1
    assert "differs from the producer's" in caplog.text
    assert daemon.client().publications() == []


def test_a_local_prefix_hit_loads_only_the_rest_and_still_consumes_the_publication(model, daemon):
    p = producer(model, daemon)
    toks = prompt(45, 7)
    handed = prefill(p, {"a": toks, "b": toks})
    c = consumer(model, daemon)
    decode_request(c, "a", toks, handed["a"])
    c.run()
    decode_request(c, "b", toks, handed["b"])
    c.run()
    assert c.finished["b"].reason == FinishReason.LENGTH
    # "a" filled every block; "b" found its first two blocks in vLLM's own
    # prefix cache and filled only the third — and still loaded, verified
    # and acknowledged the whole publication.
    assert [i for i, _ in c.fills["a"]] == [0, 1, 2]
    assert [i for i, _ in c.fills["b"]] == [2]
    assert c.restored_checked["b"] == 45
    assert daemon.client().publications() == []


def test_preempted_requests_are_aborted_and_stored_again_when_they_resume(model, daemon):
    # 12 blocks for 4 requests that each outgrow their 3 prompt blocks while
    # decoding: vLLM preempts some, and recomputes them later.
    p = producer(model, daemon, num_blocks=13)
    prompts = {f"p{i}": prompt(40, 20 + i) for i in range(4)}
    for rid, toks in prompts.items():
        p.add(rid, toks, max_tokens=12)
    p.run()
    counters = p.connector.scheduler_side.counters
    assert counters.aborted >= 1, "nothing was preempted: the test needs fewer blocks"
    assert counters.prepared == 4 + counters.aborted and counters.published == 4
    c = consumer(model, daemon)
    for rid, toks in prompts.items():
        params = p.finished[rid].params
        assert params["pdstor"]["first_token"] == p.finished[rid].tokens[0]
        decode_request(c, rid, toks, params)
    c.run()
    assert all(c.finished[r].reason == FinishReason.LENGTH for r in prompts)
    assert all(c.restored_checked[r] == 40 for r in prompts)
    assert daemon.client().publications() == []


def test_a_request_preempted_mid_prefill_is_stored_again_under_a_new_publication(model, daemon):
    p = producer(model, daemon)
    toks = prompt(150, 5)
    p.add("mid", toks, max_tokens=1)
    # Prepared beside the scheduler, then 64 of 150 tokens computed: four chunks stored.
    p.step_until(lambda: p.scheduler.requests["mid"].num_computed_tokens >= 64)
    (first,) = daemon.client().publications()
    assert first["state"] == "PREPARED"
    # vLLM's own preemption of everything running (its reset_prefix_cache).
    assert p.scheduler.reset_prefix_cache(reset_running_requests=True)
    p.run()
    side = p.connector.scheduler_side.counters
    assert (side.prepared, side.aborted, side.published) == (2, 1, 1)
    assert p.worker.worker_side.failed_saves == {}
    (again,) = daemon.client().publications()
    assert again["state"] == "READY" and again["publication"] != first["publication"]
    c = consumer(model, daemon)
    decode_request(c, "mid", toks, p.finished["mid"].params)
    c.run()
    assert c.finished["mid"].reason == FinishReason.LENGTH and c.restored_checked["mid"] == 150


def test_the_failure_controls_fail_the_request_through_vllms_load_error_path(model, daemon, tmp_path):
    p = producer(model, daemon)
    prompts = {f"f{i}": prompt(40, 50 + i) for i in range(9)}
    handed = prefill(p, prompts)
    client = daemon.client()
    c = consumer(model, daemon)

    def ready(rid: str) -> pdstor.Receipt:
        (found,) = client.lookup([handed[rid]["pdstor"]["req"]])
        assert found is not None, rid
        return found

    def state(rid: str) -> str | None:
        name = handed[rid]["pdstor"]["req"]
        found = [x["state"] for x in client.publications() if x["req_id"] == name]
        return found[0] if found else None

    def decode(rid: str, params: dict, full: list[int] | None = None) -> FinishReason:
        """A decode of `rid`'s prompt with the producer's token appended (or `full`)."""
        name = f"{rid}-d{len(c.finished)}"
        c.add(name, full or prompts[rid] + [handed[rid]["pdstor"]["first_token"]], max_tokens=4, params=params)
        c.run()
        return c.finished[name].reason

    # A chunk corrupted on the media: the strict consumer fails, the bytes stay RETAINED.
    (info,) = [x for x in client.publications(verbose=True) if x["req_id"] == handed["f0"]["pdstor"]["req"]]
    with open(daemon.target, "r+b") as f:
        f.seek(info["extents"][1]["offset"] + 300)
        f.write(b"\x00corrupt\x00")
        os.fsync(f.fileno())
    assert decode("f0", handed["f0"]) == FinishReason.ERROR
    assert state("f0") == "RETAINED"

    # No receipt at all: failed, never recomputed.
    bare = {"pdstor": {k: v for k, v in handed["f1"]["pdstor"].items() if k not in ("receipt", "req")}}
    assert decode("f1", bare) == FinishReason.ERROR and state("f1") == "READY"

    # A forged receipt: refused at claim, the publication untouched.
    forged = dict(handed["f1"]["pdstor"])
    receipt = ready("f1")
    forged["receipt"] = receipt.to_json().replace(receipt.manifest_digest, "0" * len(receipt.manifest_digest))
    assert decode("f1", {"pdstor": forged}) == FinishReason.ERROR and state("f1") == "READY"

    # The prompt without the producer's token: refused before anything is claimed.
    wrong = prompts["f1"] + [handed["f1"]["pdstor"]["first_token"] + 1]
    assert decode("f1", handed["f1"], full=wrong) == FinishReason.ERROR and state("f1") == "READY"
    # Another prompt of the same length (the stock request's shape): refused before anything is claimed.
    assert decode("f1", handed["f1"], full=prompts["f5"]) == FinishReason.ERROR and state("f1") == "READY"

    # Another model's engine (other weights): refused at claim, still READY for the right one.
    other = Engine(
        engine_config(model, daemon, "kv_consumer", "decode-other", extra={"model_identity": "other-weights"}), 256
    )
    decode_request(other, "f1-other", prompts["f1"], handed["f1"])
    other.run()
    assert other.finished["f1-other"].reason == FinishReason.ERROR and state("f1") == "READY"
    # ... which then restores it.
    assert decode("f1", handed["f1"]) == FinishReason.LENGTH and state("f1") is None

    # The same handoff a second time (a duplicate consumer): refused, the first restore stands.
    assert decode("f1", handed["f1"]) == FinishReason.ERROR

    # An unread release (the decode never came), then a late decode: failed.
    client.release(ready("f2"))
    assert state("f2") is None
    assert decode("f2", handed["f2"]) == FinishReason.ERROR

    # A decode request aborted between publish and claim: nothing claimed; the
    # publication stays READY until its unread release.
    decode_request(c, "f3-aborted", prompts["f3"], handed["f3"])
    c.abort("f3-aborted")
    assert state("f3") == "READY"
    client.release(ready("f3"))
    assert state("f3") is None

    # With its READY receipt instead of its name (a producer that carries one): restored.
    with_receipt = {"pdstor": {**handed["f4"]["pdstor"], "receipt": ready("f4").to_json()}}
    del with_receipt["pdstor"]["req"]
    assert decode("f4", with_receipt) == FinishReason.LENGTH and state("f4") is None

    counters = c.connector.scheduler_side.counters
    assert counters.load_refused == 3  # no name, wrong token, another prompt: refused from the request alone
    # Those, and refused by the daemon or the bytes: forged, duplicate, released, the corrupt chunk.
    assert c.worker.worker_side.failed_loads == 7 and counters.load_failed == 7
    assert c.worker.worker_side.restored == 2 and counters.restored == 2


def test_under_the_recompute_policy_a_failed_load_is_recomputed_counted_and_on_the_timeline(model, daemon):
    p = producer(model, daemon)
    toks = prompt(40, 99)
    handed = prefill(p, {"r": toks})
    client = daemon.client()
    (info,) = client.publications(verbose=True)
    with open(daemon.target, "r+b") as f:
        f.seek(info["extents"][0]["offset"] + 200)
        f.write(b"\xff" * 16)
        os.fsync(f.fileno())
    timeline = daemon.dir / "connector-timeline.jsonl"
    c = consumer(model, daemon, policy="recompute", extra={"timeline": str(timeline)})
    decode_request(c, "r", toks, handed["r"])
    c.run()
    assert c.finished["r"].reason == FinishReason.LENGTH
    assert c.worker.worker_side.failed_loads == 1 and c.worker.worker_side.restored == 0
    assert [x["state"] for x in client.publications()] == ["RETAINED"]
    # ... and on the timeline.
    events = [json.loads(x) for x in timeline.read_text().splitlines()]
    assert [e["req_id"] for e in events if e["event"] == "recompute"] == ["r"]


def test_admission_pressure_waits_without_blocking_and_times_out_loudly(model, tmp_path):
    d = serve(tmp_path, "3M", "64K")  # 15 slots
    try:
        p = producer(model, d, extra={"admission_timeout_s": 2})
        prompts = {f"a{i}": prompt(80, 70 + i) for i in range(4)}  # 5 chunks each
        for rid, toks in prompts.items():
            p.add(rid, toks, max_tokens=1)
        # One waits for room beside the scheduler while three are prefilled
        # (which one: whichever prepare the daemon answers last). Its first,
        # no-wait prepare is counted when the daemon answers it, on the
        # connector's prepare pool: that may come after the three finished
        # (a loaded machine ran them first), so the steps go on until then.
        side = p.connector.scheduler_side
        p.step_until(lambda: len(p.finished) == 3 and side.counters.admission_waits == 1)
        (waiting,) = set(prompts) - set(p.finished)
        assert p.scheduler.requests[waiting].num_computed_tokens == 0
        # The decode of one frees its slots; the waiting request goes on.
        c = consumer(model, d)
        first = sorted(p.finished)[0]
        decode_request(c, first, prompts[first], p.finished[first].params)
        c.run()
        p.run()
        assert "error" not in p.finished[waiting].params["pdstor"]
        # Nothing frees room for this one: after admission_timeout_s it is
        # prefilled without a handoff, and says so; its decode fails.
        p.add("late", prompt(80, 90), max_tokens=1)
        p.run()
        err = p.finished["late"].params["pdstor"]["error"]
        assert "admission_timeout_s=2" in err
        c.add("late", prompt(80, 90) + [p.finished["late"].tokens[0]], max_tokens=4, params=p.finished["late"].params)
        c.run()
        assert c.finished["late"].reason == FinishReason.ERROR
    finally:
        d.stop()


def test_a_misconfigured_engine_fails_to_start_and_says_why(model, daemon, tmp_path):
    bad = {"server": f"unix:{tmp_path}/nobody.sock"}
    with pytest.raises(RuntimeError, match="nobody.sock.*pdstor serve"):
        producer(model, daemon, extra=bad)
    with pytest.raises(pdstor.DataPlaneError, match="pdstor serve"):
        consumer(model, daemon, extra={"data_socket": f"{tmp_path}/nobody.sock"})
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys \\['sever'\\]"):
        producer(model, daemon, extra={"sever": "x"})
    # A namespace whose slots are smaller than a chunk (a 16-token block's KV
    # is 4 KiB here; with its header a chunk is 8 KiB): the start fails.
    (tmp_path / "small").mkdir()
    small = serve(tmp_path / "small", "8M", "4K")
    try:
        for make in (producer, consumer):
            with pytest.raises(RuntimeError, match="chunks are 8192 bytes.*holds 4096 bytes.*--chunk-slot 8K"):
                make(model, small)
    finally:
        small.stop()


def test_the_merged_timeline_of_both_engines_and_the_daemon_checks_clean(model, tmp_path):
    """The daemon with its probes and both engines append to one timeline;
    `pdstor timeline check` verifies every handoff in it, on host_fixed."""
    if os.geteuid() != 0:
        pytest.skip("SKIP: the provenance probes need root (the guest and CI run this)")
    timeline = tmp_path / "timeline.jsonl"
    d = serve(tmp_path, "64M", "64K", ["--timeline", str(timeline), "--provenance", "--require-native"])
    try:
        extra = {"timeline": str(timeline)}
        p = producer(model, d, extra=extra)
        prompts = {f"t{n}": prompt(n, n + 1) for n in (5, 32, 45)}
        handed = prefill(p, prompts)
        c = consumer(model, d, extra=extra)
        for rid, toks in prompts.items():
            decode_request(c, rid, toks, handed[rid])
        c.run()
        assert all(c.finished[r].reason == FinishReason.LENGTH for r in prompts)
    finally:
        d.stop()
    lines = [json.loads(x) for x in timeline.read_text().splitlines()]
    by_node: dict[tuple[str, str], int] = {}
    for e in lines:
        node = "-".join(e["node"].split("-")[:2]) if e["node"].startswith("vllm-") else "daemon"
        key = (node, e["event"])
        by_node[key] = by_node.get(key, 0) + 1
    n = len(prompts)
    for key in [("vllm-scheduler", "schedule"), ("vllm-worker", "publish"), ("vllm-worker", "claim"),
                ("vllm-worker", "restored"), ("vllm-worker", "ack"), ("vllm-scheduler", "continuation"),
                ("daemon", "publish"), ("daemon", "ack")]:
        assert by_node.get(key) == n, (key, by_node)
    out = subprocess.run(
        [pdstor_bin(), "timeline", "check", str(timeline), "--require-path", "host_fixed"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
