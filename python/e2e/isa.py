"""vLLM's CPU kernels, pinned to AVX2 for the end-to-end run and the bench.

vLLM picks its CPU kernels from CPUID alone: AVX-512 with BF16 (`vllm._C`,
with AMX where `torch.cpu._is_amx_tile_supported()`), else AVX2
(`vllm._C_AVX2`). Two things went wrong on an Intel Xeon guest (6.18) that
did not on the project's AMD guests:

- the kernel there does not enable AMX's tile data (`arch_prctl
  (ARCH_GET_XCOMP_SUPP)` lacks `XFEATURE_XTILEDATA`; the hypervisor passes
  the CPUID bits on, not the state), so the decode's worker died of SIGILL
  in `cpu_attention_with_kv_cache` on its first request with restored
  context — the plain prefills of the other servers never ran that kernel;
- with AMX off, the AVX-512 kernels' results depend on how requests are
  batched: the decode's chosen-token log-probabilities were up to 0.031
  from the oracle's in one of three runs with 4 and 8 requests at once
  (tokens still equal), where the AVX2 kernels' were 0.00000 in every run.

So on a CPU with AVX-512 the servers run what the AMD guests run: AVX2
kernels (torch told it has no AVX-512 and no AMX, by a `sitecustomize` on
PYTHONPATH that reaches vLLM's engine and worker processes too; ATen and
oneDNN capped at AVX2). On a CPU without AVX-512 nothing changes."""

from __future__ import annotations

import os
import platform
from pathlib import Path

SITECUSTOMIZE = '''"""Written by pdstor's e2e (python/e2e/isa.py): vLLM's CPU kernels pinned
to AVX2 — the same kernels, and the same numbers, on every x86 machine."""
import torch.cpu

torch.cpu._is_amx_tile_supported = lambda: False
torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
'''


def has_avx512() -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return "avx512f" in flags.split()


def avx2_env(out: Path, env: dict[str, str]) -> dict[str, str]:
    """`env` for a vLLM server, its kernels pinned to AVX2 where the CPU has
    AVX-512 (see the module's docstring)."""
    if platform.machine() != "x86_64" or not has_avx512():
        return env
    site = out / "avx2"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = [str(site), *filter(None, [env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))])]
    return {**env, "PYTHONPATH": ":".join(path), "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
