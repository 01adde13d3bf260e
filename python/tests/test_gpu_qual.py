"""The GPU bundle's rungs that only run on a GPU, judged here on what
``pdstor ladder`` and a cuFile round answer (``ladder.json`` as the ladder
writes it): a GPU machine is lent for minutes, once, so a wrong field name,
a refusal taken for a pass or a crash in the verdicts must fail here first.
The ladder itself and the run in a bare root are ``cargo xtask gpu-bundle
--bare``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "gpu-qual"))

import bench  # noqa: E402
import gpu  # noqa: E402
from common import Fail, Skip  # noqa: E402

DEVICE = {"name": "NVIDIA H200", "compute_capability": [9, 0], "driver_api_version": 13000, "dmabuf_supported": True}
MISSING = {"state": "missing", "detail": "this kernel (6.18.0) refuses IORING_RSRC_UPDATE_EXTENDED (EINVAL)"}


def rung(path: str, **over) -> dict:
    r = {
        "path": path,
        "qualified": False,
        "reason": "verdicts other than native: [\"unverifiable: probes not attached\"]",
        "bytes": 1 << 20,
        "write_mib_s": 2000.0,
        "read_mib_s": 3000.0,
        "cpu_ms_per_gib": 150.0,
        "verdicts": {"unverifiable: probes not attached": 4},
        "independent_readback": "1048576 bytes match (pread O_DIRECT, outside the engine)",
        "staging": "the exporter's memory → a registered host buffer → target, and back (timed)",
        "compared": "1048576 bytes against the pattern, on the GPU",
        "dmabuf_import": None,
        "verified": "4 chunks' crc32c taken on the GPU match the stored ones; a byte flipped at 786435 was caught (0x1 ≠ 0x2)",
        "verify_gib_s": 120.0,
    }
    return {**r, **over}


class FakeRun:
    """What the rungs see of qual.Run, with `pdstor ladder` answered by `rungs`."""

    def __init__(self, tmp: Path, rungs, runtime: str = "a VM", left: float = 400.0):
        self.out, self.scratch = tmp / "out", tmp / "scratch"
        self.out.mkdir()
        self.scratch.mkdir()
        self.target, self.force, self.pdstor = None, False, "pdstor"
        self.facts = {"cuda": {"device": DEVICE}, "pdstor_info": {"ok": True}, "runtime": {"verdict": runtime}}
        self.rungs, self._left, self.calls = rungs, left, []

    def left(self) -> float:
        return self._left

    def cmd(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        self.calls.append(argv)
        out = Path(argv[argv.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        paths = argv[argv.index("--paths") + 1].split(",")
        report = {
            "kernel": "6.18.0",
            "exporter": "cuda",
            "exporter_detail": DEVICE,
            "dmabuf_rw": MISSING,
            "probes": ["not attached: not root"],
            "rungs": [self.rungs(p) for p in paths],
        }
        (out / "ladder.json").write_text(json.dumps(report))
        return subprocess.CompletedProcess(argv, 1, "", "")


def refused(path: str) -> dict:
    return rung(
        path,
        reason=f"registering the DMA-BUF with io_uring: dmabuf_fixed unsupported: {MISSING['detail']}",
        write_mib_s=None,
        read_mib_s=None,
        cpu_ms_per_gib=None,
        verdicts={},
        independent_readback=None,
        compared=None,
        dmabuf_import="exported as a DMA-BUF of 67108864 bytes and imported by pdstor",
        verified=None,
        verify_gib_s=None,
    )


def test_dmabuf_fixed_refused_with_the_kernels_reason_and_nothing_moved_passes(tmp_path):
    said, details = gpu.dmabuf_export(FakeRun(tmp_path, refused))
    assert "imported by pdstor" in said and "IORING_RSRC_UPDATE_EXTENDED" in said, said


def test_dmabuf_fixed_that_moved_bytes_without_the_series_fails(tmp_path):
    with pytest.raises(Fail, match="fallback"):
        gpu.dmabuf_export(FakeRun(tmp_path, lambda p: {**refused(p), "write_mib_s": 900.0}))


def test_a_refusal_without_the_kernels_reason_fails(tmp_path):
    with pytest.raises(Fail, match="without the kernel's reason"):
        gpu.dmabuf_export(FakeRun(tmp_path, lambda p: {**refused(p), "reason": "registering failed"}))


def test_an_export_the_gpu_or_gvisor_cannot_make_is_a_skip_and_elsewhere_a_failure(tmp_path):
    failed = lambda p: {**refused(p), "dmabuf_import": None, "reason": "CUDA cuMemGetHandleForAddressRange(DMA_BUF_FD) failed"}  # noqa: E731
    with pytest.raises(Skip, match="gVisor"):
        gpu.dmabuf_export(FakeRun(tmp_path / "a", failed, runtime="gVisor (a user-space kernel)"))
    with pytest.raises(Fail, match="not exported"):
        gpu.dmabuf_export(FakeRun(tmp_path / "b", failed))


@pytest.fixture(autouse=True)
def _dirs(tmp_path):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()


def test_the_gpu_ladder_passes_on_bytes_checked_on_the_gpu_and_says_the_probes_were_not_attached(tmp_path):
    said, details = gpu.ladder(FakeRun(tmp_path, rung))
    assert "probes: not attached" in said and len(details["table"]) == 4, (said, details["table"])


@pytest.mark.parametrize(
    "broken, why",
    [
        ({"reason": "the bytes read back through pdstor into the exporter's memory differ at byte 4096"}, "differ"),
        ({"compared": "1048576 bytes against the pattern, on the CPU"}, "not all checked"),
        ({"independent_readback": None}, "not all checked"),
        ({"verified": None}, "not verified on the GPU"),
        ({"verified": "4 chunks' crc32c taken on the CPU match the stored ones; a byte flipped at 9 was caught"}, "not verified on the GPU"),
        ({"verified": "4 chunks' crc32c taken on the GPU match the stored ones"}, "not verified on the GPU"),
    ],
)
def test_the_gpu_ladder_fails_on_bytes_not_checked_or_wrong(tmp_path, broken, why):
    with pytest.raises(Fail, match=why):
        gpu.ladder(FakeRun(tmp_path, lambda p: rung(p, **broken)))


def cufile(n: list):
    def round(run, target, chunk):
        n.append(chunk)
        return {"write_gib_s": 1.0, "read_gib_s": 2.0, "cpu_s_per_gib": 0.3, "mode": "compatibility", "o_direct": True}

    return round


def test_throughput_alternates_and_answers_pdstor_over_cufile(tmp_path, monkeypatch):
    rounds: list = []
    monkeypatch.setattr(bench, "cufile_round", cufile(rounds))
    run = FakeRun(tmp_path, rung)
    said, details = bench._measure(run, None, "bench.img", ["--force"])
    assert len(rounds) == 6 and len(run.calls) == 6, (rounds, run.calls)
    ratio = details["results"]["8M"]["pdstor_over_cufile"]
    assert ratio["write_gib_s"] == pytest.approx(2000 / 1024) and ratio["read_gib_s"] == pytest.approx(3000 / 1024 / 2)
    assert "compatibility mode" in said and "512K" in said, said


def test_throughput_without_cufile_or_time_is_a_skip_with_what_was_measured(tmp_path, monkeypatch):
    def broken(run, target, chunk):
        raise RuntimeError("libcufile not loadable")

    monkeypatch.setattr(bench, "cufile_round", broken)
    with pytest.raises(Skip, match="libcufile") as e:
        bench._measure(FakeRun(tmp_path / "a", rung), None, "bench.img", [])
    assert len(e.value.details["results"]["8M"]["pdstor"]) == 3
    monkeypatch.setattr(bench, "cufile_round", cufile([]))
    with pytest.raises(Skip, match="out of time"):
        bench._measure(FakeRun(tmp_path / "b", rung, left=20.0), None, "bench.img", [])
