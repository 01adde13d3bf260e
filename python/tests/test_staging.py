"""Loads into a staging buffer, checked as they are copied out: the
daemon leaves them to the reader (its timeline says so), the copy out
checksums each chunk in the same pass and refuses one that does not match
its manifest, and nothing is acknowledged that was not copied out and
checked. Bytes compared outside pdstor (numpy, hashlib)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import pdstor
from conftest import LAYOUT, serve

MIB = 1 << 20


def pattern(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8).tobytes()


@pytest.fixture
def daemon(tmp_path: Path):
    """A daemon on a 64 MiB file with 1 MiB slots, writing its timeline."""
    d = serve(tmp_path, "64M", "1M", ["--timeline", str(tmp_path / "timeline.jsonl")])
    yield d
    d.stop()


def put(client: pdstor.Client, name: str, data: bytes) -> pdstor.Receipt:
    src = pdstor.Buffer(len(data))
    src.write(0, data)
    return pdstor.Writer(client).put(name, LAYOUT, [(src, at, MIB) for at in range(0, len(data), MIB)])


def corrupt(daemon, client: pdstor.Client, req_id: str, chunk: int, at: int, garbage: bytes) -> None:
    """Overwrites bytes of a stored chunk on the media, behind the daemon."""
    (info,) = [p for p in client.publications(verbose=True) if p["req_id"] == req_id]
    with open(daemon.target, "r+b") as f:
        f.seek(info["extents"][chunk]["offset"] + at)
        f.write(garbage)
        f.flush()
        os.fsync(f.fileno())


def loads_checked_by(daemon) -> list[str]:
    lines = [json.loads(line) for line in (daemon.dir / "timeline.jsonl").read_text().splitlines()]
    return [e["checked"] for e in lines if e.get("event") == "load" and e["node"].startswith("daemon")]


def test_a_staged_load_is_checked_as_it_is_copied_out(daemon):
    client = daemon.client()
    data = pattern(2 * MIB, 1)
    ready = put(client, "req-staged", data)
    r = pdstor.Reader(client, "decode-0")
    claim = r.claim(ready, layout=LAYOUT)
    r.adopt(claim, LAYOUT)
    staging = pdstor.Buffer(4 * MIB, "staging", staging=True)
    assert staging.staging and not pdstor.Buffer(4096).staging
    r.load(claim, [(0, staging, 0), (1, staging, 2 * MIB)])
    # Loaded, not yet checked: nothing is acknowledged.
    with pytest.raises(pdstor.UsageError, match=r"chunks \[0, 1\] were loaded into a staging buffer"):
        r.ack(claim)
    head, tail = bytearray(1000), np.zeros(300_000, dtype=np.uint8)
    r.scatter(claim, 0, [(0, head), (5000, tail)])
    assert bytes(head) == data[:1000] and tail.tobytes() == data[5000:305_000]
    with pytest.raises(pdstor.UsageError, match=r"chunks \[1\]"):
        r.ack(claim)
    r.scatter(claim, 1, [])  # checked only
    with pytest.raises(pdstor.UsageError, match="copied out already"):
        r.scatter(claim, 1, [])
    r.ack(claim)
    assert client.publications() == []
    checked = loads_checked_by(daemon)
    assert len(checked) == 2 and all(c.startswith("not by the daemon") for c in checked), checked


def test_a_byte_flipped_in_staging_is_caught_by_the_copy_and_never_acknowledged(daemon):
    client = daemon.client()
    data = pattern(MIB, 2)
    ready = put(client, "req-flip", data)
    r = pdstor.Reader(client)
    claim = r.claim(ready, layout=LAYOUT)
    r.adopt(claim, LAYOUT)
    staging = pdstor.Buffer(MIB, staging=True)
    r.load(claim, [(0, staging, 0)])
    staging.write(777_777, bytes([staging.read(777_777, 1)[0] ^ 0x10]))
    out = np.zeros(MIB, dtype=np.uint8)
    with pytest.raises(pdstor.VerifyFailed, match="as it copied the chunk out of staging"):
        r.scatter(claim, 0, [(0, out)])
    with pytest.raises(pdstor.UsageError, match=r"chunks \[0\] were not loaded and verified"):
        r.ack(claim)
    r.fail(claim, "a byte flipped in staging")
    assert [p["state"] for p in client.publications()] == ["RETAINED"]


def test_get_many_into_copies_each_item_on_checked_and_fails_only_its_own(daemon):
    client = daemon.client()
    items = {f"req-{i}": pattern(2 * MIB, 10 + i) for i in range(3)}
    readies = [put(client, name, data) for name, data in items.items()]
    # Chunk 1 of the last item corrupted on the media: the copy catches it.
    corrupt(daemon, client, "req-2", chunk=1, at=4321, garbage=b"\xff\x00corrupt")
    staging = pdstor.Buffer(6 * MIB, staging=True)
    dests: dict[int, np.ndarray] = {}

    def into(manifest: dict) -> np.ndarray:
        size = sum(c["len"] for c in manifest["chunks"])
        if manifest["publication"] == readies[1].publication:
            size -= 1  # the wrong size: that item fails, the others go on
        dests[manifest["publication"]] = np.zeros(size, dtype=np.uint8)
        return dests[manifest["publication"]]

    places = [(ready, staging, i * 2 * MIB) for i, ready in enumerate(readies)]
    got = pdstor.Reader(client).get_many(places, LAYOUT, into=into)
    assert isinstance(got[0], dict) and dests[readies[0].publication].tobytes() == items["req-0"]
    assert isinstance(got[1], pdstor.DataPlaneError) and "exactly its bytes" in str(got[1])
    assert isinstance(got[2], pdstor.VerifyFailed) and "as it copied" in str(got[2])
    states = {p["req_id"]: p["state"] for p in client.publications()}
    assert states == {"req-1": "RETAINED", "req-2": "RETAINED"}


def test_copy_out_answers_the_ranges_crc32c_and_refuses_overlap():
    buf = pdstor.Buffer(MIB)
    data = pattern(MIB, 4)
    buf.write(0, data)
    a, b = bytearray(4096), np.zeros(8192, dtype=np.uint8)
    crc = buf.copy_out(100, 500_000, [(10, a), (200_000, b)])
    assert crc == buf.crc32c(100, 500_000)
    assert bytes(a) == data[110:4206] and b.tobytes() == data[200_100:208_292]
    both = np.zeros(8192, dtype=np.uint8)
    with pytest.raises(ValueError, match="overlap"):
        buf.copy_out(0, 100_000, [(0, both[:5000]), (6000, both[4000:])])
    with pytest.raises(ValueError, match="overlap"):
        buf.copy_out(0, 100_000, [(0, memoryview(buf)[50_000:60_000])])
    with pytest.raises(ValueError, match="ascending order"):
        buf.copy_out(0, 100_000, [(5000, bytearray(10)), (0, bytearray(10))])
    with pytest.raises(ValueError, match="writable"):
        buf.copy_out(0, 100_000, [(0, b"read-only")])


def test_a_staging_buffer_used_for_a_plain_get_is_still_checked_here(daemon):
    """The daemon leaves loads into a staging buffer unchecked; a reader
    that does not copy them out (plain `get`) checksums them in place, so a
    chunk corrupted on the media still fails its get."""
    client = daemon.client()
    ready = put(client, "req-plain", pattern(2 * MIB, 5))
    corrupt(daemon, client, "req-plain", chunk=0, at=99, garbage=b"\x00flipped")
    with pytest.raises(pdstor.LoadFailed):
        pdstor.Reader(client).get(ready, LAYOUT, pdstor.Buffer(2 * MIB, staging=True))
    assert [p["state"] for p in client.publications()] == ["RETAINED"]


def test_destinations_that_overlap_fail_their_item_alone(daemon):
    client = daemon.client()
    items = {f"req-o{i}": pattern(MIB, 20 + i) for i in range(2)}
    readies = [put(client, name, data) for name, data in items.items()]
    shared = np.zeros(MIB + 4096, dtype=np.uint8)
    staging = pdstor.Buffer(2 * MIB, staging=True)
    # The second item's destination overlaps the first's.
    views = iter([shared[:MIB], shared[4096:]])
    got = pdstor.Reader(client).get_many(
        [(r, staging, i * MIB) for i, r in enumerate(readies)], LAYOUT, into=lambda m: next(views)
    )
    assert isinstance(got[0], dict) and shared[:MIB].tobytes() == items["req-o0"]
    assert isinstance(got[1], pdstor.Error) and "overlap" in str(got[1])
    assert [p["state"] for p in client.publications()] == ["RETAINED"], "the refused one kept, not leaked"


def test_a_wrong_piece_leaves_the_chunk_staged_for_a_corrected_call(daemon):
    client = daemon.client()
    data = pattern(MIB, 6)
    ready = put(client, "req-retry", data)
    r = pdstor.Reader(client)
    claim = r.claim(ready, layout=LAYOUT)
    r.adopt(claim, LAYOUT)
    staging = pdstor.Buffer(MIB, staging=True)
    r.load(claim, [(0, staging, 0)])
    with pytest.raises(ValueError, match="ascending order"):
        r.scatter(claim, 0, [(5000, bytearray(10)), (0, bytearray(10))])
    out = bytearray(MIB)
    r.scatter(claim, 0, [(0, out)])
    assert bytes(out) == data
    r.ack(claim)
    assert client.publications() == []
