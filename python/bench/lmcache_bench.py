"""Put and get of KV chunks through LMCache's own StorageManager, with three
backends in one process and one run, rounds alternating:

  pdstor      pdstor.lmcache.PdstorBackend on a live `pdstor serve`
  raw_block   LMCache's RustRawBlockBackend (RawBlockCore, io_uring engine,
              O_DIRECT, queue depth 256, fixed buffers from its allocator)
  local_disk  LMCache's LocalDiskBackend (O_DIRECT) on a filesystem

Each backend gets its own target of the same kind (`cargo xtask bench
--lmcache` runs it on three zram devices, memory speed, so software overhead
shows, and on files of the root filesystem). Every restored chunk is
compared with what was stored, outside the timing. Prints a table and writes
JSON with medians and the ratios pdstor/raw_block and pdstor/local_disk
(throughput: > 1 means pdstor is faster), and the CPU each spent per GiB
moved: the benchmark process's (LMCache, the plugin or the backend, their
I/O threads) plus, for pdstor, the daemon's — both sides of the handoff.

pdstor's plugin runs as its documentation recommends: LMCache's CPU pool in
shared memory (`shm_name`), so that the daemon moves bytes straight to and
from LMCache's memory objects.

What each side guarantees when its put returns: pdstor — every chunk's
crc32c taken by the writer in LMCache's memory and recorded, the chunks
flushed to the device, then the publication is READY with a signed receipt;
a get verifies each chunk's crc32c in the reader's memory object against
the manifest before it acknowledges, and consumes the publication (exactly
one reader); raw_block — bytes
written with O_DIRECT, index in memory (checkpointed periodically), no flush,
no checksum; local_disk — a file written with O_DIRECT, no flush, no
checksum.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.storage_manager import StorageManager

from pdstor.testing import Daemon, format_target
from raw_block_bench import CRC32C, is_device, parse_size

MODEL = "meta-llama/Llama-3.2-1B"
SHAPES = {
    # Llama-3.2-1B, BF16, 256 tokens: all 16 layers (8 MiB) or one layer (512 KiB).
    "8MiB": (16, 2, 256, 8, 64),
    "512KiB": (1, 2, 256, 8, 64),
}


def make_file(path: str, size: str) -> None:
    """A target file of `size`, every block written once (zeros) and synced:
    no round pays the filesystem's first allocation of its extents."""
    block = bytes(8 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a target only its owner reads (`pdstor serve` insists)
    with os.fdopen(fd, "wb") as f:
        for _ in range(parse_size(size) // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def target_bytes(path: str) -> int:
    if is_device(path):
        return int(Path(f"/sys/class/block/{Path(path).name}/size").read_text()) * 512
    return os.path.getsize(path)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def chunk_bytes(shape) -> int:
    layers, kv, tokens, heads, dim = shape
    return layers * kv * tokens * heads * dim * 2


def start_pdstor(binary: str, target: str, slot: int, dir: Path, file_size: str) -> Daemon:
    """`pdstor format` + `pdstor serve` on the target, sockets in `dir`."""
    if not is_device(target):
        make_file(target, file_size)
    format_target(binary, target, slot=slot, journal="16M", size=None if is_device(target) else file_size)
    d = Daemon(binary, dir, target, ["--qd", "128"])
    d.start()
    return d


def manager(dir: Path, name: str, shape, extra: dict, top: dict) -> StorageManager:
    lines = [
        "chunk_size: 256",
        "local_cpu: false",
        "max_local_cpu_size: 2.0",
        *[f"{k}: {json.dumps(v)}" for k, v in top.items()],
        "extra_config:",
        *[f"  {k}: {json.dumps(v)}" for k, v in extra.items()],
    ]
    cfg = dir / f"{name}.yaml"
    cfg.write_text("\n".join(lines) + "\n")
    md = LMCacheMetadata(
        model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.bfloat16, kv_shape=shape,
    )
    return StorageManager(LMCacheEngineConfig.from_file(str(cfg)), md, EventManager())


def fs_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


def backend_of(sm: StorageManager):
    (name,) = [n for n in sm.storage_backends if n != "LocalCPUBackend"]
    return name, sm.storage_backends[name]


def one_round(sm: StorageManager, source: list[torch.Tensor], tag: str, others: list[int], sync_fd: int | None = None) -> tuple[float, ...]:
    """Put then get of every chunk of `source`: the seconds each took and the
    CPU seconds spent meanwhile by this process and the processes `others`;
    with `sync_fd`, also what the guarantees the backend lacks cost, timed
    apart: an fdatasync of its target after the put, a crc32c of every chunk
    got (seconds, CPU seconds)."""
    name, backend = backend_of(sm)
    def cpu() -> float:
        return time.process_time() + sum(cpu_s(p) for p in others)
    keys = [CacheEngineKey(MODEL, 1, 0, hash((tag, i)) & (2**63 - 1), torch.bfloat16) for i in range(len(source))]
    objs = []
    for t in source:
        o = sm.allocate(t.shape, torch.bfloat16)
        o.tensor.copy_(t)
        objs.append(o)
    start, cpu0 = time.perf_counter(), cpu()
    sm.batched_put(keys, objs)
    while any(backend.exists_in_put_tasks(k) for k in keys):
        time.sleep(0.0002)
    put_s, put_cpu = time.perf_counter() - start, cpu() - cpu0
    extra = [0.0, 0.0, 0.0, 0.0]  # sync s, sync cpu, crc s, crc cpu
    if sync_fd is not None:
        start, cpu0 = time.perf_counter(), cpu()
        os.fdatasync(sync_fd)
        extra[0:2] = time.perf_counter() - start, cpu() - cpu0
    if backend.batched_contains(keys) != len(keys):
        raise RuntimeError(f"{name}: only {backend.batched_contains(keys)} of {len(keys)} chunks stored")
    start, cpu0 = time.perf_counter(), cpu()
    mapping = sm.get_block_mapping([(k, i * 256, (i + 1) * 256) for i, k in enumerate(keys)])
    got = sm.batched_get(keys, location=name) if list(mapping) == [name] else []
    get_s, get_cpu = time.perf_counter() - start, cpu() - cpu0
    if len(got) != len(keys) or any(o is None for o in got):
        raise RuntimeError(f"{name}: get returned {sum(o is not None for o in got)} of {len(keys)} chunks")
    if sync_fd is not None:
        start, cpu0 = time.perf_counter(), cpu()
        for o in got:
            CRC32C(o.tensor.data_ptr(), o.get_size())
        extra[2:4] = time.perf_counter() - start, cpu() - cpu0
    for i, (o, t) in enumerate(zip(got, source)):
        if not torch.equal(o.tensor, t):
            raise RuntimeError(f"{name}: chunk {i} restored wrong bytes")
        o.ref_count_down()
    if name != "pdstor":  # pdstor's get consumed its publications; the others keep theirs
        backend.batched_remove(keys)
    return put_s, get_s, put_cpu, get_cpu, *extra


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pdstor-bin", required=True)
    ap.add_argument("--pdstor-device", required=True, help="a block device, or a file (made --file-size)")
    ap.add_argument("--raw-block-device", required=True, help="a block device, or a file (made --file-size)")
    ap.add_argument("--file-size", default="1G", help="size of each target that is a file, not a device")
    ap.add_argument("--label", default="zram", help="what the targets are (zram, file)")
    ap.add_argument("--disk-dir", required=True, help="a directory on a filesystem for local_disk")
    ap.add_argument("--bytes", type=int, default=256 << 20, help="bytes per round per backend")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", default="8MiB,512KiB")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    if not CRC32C:
        raise SystemExit("google-crc32c is not installed (LMCache brings it): raw_block at pdstor's guarantees needs it")
    if not is_device(a.raw_block_device):
        make_file(a.raw_block_device, a.file_size)
    results = {}
    for shape_name in a.shapes.split(","):
        shape = SHAPES[shape_name]
        size = chunk_bytes(shape)
        n = max(1, a.bytes // size)
        g = torch.Generator().manual_seed(7)
        source = [
            torch.randn((2, shape[0], 256, shape[3] * shape[4]), generator=g).to(torch.bfloat16) for _ in range(n)
        ]
        dir = Path(tempfile.mkdtemp(prefix="pdstor-lmcache-bench-"))
        daemon = start_pdstor(a.pdstor_bin, a.pdstor_device, size, dir, a.file_size)
        raw_dev_bytes = target_bytes(a.raw_block_device)
        disk = Path(a.disk_dir) / shape_name
        disk.mkdir(parents=True, exist_ok=True)
        sms: dict[str, StorageManager] = {}
        try:
            results[shape_name] = measure_shape(a, shape_name, shape, size, n, source, daemon, dir, disk, raw_dev_bytes, sms)
        finally:
            for sm in sms.values():
                sm.close()
            daemon.stop()
    write_report(a, results)
    return 0


def measure_shape(a, shape_name, shape, size, n, source, daemon: Daemon, dir, disk, raw_dev_bytes, sms) -> dict:
    """Alternating rounds of the three backends on one chunk shape; medians and ratios."""
    sms.update({
        "pdstor": manager(dir, "pdstor", shape, {
            "storage_plugin.pdstor.module_path": "pdstor.lmcache",
            "storage_plugin.pdstor.class_name": "PdstorBackend",
            "pdstor.server": daemon.server,
            "pdstor.data_socket": daemon.data_socket,
            "pdstor.io_threads": 8,
            # LMCache's CPU pool in shared memory: the daemon moves bytes
            # straight to and from its memory objects.
            "shm_name": f"pdstor-bench-{os.getpid()}",
        }, {"storage_plugins": ["pdstor"]}),
        "raw_block": manager(dir, "raw_block", shape, {
            "storage_plugin.raw_block.module_path": "lmcache.v1.storage_backend.plugins.rust_raw_block_backend",
            "storage_plugin.raw_block.class_name": "RustRawBlockBackend",
            "rust_raw_block.device_path": a.raw_block_device,
            "rust_raw_block.io_engine": "io_uring",
            "rust_raw_block.use_odirect": True,
            "rust_raw_block.iouring_queue_depth": 256,
            "rust_raw_block.capacity_bytes": raw_dev_bytes,
            "rust_raw_block.meta_total_bytes": 16 << 20,
            "rust_raw_block.load_checkpoint_on_init": False,
        }, {"storage_plugins": ["raw_block"]}),
        "local_disk": manager(dir, "local_disk", shape, {"use_odirect": True}, {
            "local_disk": f"file://{disk}/",
            # GB: most of the filesystem. LMCache 0.5.6's remove() lowers its
            # usage but not the size its admission counts, so the rounds' removed
            # chunks still count against this: the bench's filesystem is sized for
            # every round.
            "max_local_disk_size": 0.9 * fs_bytes(disk) / 1e9,
        }),
    })
    for name, sm in sms.items():
        if len(sm.storage_backends) != 2:
            raise RuntimeError(f"{name}: LMCache did not create the backend: {list(sm.storage_backends)}")
    # "raw_block+": raw_block's own rounds with an fdatasync after each put
    # and a crc32c of every chunk got, timed apart and added: raw_block at
    # pdstor's guarantees.
    samples = {name: {"put": [], "get": []} for name in [*sms, "raw_block+"]}
    cpu = {name: {"put": [], "get": []} for name in samples}
    others = {"pdstor": [daemon.proc.pid], "raw_block": [], "local_disk": []}
    order = list(sms)
    sync_fd = os.open(a.raw_block_device, os.O_RDONLY)
    for name in order:  # a warm-up round each
        one_round(sms[name], source[:2], f"warm-{name}", others[name])
    gib = n * size / 2**30
    try:
        for r in range(a.rounds):
            for name in order:
                fd = sync_fd if name == "raw_block" else None
                put_s, get_s, put_cpu, get_cpu, sync_s, sync_cpu, crc_s, crc_cpu = one_round(
                    sms[name], source, f"{shape_name}-{name}-{r}", others[name], fd)
                for side, extra in ((name, (0.0, 0.0, 0.0, 0.0)), ("raw_block+", (sync_s, sync_cpu, crc_s, crc_cpu))):
                    if side == "raw_block+" and name != "raw_block":
                        continue
                    samples[side]["put"].append(gib / (put_s + extra[0]))
                    samples[side]["get"].append(gib / (get_s + extra[2]))
                    cpu[side]["put"].append((put_cpu + extra[1]) / gib)
                    cpu[side]["get"].append((get_cpu + extra[3]) / gib)
            order = order[1:] + order[:1]  # alternate who goes first
    finally:
        os.close(sync_fd)
    med = {name: {op: statistics.median(v) for op, v in s.items()} for name, s in samples.items()}
    cpu_med = {name: {op: statistics.median(v) for op, v in s.items()} for name, s in cpu.items()}
    return {
        "target": a.label,
        "chunk_bytes": size,
        "chunks_per_round": n,
        "rounds": a.rounds,
        "gib_per_s": med,
        "cpu_s_per_gib": cpu_med,
        "samples": samples,
        "ratio": {
            f"pdstor/{peer}": {op: med["pdstor"][op] / med[peer][op] for op in ("put", "get")}
            for peer in ("raw_block", "raw_block+", "local_disk")
        },
        "cpu_ratio": {
            f"pdstor/{peer}": {op: cpu_med["pdstor"][op] / cpu_med[peer][op] for op in ("put", "get")}
            for peer in ("raw_block", "raw_block+", "local_disk")
        },
    }


def write_report(a, results: dict) -> None:
    Path(a.json).write_text(json.dumps(results, indent=2))
    table(results, "gib_per_s", "ratio", "{:.2f}", ["pdstor/raw_block", "pdstor/raw_block+", "pdstor/local_disk"])
    print("(GiB/s, medians of alternating rounds; ratios > 1: pdstor faster;"
          " raw_block+: raw_block with an fdatasync per put batch and a crc32c of every chunk got)")
    table(results, "cpu_s_per_gib", "cpu_ratio", "{:.3f}", ["pdstor/raw_block", "pdstor/raw_block+"])
    print(f"(CPU s per GiB, on {a.label}: this process + pdstor's daemon; ratios < 1: pdstor spends less)")


def table(results: dict, values: str, ratios: str, fmt: str, peers: list[str]) -> None:
    """One row per chunk size and op: each backend's median, then the ratios."""
    names = ("pdstor", "raw_block", "raw_block+", "local_disk")
    print("\n" + " ".join([f"{'chunk':>8} {'op':>4}", *(f"{n:>10}" for n in names), *(f"{p:>18}" for p in peers)]))
    for shape_name, r in results.items():
        for op in ("put", "get"):
            cells = [f"{fmt.format(r[values][n][op]):>10}" for n in names]
            cells += [f"{r[ratios][p][op]:>18.2f}" for p in peers]
            print(" ".join([f"{shape_name:>8} {op:>4}", *cells]))

if __name__ == "__main__":
    sys.exit(main())
