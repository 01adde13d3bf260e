"""``pdstor.vllm.PdstorConnector`` for the engines people deploy, through
vLLM's real ``Scheduler`` and worker-role connectors against a live
``pdstor serve``: tensor parallelism (a worker per rank, each storing and
restoring its own heads), MLA and FP8 KV caches, every physical
``KVCacheLayout``, restored byte for byte; and what is refused — another
parallel layout, another FP8 format or scales, hybrid models, pipeline
parallelism — refused at claim, at restore or at start, with the reason."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm", reason="SKIP: vLLM is not installed (cargo xtask python installs vllm==0.33.0)")

from test_vllm import PROMPT_LENGTHS, daemon, decode_request, model, prefill, prompt  # noqa: E402, F401
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm_harness import DTYPE, HEAD_DIM, KV_HEADS, Engine, Kv, engine_config  # noqa: E402

from pdstor.vllm._identity import UnsupportedEngine  # noqa: E402


def engine(model, daemon, role: str, engine_id: str, kv: Kv, **kw) -> Engine:
    return Engine(engine_config(model, daemon, role, engine_id, kv=kv, **kw), 256, kv=kv)


def hand_over(model, daemon, made: Kv, read: Kv, prompts: dict[str, list[int]], **kw) -> tuple[Engine, Engine]:
    """`prompts` prefilled by an engine whose KV is `made`, then decoded by
    one whose KV is `read`; both engines, run to the end."""
    p = engine(model, daemon, "kv_producer", "prefill-0", made)
    handed = prefill(p, prompts)
    c = engine(model, daemon, "kv_consumer", "decode-0", read, **kw)
    for rid, toks in prompts.items():
        decode_request(c, rid, toks, handed[rid])
    c.run()
    return p, c


def assert_restored(c: Engine, prompts: dict[str, list[int]]) -> None:
    for rid, toks in prompts.items():
        assert c.finished[rid].reason == FinishReason.LENGTH, (rid, c.finished[rid])
        # Checked byte for byte in the step, on every rank, against the prompt alone.
        assert c.restored_checked[rid] == len(toks), rid


def test_tensor_parallel_ranks_store_and_restore_their_own_shards(model, daemon):
    kv = Kv(tp=2)
    prompts = {f"r{n}": prompt(n, n) for n in PROMPT_LENGTHS}
    p = engine(model, daemon, "kv_producer", "prefill-0", kv)
    handed = prefill(p, prompts)
    client = daemon.client()
    # One publication per request and rank, each READY once its rank's stores are durable.
    pubs = client.publications()
    assert sorted(x["req_id"] for x in pubs) == sorted(f"vllm-prefill-0-{r}.tp{k}" for r in prompts for k in (0, 1))
    assert {x["state"] for x in pubs} == {"READY"}
    assert {h["pdstor"]["tp"] for h in handed.values()} == {2}
    assert [w.worker_side.published for w in p.workers] == [len(prompts)] * 2
    c = engine(model, daemon, "kv_consumer", "decode-0", kv)
    for rid, toks in prompts.items():
        decode_request(c, rid, toks, handed[rid])
    c.run()
    assert_restored(c, prompts)
    assert [w.worker_side.restored for w in c.workers] == [len(prompts)] * 2
    assert client.publications() == []


def test_another_tensor_parallel_size_is_refused_at_claim_never_restored_wrong(model, daemon, caplog):
    prompts = {"a": prompt(45, 1), "b": prompt(100, 2)}
    client = daemon.client()
    with caplog.at_level(logging.ERROR, logger="pdstor.vllm"):
        p, c = hand_over(model, daemon, Kv(tp=2), Kv(tp=1), prompts)
    for rid in prompts:
        assert c.finished[rid].reason == FinishReason.ERROR, rid
        assert rid not in c.restored_checked
    refusals = [r.getMessage() for r in caplog.records if "claim refused" in r.getMessage()]
    assert len(refusals) == len(prompts)
    # The daemon's refusal names both layouts: the stored shard's and this reader's.
    assert all("layout_mismatch" in m and "tp=0/2" in m and "tp=0/1" in m for m in refusals), refusals
    # Nothing claimed: every shard stays READY for a decode engine with the producer's layout ...
    assert {x["state"] for x in client.publications()} == {"READY"}
    right = engine(model, daemon, "kv_consumer", "decode-1", Kv(tp=2))
    for rid, toks in prompts.items():
        decode_request(right, rid, toks, p.finished[rid].params)
    right.run()
    assert_restored(right, prompts)
    assert client.publications() == []

    # A prefill of one rank, and a decode of two: both ranks refused.
    with caplog.at_level(logging.ERROR, logger="pdstor.vllm"):
        caplog.clear()
        _, wide = hand_over(model, daemon, Kv(tp=1), Kv(tp=2), {"c": prompt(64, 3)})
    assert wide.finished["c"].reason == FinishReason.ERROR
    # Both ranks claimed the one shard, each with its own layout: both refused, the shard kept.
    assert sum("layout_mismatch" in r.getMessage() for r in caplog.records) == 2
    assert [x["state"] for x in client.publications()] == ["READY"]


@pytest.mark.parametrize("made,read", [(m.name, r.name) for m, r in zip(KVCacheLayout, [*KVCacheLayout][1:] + [*KVCacheLayout][:1])])
def test_every_kv_cache_layout_round_trips_into_any_other(model, daemon, made, read):
    """vLLM hands a connector [B, H, N, C] views over each physical layout;
    a page stored from one is restored into another through the views."""
    prompts = {f"r{n}": prompt(n, n) for n in (16, 45, 100)}
    _, c = hand_over(model, daemon, Kv(layout=made), Kv(layout=read), prompts)
    assert_restored(c, prompts)


def test_an_mla_cache_hands_over_one_latent_per_token(model, daemon, caplog):
    kv = Kv(kind="mla")
    prompts = {f"r{n}": prompt(n, n) for n in (5, 45, 150)}
    p, c = hand_over(model, daemon, kv, kv, prompts)
    assert_restored(c, prompts)
    # A chunk holds the latent once per layer: no heads, no separate V.
    shape = c.worker.worker_side.shape
    assert (shape.heads, shape.content) == (1, kv.content)
    assert c.worker.worker_side.layout["kv_format"].startswith("pdstor-vllm-v2;mla;")
    # A dense-attention decode is refused at claim, the publication kept READY.
    with caplog.at_level(logging.ERROR, logger="pdstor.vllm"):
        _, dense = hand_over(model, daemon, kv, Kv(), {"d": prompt(45, 9)})
    assert dense.finished["d"].reason == FinishReason.ERROR
    assert any("layout_mismatch" in r.getMessage() and ";mla;" in r.getMessage() for r in caplog.records)
    assert [x["state"] for x in daemon.client().publications()] == ["READY"]


@pytest.mark.parametrize("fp8", ["fp8_e4m3", "fp8_e5m2"])
def test_an_fp8_cache_round_trips_bit_for_bit_and_names_its_format_and_scales(model, daemon, fp8, caplog):
    kv = Kv(kind=fp8, scale=0.5)
    prompts = {f"r{n}": prompt(n, n) for n in (16, 100)}
    p, c = hand_over(model, daemon, kv, kv, prompts)
    assert_restored(c, prompts)
    assert c.worker.worker_side.layout["dtype"] == fp8
    client = daemon.client()
    other = "fp8_e5m2" if fp8 == "fp8_e4m3" else "fp8_e4m3"
    # The other FP8 format, a BF16 cache: both uint8 or not, refused at claim, the shard kept READY.
    for i, read in enumerate((Kv(kind=other, scale=0.5), Kv())):
        with caplog.at_level(logging.ERROR, logger="pdstor.vllm"):
            caplog.clear()
            _, d = hand_over(model, daemon, kv, read, {f"x{i}": prompt(45, 7)})
        assert d.finished[f"x{i}"].reason == FinishReason.ERROR, read
        assert any("layout_mismatch" in r.getMessage() for r in caplog.records), read
        assert {x["state"] for x in client.publications()} == {"READY"}
    # The same format quantized with other scales: refused at restore (the chunk headers carry the scales').
    with caplog.at_level(logging.ERROR, logger="pdstor.vllm"):
        caplog.clear()
        _, d = hand_over(model, daemon, kv, Kv(kind=fp8, scale=0.25), {"y": prompt(45, 8)})
    assert d.finished["y"].reason == FinishReason.ERROR
    assert any("other KV scales" in r.getMessage() for r in caplog.records)


def test_fp8_formats_differ_in_the_layout_even_under_one_model_identity(model, daemon, caplog):
    """Both FP8 formats are uint8 tensors: with the weights named by
    `model_identity` (the same for both engines), only the layout's dtype
    tells them apart."""
    same = {"model_identity": "sha256:checkpoint"}
    p = engine(model, daemon, "kv_producer", "prefill-0", Kv(kind="fp8_e4m3"), extra=same)
    handed = prefill(p, {"z": prompt(45, 4)})
    c = engine(model, daemon, "kv_consumer", "decode-0", Kv(kind="fp8_e5m2"), extra=same)
    with caplog.at_level(logging.ERROR, logger="pdstor.vllm"):
        decode_request(c, "z", prompt(45, 4), handed["z"])
        c.run()
    assert c.finished["z"].reason == FinishReason.ERROR and "z" not in c.restored_checked
    refused = [r.getMessage() for r in caplog.records if "layout_mismatch" in r.getMessage()]
    assert refused and 'dtype: "fp8_e4m3"' in refused[0] and 'dtype: "fp8_e5m2"' in refused[0], refused
    assert [x["state"] for x in daemon.client().publications()] == ["READY"]


def refusal(model, daemon, groups: list[KVCacheGroupSpec], **config) -> str:
    """Why a connector refuses to start for an engine with these KV cache
    groups (and `config`: section__key=value)."""
    vc = engine_config(model, daemon, "kv_both", "e-0")
    for what, value in config.items():
        section, key = what.split("__")
        setattr(getattr(vc, section), key, value)
    kcc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(UnsupportedEngine) as e:
            KVConnectorFactory.create_connector(vc, role, kcc)
    return str(e.value)


def test_what_is_not_handed_over_is_refused_at_start_with_the_reason(model, daemon):
    full = FullAttentionSpec(block_size=16, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=DTYPE)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=DTYPE, sliding_window=64)
    mamba = MambaSpec(block_size=16, shapes=((4, 8), (2, 8, 8)), dtypes=(DTYPE, DTYPE))
    layers = [["model.layers.0.self_attn.attn"], ["model.layers.1.self_attn.attn"]]
    why = refusal(model, daemon, [KVCacheGroupSpec(layers[0], full), KVCacheGroupSpec(layers[1], window)])
    assert "2: FullAttentionSpec (1 layers), SlidingWindowSpec (1 layers)" in why
    assert "--disable-hybrid-kv-cache-manager" in why
    why = refusal(model, daemon, [KVCacheGroupSpec(layers[0], full), KVCacheGroupSpec(layers[1], mamba)])
    assert "MambaSpec (1 layers)" in why and "state is not" in why
    why = refusal(model, daemon, [KVCacheGroupSpec(layers[0] + layers[1], window)])
    assert "SlidingWindowSpec" in why and "frees the blocks outside its window" in why
    one = [KVCacheGroupSpec(layers[0] + layers[1], full)]
    why = refusal(model, daemon, one, parallel_config__pipeline_parallel_size=2)
    assert "pipeline_parallel_size must be 1 (this engine: 2)" in why
    why = refusal(model, daemon, one, parallel_config__decode_context_parallel_size=2)
    assert "context-parallel" in why and "'decode_context_parallel_size': 2" in why
