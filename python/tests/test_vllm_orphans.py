"""What becomes of a publication no decode takes: a request aborted or an
engine shut down before the handoff rolls it back; one handed over that no
decode claims (the proxy crashed, the request was abandoned) is released
unread by the daemon after the connector's ``unread_release_s`` — on by
default, so a decode that never comes holds slots a bounded time."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm", reason="SKIP: vLLM is not installed (cargo xtask python installs vllm==0.33.0)")

from test_vllm import consumer, daemon, decode_request, model, prefill, producer, prompt  # noqa: E402, F401
from vllm.v1.engine import FinishReason  # noqa: E402


def test_a_handoff_no_decode_claims_is_released_unread_after_the_connectors_window(model, daemon):
    """By default every publication carries the connector's window (480 s);
    with `unread_release_s` set short, the daemon — itself with no
    `--unread-release-ms` — releases the unread one once it has passed
    (counted), and a decode that comes after fails through vLLM's
    load-error path."""
    p = producer(model, daemon)
    handed = prefill(p, {"default": prompt(40, 1)})
    [listed] = daemon.client().publications()
    assert listed["unread_release_ms"] == 480_000, listed
    daemon.client().release(daemon.client().lookup([handed["default"]["pdstor"]["req"]])[0])

    p = producer(model, daemon, extra={"unread_release_s": 1.0})
    toks = prompt(40, 2)
    handed = prefill(p, {"orphan": toks})
    name = handed["orphan"]["pdstor"]["req"]
    assert [x["unread_release_ms"] for x in daemon.client().publications()] == [1000]
    deadline = time.monotonic() + 60
    while daemon.client().lookup([name]) != [None] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemon.client().publications() == [], "released unread, its slots free"
    assert "pdstor_unread_expired_total 1" in daemon.client().metrics()
    c = consumer(model, daemon)
    decode_request(c, "orphan", toks, handed["orphan"])
    c.run()
    assert c.finished["orphan"].reason == FinishReason.ERROR


def test_an_aborted_request_aborts_its_publication(model, daemon):
    p = producer(model, daemon)
    p.add("long", prompt(150, 3), max_tokens=1)
    p.step_until(lambda: p.scheduler.requests["long"].num_computed_tokens >= 64)  # four blocks stored
    (pub,) = daemon.client().publications()
    assert pub["state"] == "PREPARED"
    p.abort("long")
    # Its blocks are held until the worker has rolled the publication back
    # after the stores queued before; then freed.
    assert "long" in p.scheduler.requests
    p.run()
    assert daemon.client().publications() == []
    assert p.connector.scheduler_side.counters.aborted == 1


def test_an_engine_shut_down_rolls_back_what_it_did_not_hand_over(model, daemon):
    p = producer(model, daemon)
    p.add("open", prompt(150, 9), max_tokens=1)
    p.step_until(lambda: p.scheduler.requests["open"].num_computed_tokens >= 64)
    assert [x["state"] for x in daemon.client().publications()] == ["PREPARED"]
    p.shutdown()
    # Not left PREPARED, holding its slots until an operator cancels it.
    assert daemon.client().publications() == []
