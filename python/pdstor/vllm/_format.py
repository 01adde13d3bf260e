"""What a handed-over request is on the media, and who may read it.

One pdstor publication per vLLM request and tensor-parallel rank (its
shard: ``_identity.shard_name``); one stored chunk per vLLM block of its
prompt (``chunk_tokens`` = the block size). A chunk is a 128-byte header
and then, for every attention layer in the KV cache group's order, that
block's page as vLLM's logical per-layer view ``[H, N, C]`` (heads, block
tokens, K and V of a head side by side) in C order, whatever the physical
layout of the paged cache (``kv_format`` names both). The whole is padded to
4 KiB.

The header binds the bytes to one prompt: the reader checks the magic, the
chunk's index, its token count, the layer count and page size, the SHA-256
of the prompt's token ids, and the digest of the quantization scales the
bytes were written with (an FP8 cache's per-layer K and V scales, which are
not in the page), so a chunk of another request, another prompt, another
shape or other scales is refused before a byte reaches the paged cache.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

MAGIC = b"PDSVLLM1"
VERSION = 2
HEADER_BYTES = 128
ALIGN = 4096
# magic, version, chunk index, tokens in this chunk, block tokens, prompt
# tokens, layers, page bytes, SHA-256 of the prompt's token ids, the scales'
# digest (zeros: no scales).
_HEADER = struct.Struct("<8sIIIIIIQ32s8s")
NO_SCALES = bytes(8)


def scales_digest(values: list[float]) -> bytes:
    """The digest a chunk header carries of the scales its bytes were
    quantized with (float32, in layer order, K then V)."""
    if not values:
        return NO_SCALES
    return hashlib.sha256(struct.pack(f"<{len(values)}f", *values)).digest()[:8]


def prompt_digest(token_ids: list[int]) -> bytes:
    """SHA-256 of token ids as little-endian u32s: what every chunk header carries."""
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}I", *token_ids)).digest()


@dataclass(frozen=True)
class Shape:
    """The stored shape of one request's chunks, as both sides compute it
    from their own configuration."""

    layers: int
    heads: int
    block_tokens: int
    content: int
    elem_bytes: int

    @property
    def page_bytes(self) -> int:
        return self.heads * self.block_tokens * self.content * self.elem_bytes

    @property
    def chunk_bytes(self) -> int:
        raw = HEADER_BYTES + self.layers * self.page_bytes
        return (raw + ALIGN - 1) // ALIGN * ALIGN

    def chunks_for(self, tokens: int) -> int:
        return (tokens + self.block_tokens - 1) // self.block_tokens

    def tokens_in(self, index: int, prompt_tokens: int) -> int:
        return min(self.block_tokens, prompt_tokens - index * self.block_tokens)

    def page_offset(self, layer: int) -> int:
        return HEADER_BYTES + layer * self.page_bytes


def header(shape: Shape, index: int, prompt_tokens: int, digest: bytes, scales: bytes = NO_SCALES) -> bytes:
    """The header of chunk `index` of a prompt of `prompt_tokens` tokens."""
    packed = _HEADER.pack(
        MAGIC,
        VERSION,
        index,
        shape.tokens_in(index, prompt_tokens),
        shape.block_tokens,
        prompt_tokens,
        shape.layers,
        shape.page_bytes,
        digest,
        scales,
    )
    return packed + bytes(HEADER_BYTES - len(packed))


def check_header(
    raw: bytes, shape: Shape, index: int, prompt_tokens: int, digest: bytes, scales: bytes = NO_SCALES
) -> str | None:
    """Why chunk `index`'s header is not the one this reader expects, or None."""
    magic, version = struct.unpack_from("<8sI", raw)
    if magic != MAGIC or version != VERSION:
        return f"chunk {index}: not a pdstor.vllm v{VERSION} chunk (magic {magic!r}, version {version})"
    _, _, got_index, tokens, block, prompt, layers, page, got_digest, got_scales = _HEADER.unpack_from(raw)
    expected = (index, shape.tokens_in(index, prompt_tokens), shape.block_tokens, prompt_tokens, shape.layers)
    found = (got_index, tokens, block, prompt, layers)
    if found != expected or page != shape.page_bytes:
        return (
            f"chunk {index}: header says (index, tokens, block, prompt tokens, layers) = {found}, "
            f"page {page} B; this request expects {expected}, page {shape.page_bytes} B"
        )
    if got_digest != digest:
        return f"chunk {index}: stored for another prompt (its token digest differs from this request's)"
    if got_scales != scales:
        return (
            f"chunk {index}: quantized with other KV scales (digest {got_scales.hex()}; this engine's "
            f"{scales.hex()}): the engines load different checkpoints' scales"
        )
    return None
