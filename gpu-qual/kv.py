"""The vLLM connector's worker half (``pdstor.vllm._worker.WorkerSide``) over
KV caches laid out as vLLM's CUDA attention backends lay them, without vLLM.

For every KV cache layout vLLM's dense CUDA attention backends take
(``pdstor/vllm/layouts.json``: read from vLLM's backend classes and its own
``create_kv_cache_views``, checked against vLLM in the package's tests), the
paged caches are made as vLLM's GPU model runner makes them — one shared
allocation, every layer a ``[blocks, H, N, C]`` view of it with the layout's
strides and offset — filled with random bits, and one request is handed
over through the daemon: stored from one set of blocks (the scheduler's prepare played
here; the stores and the publish on the worker's mover), restored into another (claim,
adopt, load, verify, ack, on the mover), each reported through ``get_finished``.
Every restored block must equal its source and every other block must be
untouched — compared on the device the caches live on, as raw bits. A
control then restores with a wrong first token: refused, the blocks
reported to vLLM's load-error path, nothing written.

Prints one JSON line: status (PASS / FAIL / SKIP), reason, cases, table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import types
from importlib import resources

FIRST = 4242


def answer(status: str, reason: str, **more) -> None:
    print(json.dumps({"status": status, "reason": reason, **more}), flush=True)


def caches(torch, view: dict, device: str, dtype) -> list:
    """Every layer's view of one shared allocation, as vLLM makes them."""
    raw = torch.randint(-(2**15), 2**15, (view["raw_bytes"] // 2,), dtype=torch.int16, device=device).view(dtype)
    return [torch.as_strided(raw, v["shape"], v["stride"], v["offset"]) for v in view["layers"]]


def bits(t):
    import torch

    return t.view(torch.int16)


def until(worker, done, timeout_s: float = 60.0) -> set:
    """Polls the worker's get_finished (as vLLM does every step) until
    `done(sent, received)`; the blocks its failed restores reported."""
    sent, received, invalid = set(), set(), set()
    deadline = time.monotonic() + timeout_s
    while not done(sent, received):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the worker's mover did not finish within {timeout_s} s (sent {sent}, received {received})")
        s, r = worker.finished(set())
        sent |= s or set()
        received |= r or set()
        invalid |= worker.take_invalid()
        time.sleep(0.001)
    return invalid


def until_restored(worker, req: str) -> set:
    return until(worker, lambda sent, received: req in received)


def store(pdstor, client, worker, layout, name: str, req: str, chunks: int, prompt_tokens: int, digest: bytes, src: list):
    """The connector's producer path: prepared, the blocks stored and
    published READY by the worker's mover; the READY receipt."""
    from pdstor.vllm._meta import EndSpec, PdstorMetadata, SaveSpec

    writer = pdstor.Writer(client, "gpu-qual")
    writer.prepare(name, layout, chunks, timeout_ms=10_000)
    handoff = writer.handoff()
    worker.save(PdstorMetadata(saves=[SaveSpec(req, (handoff,), prompt_tokens, digest, list(enumerate(src)), True)]))
    worker.load(PdstorMetadata(ends=[EndSpec(req, (handoff,), FIRST, "", release=True)]))
    until(worker, lambda sent, received: req in sent)
    (ready,) = client.lookup([name])
    if ready is None:
        raise RuntimeError(f"the store failed: {name} is not READY (see the log above)")
    return ready


def one_case(torch, pdstor, client, name: str, ref: dict, view: dict, device: str) -> dict:
    from pdstor.vllm._context import Context
    from pdstor.vllm._format import Shape, prompt_digest
    from pdstor.vllm._meta import LoadSpec, PdstorMetadata
    from pdstor.vllm._worker import WorkerSide

    dtype = getattr(torch, ref["dtype"])
    n_layers, heads, block, head, blocks = (ref[k] for k in ("layers", "kv_heads", "block_tokens", "head_size", "blocks"))
    shape = Shape(layers=n_layers, heads=heads, block_tokens=block, content=2 * head, elem_bytes=dtype.itemsize)
    prompt_tokens = 5 * block - 7
    layout = pdstor.layout(
        model_id=f"gpu-qual-{name}",
        dtype=ref["dtype"],
        layers=n_layers,
        kv_heads=heads,
        head_dim=head,
        chunk_tokens=block,
        kv_format=f"pdstor-vllm-v1;stored=HNC[{heads}x{block}x{2 * head}];paged={name}",
    )
    cfg = types.SimpleNamespace(writer_id="gpu-qual", reader_id="gpu-qual", staging_bytes=8 << 20, recompute=False, lease_ms=60_000, ready_timeout_s=30)
    ctx = Context(client, layout, shape, cfg, f"gpu-qual-{name}", None)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(n_layers)]
    layers = caches(torch, view, device, dtype)
    worker = WorkerSide(ctx, names, dtype)
    worker.register(dict(zip(names, layers)))
    prompt = [(i * 7919) % 32000 for i in range(prompt_tokens)]
    digest = prompt_digest(prompt)
    chunks = shape.chunks_for(prompt_tokens)
    src, dst = [5, 17, 3, 42, 60][:chunks], [50, 8, 61, 0, 33][:chunks]
    for t in layers:
        for b in dst:
            t[b].zero_()
    # vLLM's model runs on a stream of its own: the source blocks are
    # written again on one, and the store queued right behind without a
    # sync — the worker's copy (on its mover thread) must wait for them.
    stream = torch.cuda.Stream() if device == "cuda" else None
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for t in layers:
            for b in src:
                bits(t[b]).random_(-(1 << 15), 1 << 15)
        before = [t.clone() for t in layers]
        t0 = time.monotonic()
        ready = store(pdstor, client, worker, layout, f"gpu-qual-{name}", name, chunks, prompt_tokens, digest, src)
        saved_s = time.monotonic() - t0
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.monotonic()
    load = LoadSpec(name, None, ready.to_json(), None, prompt_tokens, digest, FIRST, list(enumerate(dst)))
    worker.load(PdstorMetadata(loads=[load]))
    invalid = until_restored(worker, name)
    if device == "cuda":
        torch.cuda.synchronize()
    restored_s = time.monotonic() - t0
    if worker.failed_loads or invalid:
        raise RuntimeError("the restore failed (see the log above)")
    for layer, (t, old) in enumerate(zip(layers, before)):
        for i, (s, d) in enumerate(zip(src, dst)):
            if not torch.equal(bits(t[s]), bits(t[d])):
                raise RuntimeError(f"layer {layer}, chunk {i}: block {d} differs from its source block {s}")
        keep = torch.tensor([b for b in range(blocks) if b not in dst], device=t.device)
        if not torch.equal(bits(t).index_select(0, keep), bits(old).index_select(0, keep)):
            raise RuntimeError(f"layer {layer}: a block the restore did not own changed")

    # The control: the same prompt handed over again, restored expecting
    # another first token: refused, reported, nothing written.
    ready = store(pdstor, client, worker, layout, f"gpu-qual-{name}-control", name + "-c", chunks, prompt_tokens, digest, src)
    spare = [1, 2, 4, 6, 7][:chunks]
    snapshot = [t.clone() for t in layers]
    load = LoadSpec(name + "-c", None, ready.to_json(), None, prompt_tokens, digest, FIRST + 1, list(enumerate(spare)))
    worker.load(PdstorMetadata(loads=[load]))
    invalid = until_restored(worker, name + "-c")
    if worker.failed_loads != 1 or invalid != set(spare):
        raise RuntimeError(f"the control was not refused as it should be: failed {worker.failed_loads}, reported {invalid}")
    if not all(torch.equal(bits(a), bits(b)) for a, b in zip(layers, snapshot)):
        raise RuntimeError("the refused control wrote into the KV cache")
    worker.close()
    mib = chunks * shape.chunk_bytes / 1048576
    return {
        "backend": name,
        "chunks": chunks,
        "chunk_bytes": shape.chunk_bytes,
        "save_mib_s": round(mib / saved_s, 1),
        "restore_mib_s": round(mib / restored_s, 1),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=("cpu", "cuda"), required=True)
    p.add_argument("--server", required=True)
    p.add_argument("--data-socket", required=True)
    args = p.parse_args()
    try:
        import torch
    except ImportError as e:
        answer("SKIP", f"no torch in this Python ({sys.executable}): {e}")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        answer("SKIP", f"no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False)")
        return 0
    import pdstor

    from pdstor.vllm import _layouts

    table = _layouts.bundled()
    client = pdstor.Client(args.server, args.data_socket)
    cases, rows = [], ["| KV cache layout | backends | chunks | save MiB/s | restore MiB/s |", "|---|---|---|---|---|"]
    for name, view in sorted(table["views"].items()):
        users = [b["name"] for b in table["backends"] if name in b.get("kv_cache_layouts", [])]
        try:
            c = one_case(torch, pdstor, client, name, table["reference"], view, args.device)
        except Exception as e:  # noqa: BLE001 - reported as the rung's failure
            answer("FAIL", f"layout {name} ({', '.join(users)}) on {args.device}: {e}", cases=cases, table=rows)
            return 1
        c["backends"] = users
        cases.append(c)
        rows.append(f"| {name} | {', '.join(users)} | {c['chunks']} | {c['save_mib_s']} | {c['restore_mib_s']} |")
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "the CPU"
    kinds = sorted(b["name"] for b in table["backends"] if "kv_cache_layouts" in b)
    answer(
        "PASS",
        f"{len(cases)} KV cache layouts ({', '.join(sorted(table['views']))}; backends {', '.join(kinds)} of vLLM "
        f"{table['vllm']}) stored and restored on {where}: "
        "every block equal, no other block touched, a wrong first token refused",
        cases=cases,
        table=rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
