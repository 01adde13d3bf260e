"""The rungs through the daemon: ``pdstor serve`` on a scratch file with a
handoff between two processes (``daemon``), and the vLLM connector's worker
half storing and restoring a request over KV caches in the layouts vLLM's
CUDA attention backends give (``kv-cpu``, ``kv-cuda``; ``kv.py``)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from common import Fail, Skip


class Daemon:
    """`pdstor serve` on a formatted scratch file, both planes on Unix sockets."""

    def __init__(self, run):
        self.run = run
        d = run.scratch / "daemon"
        d.mkdir(parents=True, exist_ok=True)
        self.dir = d
        self.target = d / "namespace.img"
        self.control = d / "control.sock"
        self.data_socket = d / "data.sock"
        self.server = f"unix:{self.control}"
        self.log = run.out / "serve.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        for stale in (self.target, self.control, self.data_socket):
            stale.unlink(missing_ok=True)
        fmt = [self.run.pdstor, "format", "--target", str(self.target), "--size", "2G", "--chunk-slot", "8M"]
        p = self.run.cmd(fmt + ["--journal", "16M"], 60)
        if p.returncode != 0:
            raise Fail(f"pdstor format failed: {(p.stderr or p.stdout).strip()[-800:]}")
        argv = [self.run.pdstor, "serve", "--target", str(self.target), "--listen", self.server]
        argv += ["--data-socket", str(self.data_socket)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=self.log.open("w"), env=self.run.env)
        deadline = time.monotonic() + 30
        while not (self._answers(self.control) and self._answers(self.data_socket)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-1500:]
                raise Fail(f"pdstor serve did not come up (exit {self.proc.poll()}): {tail}")
            time.sleep(0.05)

    @staticmethod
    def _answers(path: Path) -> bool:
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(str(path))
            return True
        except OSError:
            return False
        finally:
            s.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def daemon(run) -> tuple[str, dict]:
    if not run.facts.get("pdstor_info", {}).get("ok"):
        raise Skip(f"pdstor cannot open an io_uring engine here: {run.facts.get('io_uring')}")
    d = Daemon(run)
    run.daemon = d
    d.start()
    summary = run.out / "handoff.json"
    argv = [run.pdstor, "handoff", "--server", d.server, "--data-socket", str(d.data_socket)]
    argv += ["--bytes", "256M", "--chunk-size", "8M", "--summary", str(summary)]
    p = run.cmd(argv, 120)
    if p.returncode != 0:
        raise Fail(f"pdstor handoff failed ({p.returncode}): {(p.stderr or p.stdout).strip()[-800:]}")
    s = json.loads(summary.read_text())
    if s.get("bytes_identical") is not True or s.get("crc32c_verified_chunks") != s.get("chunks"):
        raise Fail(f"the handoff did not restore every byte: {s}")
    return (
        f"a writer process stored {s['chunks']} chunks of {s['chunk_size'] >> 20} MiB, a reader process restored them: "
        f"every crc32c verified, bytes identical (writer {s['writer_mib_per_s']:.0f} MiB/s, reader {s['reader_mib_per_s']:.0f} MiB/s)",
        {"handoff": s},
    )


def kv(run, device: str) -> tuple[str, dict]:
    d = run.daemon
    if d is None and not run.facts.get("pdstor_info", {}).get("ok"):
        raise Skip(f"no daemon: pdstor cannot open an io_uring engine here: {run.facts.get('io_uring')}")
    if d is None or d.proc is None or d.proc.poll() is not None:
        raise Fail("the daemon rung did not leave a daemon running")
    here = Path(__file__).resolve().parent
    argv = [sys.executable, str(here / "kv.py"), "--device", device, "--server", d.server]
    argv += ["--data-socket", str(d.data_socket)]
    p = run.cmd(argv, 240)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise Fail(f"kv.py answered nothing ({p.returncode}): {(p.stderr or p.stdout).strip()[-1500:]}")
    result = json.loads(lines[-1])
    if result["status"] == "SKIP":
        raise Skip(result["reason"])
    if result["status"] != "PASS" or p.returncode != 0:
        raise Fail(result["reason"])
    return result["reason"], {"table": result["table"], "cases": result["cases"]}
