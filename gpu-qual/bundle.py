"""Rung ``bundle``: the bundle runs on this machine — every file as built
(SHA-256 against MANIFEST.json), no shared library missing (``ldd``), this
glibc at least the one the bundle claims, the binaries start, and the wheel
imports from the bundle (not some other pdstor on the path)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from common import Fail


def manifest(bundle: Path) -> dict:
    try:
        return json.loads((bundle / "MANIFEST.json").read_text())
    except (OSError, ValueError):
        return {}


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".") if p.isdigit())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _ldd(path: Path) -> list[str]:
    """The libraries `ldd` resolves for `path`; FAIL on any it cannot find."""
    if shutil.which("ldd") is None:
        return ["(no ldd on this machine: not checked)"]
    p = subprocess.run(["ldd", str(path)], capture_output=True, text=True, timeout=30)
    missing = [line.strip() for line in p.stdout.splitlines() if "not found" in line]
    if missing:
        raise Fail(f"{path.name} needs libraries this machine lacks: {missing}")
    if p.returncode != 0:
        raise Fail(f"ldd {path.name} failed ({p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def unpack_wheel(run) -> Path:
    """The wheel unpacked into scratch/python, first on the rungs' PYTHONPATH."""
    wheels = sorted((run.bundle / "wheel").glob("pdstor-*.whl"))
    if len(wheels) != 1:
        raise Fail(f"the bundle holds {len(wheels)} pdstor wheels in wheel/, not one")
    dest = run.scratch / "python"
    shutil.rmtree(dest, ignore_errors=True)
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(dest)
    rest = run.env.get("PYTHONPATH")
    run.env["PYTHONPATH"] = str(dest) + (os.pathsep + rest if rest else "")
    return wheels[0]


def check(run) -> tuple[str, dict]:
    m = manifest(run.bundle)
    if not m:
        raise Fail(f"no readable MANIFEST.json in {run.bundle}: not a bundle cargo xtask gpu-bundle built")
    changed = [name for name, sum in m["files"].items() if name != "MANIFEST.json" and _sha256(run.bundle / name) != sum]
    if changed:
        raise Fail(f"files differ from the bundle as built: {changed}")
    here = os.confstr("CS_GNU_LIBC_VERSION") or ""
    glibc = here.split()[-1] if here else "?"
    if not here.startswith("glibc") or _version(glibc) < _version(m["glibc_claim"]):
        raise Fail(f"this machine has {here or 'no glibc'}; the bundle needs glibc >= {m['glibc_claim']}")
    wheel = unpack_wheel(run)
    native = next((run.scratch / "python" / "pdstor").glob("_native*.so"), None)
    if native is None:
        raise Fail(f"{wheel.name} holds no pdstor/_native*.so")
    libraries = {p.name: _ldd(p) for p in (run.bundle / "bin" / "pdstor", run.bundle / "bin" / "engine-tests", native)}
    v = run.cmd([run.pdstor, "--version"], 30)
    if v.returncode != 0:
        raise Fail(f"bin/pdstor --version failed ({v.returncode}): {v.stderr.strip()}")
    probe = "import pdstor, sys; print(pdstor.__file__); print(sys.version.split()[0])"
    py = run.cmd([sys.executable, "-c", probe], 60)
    if py.returncode != 0:
        raise Fail(f"the wheel does not import in {sys.executable}: {py.stderr.strip()[-600:]}")
    where, version = py.stdout.split()
    if not Path(where).resolve().is_relative_to((run.scratch / "python").resolve()):
        raise Fail(f"pdstor was imported from {where}, not from the bundle's wheel")
    details = {
        "glibc": glibc,
        "glibc_claim": m["glibc_claim"],
        "python": f"{sys.executable} {version}",
        "pdstor": v.stdout.strip(),
        "wheel": wheel.name,
        "libraries": libraries,
        "files_checked": len(m["files"]),
    }
    return f"{len(m['files'])} files intact, glibc {glibc} >= {m['glibc_claim']}, no library missing, the wheel imports", details
