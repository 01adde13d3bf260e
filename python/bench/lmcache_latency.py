"""Per-key latency of a handoff between two processes through LMCache's own
StorageManager with pdstor's plugin: a prefill process puts each of 64 KV
chunks alone (a `batched_put` of one key, timed until the key is stored:
READY, durable), then a decode process — another interpreter, which knows
the keys but holds no receipt — gets each alone (`get_block_mapping`, then
`batched_get` at pdstor: found by the daemon's lookup, claimed, loaded,
verified, acknowledged) and compares every restored byte with the writer's
chunk, regenerated from its seed outside pdstor and outside the timing.

Prints p50 and p99 per step and chunk size, and writes them as JSON. Run by
`cargo xtask bench --lmcache` on each target; the plugin runs as documented
(LMCache's pool in shared memory, `shm_name`)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KEYS = 64

ROLE = r"""
import json, os, sys, time
sys.path.insert(0, {bench!r})
import torch
import lmcache_bench as B
import lmcache_latency as L
role, shape_name, cfg_dir, server, data_socket, staging = sys.argv[1:7]
shape = B.SHAPES[shape_name]
pool = {{}} if staging == "1" else {{"shm_name": f"pdstor-latency-{{os.getpid()}}"}}
sm = B.manager(__import__("pathlib").Path(cfg_dir), role, shape, {{
    "storage_plugin.pdstor.module_path": "pdstor.lmcache",
    "storage_plugin.pdstor.class_name": "PdstorBackend",
    "pdstor.server": server, "pdstor.data_socket": data_socket,
    **pool,
}}, {{"storage_plugins": ["pdstor"]}})
try:
    out = L.prefill(sm, shape) if role == "prefill" else L.decode(sm, shape)
finally:
    sm.close()
print("RESULT " + json.dumps(out), flush=True)
"""


def key(i: int, shape):
    import torch
    from lmcache.utils import CacheEngineKey

    return CacheEngineKey("meta-llama/Llama-3.2-1B", 1, 0, 0x1A7E_0000 + i + 1000 * shape[0], torch.bfloat16)


def chunk(i: int, shape):
    """Key i's bytes, from its own seed: regenerated in either process."""
    import torch

    g = torch.Generator().manual_seed(5000 + i)
    return torch.randn((2, shape[0], 256, shape[3] * shape[4]), generator=g).to(torch.bfloat16)


def prefill(sm, shape) -> list[float]:
    """Each key put alone: seconds until it is stored."""
    import torch

    backend = sm.storage_backends["pdstor"]
    # Every chunk made first: torch's worker threads spin a while after an
    # operation, and would take the CPU from the puts being timed.
    objs = []
    for i in range(KEYS):
        t = chunk(i, shape)
        obj = sm.allocate(t.shape, torch.bfloat16)
        obj.tensor.copy_(t)
        objs.append(obj)
    time.sleep(0.5)
    took = []
    for i, obj in enumerate(objs):
        k = key(i, shape)
        start = time.perf_counter()
        sm.batched_put([k], [obj])
        while backend.exists_in_put_tasks(k):
            time.sleep(0.00005)
        took.append(time.perf_counter() - start)
        if backend.stats()["put_dropped"]:
            raise RuntimeError(f"put of key {i} was dropped")
    return took


def decode(sm, shape) -> list[float]:
    """Each key got alone: seconds until its memory object is restored."""
    import torch

    took, restored = [], []
    for i in range(KEYS):
        k = key(i, shape)
        start = time.perf_counter()
        mapping = sm.get_block_mapping([(k, 0, 256)])
        got = sm.batched_get([k], location="pdstor") if list(mapping) == ["pdstor"] else []
        took.append(time.perf_counter() - start)
        if len(got) != 1 or got[0] is None:
            raise RuntimeError(f"decode: key {i} was not restored (found in {list(mapping)})")
        restored.append(got[0])
    # Checked after the timing, for the same reason as the prefill's chunks.
    for i, obj in enumerate(restored):
        if not torch.equal(obj.tensor, chunk(i, shape)):
            raise RuntimeError(f"decode: key {i} restored wrong bytes")
        obj.ref_count_down()
    return took


def run(role: str, shape_name: str, dir: Path, daemon, staging: bool = False) -> list[float]:
    bench = str(Path(__file__).parent)
    argv = [role, shape_name, str(dir), daemon.server, daemon.data_socket, "1" if staging else "0"]
    out = subprocess.run(
        [sys.executable, "-c", ROLE.format(bench=bench), *argv],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"the {role} process failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def pct(v: list[float], q: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pdstor-bin", required=True)
    ap.add_argument("--pdstor-device", required=True, help="a block device, or a file (made --file-size)")
    ap.add_argument("--file-size", default="1G")
    ap.add_argument("--label", default="zram")
    ap.add_argument("--shapes", default="8MiB,512KiB")
    ap.add_argument("--json", required=True)
    ap.add_argument("--staging", action="store_true", help="the plugin without shm_name: every byte through staging")
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    import lmcache_bench as B

    report = {}
    for shape_name in a.shapes.split(","):
        shape = B.SHAPES[shape_name]
        dir = Path(tempfile.mkdtemp(prefix="pdstor-lmcache-latency-"))
        daemon = B.start_pdstor(a.pdstor_bin, a.pdstor_device, B.chunk_bytes(shape), dir, a.file_size)
        try:
            put = run("prefill", shape_name, dir, daemon, a.staging)
            get = run("decode", shape_name, dir, daemon, a.staging)
            left = daemon.client().publications()
            if left:
                raise RuntimeError(f"{len(left)} publications left after the decode process got every key")
        finally:
            daemon.stop()
        report[shape_name] = {
            "target": a.label,
            "pool": "staging" if a.staging else "shared (shm_name)",
            "keys": KEYS,
            **{f"{op}_ms": {"p50": pct(v, 0.5) * 1e3, "p99": pct(v, 0.99) * 1e3, "mean": statistics.mean(v) * 1e3}
               for op, v in (("put", put), ("get", get))},
        }
    Path(a.json).write_text(json.dumps(report, indent=2))
    pool = "through staging (no shm_name)" if a.staging else "LMCache's pool shared (shm_name)"
    print(f"\ncross-process, one key at a time ({KEYS} keys, on {a.label}, {pool}): ms")
    print(f"{'chunk':>8} {'put p50':>8} {'put p99':>8} {'get p50':>8} {'get p99':>8}")
    for shape_name, r in report.items():
        print(f"{shape_name:>8} {r['put_ms']['p50']:>8.2f} {r['put_ms']['p99']:>8.2f} {r['get_ms']['p50']:>8.2f} {r['get_ms']['p99']:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
