"""A real `pdstor serve` per test, on a formatted file in the test's own
directory, reached over its Unix sockets — as a user runs it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

import pdstor

REPO = Path(__file__).resolve().parents[2]


def pdstor_bin() -> str:
    """`PDSTOR_BIN`, else the workspace's newest build, else `pdstor` on PATH."""
    if os.environ.get("PDSTOR_BIN"):
        return os.environ["PDSTOR_BIN"]
    built = [p for p in (REPO / "target" / "release" / "pdstor", REPO / "target" / "debug" / "pdstor") if p.exists()]
    if built:
        return str(max(built, key=lambda p: p.stat().st_mtime))
    found = shutil.which("pdstor")
    if not found:
        pytest.fail("no pdstor binary: build it (cargo build -p pdstor) or set PDSTOR_BIN")
    return found


class Daemon:
    """`pdstor serve` on `target`, its sockets in `dir`."""

    def __init__(self, dir: Path, target: Path):
        self.dir = dir
        self.target = target
        self.server = f"unix:{dir / 'control.sock'}"
        self.data_socket = str(dir / "data.sock")
        self.log = dir / "serve.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    pdstor_bin(), "serve", "--target", str(self.target),
                    "--listen", self.server, "--data-socket", self.data_socket,
                    "--admission-timeout-ms", "2000",
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        deadline = time.monotonic() + 20
        while True:
            try:
                pdstor.Client(self.server, self.data_socket).healthz()
                if os.path.exists(self.data_socket):
                    return
            except pdstor.Error:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pdstor serve did not come up:\n{self.log.read_text()}")
            time.sleep(0.05)

    def kill9(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def client(self) -> pdstor.Client:
        return pdstor.Client(self.server, self.data_socket)


def format_target(path: Path, size: str, slot: str) -> None:
    out = subprocess.run(
        [pdstor_bin(), "format", "--target", str(path), "--size", size, "--chunk-slot", slot, "--journal", "1M"],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(f"pdstor format {path}: {out.stderr}")


@pytest.fixture
def daemon(tmp_path: Path):
    """A daemon on a 64 MiB file with 1 MiB slots."""
    target = tmp_path / "target.img"
    format_target(target, "64M", "1M")
    d = Daemon(tmp_path, target)
    d.start()
    yield d
    d.stop()


LAYOUT = pdstor.layout(
    model_id="test-model",
    dtype="bf16",
    layers=2,
    kv_heads=2,
    head_dim=64,
    chunk_tokens=256,
    kv_format="lmcache-kv2ltd",
)
