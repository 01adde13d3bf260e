"""The rungs that need a GPU: the engine's CUDA tests, GPU memory exported as
a DMA-BUF and imported by pdstor, the ladder from GPU memory, and the
throughput against cuFile (``bench.py``). Each SKIPs with "no CUDA device"
and the driver's reason where there is none."""

from __future__ import annotations

import json
from pathlib import Path

from common import Fail, Skip


def need_cuda(run) -> dict:
    """GPU 0 as pdstor's CUDA loader saw it in the facts rung, or SKIP."""
    cuda = run.facts.get("cuda") or {}
    dev = cuda.get("device")
    if not dev:
        why = cuda.get("unavailable", "the facts rung did not run")
        raise Skip(why if why.startswith("no CUDA device") else f"no CUDA device: {why}")
    return dev


def need_io_uring(run) -> None:
    if not run.facts.get("pdstor_info", {}).get("ok"):
        raise Skip(f"pdstor cannot open an io_uring engine here: {run.facts.get('io_uring')}")


def gvisor_export(run, text: str) -> None:
    """SKIP when gVisor's GPU proxy is what refused the DMA-BUF export: its
    nvproxy passes the export on only with the `rdma` capability, and even
    then the fd it answers is not a dmabuf-fs file."""
    runtime = run.facts.get("runtime", {}).get("verdict", "")
    if runtime.startswith("gVisor") and any(
        m in text for m in ("cuMemGetHandleForAddressRange", "not a DMA-BUF", "NotDmaBuf")
    ):
        raise Skip(f"gVisor's GPU proxy does not export DMA-BUFs (it needs the rdma capability and a real dmabuf fd): {text[-400:]}")


def scratch_target(run, name: str, size: int) -> tuple[str, list[str]]:
    """The ladder's target: --target (a scratch namespace) or a sparse file
    of `size` bytes in the scratch directory; with the flags to overwrite it."""
    if run.target:
        return run.target, ["--force"] if run.force else []
    path = run.scratch / name
    with path.open("wb") as f:
        f.truncate(size)
    return str(path), ["--force"]


def engine_tests(run) -> tuple[str, dict]:
    skips = run.scratch / "engine-skips.log"
    skips.unlink(missing_ok=True)
    env = dict(run.env, PDSTOR_SKIP_LOG=str(skips))
    binary = str(run.bundle / "bin" / "engine-tests")
    import subprocess

    p = subprocess.run(
        [binary, "buffer::cuda", "--test-threads", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=max(5.0, min(120.0, run.left())),
    )
    out = (p.stdout + p.stderr).strip()
    skipped = skips.read_text().strip().splitlines() if skips.exists() else []
    details = {"output": out[-3000:]}
    if p.returncode != 0:
        gvisor_export(run, out)
        raise Fail(f"the engine's CUDA tests failed: {out[-800:]}")
    if "test result: ok" not in out or " 0 passed" in out:
        raise Fail(f"the engine's test binary ran no CUDA test: {out[-400:]}")
    if skipped:
        reasons = sorted({line.split(": ", 2)[-1] for line in skipped})
        raise Skip("; ".join(reasons))
    return "every CUDA test of the engine passed on this GPU", details


def run_ladder(run, target: str, force: list[str], paths: str, size: int, chunk: str, out: Path, timeout: float) -> dict:
    """`pdstor ladder --exporter cuda` on `target`, and the ladder.json it wrote."""
    argv = [run.pdstor, "ladder", "--exporter", "cuda", "--target", target, "--paths", paths]
    argv += ["--bytes", str(size), "--chunk", chunk, "--out", str(out), *force]
    p = run.cmd(argv, timeout)
    try:
        return json.loads((out / "ladder.json").read_text())
    except (OSError, ValueError):
        raise Fail(f"pdstor ladder ({paths}, {chunk}) wrote no report (exit {p.returncode}): {(p.stderr or p.stdout).strip()[-800:]}")


def _ladder(run, paths: str, size: int, chunk: str, out: Path, total: int) -> dict:
    target, force = scratch_target(run, "ladder.img", total)
    try:
        return run_ladder(run, target, force, paths, size, chunk, out, 240)
    finally:
        if not run.target:
            Path(target).unlink(missing_ok=True)


def dmabuf_export(run) -> tuple[str, dict]:
    need_cuda(run)
    need_io_uring(run)
    size = 64 << 20
    report = _ladder(run, "dmabuf_fixed", size, "4M", run.out / "ladder-dmabuf", 3 * size)
    (rung,) = report["rungs"]
    imported = rung.get("dmabuf_import")
    series = report.get("dmabuf_rw")
    details = {"ladder": rung, "dmabuf_rw": series, "exporter": report.get("exporter_detail")}
    if not imported:
        dev = report.get("exporter_detail") or {}
        if dev.get("dmabuf_supported") is False:
            raise Skip(f"the GPU cannot export DMA-BUFs (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0): {rung.get('reason')}")
        gvisor_export(run, rung.get("reason") or "")
        raise Fail(f"GPU memory was not exported and imported: {rung.get('reason')}")
    if rung["qualified"]:
        if "taken on the GPU match" not in (rung.get("verified") or ""):
            raise Fail(f"{imported}; dmabuf_fixed moved it, but the restore was not verified on the GPU: {rung}")
        return f"{imported}; dmabuf_fixed moved it, every byte checked, every chunk's crc32c on the GPU ({rung.get('verify_gib_s') or 0:.1f} GiB/s), every verdict native", details
    if (series or {}).get("state") == "available" and not run.target:
        raise Skip(f"{imported}; the kernel has the rw-dmabuf UAPI, but dmabuf_fixed needs a raw NVMe namespace: give --target /dev/nvmeXnY ({rung['reason']})", details)
    if (series or {}).get("state") == "available":
        raise Fail(f"{imported}, but the kernel has the rw-dmabuf UAPI and dmabuf_fixed was not qualified: {rung['reason']}")
    moved = rung.get("write_mib_s") is not None or rung.get("verdicts")
    if moved:
        raise Fail(f"dmabuf_fixed moved bytes on a kernel without the series (a fallback): {rung}")
    why = (series or {}).get("detail") or ""
    if not why or why not in (rung.get("reason") or ""):
        raise Fail(f"dmabuf_fixed was refused without the kernel's reason ({why!r}): {rung.get('reason')}")
    return f"{imported}; dmabuf_fixed refused, nothing moved: {rung['reason']}", details


def ladder(run) -> tuple[str, dict]:
    dev = need_cuda(run)
    need_io_uring(run)
    size = 256 << 20
    report = _ladder(run, "host,host_fixed", size, "8M", run.out / "ladder-gpu", 3 * size)
    rows = ["| path | GPU → target MiB/s | target → GPU MiB/s | CPU ms/GiB | compared | independent readback | crc32c on the GPU | verdicts |"]
    rows.append("|---|---|---|---|---|---|---|---|")
    notes = []
    for r in report["rungs"]:
        v = ", ".join(f"{k} ×{n}" for k, n in r["verdicts"].items())
        rows.append(
            f"| {r['path']} | {r['write_mib_s'] or 0:.0f} | {r['read_mib_s'] or 0:.0f} | {r['cpu_ms_per_gib'] or 0:.0f} "
            f"| {r.get('compared') or '-'} | {r.get('independent_readback') or '-'} "
            f"| {r.get('verify_gib_s') or 0:.1f} GiB/s: {r.get('verified') or '-'} | {v} |"
        )
        why = r.get("reason") or ""
        if not r.get("independent_readback") or "on the GPU" not in (r.get("compared") or ""):
            raise Fail(f"{r['path']}: the bytes were not all checked: {why or r}")
        verified = r.get("verified") or ""
        if "taken on the GPU match" not in verified or "was caught" not in verified:
            raise Fail(f"{r['path']}: the restore was not verified on the GPU (crc32c kernel): {why or r}")
        if r["qualified"]:
            continue
        if not why.startswith("verdicts other than native"):
            raise Fail(f"{r['path']}: {why}")
        probes = report.get("probes") or []
        attached = probes and not any(p.startswith("not attached") for p in probes)
        if attached and any(not k.startswith("unverifiable") for k in r["verdicts"] if k != "native"):
            raise Fail(f"{r['path']}: the probes judged a transfer other than native: {r['verdicts']}")
        notes.append(f"{r['path']}: {why}")
    probes = "; ".join(report.get("probes") or ["none"])
    details = {"table": rows, "probes": probes, "ladder": report, "gpu": dev["name"]}
    said = f"probes: {probes}" + (f" ({'; '.join(notes)})" if notes else "")
    return f"{size >> 20} MiB per path from {dev['name']}'s memory, every byte equal on the GPU and by pread(O_DIRECT), every chunk's crc32c checked on the GPU and a flipped byte caught; {said}", details


def throughput(run) -> tuple[str, dict]:
    need_cuda(run)
    need_io_uring(run)
    import bench

    return bench.run(run, scratch_target)
