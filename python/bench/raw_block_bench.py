"""pdstor's handoff against LMCache's raw_block core, the same bytes on the
same kind of device, rounds alternating (issue 21's yardstick).

  pdstor     `pdstor bench-handoff` (the Rust client, buffers registered once)
             against a live `pdstor serve` on the target: store =
             prepare + store + publish, load = adopt + load + verify (the
             claim before it and the ack after it are timed apart).
  raw_block  LMCache 0.5.6's RawBlockCore, io_uring engine, queue depth 256,
             O_DIRECT, zero-copy, on a registered 1 GiB pool of
             TensorMemoryObjs: put = put_many of every key, get =
             load_many_into of every key — the calls its LMCache backend makes.

Each side has a target of its own (two zram devices, or two files on the
same filesystem). Every byte raw_block restores is compared with what it
stored, outside the timing; pdstor's reader checks each chunk's crc32c in
the timing, as a user's does.

What each side guarantees when its call returns:
  pdstor store  every chunk's crc32c checked as it lands, the payload
                flushed to the device, then READY journaled (flushed) with a
                signed receipt: a kill -9 or power cut after it loses nothing.
  pdstor load   the claim is journaled; every chunk's crc32c is checked
                against the manifest in the reader before load returns.
  raw_block put bytes written with O_DIRECT; the index lives in memory and is
                checkpointed every 60 s: no flush, no checksum.
  raw_block get bytes read with O_DIRECT: no checksum.

And raw_block at pdstor's guarantees, in the same rounds: its get followed by
the check a user who wants one adds (crc32c of every chunk read, with
google-crc32c, against the crc32c of what was put), and its put followed by
an fdatasync of its target (a file's data and metadata, and a flush of the
device's volatile cache where it has one: nothing on zram).
Each is timed apart and added, so a ratio reads against the peer with and
without pdstor's guarantees.

Prints a table and writes JSON: per round the seconds of each side, the
medians, and pdstor/raw_block as a throughput ratio (> 1: pdstor faster).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import stat
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.storage_backend.raw_block import RawBlockCore, RawBlockCoreConfig
from lmcache.v1.storage_backend.raw_block.key_codec import RawBlockKeySpec

from pdstor.testing import Daemon, format_target



def google_crc32c_value():
    """google-crc32c's C library (`crc32c_value(data, count)`, SSE4.2), called
    on the object's memory in place: its Python wrapper takes only `bytes`,
    whose copy a checking reader would not make. None where it is not
    installed (the columns at equal guarantees are then left out)."""
    try:
        import ctypes
        import glob

        import google_crc32c
    except ImportError:
        return None
    libs = glob.glob(os.path.join(os.path.dirname(google_crc32c.__file__), "..", "google_crc32c.libs", "libcrc32c*"))
    if not libs:
        return None
    lib = ctypes.CDLL(libs[0])
    lib.crc32c_value.restype, lib.crc32c_value.argtypes = ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_size_t]
    return lib.crc32c_value


CRC32C = google_crc32c_value()

POOL = 1 << 30
HEADER = 4096
META = 128 << 20


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1].upper()] if s[-1].upper() in units else int(s)


def is_device(path: str) -> bool:
    return os.path.exists(path) and stat.S_ISBLK(os.stat(path).st_mode)


def raw_block(target: str, chunk: int) -> RawBlockCore:
    """RawBlockCore as LMCache's RustRawBlockBackend builds it with
    io_engine=io_uring and use_odirect=true (its other defaults kept)."""
    slot = -(-(HEADER + chunk) // 4096) * 4096
    cfg = RawBlockCoreConfig(
        device_path=target,
        capacity_bytes=0,
        block_align=4096,
        header_bytes=HEADER,
        slot_bytes=slot,
        use_odirect=True,
        enable_zero_copy=True,
        meta_total_bytes=META,
        meta_magic=b"LMCIDX01",
        meta_version=1,
        meta_checkpoint_interval_sec=60,
        meta_idle_quiet_ms=100,
        meta_enable_periodic=True,
        load_checkpoint_on_init=False,
        meta_verify_on_load=True,
        io_engine="io_uring",
        iouring_queue_depth=256,
    )
    return RawBlockCore(cfg, key_namespace="legacy")


class Peer:
    """raw_block with a registered 1 GiB pool: the writer's objects in its
    first half, the reader's in its second."""

    def __init__(self, target: str, total: int, chunk: int):
        if 2 * total > POOL:
            raise SystemExit(f"--bytes {total} does not fit twice in the 1 GiB pool")
        self.core = raw_block(target, chunk)
        # Page-aligned (an anonymous mapping), as LMCache's allocator's pages
        # are: O_DIRECT on an unaligned object would go through a bounce copy.
        self.mapping = mmap.mmap(-1, POOL)
        self.pool = torch.frombuffer(self.mapping, dtype=torch.uint8)
        if self.pool.data_ptr() % 4096:
            raise SystemExit("the raw_block pool is not page-aligned")
        self.core.register_fixed_buffer_range(self.pool.data_ptr(), POOL)
        n = total // chunk
        # bf16 elements, as LMCache's objects are.
        shape = torch.Size([chunk // 2])

        def objs(base: int) -> list[TensorMemoryObj]:
            out = []
            for i in range(n):
                off = base + i * chunk
                md = MemoryObjMetadata(
                    shape=shape, dtype=torch.bfloat16, address=off, phy_size=chunk, ref_count=1,
                    fmt=MemoryFormat.KV_2LTD,
                )
                out.append(TensorMemoryObj(self.pool[off:off + chunk], md, None))
            return out

        self.src = objs(0)
        self.dst = objs(POOL // 2)
        self.target = target
        self.sync_fd = os.open(target, os.O_RDWR)
        self.total = total
        gen = torch.Generator().manual_seed(21)
        self.pool[:total] = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=gen)
        self.round = 0
        # What a checking reader compares with: each chunk's crc32c as put.
        self.crcs = [self.crc(o) for o in self.src] if CRC32C else []

    @staticmethod
    def crc(obj: TensorMemoryObj) -> int:
        return CRC32C(obj.tensor.data_ptr(), obj.get_size())

    def durable(self) -> float:
        """What raw_block's put takes to reach pdstor's durability: an
        fdatasync of its target right after it, timed apart."""
        t = time.perf_counter()
        os.fdatasync(self.sync_fd)
        return time.perf_counter() - t

    def checked(self) -> float | None:
        """What raw_block's get takes to reach pdstor's check: every chunk
        read checked (crc32c; None without google-crc32c), timed apart."""
        if not CRC32C:
            return None
        t = time.perf_counter()
        bad = [i for i, o in enumerate(self.dst) if self.crc(o) != self.crcs[i]]
        crc_s = time.perf_counter() - t
        if bad:
            raise SystemExit(f"raw_block: {len(bad)} chunks read back with another crc32c")
        return crc_s

    def run(self) -> tuple[float, float, float | None, float]:
        """One round: put every key, get every key, check, delete; and the
        check and flush that bring raw_block to pdstor's guarantees."""
        self.round += 1
        keys = [RawBlockKeySpec(encoded=f"r{self.round}-{i}", slot_identity=i + 1) for i in range(len(self.src))]
        self.pool[POOL // 2:POOL // 2 + self.total].zero_()
        t = time.perf_counter()
        put = self.core.put_many(keys, self.src)
        put_s = time.perf_counter() - t
        if not all(put.results):
            raise SystemExit(f"raw_block put_many failed for {put.results.count(False)} keys")
        sync_s = self.durable()
        encoded = [k.encoded for k in keys]
        t = time.perf_counter()
        got = self.core.load_many_into(encoded, self.dst)
        get_s = time.perf_counter() - t
        if not all(got):
            raise SystemExit(f"raw_block load_many_into failed for {got.count(False)} keys")
        if not torch.equal(self.pool[:self.total], self.pool[POOL // 2:POOL // 2 + self.total]):
            raise SystemExit("raw_block restored bytes that differ from what it stored")
        crc_s = self.checked()
        self.core.delete_many(encoded)
        return put_s, get_s, crc_s, sync_s

    def close(self) -> None:
        self.core.close()
        os.close(self.sync_fd)


def pdstor_round(binary: str, d: Daemon, total: int, chunk: int) -> tuple[float, float]:
    """One `pdstor bench-handoff` round (after its own warm-up handoff)."""
    out = subprocess.run(
        [binary, "bench-handoff", "--json", "--server", d.server, "--data-socket", str(d.data_socket),
         "--bytes", str(total), "--chunk", str(chunk), "--rounds", "1", "--latency-samples", "0"],
        check=True, capture_output=True, text=True,
    )
    steps = json.loads(out.stdout)["round_steps_us"][0]
    return steps["prepare+store+publish"] / 1e6, steps["adopt+load+verify"] / 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pdstor-bin", required=True)
    ap.add_argument("--pdstor-target", required=True, help="device or file for pdstor")
    ap.add_argument("--peer-target", required=True, help="device or file for raw_block")
    ap.add_argument("--label", required=True, help="what the targets are (zram, file)")
    ap.add_argument("--bytes", default="512M")
    ap.add_argument("--file-size", default="1200M", help="size of each target that is a file, not a device")
    ap.add_argument("--chunks", default="8M,512K")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--qd", type=int, help="the daemon's queue depth (`pdstor serve --qd`; its default if not given)")
    ap.add_argument("--merge", help="the daemon's merge limit (`pdstor serve --merge`; its default if not given)")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    total = parse_size(a.bytes)
    report = {"target": a.label, "bytes": total, "rounds": a.rounds, "cases": []}
    for c in a.chunks.split(","):
        chunk = parse_size(c)
        if total % chunk:
            raise SystemExit(f"--bytes {a.bytes} is not a multiple of chunk {c}")
        format_target(a.pdstor_bin, a.pdstor_target, slot=chunk, journal="16M",
                      size=None if is_device(a.pdstor_target) else a.file_size)
        if not is_device(a.peer_target):
            with open(a.peer_target, "wb") as f:
                f.truncate(parse_size(a.file_size))
        with tempfile.TemporaryDirectory(prefix="pdstor-rawbench-") as tmp:
            serve_args = (["--qd", str(a.qd)] if a.qd else []) + (["--merge", a.merge] if a.merge else [])
            d = Daemon(a.pdstor_bin, Path(tmp), a.pdstor_target, serve_args)
            d.start()
            peer = Peer(a.peer_target, total, chunk)
            try:
                rows = []
                for _ in range(a.rounds):
                    ps, pl = pdstor_round(a.pdstor_bin, d, total, chunk)
                    rp, rg, crc_s, sync_s = peer.run()
                    row = {"pdstor_store_s": ps, "pdstor_load_s": pl, "raw_put_s": rp, "raw_get_s": rg}
                    if crc_s is not None:
                        row["raw_get_checked_s"] = rg + crc_s
                    row["raw_put_durable_s"] = rp + sync_s
                    rows.append(row)
            finally:
                peer.close()
                d.stop()
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        case = {
            "chunk": chunk,
            "rounds": rows,
            "median_s": med,
            "store_ratio": med["raw_put_s"] / med["pdstor_store_s"],
            "load_ratio": med["raw_get_s"] / med["pdstor_load_s"],
            # Against raw_block at pdstor's guarantees: its put made durable
            # (fdatasync), its get checked (crc32c).
            "store_ratio_durable": med["raw_put_durable_s"] / med["pdstor_store_s"],
            "load_ratio_checked": med["raw_get_checked_s"] / med["pdstor_load_s"] if "raw_get_checked_s" in med else None,
        }
        report["cases"].append(case)
        gib = total / (1 << 30)
        print(
            f"{a.label:<5} {c:>5}  store {gib / med['pdstor_store_s']:6.2f} GiB/s vs put {gib / med['raw_put_s']:6.2f}"
            f" -> {case['store_ratio']:.2f}   load {gib / med['pdstor_load_s']:6.2f} GiB/s vs get"
            f" {gib / med['raw_get_s']:6.2f} -> {case['load_ratio']:.2f}"
            f"   at equal guarantees: store {case['store_ratio_durable']:.2f}, load "
            + (f"{case['load_ratio_checked']:.2f}" if case["load_ratio_checked"] is not None else "n/a (no google-crc32c)"),
            flush=True,
        )
    Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
