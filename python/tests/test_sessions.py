"""A reader's session and an operator's reclaim: a claim that can no longer
act — fenced by a daemon restart, or failed by its reader — is reclaimed
without closing its session, so a serving engine that carries on in the
same session (the vLLM connector names one per engine) is not fenced for
ever; a live claim's session is closed, and its reader with it."""

from __future__ import annotations

import numpy as np
import pytest

import pdstor
from conftest import LAYOUT, Daemon

MIB = 1 << 20


def put(client: pdstor.Client, req: str, seed: int) -> tuple[pdstor.Receipt, bytes]:
    buf = pdstor.Buffer(MIB)
    data = np.random.default_rng(seed).integers(0, 256, size=MIB, dtype=np.uint8).tobytes()
    buf.write(0, data)
    return pdstor.Writer(client, "prefill-0").put(req, LAYOUT, [(buf, 0, MIB)]), data


def test_reclaiming_a_claim_that_cannot_act_leaves_its_session_open(daemon: Daemon):
    client = daemon.client()
    fenced, _ = put(client, "req-fenced", 1)
    failed, _ = put(client, "req-failed", 2)
    engine = pdstor.Reader(client, "decode-0", session="vllm-decode")
    engine.fail(engine.claim(failed), "the decode's load failed")
    engine.claim(fenced)
    daemon.kill9()
    daemon.start()
    client = daemon.client()
    by_req = {p["req_id"]: p for p in client.publications()}
    assert (by_req["req-fenced"]["state"], by_req["req-failed"]["state"]) == ("CLAIMED", "RETAINED")
    for p in by_req.values():
        client.reclaim_publication(p["publication"], "the decode's claim cannot act")
    assert client.publications() == []
    # The engine carries on in its session: its next handoff restores.
    ready, data = put(client, "req-next", 3)
    dst = pdstor.Buffer(MIB)
    pdstor.Reader(client, "decode-0", session="vllm-decode").get(ready, LAYOUT, dst)
    assert dst.read(0, MIB) == data


def test_reclaiming_a_live_claim_closes_its_session(daemon: Daemon):
    client = daemon.client()
    live, _ = put(client, "req-live", 4)
    zombie = pdstor.Reader(client, "decode-0", session="zombie")
    claim = zombie.claim(live)
    client.reclaim_publication(live.publication, "its reader host died")
    later, _ = put(client, "req-later", 5)
    again = zombie.claim(later)
    with pytest.raises(pdstor.Fenced):
        zombie.adopt(again, LAYOUT)
    assert claim.publication == live.publication
