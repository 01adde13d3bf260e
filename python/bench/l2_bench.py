"""pdstor's L2 adapter against LMCache's raw_block L2 adapter, in one run,
through LMCache's L2 adapter interface as its multiprocess server drives it
(store; lookup-and-lock then load then unlock; completions on the eventfds),
both on one L1 pool in /dev/shm (the server's ``--shm-name``), page-aligned,
so raw_block does O_DIRECT from L1 and pdstor moves bytes with no staging
copy. Each side on its own device of the same kind. Every round's loads
compared with what was stored (torch.equal), outside the timings.

Reported per side and object size: store and load throughput (MB/s, median
of the rounds) and CPU per GiB moved (this process's, plus the daemon's for
pdstor), and "raw_block + crc32c": raw_block with the check a user who wants
one adds (google-crc32c over every object loaded), its time and CPU added.

    python l2_bench.py --pdstor-server unix:/tmp/bz/control.sock --pdstor-data /tmp/bz/data.sock \\
        --raw-block-device /dev/zram2 --pdstor-pid PID --size-kib 8192 --keys 16
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import time
from pathlib import Path

import torch
from lmcache.v1.check import check_mode_test_l2_adapter as check
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.internal_api import L1MemoryDesc
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

from raw_block_bench import CRC32C

_CLK = os.sysconf("SC_CLK_TCK")


def cpu_of(pid: int) -> float:
    """Seconds of CPU process `pid` has used (user + system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK


def wait(fd: int) -> None:
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    assert poll.poll(120_000), "the adapter never signalled"
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        pass


def crc32c_all(objs: list) -> None:
    """google-crc32c's C library over each object in place (the check
    raw_block lacks), as a checking reader would run it."""
    for o in objs:
        CRC32C(o.data_ptr, len(o.byte_array))


def make_adapter(spec: dict, desc: L1MemoryDesc):
    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)])).adapters[0]
    return create_l2_adapter(cfg, l1_memory_desc=desc)


def side(name: str, adapter, pool_objs: list, args, daemon_pid: int | None, add_crc: bool = False) -> dict:
    n, size = args.keys, args.size_kib << 10
    stores, loads, store_cpu, load_cpu = [], [], [], []
    src, dst = pool_objs[:n], pool_objs[n : 2 * n]
    for r in range(args.rounds + 1):
        ks = [ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(10_000 * r + i + (7 if add_crc else 0) * 1_000_000), model_name=name, kv_rank=0) for i in range(n)]
        for i, o in enumerate(src):
            o.raw_data.fill_(float(r * 100 + i))
        c0, d0, t0 = time.process_time(), cpu_of(daemon_pid) if daemon_pid else 0.0, time.perf_counter()
        task = adapter.submit_store_task(ks, src)
        wait(adapter.get_store_event_fd())
        ok = adapter.pop_completed_store_tasks()[task]
        t1, c1, d1 = time.perf_counter(), time.process_time(), cpu_of(daemon_pid) if daemon_pid else 0.0
        assert ok.is_successful(), f"{name}: store failed"
        for o in dst:
            o.raw_data.zero_()
        task = adapter.submit_lookup_and_lock_task(ks, {})
        wait(adapter.get_lookup_and_lock_event_fd())
        bits = adapter.query_lookup_and_lock_result(task)
        assert all(bits.test(i) for i in range(n)), f"{name}: not every key found"
        c2, d2, t2 = time.process_time(), cpu_of(daemon_pid) if daemon_pid else 0.0, time.perf_counter()
        task = adapter.submit_load_task(ks, dst)
        wait(adapter.get_load_event_fd())
        bits = adapter.query_load_result(task)
        if add_crc:
            crc32c_all(dst)
        t3, c3, d3 = time.perf_counter(), time.process_time(), cpu_of(daemon_pid) if daemon_pid else 0.0
        adapter.submit_unlock(ks)
        assert all(bits.test(i) for i in range(n)), f"{name}: not every key loaded"
        for s, d in zip(src, dst):
            assert torch.equal(s.raw_data, d.raw_data), f"{name}: a loaded object differs from the stored one"
        adapter.delete(ks)  # as LMCache's eviction would: room for the next round
        if r == 0:
            continue  # warm-up
        stores.append(t1 - t0)
        loads.append(t3 - t2)
        store_cpu.append((c1 - c0) + (d1 - d0))
        load_cpu.append((c3 - c2) + (d3 - d2))
    gib = n * size / (1 << 30)
    mb = n * size / 1e6
    return {
        "side": name + (" + crc32c" if add_crc else ""),
        "size_kib": args.size_kib,
        "store_mbps": round(mb / statistics.median(stores)),
        "load_mbps": round(mb / statistics.median(loads)),
        "store_cpu_s_per_gib": round(statistics.median(store_cpu) / gib, 3),
        "load_cpu_s_per_gib": round(statistics.median(load_cpu) / gib, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pdstor-server", required=True)
    ap.add_argument("--pdstor-data", required=True)
    ap.add_argument("--pdstor-pid", type=int, required=True, help="the daemon's pid (its CPU is counted)")
    ap.add_argument("--raw-block-device", required=True)
    ap.add_argument("--size-kib", type=int, default=8192)
    ap.add_argument("--keys", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    n, size = args.keys, args.size_kib << 10
    path = Path(f"/dev/shm/pdstor-l2-bench-{os.getpid()}")
    try:
        pool = torch.from_file(str(path), shared=True, size=2 * n * size, dtype=torch.uint8)
        floats = pool.view(torch.float32)
        per = size // 4
        objs = [check._create_memory_obj(raw_data=floats[i * per : (i + 1) * per], obj_size=per) for i in range(2 * n)]
        desc = L1MemoryDesc(ptr=pool.data_ptr(), size=pool.numel(), align_bytes=4096)
        results = []
        pd = make_adapter(
            {"type": "plugin", "module_path": "pdstor.lmcache", "class_name": "L2Adapter",
             "adapter_params": {"server": args.pdstor_server, "data_socket": args.pdstor_data}},
            desc,
        )
        assert pd.shared is not None, "the pool is not shared with the daemon"
        results.append(side("pdstor", pd, objs, args, args.pdstor_pid))
        pd.close()
        rb = make_adapter(
            {"type": "raw_block", "device_path": args.raw_block_device, "slot_bytes": size + 4096,
             "meta_total_bytes": 16 << 20, "io_engine": "io_uring"},
            desc,
        )
        results.append(side("raw_block", rb, objs, args, None))
        results.append(side("raw_block", rb, objs, args, None, add_crc=True))
        rb.close()
    finally:
        path.unlink(missing_ok=True)
    for r in results:
        print(json.dumps(r))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
