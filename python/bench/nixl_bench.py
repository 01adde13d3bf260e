"""pdstor's engine against NIXL's POSIX backend (io_uring) at small-chunk
sizes, the same bytes on the same target, rounds alternating (issue 21's
small-chunk comparison).

  pdstor  `pdstor bench --pattern write|read --bs B --qd Q`: the engine alone
          (io_uring, O_DIRECT, registered buffers), sequential commands of B
          bytes, Q in flight (128 by default).
  NIXL    nixl-cu12 1.5.1's POSIX backend with use_uring=true and its default
          kernel_queue_size (256): one transfer of every chunk, DRAM (an
          anonymous, page-aligned mapping, registered) to FILE (the target
          opened O_DIRECT, registered), chunk i of the target from a
          shuffled place in memory so that no two descriptors can be merged
          into one command — each side issues one command per chunk. (Its
          throughput here did not move with kernel_queue_size from 8 to 128:
          it is not bounded by it the way pdstor is by its queue depth.)

Each round writes then reads with one side, then the other, the order
alternating. Every byte NIXL reads back is compared with what it wrote,
outside the timing (pdstor's engine checks its own in its tests). Neither
side flushes or checksums here: this compares the engines, not the
handoff.

NIXL's Python package looks for a CUDA runtime and, finding torch's CUDA 13
wheels, asks for nixl-cu13; the CUDA 12 build it ships runs its POSIX
backend on the CPU alone, so it is imported directly (`nixl_cu12`).

Prints a table and writes JSON: per round each side's bytes/s, the medians,
and pdstor/NIXL (> 1: pdstor faster).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import random
import stat
import statistics
import subprocess
import time

from nixl_cu12._api import nixl_agent, nixl_agent_config


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1].upper()] if s[-1].upper() in units else int(s)


def is_device(path: str) -> bool:
    return os.path.exists(path) and stat.S_ISBLK(os.stat(path).st_mode)


def address(m: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


class Nixl:
    """One agent with the POSIX backend on the target, two registered
    buffers (what it writes from, what it reads into), and the descriptor
    lists for chunks of `chunk` bytes."""

    def __init__(self, target: str, total: int, chunk: int):
        self.total, self.chunk = total, chunk
        self.fd = os.open(target, os.O_RDWR | os.O_DIRECT)
        self.src, self.dst = mmap.mmap(-1, total), mmap.mmap(-1, total)
        seed = os.urandom(4096)
        for off in range(0, total, 4096):
            self.src[off:off + 4096] = seed[off % 4093:] + seed[:off % 4093]
        self.agent = nixl_agent("pdstor-bench", nixl_agent_config(backends=[]))
        self.agent.create_backend("POSIX", {"use_uring": "true", "use_aio": "false", "use_posix_aio": "false"})
        for m in (self.src, self.dst):
            self.agent.register_memory([(address(m), total, 0, "")], "DRAM", backends=["POSIX"])
        self.agent.register_memory([(0, total, self.fd, "")], "FILE", backends=["POSIX"])
        n = total // chunk
        place = list(range(n))
        random.Random(chunk).shuffle(place)
        # Neighbours on the target are never neighbours in memory: nothing merges.
        self.place = place
        self.file = self.agent.get_xfer_descs([(i * chunk, chunk, self.fd) for i in range(n)], "FILE")
        self.mem = {
            name: self.agent.get_xfer_descs([(address(m) + place[i] * chunk, chunk, 0) for i in range(n)], "DRAM")
            for name, m in (("src", self.src), ("dst", self.dst))
        }

    def run(self, op: str) -> float:
        """Seconds for one transfer of every chunk; raises if it fails."""
        local = self.mem["src" if op == "WRITE" else "dst"]
        h = self.agent.initialize_xfer(op, local, self.file, "pdstor-bench", backends=["POSIX"])
        try:
            started = time.perf_counter()
            state = self.agent.transfer(h)
            while state == "PROC":
                state = self.agent.check_xfer_state(h)
            took = time.perf_counter() - started
        finally:
            self.agent.release_xfer_handle(h)
        if state != "DONE":
            raise SystemExit(f"NIXL {op} of {self.total} bytes in {self.chunk}-byte chunks ended {state}")
        return took

    def write_then_read(self) -> tuple[float, float]:
        w = self.run("WRITE")
        self.dst[:] = b"\0" * self.total
        r = self.run("READ")
        if self.dst[:] != self.src[:]:
            first = next(i for i in range(0, self.total, self.chunk) if self.dst[i:i + self.chunk] != self.src[i:i + self.chunk])
            raise SystemExit(f"NIXL read back other bytes than it wrote (first at memory offset {first})")
        return w, r


def pdstor(binary: str, target: str, pattern: str, chunk: int, qd: int, total: int) -> float:
    """Bytes/s of one `pdstor bench` run."""
    out = subprocess.run(
        [binary, "bench", "--json", "--force", "--target", target, "--pattern", pattern, "--bs", str(chunk),
         "--qd", str(qd), "--size", str(total)],
        check=True, capture_output=True, text=True,
    )
    v = json.loads(out.stdout)
    return v["bytes"] / v["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pdstor-bin", required=True)
    ap.add_argument("--target", required=True, help="block device or file both sides use in turn")
    ap.add_argument("--label", required=True, help="what the target is (zram, file)")
    ap.add_argument("--bytes", default="256M")
    ap.add_argument("--chunks", default="16K,64K")
    ap.add_argument("--qd", type=int, default=128, help="pdstor's commands in flight")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    total = parse_size(a.bytes)
    if not is_device(a.target):
        with open(a.target, "wb") as f:
            f.truncate(total)
    # Precondition: one full write, untimed, so neither side pays for first allocation.
    pdstor(a.pdstor_bin, a.target, "write", 4 << 20, 16, total)
    report = {"target": a.label, "bytes": total, "qd": a.qd, "rounds": a.rounds, "cases": []}
    for c in a.chunks.split(","):
        chunk = parse_size(c)
        if total % chunk:
            raise SystemExit(f"--bytes {a.bytes} is not a multiple of chunk {c}")
        nixl = Nixl(a.target, total, chunk)
        rows = []
        for rnd in range(a.rounds):
            def ours() -> tuple[float, float]:
                return (pdstor(a.pdstor_bin, a.target, "write", chunk, a.qd, total),
                        pdstor(a.pdstor_bin, a.target, "read", chunk, a.qd, total))

            def theirs() -> tuple[float, float]:
                w, r = nixl.write_then_read()
                return total / w, total / r

            if rnd % 2 == 0:
                p, n = ours(), theirs()
            else:
                n = theirs()
                p = ours()
            rows.append({"pdstor_write": p[0], "pdstor_read": p[1], "nixl_write": n[0], "nixl_read": n[1]})
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        case = {
            "chunk": chunk,
            "rounds": rows,
            "median_bytes_per_s": med,
            "write_ratio": statistics.median(r["pdstor_write"] / r["nixl_write"] for r in rows),
            "read_ratio": statistics.median(r["pdstor_read"] / r["nixl_read"] for r in rows),
        }
        report["cases"].append(case)
        gib = 1 << 30
        print(
            f"{a.label:<6} {c:>4}  write {med['pdstor_write'] / gib:5.2f} GiB/s vs NIXL {med['nixl_write'] / gib:5.2f}"
            f" -> {case['write_ratio']:.2f}   read {med['pdstor_read'] / gib:5.2f} GiB/s vs NIXL"
            f" {med['nixl_read'] / gib:5.2f} -> {case['read_ratio']:.2f}",
            flush=True,
        )
        os.close(nixl.fd)
    with open(a.json, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
