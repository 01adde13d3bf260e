"""The pdstor layout of a vLLM engine: what a reader must match to restore
what a writer stored. Both sides compute it from their own configuration;
the daemon refuses a claim or an adopt naming another.

Beyond the shape it names the weights (the model, its revision, vLLM's hash
of everything that shapes the computation graph, how weights are loaded —
with the seed for dummy weights), the KV cache dtype, the paged layout the
engine uses, the stored layout, and the tensor/pipeline rank: KV cache of one
model silently reused by another is a known bug class; here it is a refusal.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import pdstor

from ._format import Shape


class UnsupportedEngine(ValueError):
    """This engine's KV cache is not one pdstor.vllm hands over."""


def engine_layout(vllm_config: Any, kv_cache_config: Any, extra: dict[str, Any]) -> tuple[dict, Shape]:
    """The pdstor layout and the stored chunk shape of this engine."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = list(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else []
    if len(groups) != 1:
        raise UnsupportedEngine(
            f"pdstor.vllm hands over models with one full-attention KV cache group; this engine has "
            f"{len(groups)} ({[type(g.kv_cache_spec).__name__ for g in groups]}): use a model without "
            "sliding-window or state layers"
        )
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, FullAttentionSpec) or spec.state_content_bytes is not None or spec.num_head_slots:
        raise UnsupportedEngine(
            f"pdstor.vllm hands over dense full-attention KV caches; this engine's is {spec!r}"
        )
    pc = vllm_config.parallel_config
    ranks = (pc.tensor_parallel_size, pc.pipeline_parallel_size)
    if ranks != (1, 1):
        raise UnsupportedEngine(
            f"pdstor.vllm hands over one rank's KV cache: tensor_parallel_size and pipeline_parallel_size "
            f"must be 1 (this engine: {ranks[0]} and {ranks[1]})"
        )
    elem = spec.dtype.itemsize
    shape = Shape(
        layers=len(groups[0].layer_names),
        heads=spec.num_heads,
        block_tokens=spec.block_size,
        content=spec.head_size + spec.head_size_v,
        elem_bytes=elem,
    )
    mc = vllm_config.model_config
    load_format = str(getattr(vllm_config.load_config, "load_format", "auto"))
    weights = [mc.compute_hash(), load_format, str(spec.dtype)]
    if load_format == "dummy":
        weights.append(f"seed={mc.seed}")
    identity = extra.get("model_identity") or hashlib.sha256("|".join(weights).encode()).hexdigest()[:16]
    name = os.path.basename(str(mc.model).rstrip("/")) or str(mc.model)
    paged = getattr(vllm_config.cache_config, "kv_cache_layout", None) or "auto"
    kv_format = (
        f"pdstor-vllm-v1;stored=HNC[{shape.heads}x{shape.block_tokens}x{shape.content}];"
        f"paged={paged};tp=0/1;pp=0/1"
    )
    layout = pdstor.layout(
        model_id=f"{name}@{mc.revision or '-'}#{identity}",
        dtype=str(spec.dtype).removeprefix("torch."),
        layers=shape.layers,
        kv_heads=spec.num_kv_heads,
        head_dim=spec.head_size,
        chunk_tokens=spec.block_size,
        kv_format=kv_format,
    )
    return layout, shape
