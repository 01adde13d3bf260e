"""The connector's mover — the worker's one thread that stores, publishes,
claims and restores — takes every job queued since its last round and
batches what it can: a step's stores go in one data-plane frame, its
publishes in one batch (one round trip, one commit), as do the claims of
the restores handed over together; a publication is still made READY
before the stores queued after its end."""

from __future__ import annotations

import threading
import time

import pytest

import pdstor

pytest.importorskip("vllm", reason="SKIP: vLLM is not installed (cargo xtask python installs vllm==0.33.0)")

from test_vllm import consumer, daemon, decode_request, model, producer, prompt  # noqa: E402, F401
from vllm.v1.engine import FinishReason  # noqa: E402


def metric(daemon, name: str) -> int:
    """A counter of the daemon's, as its metrics read now."""
    for line in daemon.client().metrics().splitlines():
        if line.startswith(f"{name} "):
            return int(float(line.split()[-1]))
    return 0


def daemon_batches(daemon) -> int:
    """The daemon's count of `POST /storage-pd/batch` requests."""
    return metric(daemon, 'pdstor_step_seconds_count{step="batch"}')


def test_a_steps_stores_publishes_and_claims_each_go_together(model, daemon):
    """Three requests that finish in one step are stored in one data-plane
    frame (their chunks one submission to the device) and published READY
    in one batch (one round trip, one commit); handed over together, they
    are claimed in one batch; every restore byte for byte. (A step's budget
    that holds all three prompts: they finish, and are handed over, in one
    step each side.)"""
    p = producer(model, daemon, batched=256)
    prompts = {f"b{i}": prompt(64, 60 + i) for i in range(3)}
    before = daemon_batches(daemon)
    submissions = metric(daemon, "pdstor_payload_submissions_total")
    chunks = metric(daemon, "pdstor_payload_chunks_total")
    for rid, toks in prompts.items():
        p.add(rid, toks, max_tokens=1)
    # Each asks for its prepare, on the pool; none is scheduled before its
    # prepare is answered — all three, then, in the same step.
    p.step()
    preparing = p.connector.scheduler_side.producer.preparing
    assert sorted(preparing) == sorted(prompts), preparing
    deadline = time.monotonic() + 30
    while not all(f.done() for f, _, _ in preparing.values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    p.run()
    handed = {rid: p.finished[rid].params for rid in prompts}
    assert all("error" not in h["pdstor"] for h in handed.values()), handed
    assert daemon_batches(daemon) - before == 1, "one publish batch for the step's three"
    stored = metric(daemon, "pdstor_payload_chunks_total") - chunks
    assert stored >= 3, stored
    assert metric(daemon, "pdstor_payload_submissions_total") - submissions == 1, f"{stored} chunks of three requests"
    assert sorted(x["state"] for x in daemon.client().publications()) == ["READY"] * 3
    c = consumer(model, daemon, batched=256)
    before = daemon_batches(daemon)
    for rid, toks in prompts.items():
        decode_request(c, rid, toks, handed[rid], max_tokens=2)
    c.run()
    assert daemon_batches(daemon) - before == 1, "one claim batch for the three"
    for rid, toks in prompts.items():
        assert c.restored_checked[rid] == len(toks), rid
        assert c.finished[rid].reason == FinishReason.LENGTH
    assert daemon.client().publications() == []



def test_a_publication_behind_a_busy_mover_is_made_ready_before_the_stores_queued_after_it(model, daemon):
    """The mover held in one request's store while the engine steps two
    more: its next round holds a short request's end followed by a long
    request's later stores. The short one is published READY before those
    stores run, not after the whole round."""
    p = producer(model, daemon)
    side = p.worker.worker_side
    entered, gate, calls = threading.Event(), threading.Event(), []
    save_all, publish_all = side.save_all, side.publish_all
    mover = side._mover()
    do_all = mover._do_all

    def held_save(specs):
        calls.extend(("store", spec.req_id) for spec in specs)
        if not entered.is_set():
            entered.set()
            assert gate.wait(30)
        save_all(specs)

    def recorded_publish(specs):
        calls.append(("publish", *sorted(s.req_id for s in specs)))
        publish_all(specs)

    def recorded_round(jobs):
        calls.append(("round", [(type(j).__name__, j.req_id) for j in jobs]))
        do_all(jobs)

    side.save_all, side.publish_all, mover._do_all = held_save, recorded_publish, recorded_round
    p.add("first", prompt(20, 70), max_tokens=1)
    p.step_until(entered.is_set)  # the mover inside the first round: what follows is the next one's
    p.add("short", prompt(20, 71), max_tokens=1)
    # Prepared before "long" is added: a request is scheduled once its
    # prepare is answered, and the two prepares run at once on the pool —
    # "long" answered first would take every step's budget ahead of "short".
    p.step_until(lambda: "short" in p.connector.scheduler_side.producer.pubs or "short" in p.finished)
    p.add("long", prompt(300, 72), max_tokens=1)  # a 64-token budget a step: five steps of stores
    p.step_until(lambda: "short" in p.finished and p.scheduler.requests["long"].num_computed_tokens >= 200)
    gate.set()
    p.run()
    assert p.finished["long"].reason == FinishReason.LENGTH
    # The round that ends "short": its end queued before stores of "long".
    [start] = [i for i, c in enumerate(calls) if c[0] == "round" and ("EndSpec", "short") in c[1]]
    jobs = calls[start][1]
    end = jobs.index(("EndSpec", "short"))
    assert ("SaveSpec", "long") in jobs[end:], jobs
    # What it did: "short" published, then those stores.
    done = calls[start + 1 :]
    done = done[: next((i for i, c in enumerate(done) if c[0] == "round"), len(done))]
    published = next(i for i, c in enumerate(done) if c[0] == "publish" and "short" in c)
    assert ("store", "long") in done[published:], done
    assert sorted(x["state"] for x in daemon.client().publications()) == ["READY"] * 3


def test_a_store_refused_in_a_steps_frame_rolls_back_only_its_own_publication(model, daemon):
    """Two requests stored in one frame, one of whose publications is gone
    by then (aborted behind the connector's back): its store is refused and
    its publication ends rolled back (nothing left PREPARED); the
    other is published READY and restores byte for byte."""
    p = producer(model, daemon, batched=256)
    side = p.worker.worker_side
    save_all, aborted = side.save_all, []

    def abort_first(specs):
        if not aborted:
            gone = next(s for s in specs if s.req_id == "gone")
            aborted.append(pdstor.Writer.resume(daemon.client(), side.handoff(gone)).abort())
        save_all(specs)

    side.save_all = abort_first
    prompts = {"gone": prompt(64, 80), "kept": prompt(64, 81)}
    for rid, toks in prompts.items():
        p.add(rid, toks, max_tokens=1)
    p.run()
    assert aborted and side.failed_saves == {}, (aborted, side.failed_saves)
    (kept,) = daemon.client().publications()
    assert kept["state"] == "READY" and kept["req_id"].endswith("kept"), kept
    c = consumer(model, daemon)
    decode_request(c, "kept", prompts["kept"], p.finished["kept"].params, max_tokens=2)
    c.run()
    assert c.restored_checked["kept"] == len(prompts["kept"])
    assert daemon.client().publications() == []
