"""Rung ``facts``: what this machine is and has, with the evidence for each
answer — the kernel and the runtime (a VM, gVisor), the NVIDIA driver and
GPU, BTF, tracefs, root, io_uring, O_DIRECT on the scratch disk, udmabuf,
DMA heaps, the rw-dmabuf series, and CUDA's DMA-BUF export attribute. It
reports and never fails on what is missing; the other rungs read it."""

from __future__ import annotations

import json
import mmap
import os
import shutil
from pathlib import Path


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text(errors="replace").strip()
    except OSError:
        return None


def _mount_of(path: Path) -> dict:
    """The mount holding `path` (longest prefix in /proc/mounts)."""
    best = {"mount": "?", "fstype": "?"}
    text = _read("/proc/mounts") or ""
    p = str(path.resolve())
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and (p == parts[1] or p.startswith(parts[1].rstrip("/") + "/")):
            if len(parts[1]) >= len(best["mount"]) or best["mount"] == "?":
                best = {"device": parts[0], "mount": parts[1], "fstype": parts[2]}
    return best


def runtime() -> dict:
    """gVisor, a VM (Firecracker among them) or bare metal, with the evidence."""
    version = _read("/proc/version") or ""
    cpuinfo = _read("/proc/cpuinfo") or ""
    cmdline = _read("/proc/cmdline") or ""
    evidence = {
        "proc_version": version,
        "hypervisor_cpu_flag": " hypervisor" in cpuinfo,
        "dmi_product": _read("/sys/class/dmi/id/product_name"),
        "cmdline_virtio_mmio": "virtio_mmio.device=" in cmdline,
        "container_markers": [m for m in ("/.dockerenv", "/run/.containerenv") if os.path.exists(m)],
    }
    if "gVisor" in version or (os.uname().release == "4.4.0" and "Sun Jan 10 15:06:54 PST 2016" in version):
        verdict = "gVisor (a user-space kernel: io_uring, BPF and O_DIRECT may be refused)"
    elif evidence["cmdline_virtio_mmio"] and not evidence["dmi_product"]:
        verdict = "a microVM (virtio-mmio devices, no DMI: Firecracker-like)"
    elif evidence["hypervisor_cpu_flag"]:
        verdict = f"a VM ({evidence['dmi_product'] or 'hypervisor flag set'})"
    else:
        verdict = "bare metal (no hypervisor flag)"
    return {"verdict": verdict, "evidence": evidence}


def o_direct(directory: Path) -> dict:
    """Whether a 4 KiB O_DIRECT write and read work in `directory`."""
    path = directory / "o_direct.probe"
    buf = mmap.mmap(-1, 4096)
    buf.write(b"\xa5" * 4096)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    except OSError as e:
        return {"works": False, "why": f"open(O_DIRECT): {e}", **_mount_of(directory)}
    try:
        os.pwrite(fd, buf, 0)
        back = mmap.mmap(-1, 4096)
        n = os.preadv(fd, [back], 0)
        return {"works": n == 4096 and back[:] == buf[:], **_mount_of(directory)}
    except OSError as e:
        return {"works": False, "why": f"O_DIRECT I/O: {e}", **_mount_of(directory)}
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def pdstor_info(run) -> dict:
    """`pdstor info` on a scratch file: io_uring, the rw-dmabuf series,
    udmabuf and DMA heaps, and CUDA as pdstor sees them."""
    target = run.scratch / "facts.img"
    with target.open("wb") as f:
        f.truncate(64 << 20)
    try:
        p = run.cmd([run.pdstor, "info", "--target", str(target)], 60)
    finally:
        target.unlink(missing_ok=True)
    if p.returncode != 0:
        return {"ok": False, "error": (p.stderr or p.stdout).strip()[-1000:]}
    return {"ok": True, **json.loads(p.stdout)}


def gpu() -> dict:
    """The driver and GPUs as the driver's files and nvidia-smi say."""
    out: dict = {"driver": _read("/proc/driver/nvidia/version"), "dev_nvidia0": os.path.exists("/dev/nvidia0")}
    if shutil.which("nvidia-smi"):
        import subprocess

        q = "--query-gpu=name,driver_version,memory.total,pci.bus_id"
        try:
            p = subprocess.run(["nvidia-smi", q, "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
            out["nvidia_smi"] = p.stdout.strip().splitlines() or p.stderr.strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            out["nvidia_smi"] = f"failed: {e}"
    license = _read("/sys/module/nvidia/version")
    out["module_version"] = license
    out["open_kernel_modules"] = "Open Kernel Module" in (out["driver"] or "") if out["driver"] else None
    return out


def gather(run) -> tuple[str, dict]:
    uname = os.uname()
    info = pdstor_info(run)
    g = gpu()
    cuda = info.get("cuda", {}) if info.get("ok") else {"unavailable": "pdstor info failed"}
    dev = cuda.get("device")
    g["summary"] = (
        f"{dev['name']}, compute {dev['compute_capability']}, driver API {dev['driver_api_version']}, "
        f"DMA-BUF export {'supported' if dev['dmabuf_supported'] else 'NOT supported'}"
        if dev
        else f"none: {cuda.get('unavailable', '?')}"
    )
    tracing = _read("/proc/mounts") or ""
    f = {
        "kernel": uname.release,
        "machine": uname.machine,
        "runtime": runtime(),
        "root": os.geteuid() == 0,
        "gpu": g,
        "cuda": cuda,
        "btf": os.path.exists("/sys/kernel/btf/vmlinux"),
        "tracefs_mounted": " tracefs " in tracing,
        "io_uring_disabled_sysctl": _read("/proc/sys/kernel/io_uring_disabled"),
        "io_uring": "works (pdstor info opened an engine)" if info.get("ok") else f"pdstor info failed: {info.get('error')}",
        "o_direct_scratch": o_direct(run.scratch),
        "udmabuf": os.path.exists("/dev/udmabuf"),
        "dma_heaps": sorted(os.listdir("/dev/dma_heap")) if os.path.isdir("/dev/dma_heap") else [],
        "rw_dmabuf_series": info.get("dmabuf_rw", "unknown: pdstor info failed"),
        "pdstor_info": info,
        "cpus": os.cpu_count(),
        "memory_kib": next(
            (int(line.split()[1]) for line in (_read("/proc/meminfo") or "").splitlines() if line.startswith("MemTotal")),
            None,
        ),
    }
    run.facts = f
    lines = [
        "| fact | value |",
        "|---|---|",
        f"| kernel | {f['kernel']} |",
        f"| runtime | {f['runtime']['verdict']} |",
        f"| GPU | {g['summary']} |",
        f"| driver | {(g['driver'] or 'none').splitlines()[0]} |",
        f"| root / BTF / tracefs | {f['root']} / {f['btf']} / {f['tracefs_mounted']} |",
        f"| io_uring | {f['io_uring']} |",
        f"| O_DIRECT on the scratch disk | {f['o_direct_scratch']} |",
        f"| udmabuf / DMA heaps | {f['udmabuf']} / {f['dma_heaps']} |",
        f"| rw-dmabuf series | {json.dumps(f['rw_dmabuf_series'])} |",
    ]
    return f"{f['kernel']}; {f['runtime']['verdict']}; GPU: {g['summary']}", {"table": lines}
