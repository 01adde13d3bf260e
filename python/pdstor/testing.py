"""A `pdstor serve` for tests and benchmarks: formats a target, starts the
daemon with its sockets in a directory of yours, waits until it answers, and
stops or kills it. The package's own tests and `cargo xtask bench --lmcache`
use it; so can yours."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from ._native import Client
from .errors import Error


def pdstor_binary() -> str:
    """`PDSTOR_BIN`, else `pdstor` on PATH."""
    found = os.environ.get("PDSTOR_BIN") or shutil.which("pdstor")
    if not found:
        raise FileNotFoundError("no pdstor binary: set PDSTOR_BIN or put pdstor on PATH (cargo build -p pdstor)")
    return found


def format_target(
    binary: str, target: str | Path, *, slot: str | int, size: str | None = None, journal: str = "1M"
) -> None:
    """`pdstor format`: a file (created `size` large) or a device, `slot` bytes per chunk."""
    cmd = [binary, "format", "--target", str(target), "--chunk-slot", str(slot), "--journal", journal, "--force"]
    if size is not None:
        cmd += ["--size", size]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"pdstor format {target}: {out.stderr.strip()}")


class Daemon:
    """`pdstor serve` on `target`; its control and data sockets and its log in `dir`."""

    def __init__(self, binary: str, dir: str | Path, target: str | Path, extra: list[str] | None = None):
        self.binary = binary
        self.dir = Path(dir)
        self.target = Path(target)
        self.server = f"unix:{self.dir / 'control.sock'}"
        self.data_socket = str(self.dir / "data.sock")
        self.log = self.dir / "serve.log"
        self.extra = list(extra or [])
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30) -> None:
        """Starts the daemon and waits until it answers `healthz` and its data socket exists."""
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    "serve",
                    "--target",
                    str(self.target),
                    "--listen",
                    self.server,
                    "--data-socket",
                    self.data_socket,
                    *self.extra,
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                Client(self.server, self.data_socket).healthz()
                if os.path.exists(self.data_socket):
                    return
            except Error:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pdstor serve did not come up on {self.target}:\n{self.log.read_text()}")
            time.sleep(0.05)

    def kill9(self) -> None:
        """`kill -9` (a crash); `start()` brings it back on the same target."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        """SIGTERM and wait (SIGKILL after 20 s)."""
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def client(self) -> Client:
        return Client(self.server, self.data_socket)
