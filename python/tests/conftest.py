"""A real `pdstor serve` per test, on a formatted file in the test's own
directory, reached over its Unix sockets — as a user runs it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import pdstor
from pdstor.testing import Daemon as _Daemon
from pdstor.testing import format_target as _format

REPO = Path(__file__).resolve().parents[2]


def pdstor_bin() -> str:
    """`PDSTOR_BIN` (`cargo xtask python` sets it), else the workspace's newest build."""
    if os.environ.get("PDSTOR_BIN"):
        return os.environ["PDSTOR_BIN"]
    built = [p for p in (REPO / "target" / "release" / "pdstor", REPO / "target" / "debug" / "pdstor") if p.exists()]
    if not built:
        pytest.fail("no pdstor binary: build it (cargo build -p pdstor) or set PDSTOR_BIN")
    return str(max(built, key=lambda p: p.stat().st_mtime))


class Daemon(_Daemon):
    """The package's test daemon, on the workspace's binary."""

    def __init__(self, dir: Path, target: Path, extra: list[str] | None = None):
        super().__init__(pdstor_bin(), dir, target, ["--admission-timeout-ms", "2000", *(extra or [])])


def format_target(path: Path, size: str, slot: str) -> None:
    _format(pdstor_bin(), path, slot=slot, size=size)


def serve(tmp_path: Path, size: str, slot: str, extra: list[str] | None = None):
    """A started daemon on a new `size` file with `slot`-byte slots (`extra`: more `serve` flags)."""
    target = tmp_path / "target.img"
    format_target(target, size, slot)
    d = Daemon(tmp_path, target, extra)
    d.start()
    return d


@pytest.fixture
def daemon(tmp_path: Path):
    """A daemon on a 64 MiB file with 1 MiB slots."""
    d = serve(tmp_path, "64M", "1M")
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
