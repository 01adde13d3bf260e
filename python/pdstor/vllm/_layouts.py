"""The KV caches vLLM's CUDA attention backends give a connector's
``register_kv_caches``, as ``layouts.json`` records them for the GPU bundle,
which runs the worker half over CUDA KV caches where vLLM is not installed.

Read from the vLLM this package is tested against, never written by hand:
which KV cache layouts each dense CUDA backend takes
(``supported_kv_cache_layouts``, none named = any), and for each layout the
per-layer views vLLM's own ``create_kv_cache_views`` makes of one shared
allocation (shape, strides and offset of every layer, as the worker gets
them) for a reference model. ``python -m pdstor.vllm._layouts`` prints the
table; the package's tests fail when it no longer matches vLLM.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

# Dense full-attention backends on NVIDIA GPUs. MLA and hybrid models are
# not handed over yet: the connector refuses them at start.
CUDA_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "FLEX_ATTENTION")

# The model the views are computed for, and that the bundle's rung uses.
REFERENCE: dict[str, Any] = {
    "layers": 4,
    "blocks": 64,
    "kv_heads": 8,
    "block_tokens": 16,
    "head_size": 128,
    "dtype": "bfloat16",
}


def bundled() -> dict[str, Any]:
    """The table shipped with the package."""
    return json.loads(resources.files("pdstor.vllm").joinpath("layouts.json").read_text())


def read_from_vllm() -> dict[str, Any]:
    """The table as the installed vLLM says it."""
    import torch
    import vllm
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    ref = REFERENCE
    dtype = getattr(torch, ref["dtype"])
    spec = FullAttentionSpec(
        block_size=ref["block_tokens"], num_kv_heads=ref["kv_heads"], head_size=ref["head_size"], dtype=dtype
    )
    backends, used = [], set()
    for name in CUDA_BACKENDS:
        member = AttentionBackendEnum[name]
        entry: dict[str, Any] = {"name": name, "class": member.get_path()}
        try:
            supported = member.get_class().supported_kv_cache_layouts()
        except ImportError as e:
            entry["unreadable"] = f"{type(e).__name__}: {e}"
            backends.append(entry)
            continue
        layouts = [x.name for x in (supported if supported is not None else KVCacheLayout)]
        entry["kv_cache_layouts"] = layouts
        entry["any_layout"] = supported is None
        used.update(layouts)
        backends.append(entry)
    views: dict[str, Any] = {}
    names = [f"layer.{i}" for i in range(ref["layers"])]
    for layout in KVCacheLayout:
        if layout.name not in used:
            continue
        layer_stride, block_stride, *_ = compute_layout_strides(spec, ref["blocks"], ref["layers"], layout)
        size = ref["layers"] * ref["blocks"] * spec.page_size_bytes
        tensor = KVCacheTensor(size=size, layers=names, layer_stride=layer_stride, block_stride=block_stride)
        raw = torch.zeros(size, dtype=torch.int8)
        made = create_kv_cache_views(raw, spec, ref["blocks"], layout, tensor)
        views[layout.name] = {
            "raw_bytes": size,
            "layers": [
                {"shape": list(v.shape), "stride": list(v.stride()), "offset": v.storage_offset()} for v in made
            ],
        }
    return {"vllm": vllm.__version__, "reference": ref, "backends": backends, "views": views}


if __name__ == "__main__":
    print(json.dumps(read_from_vllm(), indent=1))
