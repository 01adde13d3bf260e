"""Rung ``throughput``: GPU → storage → GPU, pdstor against cuFile on the same
file, the same bytes and the same chunk sizes (8 MiB and 512 KiB), in
alternating rounds; GiB/s each way and CPU seconds per GiB moved, medians.

pdstor: ``pdstor ladder --exporter cuda --paths host_fixed`` — GPU memory →
a registered host buffer → io_uring O_DIRECT writes and a flush, and back
into cleared GPU memory (the copies to and from the GPU inside the timed
span), every byte compared on the GPU and read back by pread(O_DIRECT).
cuFile (``cufile.py``, ctypes over the machine's libcufile): cuFileWrite of
the same region from GPU memory, chunk by chunk, then fsync; cuFileRead back
into cleared GPU memory; compared on the GPU with torch. Its mode (GDS with
nvidia-fs, or compatibility: POSIX I/O through its own bounce buffers) is
stated with the evidence. CPU time is each process's user + system time
(getrusage), so cuFile's own threads count as pdstor's do.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import time
from pathlib import Path

from common import Skip

GIB = 1 << 30
# Bytes each way per round: 512 MiB keeps the rung near two minutes on a
# 250 MB/s VM disk (each pdstor round also reads its region back
# independently).
BYTES = 512 << 20
ROUNDS = 3
# Seconds a round is assumed to take until one has been timed.
FIRST_GUESS = {"pdstor": 30.0, "cufile": 45.0}
SIZES = (("8M", 8 << 20), ("512K", 512 << 10))


def _cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def pdstor_round(run, target: str, force: list[str], chunk: str, out: Path) -> dict:
    import gpu

    report = gpu.run_ladder(run, target, force, "host_fixed", BYTES, chunk, out, 180)
    (r,) = report["rungs"]
    if r.get("reason") and not r["reason"].startswith("verdicts other than native"):
        raise RuntimeError(f"pdstor ladder ({chunk}): {r['reason']}")
    return {
        "write_gib_s": r["write_mib_s"] / 1024,
        "read_gib_s": r["read_mib_s"] / 1024,
        "cpu_s_per_gib": r["cpu_ms_per_gib"] / 1000,
    }


class CuFileSide:
    """cuFile on the file pdstor's rounds use: the same region (the ladder's
    host_fixed rung is its second region), from and into GPU memory. Runs
    in a child process of its own per round (``python bench.py cufile``):
    a cuFile that hangs (one without libcuda spins in cuFileDriverOpen) is
    killed at the round's timeout, not the whole qualification."""

    def __init__(self, torch, path: str):
        import cufile

        cufile.cuda_ready()
        cufile.load()
        cufile.driver_open()
        self.cufile, self.torch = cufile, torch
        self.src = torch.randint(-(2**31), 2**31 - 1, (BYTES // 4,), dtype=torch.int32, device="cuda")
        self.dst = torch.zeros_like(self.src)
        self.registered = []
        for t in (self.src, self.dst):
            try:
                cufile.buf_register(t.data_ptr(), BYTES)
                self.registered.append(t)
            except cufile.CuFileError as e:
                self.unregistered = str(e)
        self.file, self.o_direct = cufile.CuFile.open_path(path, os.O_RDWR)
        self.mode, self.evidence = cufile.mode()

    def round(self, chunk: int) -> dict:
        torch, base = self.torch, BYTES
        self.dst.zero_()
        torch.cuda.synchronize()
        cpu, t = _cpu(), time.monotonic()
        for off in range(0, BYTES, chunk):
            n = self.file.write(self.src.data_ptr(), chunk, base + off, off)
            if n != chunk:
                raise RuntimeError(f"cuFileWrite wrote {n} of {chunk} bytes at {base + off}")
        os.fsync(self.file.fd)
        write_s, write_cpu = time.monotonic() - t, _cpu() - cpu
        cpu, t = _cpu(), time.monotonic()
        for off in range(0, BYTES, chunk):
            n = self.file.read(self.dst.data_ptr(), chunk, base + off, off)
            if n != chunk:
                raise RuntimeError(f"cuFileRead read {n} of {chunk} bytes at {base + off}")
        torch.cuda.synchronize()
        read_s, read_cpu = time.monotonic() - t, _cpu() - cpu
        if not torch.equal(self.src, self.dst):
            raise RuntimeError(f"cuFile ({chunk} B chunks): the bytes read back differ from those written")
        return {
            "write_gib_s": BYTES / GIB / write_s,
            "read_gib_s": BYTES / GIB / read_s,
            "cpu_s_per_gib": (write_cpu + read_cpu) / (2 * BYTES / GIB),
            "mode": self.mode,
            "o_direct": self.o_direct,
            "buffers_registered": len(self.registered),
            "evidence": self.evidence,
        }

    def close(self) -> None:
        self.file.close()
        for t in self.registered:
            self.cufile.buf_deregister(t.data_ptr())
        self.cufile.driver_close()


def cufile_round(run, target: str, chunk: int) -> dict:
    """One cuFile round in a child process; its JSON answer."""
    import sys

    argv = [sys.executable, str(Path(__file__).resolve()), "cufile", target, str(chunk)]
    p = run.cmd(argv, 120)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"exit {p.returncode}: {(p.stderr or p.stdout).strip()[-800:]}")
    # The round's figures stand once printed: a teardown that fails after
    # (cuFile's close, torch at exit) is recorded, not a lost round.
    return {**json.loads(lines[-1]), "exit": p.returncode}


def _median(rounds: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def run(run, scratch_target) -> tuple[str, dict]:
    try:
        import torch
    except ImportError as e:
        raise Skip(f"no torch in this Python: cuFile's side needs it ({e})")
    if not torch.cuda.is_available():
        raise Skip("no CUDA device (torch.cuda.is_available() is False)")
    target, force = scratch_target(run, "bench.img", 3 * BYTES)
    try:
        return _measure(run, torch, target, force)
    finally:
        if not run.target:
            Path(target).unlink(missing_ok=True)


def _measure(run, torch, target: str, force: list[str]) -> tuple[str, dict]:
    results: dict = {}
    rows = ["| chunk | | write GiB/s | read GiB/s | CPU s/GiB |", "|---|---|---|---|---|"]
    peer_error, stopped = None, None
    took = dict(FIRST_GUESS)
    for label, chunk in SIZES:
        mine, theirs = [], []
        for n in range(ROUNDS):
            out = run.out / f"bench-{label}-{n}"
            sides = ["pdstor", "cufile"] if n % 2 == 0 else ["cufile", "pdstor"]
            for side in sides:
                if stopped is None and run.left() < 1.5 * took[side] + 10:
                    stopped = f"out of time before the {side} round {n} of {label}: {run.left():.0f} s left"
                if stopped is not None or (side == "cufile" and peer_error is not None):
                    continue
                t = time.monotonic()
                if side == "pdstor":
                    mine.append(pdstor_round(run, target, force, label, out))
                else:
                    try:
                        theirs.append(cufile_round(run, target, chunk))
                    except Exception as e:  # noqa: BLE001 - the peer failing is reported, pdstor still measured
                        peer_error = f"cuFile failed ({label} chunks, round {n}): {e}"
                took[side] = time.monotonic() - t
        if peer_error is None:
            # Rounds in pairs only: a ratio of medians over the same alternation.
            pairs = min(len(mine), len(theirs))
            mine, theirs = mine[:pairs], theirs[:pairs]
        entry: dict = {"pdstor": mine, "cufile": theirs}
        for who, rounds in (("pdstor", mine), ("cuFile", theirs)):
            if rounds:
                w, r, c = (_median(rounds, k) for k in ("write_gib_s", "read_gib_s", "cpu_s_per_gib"))
                rows.append(f"| {label} | {who} | {w:.2f} | {r:.2f} | {c:.3f} |")
        if theirs and len(theirs) == len(mine):
            ratio = {k: _median(mine, k) / _median(theirs, k) for k in ("write_gib_s", "read_gib_s", "cpu_s_per_gib")}
            entry["pdstor_over_cufile"] = ratio
            rows.append(
                f"| {label} | pdstor ÷ cuFile | {ratio['write_gib_s']:.2f} | {ratio['read_gib_s']:.2f} "
                f"| {ratio['cpu_s_per_gib']:.2f} |"
            )
        results[label] = entry
    details = {"table": rows, "results": results, "bytes_per_round": BYTES, "rounds": ROUNDS}
    if peer_error is not None:
        raise Skip(f"{peer_error}; pdstor alone measured (see the details)", details)
    if stopped is not None or any("pdstor_over_cufile" not in e for e in results.values()):
        raise Skip(f"{stopped or 'rounds missing'}; the rounds measured are in the details", details)
    first = results[SIZES[0][0]]["cufile"][0]
    details["cufile_mode"], details["cufile_o_direct"] = first["mode"], first["o_direct"]
    said = "; ".join(
        f"{label}: write ×{e['pdstor_over_cufile']['write_gib_s']:.2f}, read ×{e['pdstor_over_cufile']['read_gib_s']:.2f}, "
        f"CPU/GiB ×{e['pdstor_over_cufile']['cpu_s_per_gib']:.2f}"
        for label, e in results.items()
    )
    return f"pdstor ÷ cuFile ({first['mode']} mode), medians of {ROUNDS} alternating rounds of {BYTES >> 20} MiB: {said}", details


def _cufile_main(target: str, chunk: int) -> int:
    import sys

    import torch

    side = CuFileSide(torch, target)
    print(json.dumps(side.round(chunk), default=str), flush=True)
    try:
        side.close()
    except Exception as e:  # noqa: BLE001 - the figures are out; a teardown failure is only said
        print(f"cuFile close: {e}", file=sys.stderr, flush=True)
    sys.stderr.flush()
    # No interpreter teardown: torch and cuFile at exit have crashed after
    # good rounds, and the round is over.
    os._exit(0)


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if len(sys.argv) != 4 or sys.argv[1] != "cufile":
        sys.exit("usage: bench.py cufile TARGET CHUNK_BYTES (one cuFile round; qual.py runs it)")
    sys.exit(_cufile_main(sys.argv[2], int(sys.argv[3])))
