"""pdstor's GPU qualification: the rungs, each PASS / FAIL / SKIP with its
reason, into OUT/report.json and OUT/report.md.

Run by ``run.sh OUT`` from the bundle (``cargo xtask gpu-bundle``) on a
machine where nothing of ours is installed, and by ``cargo xtask gpu-qual``
on a GPU machine with a checkout: one qualification, two launchers. Only the
standard library is imported here; torch (the KV rungs) and the NVIDIA
driver (the GPU rungs) are looked for, and their absence is a SKIP with the
reason, never a crash. The report is written after every rung, so a run cut
short still leaves what it found.

A rung FAILs only on what pdstor got wrong (bytes that differ, a refusal
without the kernel's reason, a fallback nobody asked for, a crash); what the
machine lacks (a GPU, io_uring in gVisor, BTF, root) is a SKIP or a note.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bundle  # noqa: E402
from common import Fail, Skip  # noqa: E402
import facts  # noqa: E402
import gpu  # noqa: E402
import service  # noqa: E402

# The run must end within 8 minutes on the GPU machine; rungs that would
# start with too little time left SKIP, saying so.
BUDGET_S = 450


@dataclass
class Rung:
    id: str
    title: str
    status: str = "SKIP"
    reason: str = ""
    seconds: float = 0.0
    details: dict = field(default_factory=dict)


class Run:
    def __init__(self, args: argparse.Namespace):
        self.bundle = Path(args.bundle).resolve()
        self.out = Path(args.out).resolve()
        self.scratch = Path(args.scratch).resolve() if args.scratch else self.bundle / "scratch"
        self.target = args.target
        self.force = args.force
        self.only = set(args.only.split(",")) if args.only else None
        self.deadline = time.monotonic() + args.budget
        self.started = time.time()
        self.rungs: list[Rung] = []
        self.facts: dict = {}
        self.pdstor = str(self.bundle / "bin" / "pdstor")
        self.env = dict(os.environ)
        # One GPU is qualified: every CUDA process of the run (about 17)
        # initialises GPU 0 only, not every GPU of a many-GPU machine.
        self.env.setdefault("CUDA_VISIBLE_DEVICES", "0")
        self.daemon: service.Daemon | None = None

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def cmd(self, argv: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
        """A command with the lesser of `timeout` and the time left."""
        limit = max(1.0, min(timeout, self.left()))
        return subprocess.run(argv, capture_output=True, text=True, timeout=limit, env=self.env, **kw)

    def rung(self, id: str, title: str, fn, need_s: float = 5) -> Rung:
        r = Rung(id, title)
        t = time.monotonic()
        if self.only is not None and id not in self.only:
            r.reason = "not asked for (--only)"
        elif self.left() < need_s:
            r.reason = f"out of time: {self.left():.0f} s of the {BUDGET_S} s budget left, the rung needs about {need_s:.0f}"
        else:
            try:
                r.reason, r.details = fn()
                r.status = "PASS"
            except (Skip, Fail) as e:
                r.status, r.reason, r.details = "SKIP" if isinstance(e, Skip) else "FAIL", str(e), e.details
            except subprocess.TimeoutExpired as e:
                r.status, r.reason = "FAIL", f"timed out after {e.timeout:.0f} s: {' '.join(map(str, e.cmd))}"
            except Exception as e:  # noqa: BLE001 - a crash is a FAIL with its trace, and the run goes on
                r.status, r.reason = "FAIL", f"crashed: {e!r}"
                r.details = {"traceback": traceback.format_exc()}
        r.seconds = round(time.monotonic() - t, 2)
        self.rungs.append(r)
        print(f"qual: {r.status:4} {r.id}: {r.reason}", flush=True)
        self.write()
        return r

    def write(self) -> None:
        report = {
            "title": "pdstor GPU qualification",
            "started_unix": int(self.started),
            "seconds": round(time.time() - self.started, 1),
            "bundle": str(self.bundle),
            "manifest": bundle.manifest(self.bundle),
            "facts": self.facts,
            "rungs": [asdict(r) for r in self.rungs],
            "summary": {s: sum(r.status == s for r in self.rungs) for s in ("PASS", "FAIL", "SKIP")},
        }
        (self.out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        (self.out / "report.md").write_text(markdown(report))


def markdown(report: dict) -> str:
    f = report["facts"]
    lines = [
        "# pdstor GPU qualification",
        "",
        f"- bundle: commit {report['manifest'].get('commit', '?')[:12]}, claims glibc >= "
        f"{report['manifest'].get('glibc_claim', '?')}",
        f"- kernel: {f.get('kernel', '?')}; runtime: {f.get('runtime', {}).get('verdict', '?')}",
        f"- GPU: {f.get('gpu', {}).get('summary', '?')}",
        f"- took {report['seconds']} s; {report['summary']}",
        "",
        "| rung | status | reason | s |",
        "|---|---|---|---|",
    ]
    for r in report["rungs"]:
        reason = r["reason"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r['id']}: {r['title']} | **{r['status']}** | {reason} | {r['seconds']} |")
    for r in report["rungs"]:
        table = r["details"].get("table")
        if table:
            lines += ["", f"## {r['id']}", "", *table]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", required=True, help="the bundle's directory (bin/, wheel/, these scripts)")
    p.add_argument("--out", required=True, help="where report.json and report.md go")
    p.add_argument("--scratch", help="a disk-backed directory for the scratch files (default: BUNDLE/scratch)")
    p.add_argument("--target", help="a scratch NVMe namespace (/dev/nvmeXnY) for the ladder instead of a file")
    p.add_argument("--force", action="store_true", help="overwrite a --target that holds a filesystem")
    p.add_argument("--only", help="run only these rungs (comma-separated ids)")
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds the whole run may take")
    args = p.parse_args()
    run = Run(args)
    run.out.mkdir(parents=True, exist_ok=True)
    run.scratch.mkdir(parents=True, exist_ok=True)
    try:
        run.rung("bundle", "the bundle runs here: files intact, no library missing, the wheel imports", lambda: bundle.check(run))
        run.rung("facts", "kernel, runtime, GPU and driver, BTF, tracefs, io_uring, O_DIRECT, DMA-BUF", lambda: facts.gather(run))
        run.rung("engine-cuda", "the engine's CUDA tests (export, copies, the GPU compare)", lambda: gpu.engine_tests(run))
        run.rung("dmabuf-export", "GPU memory exported as a DMA-BUF and imported; dmabuf_fixed or the kernel's refusal", lambda: gpu.dmabuf_export(run), 20)
        run.rung("ladder-gpu", "the ladder from GPU memory on a disk-backed file, checked on the GPU and by pread(O_DIRECT)", lambda: gpu.ladder(run), 30)
        run.rung("daemon", "pdstor serve on a file: a handoff between two processes, verified", lambda: service.daemon(run), 20)
        run.rung("kv-cpu", "the vLLM connector's worker half over CPU KV caches in the CUDA backends' layouts", lambda: service.kv(run, "cpu"), 20)
        run.rung("kv-cuda", "the vLLM connector's worker half over CUDA KV caches, compared on the GPU", lambda: service.kv(run, "cuda"), 30)
        if run.daemon is not None:
            run.daemon.stop()
            run.daemon = None
        run.rung("throughput", "GPU → storage → GPU: pdstor against cuFile, same file and sizes, alternating rounds", lambda: gpu.throughput(run), 120)
    finally:
        if run.daemon is not None:
            run.daemon.stop()
        run.write()
        if not args.scratch:
            shutil.rmtree(run.scratch, ignore_errors=True)
    failed = [r.id for r in run.rungs if r.status == "FAIL"]
    print(f"qual: report in {run.out}/report.json and report.md; {len(failed)} failed {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
