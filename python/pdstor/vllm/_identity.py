"""The pdstor layout of a vLLM engine: what a reader must match to restore
what a writer stored. Both sides compute it from their own configuration;
the daemon refuses a claim or an adopt naming another.

Beyond the shape it names the weights (the model, its revision, vLLM's hash
of everything that shapes the computation graph, how weights are loaded —
with the seed for dummy weights), the KV cache dtype as the engine was asked
for it (every FP8 cache is a ``uint8`` tensor: ``fp8_e4m3`` and ``fp8_e5m2``
differ only here), the scales' layout, the stored layout, the attention
backend family and the tensor-parallel shard: KV cache of one model silently
reused by another is a known bug class; here it is a refusal.

Under tensor parallelism every rank holds its own heads' shard of each
block: each rank stores it as a publication of its own, whose layout names
the shard (``tp=r/N``), so a decode engine restores rank by rank, and one
with another tensor-parallel size is refused at claim (``layout_mismatch``
names both layouts).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

import pdstor

from ._format import Shape


class UnsupportedEngine(ValueError):
    """This engine's KV cache is not one pdstor.vllm hands over."""


@dataclass(frozen=True)
class EngineKV:
    """What one engine stores: the chunk shape of a rank's shard, and the
    layout of every rank's publications."""

    shape: Shape
    # One per tensor-parallel rank: rank r's shard is stored under layouts[r].
    layouts: tuple[dict, ...]
    # The KV cache dtype as configured ("auto" resolved to the torch dtype).
    kv_dtype: str

    @property
    def tp_size(self) -> int:
        return len(self.layouts)


def shard_name(name: str, rank: int, tp_size: int) -> str:
    """The publication of tensor-parallel rank `rank`'s shard of request
    publication `name` (the name itself for one rank)."""
    return name if tp_size == 1 else f"{name}.tp{rank}"


def _group(kv_cache_config: Any) -> Any:
    """The one KV cache group pdstor.vllm hands over, or a refusal naming
    every group's kind."""
    groups = list(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else []
    kinds = ", ".join(f"{type(g.kv_cache_spec).__name__} ({len(g.layer_names)} layers)" for g in groups)
    if len(groups) != 1:
        raise UnsupportedEngine(
            f"pdstor.vllm hands over models with one full-attention KV cache group; this engine has {len(groups)}: "
            f"{kinds or 'none'}. A sliding-window hybrid is handed over with --disable-hybrid-kv-cache-manager "
            "(every layer keeps every block); a Mamba or linear-attention hybrid's state is not"
        )
    return groups[0]


def _check_spec(spec: Any) -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    kind = type(spec).__name__
    if not isinstance(spec, FullAttentionSpec):
        raise UnsupportedEngine(
            f"pdstor.vllm hands over full-attention KV caches (dense or MLA); this engine's is a {kind} "
            f"({spec!r}): a sliding-window model frees the blocks outside its window; serve it with "
            "--disable-hybrid-kv-cache-manager to keep them"
        )
    odd = {
        "num_head_slots": getattr(spec, "num_head_slots", None),
        "state_content_bytes": getattr(spec, "state_content_bytes", None),
        "page_size_padded": getattr(spec, "page_size_padded", None),
    }
    odd = {k: v for k, v in odd.items() if v is not None}
    if getattr(spec, "tokens_per_state", 1) != 1:
        odd["tokens_per_state"] = spec.tokens_per_state
    if odd:
        raise UnsupportedEngine(
            f"pdstor.vllm hands over pages of one state per token and head, unpadded; this engine's {kind} "
            f"packs them otherwise ({odd})"
        )


def _kv_dtype(vllm_config: Any, spec: Any) -> str:
    """The KV cache dtype's name: the configured one for a quantized cache
    (its tensors are bytes), else the tensors' dtype."""
    cc = vllm_config.cache_config
    asked = str(getattr(spec, "cache_dtype_str", None) or getattr(cc, "cache_dtype", "auto") or "auto")
    # As configured: "fp8" and "fp8_e4m3" are one format on CUDA, not on
    # every platform, so two engines configured unlike are refused.
    if asked.startswith("fp8"):
        return asked
    return str(spec.dtype).removeprefix("torch.")


def engine_kv(vllm_config: Any, kv_cache_config: Any, extra: dict[str, Any]) -> EngineKV:
    """The shard shape and every rank's pdstor layout of this engine."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    group = _group(kv_cache_config)
    spec = group.kv_cache_spec
    _check_spec(spec)
    pc = vllm_config.parallel_config
    tp, pp = int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size)
    if pp != 1:
        raise UnsupportedEngine(
            f"pdstor.vllm hands over tensor-parallel engines; pipeline_parallel_size must be 1 (this engine: {pp}): "
            "each stage holds other layers, and a stage's shape is not the scheduler's to know"
        )
    context = {
        k: int(getattr(pc, k, 1) or 1) for k in ("decode_context_parallel_size", "prefill_context_parallel_size")
    }
    if any(v != 1 for v in context.values()):
        raise UnsupportedEngine(
            f"pdstor.vllm hands over blocks of consecutive tokens; this engine interleaves a block's tokens "
            f"across context-parallel ranks ({context}): serve it without context parallelism"
        )
    elem = spec.dtype.itemsize
    shape = Shape(
        layers=len(group.layer_names),
        heads=spec.num_kv_heads,
        block_tokens=spec.block_size,
        content=spec.head_size + spec.head_size_v,  # MLA: the latent alone (head_size_v 0)
        elem_bytes=elem,
    )
    mc = vllm_config.model_config
    kv_dtype = _kv_dtype(vllm_config, spec)
    load_format = str(getattr(vllm_config.load_config, "load_format", "auto"))
    weights = [mc.compute_hash(), load_format, kv_dtype]
    if load_format == "dummy":
        weights.append(f"seed={mc.seed}")
    identity = extra.get("model_identity") or hashlib.sha256("|".join(weights).encode()).hexdigest()[:16]
    name = os.path.basename(str(mc.model).rstrip("/")) or str(mc.model)
    kind = "mla" if isinstance(spec, MLAAttentionSpec) else "kv"
    scales = "per-layer" if kv_dtype.startswith("fp8") else "none"
    layouts = tuple(
        pdstor.layout(
            model_id=f"{name}@{mc.revision or '-'}#{identity}",
            dtype=kv_dtype,
            layers=shape.layers,
            kv_heads=spec.num_kv_heads,
            head_dim=spec.head_size,
            chunk_tokens=spec.block_size,
            kv_format=(
                f"pdstor-vllm-v2;{kind};stored=HNC[{shape.heads}x{shape.block_tokens}x{shape.content}];"
                f"scales={scales};backend={_backend_family()};tp={rank}/{tp};pp=0/1"
            ),
        )
        for rank in range(tp)
    )
    return EngineKV(shape, layouts, kv_dtype)


def _backend_family() -> str:
    """What a page's bytes mean beyond its logical [H, N, C] view: the CPU
    attention backend packs a page's interior otherwise than the GPU ones,
    whatever the layout; every GPU layout's logical view means the same."""
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "gpu"


def tp_rank(vllm_config: Any) -> int:
    """This worker's tensor-parallel rank."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, model_parallel_is_initialized

        if model_parallel_is_initialized():
            return int(get_tensor_model_parallel_rank())
    except ImportError:
        pass
    pc = vllm_config.parallel_config
    return int(getattr(pc, "rank", 0)) % int(pc.tensor_parallel_size)
