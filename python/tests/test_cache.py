"""Cache publications from Python: a writer publishes one with
``prepare(..., cache=True)``, two readers read it at the same time (each a
read of its own, loaded and checked here, then ended with its digest), the
writer cannot release it while either read is open, and a read ends once.
Bytes compared outside pdstor (numpy)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pdstor
from conftest import LAYOUT, serve

MIB = 1 << 20


@pytest.fixture
def daemon(tmp_path: Path):
    d = serve(tmp_path, "32M", "1M")
    yield d
    d.stop()


def publish_cache(client: pdstor.Client, name: str, data: bytes) -> pdstor.Receipt:
    src = pdstor.Buffer(len(data))
    src.write(0, data)
    w = pdstor.Writer(client)
    chunks = len(data) // MIB
    w.prepare(name, LAYOUT, chunks, cache=True)
    w.store([(i, src, i * MIB, MIB) for i in range(chunks)], last=True)
    return w.publish()


def test_two_readers_read_one_cache_publication_at_once(daemon):
    client = daemon.client()
    data = np.random.default_rng(7).integers(0, 256, size=3 * MIB, dtype=np.uint8).tobytes()
    ready = publish_cache(client, "prefix-py", data)
    readers = [pdstor.Reader(client, f"decode-{i}") for i in range(2)]
    bufs = [pdstor.Buffer(len(data)) for _ in readers]
    reads = [r.read(ready, LAYOUT) for r in readers]
    for r, read, buf in zip(readers, reads, bufs):
        r.load(read, [(i, buf, i * MIB) for i in range(3)])
    with pytest.raises(pdstor.WrongState):
        client.release(ready)  # both reads are open
    for r, read, buf in zip(readers, reads, bufs):
        r.end_read(read)
        assert bytes(buf.read(0, len(data))) == data
    with pytest.raises(pdstor.ReadEnded):
        readers[0].abandon_read(reads[0], "already ended")
    # A read given up ends too; then the writer releases it.
    again = readers[1].read(ready)
    with pytest.raises(pdstor.Error, match="not loaded"):
        readers[1].end_read(again)
    readers[1].abandon_read(again, "the engine gave up")
    client.release(ready)
    assert client.publications() == []


def test_a_handoff_is_not_read_and_a_cache_publication_is_not_claimed(daemon):
    client = daemon.client()
    data = bytes(MIB)
    cached = publish_cache(client, "cache-py", data)
    src = pdstor.Buffer(MIB)
    handoff = pdstor.Writer(client).put("handoff-py", LAYOUT, [(src, 0, MIB)])
    r = pdstor.Reader(client, "decode-0")
    with pytest.raises(pdstor.WrongState):
        r.read(handoff)
    with pytest.raises(pdstor.WrongState):
        r.claim(cached)


def test_a_session_close_and_an_operator_end_reads_a_dead_reader_left(daemon):
    """Client.close_session ends the reads of a session (none begins in it
    again); Client.end_reads ends every read of a publication, by number:
    either way their receipts are refused ReadEnded and the writer can
    release the publication."""
    client = daemon.client()
    ready = publish_cache(client, "orphaned-py", bytes(2 * MIB))
    gone = pdstor.Reader(client, "decode-gone", session="s-gone")
    held = [gone.read(ready), gone.read(ready)]
    assert client.publications()[0]["reading"] == 2
    client.close_session(held[0])
    assert client.publications()[0].get("reading", 0) == 0, "(listed only while some are open)"
    with pytest.raises(pdstor.ReadEnded):
        gone.abandon_read(held[1], "ended by the close")
    with pytest.raises(pdstor.Error, match="fenced|closed"):
        gone.read(ready)
    other = pdstor.Reader(client, "decode-other", session="s-other")
    left = other.read(ready)
    with pytest.raises(pdstor.Error, match="reason"):
        client.end_reads(ready.publication, " ")
    assert client.end_reads(ready.publication, "the decode host died") == 1
    with pytest.raises(pdstor.ReadEnded):
        other.abandon_read(left, "too late")
    client.release(ready)
    assert client.publications() == []
