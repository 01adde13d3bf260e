"""The connector's copies between vLLM's paged KV cache and its staging
buffer, measured on this machine's CPU: storing, one indexed copy per layer
(``index_select``, what the worker does) against one copy per block and
layer (what it did before); restoring, one copy per page (what the worker
does on a CPU) against one indexed copy per layer (``index_copy_``, what it
does on a GPU), for a Llama-3.1-8B rank's cache
(32 layers, 8 KV heads, 16-token blocks, head size 128, bf16: 64 KiB a
page, 2 MiB a block) in two of vLLM's physical layouts.

Restoring with its check: each chunk's crc32c taken in place and then its
pages copied (two passes), against the crc32c taken in the copy
(``Buffer.copy_out``: one pass, what the worker does where a block's pages
are contiguous).

The bytes are checked: the staged slots equal the blocks' pages, and a
restore fills exactly the blocks it names; the two checks agree. Writes ``report.json`` and
``report.md`` to ``--out``. Run by ``cargo xtask bench --staging``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import pdstor
from pdstor.vllm._format import Shape
from pdstor.vllm._staging import Staging

LAYERS, HEADS, BLOCK, HEAD, BLOCKS = 32, 8, 16, 128, 192
DTYPE = torch.bfloat16


def caches(layout: str) -> list[torch.Tensor]:
    """Every layer's [blocks, H, N, C] view, as vLLM hands them over: one
    tensor per layer, heads outer (LBHNC) or tokens outer (LBNHC)."""
    out = []
    for layer in range(LAYERS):
        if layout == "LBHNC":
            t = torch.empty(BLOCKS, HEADS, BLOCK, 2 * HEAD, dtype=DTYPE)
        else:
            t = torch.empty(BLOCKS, BLOCK, HEADS, 2 * HEAD, dtype=DTYPE).transpose(1, 2)
        # Any bits (NaNs among them): compared as bits.
        t.view(torch.int16).random_(-(1 << 15), 1 << 15)
        out.append(t)
    return out


def per_block(staging: Staging, layers: list[torch.Tensor], blocks: list[int], back: bool) -> None:
    """The copies before: one per block and layer."""
    s = staging.shape
    for slot, block in enumerate(blocks):
        for layer, kv in enumerate(layers):
            at = staging.offset(slot) + s.page_offset(layer)
            page = staging.host.view(-1)[at : at + s.page_bytes].view(DTYPE).view(s.heads, s.block_tokens, s.content)
            if back:
                kv[block].copy_(page)
            else:
                page.copy_(kv[block])


def index_copy(staging: Staging, layers: list[torch.Tensor], blocks: list[int]) -> None:
    """The GPU path's scatter, on CPU tensors: one index_copy_ per layer."""
    idx = torch.tensor(blocks, dtype=torch.int64)
    for layer, kv in enumerate(layers):
        kv.index_copy_(0, idx, staging._pages(staging.host, 0, len(blocks), layer))


def checks(staging: Staging, layers: list[torch.Tensor], places: list[tuple[int, int]], out: dict, rounds: int) -> None:
    """A restore's check with its copy: each chunk's crc32c taken in place,
    then its pages copied (two passes: the connector before), against the
    crc32c taken in the copy (``Buffer.copy_out``, one pass: what the worker
    does where a block's pages are contiguous). Both checked against each
    other and the pages compared as bits."""
    s = staging.shape
    chunk = s.chunk_bytes
    crcs = [staging.buffer.crc32c(staging.offset(slot), chunk) for slot, _ in places]

    def two_passes() -> None:
        for slot, _ in places:
            staging.buffer.crc32c(staging.offset(slot), chunk)
        staging.scatter(0, 0, places)

    out["restore_checked_then_copied_s"] = timed(two_passes, rounds)
    if not all(kv[places[0][1]].is_contiguous() for kv in layers):
        out["restore_checked_in_copy_s"] = None  # the worker checks, then copies
        return

    def one_pass() -> list[int]:
        return [
            staging.buffer.copy_out(
                staging.offset(slot),
                chunk,
                [(s.page_offset(layer), kv[block].view(torch.uint8).numpy()) for layer, kv in enumerate(layers)],
            )
            for slot, block in places
        ]

    if one_pass() != crcs:
        raise SystemExit("staging bench: the crc32c taken in the copy is not the one taken in place")
    out["restore_checked_in_copy_s"] = timed(one_pass, rounds)


def timed(run, rounds: int) -> float:
    took = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        run()
        took.append(time.perf_counter() - t0)
    return statistics.median(took)


def one(layout: str, batch: int, rounds: int) -> dict:
    shape = Shape(layers=LAYERS, heads=HEADS, block_tokens=BLOCK, content=2 * HEAD, elem_bytes=2)
    layers = caches(layout)
    staging = Staging(shape, layers, DTYPE, batch * shape.chunk_bytes)
    blocks = [(7 * i + 3) % BLOCKS for i in range(batch)]
    moved = batch * LAYERS * shape.page_bytes
    out = {"layout": layout, "blocks": batch, "bytes": moved}
    # Storing: the paged cache into the staging slots.
    out["store_per_block_s"] = timed(lambda: per_block(staging, layers, blocks, back=False), rounds)
    out["store_indexed_s"] = timed(lambda: staging.gather(blocks), rounds)
    for slot, block in enumerate(blocks):
        for layer, kv in enumerate(layers):
            at = staging.offset(slot) + shape.page_offset(layer)
            got = staging.host.view(-1)[at : at + shape.page_bytes].view(DTYPE).view(HEADS, BLOCK, 2 * HEAD)
            if not torch.equal(got.view(torch.int16), kv[block].view(torch.int16)):
                raise SystemExit(f"staging bench: slot {slot} layer {layer} is not block {block}'s page ({layout})")
    # Restoring: the slots into other blocks.
    into = [(b + BLOCKS // 2) % BLOCKS for b in blocks]
    places = list(enumerate(into))
    out["restore_per_block_s"] = timed(lambda: per_block(staging, layers, into, back=True), rounds)
    out["restore_indexed_s"] = timed(lambda: index_copy(staging, layers, into), rounds)
    out["restore_worker_s"] = timed(lambda: (staging.scatter(0, 0, places), staging.finish()), rounds)
    for layer, kv in enumerate(layers):
        if not torch.equal(kv[into].view(torch.int16), kv[blocks].view(torch.int16)):
            raise SystemExit(f"staging bench: a restore of layer {layer} did not fill the blocks it names ({layout})")
    out["restore_worker_gbs"] = round(moved / out["restore_worker_s"] / 1e9, 2)
    checks(staging, layers, places, out, rounds)
    for way in ("store", "restore"):
        out[f"{way}_per_block_gbs"] = round(moved / out[f"{way}_per_block_s"] / 1e9, 2)
        out[f"{way}_indexed_gbs"] = round(moved / out[f"{way}_indexed_s"] / 1e9, 2)
        out[f"{way}_ratio"] = round(out[f"{way}_indexed_s"] / out[f"{way}_per_block_s"], 3)
    # Copy calls a batch makes: one per block and layer, against one per layer.
    out["copies_per_block_before"], out["copies_per_batch_indexed"] = batch * LAYERS, LAYERS
    staging.close()
    return out


def checked_cells(c: dict) -> str:
    """The restore-with-its-check cells of a case's row: the one pass's time
    over the two passes', and over the copy with no check at all (the
    worker's copy alone): what verification costs the restore."""
    two, one = c["restore_checked_then_copied_s"], c["restore_checked_in_copy_s"]
    gbs = lambda t: f"{round(c['bytes'] / t / 1e9, 2)} GB/s"  # noqa: E731
    if one is None:
        return f"{gbs(two)} | n/a (pages strided: checked, then copied) | – | – |"
    return f"{gbs(two)} | {gbs(one)} | {round(one / two, 3)} | {round(one / c['restore_worker_s'], 3)} |"


def objects(rounds: int) -> dict:
    """The LMCache plugin's get without ``shm_name``: a group of 8 MiB
    chunks (a Llama-3.2-1B key) copied from the staging buffer into memory
    objects, unchecked (``read_into``: the plugin before, its chunks checked
    in place first) against checked in the copy (``copy_out``)."""
    size, n = 8 << 20, 16
    staging = pdstor.Buffer(n * size, staging=True)
    torch.frombuffer(staging, dtype=torch.uint8).random_(0, 256)
    objs = [torch.empty(size, dtype=torch.uint8).numpy() for _ in range(n)]
    crcs = [staging.crc32c(i * size, size) for i in range(n)]
    plain = timed(lambda: [staging.read_into(i * size, o) for i, o in enumerate(objs)], rounds)
    two = timed(lambda: [(staging.crc32c(i * size, size), staging.read_into(i * size, o)) for i, o in enumerate(objs)], rounds)
    if [staging.copy_out(i * size, size, [(0, o)]) for i, o in enumerate(objs)] != crcs:
        raise SystemExit("staging bench: copy_out's crc32c is not the one taken in place")
    if any(o.tobytes() != staging.read(i * size, size) for i, o in enumerate(objs)):
        raise SystemExit("staging bench: copy_out copied other bytes")
    one = timed(lambda: [staging.copy_out(i * size, size, [(0, o)]) for i, o in enumerate(objs)], rounds)
    gbs = lambda t: round(n * size / t / 1e9, 2)  # noqa: E731
    return {"object_bytes": size, "objects": n, "copy_gbs": gbs(plain), "checked_then_copied_gbs": gbs(two),
            "checked_in_copy_gbs": gbs(one), "ratio_to_two_passes": round(one / two, 3), "ratio_to_copy": round(one / plain, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--pdstor", help="unused: the copies need no daemon")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    cases = [one(layout, batch, args.rounds) for layout in ("LBHNC", "LBNHC") for batch in (1, 8, 32)]
    lm = objects(args.rounds)
    (args.out / "report.json").write_text(json.dumps({"torch_threads": 1, "cases": cases, "lmcache_objects": lm}, indent=2))
    lines = [
        "| layout | blocks | store per block | store indexed (worker) | ÷ | restore per block | restore indexed | ÷ "
        "| checked, then copied | checked in the copy (worker) | ÷ | ÷ unchecked |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        lines.append(
            f"| {c['layout']} | {c['blocks']} | {c['store_per_block_gbs']} GB/s | {c['store_indexed_gbs']} GB/s | "
            f"{c['store_ratio']} | {c['restore_per_block_gbs']} GB/s | {c['restore_indexed_gbs']} GB/s | {c['restore_ratio']} | "
            + checked_cells(c)
        )
    lines += [
        "",
        "| LMCache object | unchecked copy (`read_into`) | checked, then copied | checked in the copy (`copy_out`) | ÷ two passes | ÷ unchecked |",
        "|---|---|---|---|---|---|",
        f"| {lm['objects']} × {lm['object_bytes'] >> 20} MiB | {lm['copy_gbs']} GB/s | {lm['checked_then_copied_gbs']} GB/s | "
        f"{lm['checked_in_copy_gbs']} GB/s | {lm['ratio_to_two_passes']} | {lm['ratio_to_copy']} |",
    ]
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
