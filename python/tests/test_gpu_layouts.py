"""The KV cache views the GPU bundle restores into are vLLM's own: the table
``pdstor/vllm/layouts.json`` it ships must be what the installed vLLM's CUDA
backends and ``create_kv_cache_views`` say now, and the worker half must
import and run where vLLM is not installed."""

from __future__ import annotations

import json
import subprocess
import sys

from pdstor.vllm import _layouts


def test_the_bundled_layouts_are_what_vllm_says():
    shipped, now = _layouts.bundled(), _layouts.read_from_vllm()
    assert shipped == now, (
        "pdstor/vllm/layouts.json no longer matches the installed vLLM: regenerate it with "
        "`python -m pdstor.vllm._layouts > python/pdstor/vllm/layouts.json` in the test environment\n"
        + json.dumps(now, indent=1)[:4000]
    )
    readable = [b["name"] for b in shipped["backends"] if "kv_cache_layouts" in b]
    assert "FLASH_ATTN" in readable and "TRITON_ATTN" in readable, shipped["backends"]
    # vLLM hands every layer over as [B, H, N, C], whatever the layout.
    ref = shipped["reference"]
    want = [ref["blocks"], ref["kv_heads"], ref["block_tokens"], 2 * ref["head_size"]]
    for name, v in shipped["views"].items():
        assert [layer["shape"] for layer in v["layers"]] == [want] * ref["layers"], name


def test_the_worker_half_imports_without_vllm():
    # vLLM made unimportable: the worker, its metadata and the table still load,
    # and asking for the connector itself says what is missing.
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "from pdstor.vllm._worker import WorkerSide\n"
        "from pdstor.vllm._meta import LoadSpec, PdstorMetadata, SaveSpec\n"
        "from pdstor.vllm import _layouts\n"
        "assert _layouts.bundled()['views']\n"
        "import pdstor.vllm\n"
        "try:\n"
        "    pdstor.vllm.PdstorConnector\n"
        "except ImportError as e:\n"
        "    print('refused:', e)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "refused:" in p.stdout and "vllm" in p.stdout, p.stdout
