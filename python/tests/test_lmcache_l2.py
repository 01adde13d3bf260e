"""pdstor's L2 adapter for LMCache's multiprocess server, driven the way
LMCache's own check drives an L2 adapter (its controllers' calls, every
completion through the adapter's eventfds, LMCache's memory objects and
keys), in two processes sharing one daemon — and LMCache's own check run on
it beside raw_block_l2_adapter, the peer. Bytes compared with torch.equal,
outside pdstor."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
check = pytest.importorskip("lmcache.v1.check.check_mode_test_l2_adapter")

from conftest import serve  # noqa: E402

import pdstor  # noqa: E402
from pdstor.lmcache_l2 import L2Adapter  # noqa: E402
from lmcache.v1.storage_backend.raw_block.key_codec import object_key_to_string  # noqa: E402

OBJ = 512 * 1024 // 4  # float32 elements: 512 KiB objects


@pytest.fixture
def daemon(tmp_path: Path):
    d = serve(tmp_path, "64M", "256K")
    yield d
    d.stop()


def params(d) -> dict:
    return {"server": d.server, "data_socket": d.data_socket, "staging_mib": 4}


def keys(n: int, tag: str = "p") -> list:
    return [check._create_object_key("model-l2", f"{tag}-{i}") for i in range(n)]


def shared_keys(n: int) -> list:
    """Keys every process names alike (LMCache's check hashes with str
    hash(), which differs between processes)."""
    from lmcache.v1.distributed.api import ObjectKey

    return [ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(7000 + i), model_name="model-l2", kv_rank=0) for i in range(n)]


def objects(n: int, seed: float = 1.0) -> list:
    objs = [check._create_memory_obj(obj_size=OBJ) for _ in range(n)]
    for i, o in enumerate(objs):
        o.raw_data.copy_(torch.arange(OBJ, dtype=torch.float32) * (seed + i))
    return objs


def wait(fd: int) -> None:
    assert check._wait_event_fd(fd, 30_000), "the adapter never signalled its eventfd"


def store(a: L2Adapter, ks: list, objs: list):
    task = a.submit_store_task(ks, objs)
    wait(a.get_store_event_fd())
    return a.pop_completed_store_tasks()[task]


def lock(a: L2Adapter, ks: list) -> list[bool]:
    task = a.submit_lookup_and_lock_task(ks, {})
    wait(a.get_lookup_and_lock_event_fd())
    bits = a.query_lookup_and_lock_result(task)
    return [bits.test(i) for i in range(len(ks))]


def load(a: L2Adapter, ks: list, objs: list) -> list[bool]:
    task = a.submit_load_task(ks, objs)
    wait(a.get_load_event_fd())
    bits = a.query_load_result(task)
    return [bits.test(i) for i in range(len(ks))]


def step(d, name: str) -> int:
    """How many `name` steps the daemon answered on their own route (`batch`: batches)."""
    series = f'pdstor_step_seconds_count{{step="{name}"}} '
    line = next((l for l in d.client().metrics().splitlines() if l.startswith(series)), None)
    return 0 if line is None else int(float(line.split()[-1]))


def test_store_lock_load_unlock_delete_and_the_accounting(daemon):
    a = L2Adapter(params(daemon))
    try:
        ks, objs = keys(6), objects(6)
        result = store(a, ks, objs)
        assert result.is_successful() and result.bytes_transferred() == 6 * OBJ * 4
        assert a.get_usage().total_bytes_used == 6 * OBJ * 4
        assert store(a, ks[:2], objs[:2]).is_successful(), "a key stored again is stored"
        absent = keys(2, "absent")
        batches, lookups = step(daemon, "batch"), step(daemon, "lookup")
        assert lock(a, ks + absent) == [True] * 6 + [False] * 2
        # A lookup and a read in one step: one batch of reads by name.
        assert (step(daemon, "batch") - batches, step(daemon, "lookup") - lookups) == (1, 0)
        out = objects(6, seed=0.0)
        assert load(a, ks, out) == [True] * 6
        for got, want in zip(out, objs):
            assert torch.equal(got.raw_data, want.raw_data)
        a.submit_unlock(ks + absent)  # nothing held any more: no-op
        listed = a.list_l2_keys(page_size=4)
        assert len(listed.entries) == 4 and listed.next_page_token is not None
        rest = a.list_l2_keys(page_size=4, cursor=listed.next_page_token)
        assert len(rest.entries) == 2 and rest.next_page_token is None
        # Held: another process's delete (or this one's) keeps it.
        assert lock(a, ks[:1]) == [True]
        a.delete(ks[:2])
        assert a.failures["delete_kept"] == 1
        assert a.get_usage().total_bytes_used == 5 * OBJ * 4
        a.submit_unlock(ks[:1])
        a.delete(ks[:1])
        assert lock(a, ks[:2]) == [False, False]
        assert a.report_status()["is_healthy"]
    finally:
        a.close()


def test_a_key_no_one_reads_goes_after_the_adapters_unread_window_and_a_read_key_stays(daemon):
    """Without ``unread_release_s`` (the default) a key carries no window:
    LMCache's eviction governs its L2. With it, the daemon releases a key no
    one has read for that long — counted from its last read, so one read
    more often stays."""
    a = L2Adapter(params(daemon))
    try:
        assert store(a, keys(1, "kept"), objects(1)).is_successful()
        assert [p.get("unread_release_ms") for p in daemon.client().publications()] == [None]
    finally:
        a.close()
    a = L2Adapter(dict(params(daemon), unread_release_s=2.0))
    try:
        hot, cold = keys(1, "hot"), keys(1, "cold")
        assert store(a, hot + cold, objects(2)).is_successful()
        names = lambda: {p["req_id"] for p in daemon.client().publications()}  # noqa: E731
        cold_name, hot_name = object_key_to_string(cold[0]), object_key_to_string(hot[0])
        assert {cold_name, hot_name} <= names()
        deadline = time.monotonic() + 30
        while cold_name in names() and time.monotonic() < deadline:
            assert lock(a, hot) == [True] and load(a, hot, objects(1, seed=0.0)) == [True]
            time.sleep(0.2)
        assert cold_name not in names(), "the key no one read went"
        assert hot_name in names(), "read every 0.2 s: kept past its 2 s window"
        assert "pdstor_unread_expired_total 1" in daemon.client().metrics()
    finally:
        a.close()
    with pytest.raises(ValueError, match="unread_release_s is a number of seconds"):
        L2Adapter(dict(params(daemon), unread_release_s=-1))


def test_two_requests_locking_one_key_keep_their_own_locks(daemon):
    """LMCache unlocks every key it planned after a load: a load's unlock
    ends nothing more, so another request's lock on the key still holds."""
    a = L2Adapter(params(daemon))
    try:
        (k,), objs = keys(1, "twice"), objects(1)
        assert store(a, [k], objs).is_successful()
        assert lock(a, [k]) == [True]  # request A
        assert lock(a, [k]) == [True]  # request B
        out = objects(1, seed=0.0)
        assert load(a, [k], out) == [True]  # A loads ...
        a.submit_unlock([k])  # ... and unlocks
        a.delete([k])
        assert a.failures["delete_kept"] == 1, "B's lock still holds the key"
        assert load(a, [k], out) == [True]  # B loads
        a.submit_unlock([k])
        a.delete([k])
        assert daemon.client().publications() == []
    finally:
        a.close()


def test_a_chunk_that_does_not_verify_fails_its_key_and_the_publication_stays(daemon):
    a = L2Adapter(params(daemon))
    try:
        ks, objs = keys(2, "bad"), objects(2)
        assert store(a, ks, objs).is_successful()
        client = daemon.client()
        (info,) = [p for p in client.publications(verbose=True) if p["req_id"].endswith(ks[1].chunk_hash.hex())]
        with open(daemon.target, "r+b") as f:
            f.seek(info["extents"][0]["offset"] + 100)
            f.write(b"\xff" * 8)
        out = objects(2, seed=0.0)
        assert load(a, ks, out) == [True, False]
        assert torch.equal(out[0].raw_data, objs[0].raw_data)
        assert a.failures["load"] == 1
        assert lock(a, ks[1:]) == [True], "the publication stays, for an operator to look at"
    finally:
        a.close()


def test_an_l1_in_shared_memory_moves_straight_to_and_from_the_device(daemon):
    """LMCache's L1 as a shared-memory file (the server's --shm-name): no
    staging copy either way, and the bytes still come back exactly."""
    path = Path(f"/dev/shm/pdstor-test-l1-{os.getpid()}")
    n = 4
    try:
        pool = torch.from_file(str(path), shared=True, size=(n + 1) * OBJ * 4, dtype=torch.uint8)
        floats = pool.view(torch.float32)
        # Objects at page-aligned places in the pool, as LMCache's allocator lays them out.
        objs = [check._create_memory_obj(raw_data=floats[i * OBJ : (i + 1) * OBJ], obj_size=OBJ) for i in range(n)]
        for i, o in enumerate(objs):
            o.raw_data.copy_(torch.arange(OBJ, dtype=torch.float32) * (3.0 + i))
        want = [o.raw_data.clone() for o in objs]
        a = L2Adapter(params(daemon), l1_memory_desc=check._create_l1_memory_desc(pool))
        try:
            assert a.shared is not None and a.shared.path == str(path)
            ks = keys(n, "shm")
            assert store(a, ks, objs).is_successful()
            for o in objs:
                o.raw_data.zero_()
            assert lock(a, ks) == [True] * n
            assert load(a, ks, objs) == [True] * n
            for o, w in zip(objs, want):
                assert torch.equal(o.raw_data, w)
            assert a.moved == {"in_place": 2 * n, "staged": 0}, a.moved
            # An object outside the shared file still goes through staging.
            outside = objects(1, seed=9.0)
            assert store(a, keys(1, "anon"), outside).is_successful()
            assert a.moved["staged"] == 1
        finally:
            a.close()
    finally:
        path.unlink(missing_ok=True)


_READER = """
import json, sys, torch
from lmcache.v1.check import check_mode_test_l2_adapter as check
from pdstor.lmcache_l2 import L2Adapter
params, n, obj, go = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
a = L2Adapter(params)
from lmcache.v1.distributed.api import ObjectKey
ks = [ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(7000 + i), model_name="model-l2", kv_rank=0) for i in range(n)]
t = a.submit_lookup_and_lock_task(ks, {})
assert check._wait_event_fd(a.get_lookup_and_lock_event_fd(), 30000)
locked = a.query_lookup_and_lock_result(t)
print(json.dumps([locked.test(i) for i in range(n)]), flush=True)
sys.stdin.readline()  # both processes hold their locks now
objs = [check._create_memory_obj(obj_size=obj) for _ in range(n)]
t = a.submit_load_task(ks, objs)
assert check._wait_event_fd(a.get_load_event_fd(), 30000)
loaded = a.query_load_result(t)
want = [torch.arange(obj, dtype=torch.float32) * (1.0 + i) for i in range(n)]
print(json.dumps([loaded.test(i) and torch.equal(o.raw_data, w) for i, (o, w) in enumerate(zip(objs, want))]), flush=True)
a.close()
"""


def test_two_server_processes_share_a_stored_prefix(daemon):
    a = L2Adapter(params(daemon))
    try:
        ks, objs = shared_keys(4), objects(4)
        assert store(a, ks, objs).is_successful()
        readers = [
            subprocess.Popen(
                [sys.executable, "-c", _READER, json.dumps(params(daemon)), "4", str(OBJ), "go"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        for r in readers:
            assert json.loads(r.stdout.readline()) == [True] * 4
        # Both hold reads: the writer's eviction cannot take the prefix.
        a.delete(ks)
        assert a.failures["delete_kept"] == 4
        for r in readers:
            r.stdin.write("go\n")
            r.stdin.flush()
        for r in readers:
            assert json.loads(r.stdout.readline()) == [True] * 4, "each process restored every object byte for byte"
            assert r.wait(60) == 0
        a.delete(ks)
        assert daemon.client().publications() == []
    finally:
        a.close()


@pytest.mark.parametrize("adapter", ["pdstor", "raw_block"])
def test_lmcaches_own_check_passes_beside_raw_block(daemon, tmp_path, adapter):
    if adapter == "pdstor":
        spec = {"type": "plugin", "module_path": "pdstor.lmcache_l2", "class_name": "L2Adapter", "adapter_params": params(daemon)}
    else:
        device = tmp_path / "raw_block.img"
        device.write_bytes(b"\0" * (64 << 20))
        spec = {"type": "raw_block", "device_path": str(device), "capacity_bytes": 64 << 20, "meta_total_bytes": 4 << 20,
                "slot_bytes": 1 << 20, "use_odirect": False}  # the check's L1 is not page-aligned
    out = subprocess.run(
        [sys.executable, "-m", "lmcache.v1.basic_check", "--mode", "test_l2_adapter", "--l2-adapter", json.dumps(spec),
         "--num-keys", "8", "--obj-size", str(OBJ)],
        capture_output=True, text=True, timeout=300,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "Validation" in text, text
    # It asserts nothing itself: it prints "Validation: 8/8 found" and the like.
    results = re.findall(r"Validation[^:]*: (\d+)/(\d+)", text)
    assert len(results) == 4, text  # absent, found, loaded, content
    for ok, total in results:
        assert ok == total == "8", text


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _MPServer:
    """LMCache's multiprocess server (CPU: no lazy L1), its L2 the adapter."""

    def __init__(self, d, log: Path, port: int):
        spec = {"type": "plugin", "module_path": "pdstor.lmcache", "class_name": "L2Adapter",
                "adapter_params": {**params(d), "staging_mib": 32}}
        self.log = log
        self.proc = subprocess.Popen(
            # An address, not "localhost": a machine without /etc/hosts (a bare
            # root) cannot resolve that name, and zmq's bind fails (ENODEV).
            [sys.executable, "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1", "--port", str(port),
             "--l1-size-gb", "0.25",
             "--eviction-policy", "LRU", "--no-l1-use-lazy", "--supported-transfer-mode", "auto",
             "--l2-adapter", json.dumps(spec)],
            stdout=open(log, "w"), stderr=subprocess.STDOUT,
        )
        import time

        deadline = time.monotonic() + 120
        while "cache server is running" not in log.read_text():
            assert self.proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _bench(port: int, out: Path) -> dict:
    """LMCache's own CPU client: a cold request stores each sequence's KV
    (random, seeded), a warm one zeroes its blocks, retrieves and compares
    the checksums with the cold ones."""
    run = subprocess.run(
        [sys.executable, "-m", "lmcache.cli.main", "bench", "server", "--mode", "cpu",
         "--rpc-url", f"tcp://127.0.0.1:{port}", "--kvcache-shape-spec", "(2,64,16,8,128):float16:4",
         "--start", "0", "--end", "2", "--interval", "0.1", "--num-tokens", "512", "-q",
         "--format", "json", "--output", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(out.read_text())["metrics"]["results"]


def test_lmcaches_server_stores_through_the_adapter_and_a_restarted_server_loads_from_it(daemon, tmp_path):
    port = _free_port()
    first = _MPServer(daemon, tmp_path / "mp-1.log", port)
    try:
        results = _bench(port, tmp_path / "bench-1.json")
        # The server stores to L2 behind the client's back: wait for it
        # (2 requests x 2 chunks of 256 tokens, each an object READY on the device).
        import time

        deadline = time.monotonic() + 60
        while True:
            stored = [p for p in daemon.client().publications() if p.get("cache") and p["state"] == "READY"]
            if len(stored) >= 4 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(stored) == 4, stored
    finally:
        first.stop()
    # LMCache's client checked every retrieved chunk against what it stored.
    assert results["total_requests"] == 2 and results["checksum_ok"] == 2 and results["checksum_fail"] == 0, results
    # A new server, its L1 empty: every chunk comes back from pdstor.
    port = _free_port()
    second = _MPServer(daemon, tmp_path / "mp-2.log", port)
    try:
        _bench(port, tmp_path / "bench-2.json")
    finally:
        second.stop()
    log = (tmp_path / "mp-2.log").read_text()
    from_l2 = [int(l2) for _, l2 in re.findall(r"retained keys \((\d+) L1, (\d+) L2\)", log)]
    assert from_l2 and sum(from_l2) >= 4, log[-3000:]
    assert "not loaded" not in log and "not stored" not in log, log[-3000:]
