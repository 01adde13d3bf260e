"""The staging buffer between vLLM's paged KV cache and the daemon, and the
copies through it.

The daemon reads and writes one registered buffer in place (a memfd,
``host_fixed``); a chunk is one contiguous slot of it: its header, then
every layer's page in the group's order. The copies are made per layer,
never per block: a batch of blocks is gathered from each layer's paged
cache with one indexed copy (``index_select``) straight into that layer's
pages of the batch's slots — a strided view of the staging buffer. A
restore copies them back one page at a time on a CPU (its memcpy is faster
than its ``index_copy_``), with one ``index_copy_`` per layer on a GPU.

On a GPU the staging buffer is pinned (registered with CUDA), and a batch
goes through a device-side image of its slots: one gather per layer on the
GPU, then one copy of the whole batch to the host on a side stream (a
restore: one copy to the GPU, then one scatter per layer). Restores are
double-buffered — each half of the staging slots in turn — so the copy of
one batch to the GPU overlaps the daemon's read of the next.

Copies a chunk makes, per layer page: CPU, one (paged cache to staging,
one indexed copy per layer for a batch; back, one copy per page: a CPU's
``index_copy_`` is slower than its memcpy, and the chunk's check rides along
it); GPU staged, two (a gather on the
GPU, and its share of one bulk copy over PCIe; back, the reverse); GPU
DMA-BUF, none through the host (docs/vllm.md).
"""

from __future__ import annotations

from typing import Any

import torch

import pdstor

from ._format import Shape


class Staging:
    def __init__(self, shape: Shape, layers: list[torch.Tensor], dtype: torch.dtype, size: int):
        self.shape, self.layers, self.dtype = shape, layers, dtype
        self.slots = max(1, size // shape.chunk_bytes)
        self.cuda = bool(layers) and layers[0].is_cuda
        # On a CPU a restore's bytes only pass through: each chunk is checked
        # as it is copied out into the paged blocks (Reader.scatter), one
        # pass over them. On a GPU they go on by DMA: the daemon checks them
        # in place in the pinned staging as they land.
        self.buffer = pdstor.Buffer(self.slots * shape.chunk_bytes, "pdstor-vllm-staging", staging=not self.cuda)
        self.host = torch.frombuffer(self.buffer, dtype=torch.uint8).view(self.slots, shape.chunk_bytes)
        self.device_image: torch.Tensor | None = None
        self.stream: Any = None
        # Per half of the slots: the event after which its device image and
        # host slots may be reused (restores, double-buffered).
        self.busy: list[Any] = [None, None]
        if self.cuda:
            self._pin()
            # Zeroed: a chunk's padding goes to the media from here.
            self.device_image = torch.zeros_like(self.host, device=layers[0].device)
            self.stream = torch.cuda.Stream(device=layers[0].device)

    def bind_thread(self) -> None:
        """Makes the calling thread's current CUDA device the caches' (a
        thread starts on device 0: entering a stream of another device and
        leaving it would make a context on device 0 in every rank's process)."""
        if self.cuda:
            torch.cuda.set_device(self.layers[0].device)

    def _pin(self) -> None:
        """Registers the staging memory with CUDA, so copies to and from it
        are DMA, not staged through pageable memory."""
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(self.host.data_ptr(), self.host.numel(), 0)
        if int(err) != 0:
            raise RuntimeError(
                f"pdstor.vllm: pinning the {self.host.numel()}-byte staging buffer failed (cudaError {int(err)}): "
                "raise the memlock limit (ulimit -l) or lower kv_connector_extra_config.staging_bytes"
            )

    def close(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self.host.data_ptr())

    def offset(self, slot: int) -> int:
        return slot * self.shape.chunk_bytes

    def _pages(self, image: torch.Tensor, first: int, n: int, layer: int) -> torch.Tensor:
        """Layer `layer`'s pages of slots first..first+n of `image` (the host
        buffer or its device image), as [n, H, N, C]: a strided view."""
        s = self.shape
        at = s.page_offset(layer)
        rows = image[first : first + n, at : at + s.page_bytes]
        return rows.view(self.dtype).view(n, s.heads, s.block_tokens, s.content)

    # -- storing ----------------------------------------------------------------

    def gather(self, blocks: list[int], after: Any = None) -> None:
        """Copies `blocks` (one per slot, from slot 0) of every layer into
        the staging slots: one indexed copy per layer (and on a GPU one
        copy of the batch to the host), done when this returns."""
        n = len(blocks)
        if not self.cuda:
            idx = torch.tensor(blocks, dtype=torch.int64)
            for layer, kv in enumerate(self.layers):
                torch.index_select(kv, 0, idx, out=self._pages(self.host, 0, n, layer))
            return
        assert self.device_image is not None
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            idx = torch.tensor(blocks, dtype=torch.int64).to(self.layers[0].device, non_blocking=True)
            for layer, kv in enumerate(self.layers):
                torch.index_select(kv, 0, idx, out=self._pages(self.device_image, 0, n, layer))
            self.host[:n].copy_(self.device_image[:n], non_blocking=True)
        self.stream.synchronize()

    # -- restoring --------------------------------------------------------------

    def halves(self) -> list[tuple[int, int]]:
        """The slot ranges restores alternate between: (first, count)."""
        if self.slots < 2:
            return [(0, self.slots)]
        half = self.slots // 2
        return [(0, half), (half, self.slots - half)]

    def wait(self, half: int) -> None:
        """Until the copies out of `half`'s slots are done (they may be refilled)."""
        event, self.busy[half] = self.busy[half], None
        if event is not None:
            event.synchronize()

    def copy_out(
        self, reader: pdstor.Reader, claim: pdstor.Receipt, first: int, batch: list[int], fill: dict[int, int]
    ) -> int:
        """CPU: copies each slot's chunk (slots from `first`, chunk indexes
        `batch`) out into its block of every layer (`fill`: chunk → block;
        a chunk with none is checked only), the whole chunk checked against
        the manifest in the same pass (``Reader.scatter``). A block whose
        page is not contiguous is checked, then copied. Answers the bytes
        checked in the copy."""
        in_copy = 0
        for slot, index in enumerate(batch):
            block = fill.get(index)
            pages = [] if block is None else [kv[block] for kv in self.layers]
            if block is None or all(p.is_contiguous() for p in pages):
                pieces = [(self.shape.page_offset(layer), p.view(torch.uint8).numpy()) for layer, p in enumerate(pages)]
                reader.scatter(claim, index, pieces)
                in_copy += self.shape.chunk_bytes
                continue
            reader.scatter(claim, index, [])
            self.scatter(0, first, [(slot, block)])
        return in_copy

    def scatter(self, half: int, first: int, places: list[tuple[int, int]]) -> None:
        """Copies staging slots into paged blocks: `places` is (slot, block)
        with slots counted from `first`. On a GPU, one bulk copy to the
        device and one indexed copy per layer, queued on the side stream
        (`wait` for it; `finish` waits for every one); on a CPU, one copy
        per page."""
        if not places:
            return
        slots = [slot for slot, _ in places]
        n = max(slots) + 1
        dense = slots == list(range(n))
        if not self.cuda:
            # On a CPU a page's copy_ is a memcpy and index_copy_ is not:
            # measured 2.5x faster per block (cargo xtask bench --staging).
            for layer, kv in enumerate(self.layers):
                src = self._pages(self.host, first, n, layer)
                for slot, block in places:
                    kv[block].copy_(src[slot])
            return
        assert self.device_image is not None
        device = self.layers[0].device
        with torch.cuda.stream(self.stream):
            self.device_image[first : first + n].copy_(self.host[first : first + n], non_blocking=True)
            idx = torch.tensor([b for _, b in places], dtype=torch.int64).to(device, non_blocking=True)
            pick = None if dense else torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True)
            for layer, kv in enumerate(self.layers):
                src = self._pages(self.device_image, first, n, layer)
                kv.index_copy_(0, idx, src if pick is None else src.index_select(0, pick))
            event = torch.cuda.Event()
            event.record(self.stream)
        self.busy[half] = event

    def finish(self) -> None:
        """Until every queued scatter is in the paged cache."""
        for half in range(len(self.busy)):
            self.wait(half)
