"""The LMCache plugin with the real LMCache (0.5.6, from PyPI): its
StorageManager loads `pdstor.lmcache.PdstorBackend` from a configuration
file exactly as a user's would, and stores and retrieves KV chunks of
Llama-3.2-1B's shape (16 layers, 8 KV heads of 64, BF16, 256 tokens: 8 MiB a
chunk) through a live `pdstor serve`."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lmcache")

from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.event_manager import EventManager  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.storage_manager import StorageManager  # noqa: E402

import pdstor  # noqa: E402
from conftest import Daemon, serve  # noqa: E402

MODEL = "meta-llama/Llama-3.2-1B"
KV_SHAPE = (16, 2, 256, 8, 64)  # layers, K/V, tokens, KV heads, head size


_POOLS = iter(range(1 << 30))


def config_file(dir: Path, d: Daemon, shm: bool = True, extra: str = "") -> Path:
    """The YAML an LMCache user writes to load the plugin: LMCache's CPU pool
    in shared memory (`shm_name`, a name of its own) so that the daemon
    moves bytes straight to and from its memory objects, or (`shm=False`)
    not, so that they go through the plugin's staging buffer."""
    path = dir / f"lmcache-{next(_POOLS)}.yaml"
    pool = f'  shm_name: "pdstor-test-{os.getpid()}-{next(_POOLS)}"\n' if shm else ""
    path.write_text(
        f"""chunk_size: 256
local_cpu: false
max_local_cpu_size: 1.0
storage_plugins: ["pdstor"]
extra_config:
  storage_plugin.pdstor.module_path: pdstor.lmcache
  storage_plugin.pdstor.class_name: PdstorBackend
  pdstor.server: "{d.server}"
  pdstor.data_socket: "{d.data_socket}"
  pdstor.io_threads: 4
{pool}{extra}"""
    )
    return path


def manager(cfg: Path, kv_shape=KV_SHAPE) -> StorageManager:
    config = LMCacheEngineConfig.from_file(str(cfg))
    md = LMCacheMetadata(
        model_name=MODEL,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=kv_shape,
    )
    sm = StorageManager(config, md, EventManager())
    assert "pdstor" in sm.storage_backends, f"LMCache did not load the plugin: {list(sm.storage_backends)}"
    return sm


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey(MODEL, 1, 0, 0xC0FFEE00 + i, torch.bfloat16)


def kv(i: int, tokens: int = 256) -> "torch.Tensor":
    """Chunk i's KV, from its own seed: regenerated anywhere, no pdstor involved."""
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn((2, KV_SHAPE[0], tokens, KV_SHAPE[3] * KV_SHAPE[4]), generator=g).to(torch.bfloat16)


def put(sm: StorageManager, ids: list[int], tokens: int = 256) -> None:
    objs = []
    for i in ids:
        t = kv(i, tokens)
        obj = sm.allocate(t.shape, torch.bfloat16)
        obj.tensor.copy_(t)
        objs.append(obj)
    sm.batched_put([key(i) for i in ids], objs)
    backend = sm.storage_backends["pdstor"]
    deadline = time.monotonic() + 60
    while any(backend.exists_in_put_tasks(key(i)) for i in ids):
        assert time.monotonic() < deadline, "puts did not finish"
        time.sleep(0.01)


def retrieve(sm: StorageManager, keys: list[CacheEngineKey]) -> list:
    """What LMCache's engine does to retrieve (LMCacheEngine.retrieve): map
    the keys to the backends that hold them, then get from each there."""
    mapping = sm.get_block_mapping([(k, i * 256, (i + 1) * 256) for i, k in enumerate(keys)])
    assert list(mapping) == ["pdstor"], f"the keys were found in {list(mapping)}"
    return sm.batched_get([k for k, _, _ in mapping["pdstor"]], location="pdstor")


@pytest.fixture
def big_daemon(tmp_path: Path):
    """A daemon on a 256 MiB file with 8 MiB slots (one LMCache chunk each)."""
    d = serve(tmp_path, "256M", "8M")
    yield d
    d.stop()


@pytest.fixture
def sm_factory(tmp_path: Path, big_daemon: Daemon):
    made: list[StorageManager] = []

    def make(kv_shape=KV_SHAPE, shm: bool = True) -> StorageManager:
        sm = manager(config_file(tmp_path, big_daemon, shm), kv_shape)
        made.append(sm)
        return sm

    yield make
    for sm in made:
        sm.close()


def steps(d: Daemon, step: str) -> int:
    """Control-plane requests of one route the daemon answered so far."""
    series = f'pdstor_step_seconds_count{{step="{step}"}} '
    line = next((l for l in d.client().metrics().splitlines() if l.startswith(series)), None)
    return 0 if line is None else int(float(line.split()[-1]))


@pytest.mark.parametrize("shm", [True, False], ids=["shared-pool", "staging"])
def test_lmcache_stores_and_retrieves_through_pdstor(sm_factory, big_daemon: Daemon, shm: bool):
    sm = sm_factory(shm=shm)
    # With shm_name the daemon reaches LMCache's own pool; without, staging.
    pool = sm.storage_backends["pdstor"]._pool
    assert (pool is not None) == shm
    if shm:
        assert pool.size == sm.storage_backends["LocalCPUBackend"].memory_allocator.size
    batches = steps(big_daemon, "batch")
    put(sm, [0, 1, 2, 3])
    # LMCache's batch of four keys: one prepare batch and one publish batch,
    # no step on its own.
    assert steps(big_daemon, "batch") - batches == 2
    assert steps(big_daemon, "prepare") == steps(big_daemon, "publish") == 0
    # Each key is a READY publication of one 8 MiB chunk, durable before it counts.
    pubs = big_daemon.client().publications("READY")
    assert sorted(p["req_id"] for p in pubs) == sorted(key(i).to_string() for i in range(4))
    assert all(p["chunks"] == 1 for p in pubs)
    assert sm.batched_contains([key(i) for i in range(5)])[0] == 4
    batches = steps(big_daemon, "batch")
    got = retrieve(sm, [key(i) for i in range(4)])
    # And its get: one batch of claims that adopt too; then, into LMCache's
    # own pool, loads that acknowledge their claims (the daemon checks them
    # in place), or into staging (checked by the plugin as it copies each
    # chunk out) loads and one ack batch.
    assert steps(big_daemon, "batch") - batches == (1 if shm else 2)
    assert steps(big_daemon, "claim") == steps(big_daemon, "adopt") == steps(big_daemon, "ack") == 0
    for i, obj in enumerate(got):
        assert obj is not None and torch.equal(obj.tensor, kv(i)), f"chunk {i} differs"
        obj.ref_count_down()
    # A handoff consumes: restored and acknowledged, the slots are free again.
    assert big_daemon.client().publications() == []


def test_a_partial_last_chunk_keeps_its_token_count(sm_factory):
    sm = sm_factory()
    put(sm, [7], tokens=100)
    (obj,) = retrieve(sm, [key(7)])
    assert obj.tensor.shape[2] == 100 and torch.equal(obj.tensor, kv(7, 100))
    obj.ref_count_down()


def test_a_backend_keeps_a_bounded_number_of_receipts(sm_factory, monkeypatch):
    """A prefill's keys are consumed elsewhere: the receipts it keeps are
    the newest READY_KEPT, and an older key is still found, by name."""
    import pdstor.lmcache

    monkeypatch.setattr(pdstor.lmcache, "READY_KEPT", 2)
    sm = sm_factory()
    put(sm, [20, 21, 22, 23])
    backend = sm.storage_backends["pdstor"]
    assert list(backend._ready) == [key(22).to_string(), key(23).to_string()]
    assert backend.contains(key(20)), "forgotten here, handed out again by the daemon"
    got = retrieve(sm, [key(20)])
    assert torch.equal(got[0].tensor, kv(20))
    got[0].ref_count_down()


def test_after_a_fenced_claim_the_plugin_claims_in_a_new_session(tmp_path: Path, big_daemon: Daemon):
    """The operator closed the session a plugin thread claims in (its host
    was believed gone): the get in it fails, Fenced, and the next claims are
    made in a new session — the plugin is not fenced for good."""
    sm = manager(config_file(tmp_path, big_daemon, extra="  pdstor.io_threads: 1\n"))
    try:
        backend = sm.storage_backends["pdstor"]
        session = backend._threads.submit(lambda: backend._conn().reader.session).result()
        put(sm, [30, 31, 32])
        client = big_daemon.client()
        (ready,) = client.lookup([key(30).to_string()])
        claim = pdstor.Reader(client, "lmcache-0", session=session).claim(ready)
        client.close_session(claim)
        client.reclaim(claim)
        with pytest.raises(pdstor.Fenced):
            retrieve(sm, [key(31)])
        (fenced,) = [p for p in client.publications() if p["req_id"] == key(31).to_string()]
        client.reclaim_publication(fenced["publication"], "its claim was fenced")
        got = retrieve(sm, [key(32)])
        assert torch.equal(got[0].tensor, kv(32)), "claimed in a new session and restored"
        got[0].ref_count_down()
    finally:
        sm.close()


WRITER = r"""
import sys, time, torch
sys.path.insert(0, sys.argv[2])
from pathlib import Path
import test_lmcache as t
sm = t.manager(Path(sys.argv[1]))
t.put(sm, [10, 11, 12])
sm.close()
print("stored")
"""


def test_a_second_process_restores_what_the_first_stored(sm_factory, tmp_path, big_daemon: Daemon):
    cfg = config_file(tmp_path, big_daemon)
    out = subprocess.run(
        [sys.executable, "-c", WRITER, str(cfg), os.path.dirname(__file__)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and "stored" in out.stdout, out.stderr[-3000:]
    sm = sm_factory()  # the decode process: knows the keys, not the receipts
    keys = [key(i) for i in (10, 11, 12)]
    assert sm.batched_contains(keys)[0] == 3
    for i, obj in zip((10, 11, 12), retrieve(sm, keys)):
        assert torch.equal(obj.tensor, kv(i))
        obj.ref_count_down()


def test_a_corrupt_chunk_is_a_load_error_in_lmcache(sm_factory, big_daemon: Daemon):
    sm = sm_factory()
    put(sm, [20, 21])
    victim = key(21).to_string()
    (info,) = [p for p in big_daemon.client().publications(verbose=True) if p["req_id"] == victim]
    with open(big_daemon.target, "r+b") as f:
        f.seek(info["extents"][0]["offset"] + 4 * 4096 + 17)
        f.write(b"bit rot")
        f.flush()
        os.fsync(f.fileno())
    with pytest.raises(pdstor.LoadFailed):
        retrieve(sm, [key(20), key(21)])
    # Not a miss, not freed: the corrupt publication is RETAINED with its bytes.
    states = {p["req_id"]: p["state"] for p in big_daemon.client().publications()}
    assert states == {victim: "RETAINED"}, states


def test_a_daemon_restart_between_put_and_get_keeps_the_data(sm_factory, big_daemon: Daemon):
    sm = sm_factory()
    put(sm, [30, 31])
    sm.close()
    big_daemon.kill9()
    big_daemon.start()
    sm = sm_factory()
    got = retrieve(sm, [key(30), key(31)])
    for i, obj in zip((30, 31), got):
        assert torch.equal(obj.tensor, kv(i))
        obj.ref_count_down()


def test_a_non_blocking_get_leaves_lmcache_s_event_loop_running(sm_factory, big_daemon: Daemon):
    """LMCache prefetches with batched_get_non_blocking on its event loop:
    the loads run off the loop, which keeps serving other work meanwhile.
    Made deterministic by holding every staging region (of a plugin that
    stages: no shm_name), so that the get cannot finish until a coroutine
    on that same loop gives them back."""
    sm = sm_factory(shm=False)
    put(sm, [50, 51, 52])
    backend = sm.storage_backends["pdstor"]
    staging = backend._staging
    held = staging.acquire(staging.regions)
    given_back = threading.Event()

    def watchdog() -> None:  # never hang: give them back if the loop cannot
        if not given_back.wait(30):
            staging.release(held)

    threading.Thread(target=watchdog, daemon=True).start()

    async def prefetch():
        task = asyncio.ensure_future(backend.batched_get_non_blocking("lookup-0", [key(50), key(51), key(52)]))
        for _ in range(20):
            await asyncio.sleep(0.001)
            assert not task.done(), "the get finished while its staging was held: it cannot have loaded"
        staging.release(held)
        given_back.set()
        return await task

    got = asyncio.run(prefetch())
    assert given_back.is_set(), "the event loop was blocked until the watchdog gave the staging back"
    for i, obj in zip((50, 51, 52), got):
        assert torch.equal(obj.tensor, kv(i)), f"chunk {i}"
        obj.ref_count_down()


def test_a_reader_with_another_layout_leaves_it_for_the_right_one(sm_factory, big_daemon: Daemon):
    put(sm_factory(), [40])
    # Same bytes per token, another geometry (4 KV heads of 128): refused
    # when it claims, so nothing is claimed and the key stays READY.
    other = sm_factory(kv_shape=(16, 2, 256, 4, 128))
    with pytest.raises(pdstor.LayoutMismatch):
        retrieve(other, [key(40)])
    assert [p["state"] for p in big_daemon.client().publications()] == ["READY"]
    stats = other.storage_backends["pdstor"].stats()
    assert stats == {"put_dropped": 0, "get_failed": 1, "get_missed": 0, "get_discarded": 0}
    # The decoder configured like the writer still restores it, byte for byte.
    (obj,) = retrieve(sm_factory(), [key(40)])
    assert torch.equal(obj.tensor, kv(40))
    obj.ref_count_down()
    assert big_daemon.client().publications() == []


def test_keys_nobody_reads_make_room_where_the_operator_opted_in(tmp_path: Path):
    """`serve --evict-unread`: a cache of 4 chunks takes 6 puts (the oldest
    unread keys go), and a reader that looked a key up before it went sees a
    miss, counted — never an error, never a dropped put."""
    d = serve(tmp_path, "35M", "8M", ["--evict-unread"])  # 4 slots of 8 MiB
    made: list[StorageManager] = []
    try:
        prefill = manager(config_file(tmp_path, d))
        decode = manager(config_file(tmp_path, d))
        made += [prefill, decode]
        for i in range(4):
            put(prefill, [i])
        reader = decode.storage_backends["pdstor"]
        assert reader.batched_contains([key(0)]) == 1  # the decoder holds key 0's receipt now
        for i in (4, 5):
            put(prefill, [i])
        assert prefill.storage_backends["pdstor"].stats()["put_dropped"] == 0
        ready = sorted(p["req_id"] for p in d.client().publications())
        assert ready == sorted(key(i).to_string() for i in range(2, 6)), "the two oldest went"
        assert reader.batched_get_blocking([key(0)]) == [None]
        assert reader.stats()["get_missed"] == 1
        (obj,) = retrieve(decode, [key(5)])
        assert torch.equal(obj.tensor, kv(5))
        obj.ref_count_down()
        assert len(d.client().publications()) == 3, "key 5 was consumed; keys 2-4 wait"
    finally:
        for sm in made:
            sm.close()
        d.stop()


def test_a_key_no_decode_claims_is_released_after_the_plugins_unread_window(tmp_path: Path, big_daemon: Daemon):
    """Every key carries the plugin's unread window (``pdstor.unread_release_s``,
    480 s by default, as the vLLM connector's): set short, the daemon — with
    no window of its own — releases a key no decode claimed once it has
    passed, counted; its slots are free again."""
    sm = manager(config_file(tmp_path, big_daemon))
    try:
        put(sm, [0])
        [listed] = big_daemon.client().publications()
        assert listed["unread_release_ms"] == 480_000, listed
        assert sm.storage_backends["pdstor"].remove(key(0))
    finally:
        sm.close()
    sm = manager(config_file(tmp_path, big_daemon, extra="  pdstor.unread_release_s: 0.5\n"))
    try:
        put(sm, [1])
        assert [p["unread_release_ms"] for p in big_daemon.client().publications()] == [500]
        deadline = time.monotonic() + 30
        while big_daemon.client().publications() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert big_daemon.client().publications() == [], "released unread, its slots free"
        assert "pdstor_unread_expired_total 1" in big_daemon.client().metrics()
    finally:
        sm.close()


class _Records(logging.Handler):
    """Every record the plugin's logger emits (LMCache's loggers do not
    propagate to the root logger that pytest's caplog watches)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_wrong_data_socket_fails_loudly_at_start_up(tmp_path: Path, big_daemon: Daemon):
    from pdstor.lmcache import PdstorBackend

    cfg_path = config_file(tmp_path, big_daemon)
    cfg_path.write_text(cfg_path.read_text().replace(big_daemon.data_socket, f"{tmp_path}/not-the-data.sock"))
    seen = _Records()
    log = logging.getLogger("pdstor.lmcache")
    log.addHandler(seen)
    try:
        # Directly: the plugin refuses to start.
        cfg = LMCacheEngineConfig.from_file(str(cfg_path))
        md = LMCacheMetadata(MODEL, 1, 1, 0, 0, torch.bfloat16, KV_SHAPE)
        with pytest.raises(pdstor.Error):
            PdstorBackend(config=cfg, metadata=md, local_cpu_backend=object())
        # Through LMCache: its StorageManager catches that and runs without
        # the backend; the ERROR line says so and names the setting.
        sm = StorageManager(cfg, md, EventManager())
        try:
            assert "pdstor" not in sm.storage_backends
        finally:
            sm.close()
    finally:
        log.removeHandler(seen)
    errors = [r.getMessage() for r in seen.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2, errors
    for message in errors:
        assert "pdstor.data_socket" in message and "not-the-data.sock" in message, message
        assert "WITHOUT the pdstor backend" in message, message
    big_daemon.client().healthz()


def test_bad_configuration_gives_python_exceptions(tmp_path: Path, big_daemon: Daemon):
    from pdstor.lmcache import PdstorBackend

    cfg = LMCacheEngineConfig.from_file(str(config_file(tmp_path, big_daemon)))
    md = LMCacheMetadata(MODEL, 1, 1, 0, 0, torch.bfloat16, KV_SHAPE)
    with pytest.raises(ValueError, match="local_cpu_backend"):
        PdstorBackend(config=cfg, metadata=md, local_cpu_backend=None)
    cfg.extra_config = dict(cfg.extra_config, **{"pdstor.server": f"unix:{tmp_path}/nobody.sock"})
    with pytest.raises(pdstor.TransportError):
        PdstorBackend(config=cfg, metadata=md, local_cpu_backend=object())
    cfg.extra_config = dict(cfg.extra_config, **{"pdstor.server": big_daemon.server, "pdstor.io_threads": 0})
    with pytest.raises(ValueError, match="io_threads"):
        PdstorBackend(config=cfg, metadata=md, local_cpu_backend=object())
    cfg.extra_config = dict(cfg.extra_config, **{"pdstor.io_threads": 2, "pdstor.unread_release_s": "soon"})
    with pytest.raises(ValueError, match="pdstor.unread_release_s is a number of seconds"):
        PdstorBackend(config=cfg, metadata=md, local_cpu_backend=object())
    big_daemon.client().healthz()
