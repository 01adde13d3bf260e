"""pdstor's L2 adapter against LMCache's raw_block L2 adapter, in one run,
through LMCache's L2 adapter interface as its multiprocess server drives it
(store; lookup-and-lock then load then unlock; completions on the eventfds),
both on one L1 pool in /dev/shm (the server's ``--shm-name``), page-aligned,
so raw_block does O_DIRECT from L1 and pdstor moves bytes with no staging
copy. Each side on its own target of the same kind (two zram devices, or two
files), rounds alternating. Every round's loads are compared with what was
stored (torch.equal), outside the timings.

Reported per object size: store and load throughput (MB/s, median of the
rounds; a load timed from lookup-and-lock to its completion) and CPU per GiB moved (this process's, which holds both adapters and
their I/O threads, plus pdstor's daemon's), for pdstor, raw_block as it
ships (no flush, no checksum), and raw_block at pdstor's guarantees: each
store batch followed by an fdatasync of its target (a no-op where the device
keeps no write cache, as pdstor's own flush is) and each load batch by a
crc32c of every object (google-crc32c), timed and counted in the same round.

    python l2_bench.py --pdstor-bin target/release/pdstor --pdstor-target /dev/zram1 \\
        --raw-block-target /dev/zram2 --label zram --json l2.json
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import tempfile
import time
from pathlib import Path

import torch
from lmcache.v1.check import check_mode_test_l2_adapter as check
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.internal_api import L1MemoryDesc
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

from lmcache_bench import cpu_s, make_file, start_pdstor
from raw_block_bench import CRC32C, is_device


def wait(fd: int) -> None:
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    assert poll.poll(120_000), "the adapter never signalled"
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        pass


def make_adapter(spec: dict, desc: L1MemoryDesc):
    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)])).adapters[0]
    return create_l2_adapter(cfg, l1_memory_desc=desc)


class Side:
    """One adapter, its target, and what its rounds measured."""

    def __init__(self, name: str, adapter, target: str, daemon_pid: int | None):
        self.name, self.adapter, self.daemon_pid = name, adapter, daemon_pid
        # raw_block's flush to pdstor's durability (fdatasync works on a read-only fd).
        self.sync_fd = os.open(target, os.O_RDONLY) if daemon_pid is None else None
        self.samples: dict[str, list[float]] = {k: [] for k in ("store", "load", "sync", "crc", "store_cpu", "load_cpu", "sync_cpu", "crc_cpu")}

    def cpu(self) -> float:
        return time.process_time() + (cpu_s(self.daemon_pid) if self.daemon_pid else 0.0)

    def timed(self, what: str, f, record: bool):
        c0, t0 = self.cpu(), time.perf_counter()
        out = f()
        if record:
            self.samples[what].append(time.perf_counter() - t0)
            self.samples[what + "_cpu"].append(self.cpu() - c0)
        return out

    def round(self, r: int, src: list, dst: list, record: bool) -> None:
        a, n = self.adapter, len(src)
        ks = [ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(10_000 * r + i), model_name=self.name, kv_rank=0) for i in range(n)]
        for i, o in enumerate(src):
            o.raw_data.fill_(float(r * 100 + i))
        for o in dst:
            o.raw_data.zero_()

        def store():
            task = a.submit_store_task(ks, src)
            wait(a.get_store_event_fd())
            return a.pop_completed_store_tasks()[task]

        ok = self.timed("store", store, record)
        assert ok.is_successful(), f"{self.name}: store failed"
        if self.sync_fd is not None:
            self.timed("sync", lambda: os.fdatasync(self.sync_fd), record)
        def load():  # a get as the server makes it: lookup-and-lock, then the load
            task = a.submit_lookup_and_lock_task(ks, {})
            wait(a.get_lookup_and_lock_event_fd())
            bits = a.query_lookup_and_lock_result(task)
            assert all(bits.test(i) for i in range(n)), f"{self.name}: not every key found"
            task = a.submit_load_task(ks, dst)
            wait(a.get_load_event_fd())
            return a.query_load_result(task)

        bits = self.timed("load", load, record)
        if self.sync_fd is not None and CRC32C:
            self.timed("crc", lambda: [CRC32C(o.data_ptr, len(o.byte_array)) for o in dst], record)
        a.submit_unlock(ks)
        assert all(bits.test(i) for i in range(n)), f"{self.name}: not every key loaded"
        for s, d in zip(src, dst):
            assert torch.equal(s.raw_data, d.raw_data), f"{self.name}: a loaded object differs from the stored one"
        a.delete(ks)  # as LMCache's eviction would: room for the next round

    def close(self) -> None:
        self.adapter.close()
        if self.sync_fd is not None:
            os.close(self.sync_fd)


def figures(side: Side, mb: float, gib: float, guaranteed: bool) -> dict:
    s = {k: v for k, v in side.samples.items()}
    plus = lambda what: s[what] if guaranteed and s[what] else [0.0] * len(s["store"])  # noqa: E731
    med = lambda a, b: statistics.median(x + y for x, y in zip(a, b))  # noqa: E731
    return {
        "store_mbps": round(mb / med(s["store"], plus("sync"))),
        "load_mbps": round(mb / med(s["load"], plus("crc"))),
        "store_cpu_s_per_gib": round(med(s["store_cpu"], plus("sync_cpu")) / gib, 3),
        "load_cpu_s_per_gib": round(med(s["load_cpu"], plus("crc_cpu")) / gib, 3),
    }


def measure(a, size_kib: int) -> dict:
    size = size_kib << 10
    n = max(1, a.bytes // size)
    dir = Path(tempfile.mkdtemp(prefix="pdstor-l2-bench-"))
    daemon = start_pdstor(a.pdstor_bin, a.pdstor_target, size, dir, a.file_size)
    path = Path(f"/dev/shm/pdstor-l2-bench-{os.getpid()}")
    sides: list[Side] = []
    try:
        pool = torch.from_file(str(path), shared=True, size=2 * n * size, dtype=torch.uint8)
        floats, per = pool.view(torch.float32), size // 4
        objs = [check._create_memory_obj(raw_data=floats[i * per : (i + 1) * per], obj_size=per) for i in range(2 * n)]
        desc = L1MemoryDesc(ptr=pool.data_ptr(), size=pool.numel(), align_bytes=4096)
        pd = make_adapter(
            {"type": "plugin", "module_path": "pdstor.lmcache", "class_name": "L2Adapter",
             "adapter_params": {"server": daemon.server, "data_socket": daemon.data_socket}},
            desc,
        )
        sides.append(Side("pdstor", pd, a.pdstor_target, daemon.proc.pid))
        assert pd.shared is not None, "the pool is not shared with the daemon"
        rb = make_adapter(
            {"type": "raw_block", "device_path": a.raw_block_target, "slot_bytes": size + 4096,
             "meta_total_bytes": 16 << 20, "io_engine": "io_uring"},
            desc,
        )
        sides.append(Side("raw_block", rb, a.raw_block_target, None))
        order = list(sides)
        for r in range(a.rounds + 1):  # round 0 warms up
            for s in order:
                s.round(r, objs[:n], objs[n:], record=r > 0)
            order = order[1:] + order[:1]
    finally:
        for s in sides:
            s.close()
        daemon.stop()
        path.unlink(missing_ok=True)
    mb, gib = n * size / 1e6, n * size / (1 << 30)
    out = {
        "target": a.label, "object_kib": size_kib, "objects_per_round": n, "rounds": a.rounds,
        "pdstor": figures(sides[0], mb, gib, False),
        "raw_block": figures(sides[1], mb, gib, False),
        "raw_block_guaranteed": figures(sides[1], mb, gib, True),
    }
    out["ratio"] = {
        f"pdstor/{peer}": {op: out["pdstor"][f"{op}_mbps"] / out[peer][f"{op}_mbps"] for op in ("store", "load")}
        for peer in ("raw_block", "raw_block_guaranteed")
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pdstor-bin", required=True)
    ap.add_argument("--pdstor-target", required=True, help="a block device, or a file (made --file-size)")
    ap.add_argument("--raw-block-target", required=True, help="a block device, or a file (made --file-size)")
    ap.add_argument("--file-size", default="1G")
    ap.add_argument("--label", default="zram", help="what the targets are (zram, file)")
    ap.add_argument("--sizes-kib", default="8192,512")
    ap.add_argument("--bytes", type=int, default=128 << 20, help="bytes stored and loaded per round per side")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if not CRC32C:
        raise SystemExit("google-crc32c is not installed: raw_block at pdstor's guarantees needs it (pip install google-crc32c)")
    if not is_device(a.raw_block_target):
        make_file(a.raw_block_target, a.file_size)
    results = [measure(a, int(k)) for k in a.sizes_kib.split(",")]
    print(f"\nL2 adapters on {a.label} (MB/s, medians of alternating rounds; CPU s/GiB: this process + pdstor's daemon)")
    print(f"{'object':>8} {'op':>5} {'pdstor':>8} {'raw_block':>10} {'+guarantees':>12} {'÷raw':>6} {'÷guar':>6}   cpu: {'pdstor':>7} {'raw':>7} {'+guar':>7}")
    for r in results:
        for op in ("store", "load"):
            v = [r[s][f"{op}_mbps"] for s in ("pdstor", "raw_block", "raw_block_guaranteed")]
            c = [r[s][f"{op}_cpu_s_per_gib"] for s in ("pdstor", "raw_block", "raw_block_guaranteed")]
            q = [r["ratio"][p][op] for p in ("pdstor/raw_block", "pdstor/raw_block_guaranteed")]
            print(f"{r['object_kib']:>6}Ki {op:>5} {v[0]:>8} {v[1]:>10} {v[2]:>12} {q[0]:>6.2f} {q[1]:>6.2f}        {c[0]:>7.3f} {c[1]:>7.3f} {c[2]:>7.3f}")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
