"""pdstor as an LMCache storage backend.

Load it the way LMCache loads any storage plugin, from its configuration::

    storage_plugins: ["pdstor"]
    extra_config:
      storage_plugin.pdstor.module_path: pdstor.lmcache
      storage_plugin.pdstor.class_name: PdstorBackend
      pdstor.server: unix:/run/pdstor/control.sock
      pdstor.data_socket: /run/pdstor/data.sock

How LMCache's operations map onto pdstor's protocol:

* **put** (``batched_submit_put_task``): each LMCache key — one chunk of
  ``chunk_size`` (256) tokens of every layer — becomes one publication whose
  request id is the key's string (``CacheEngineKey.to_string()``). Its bytes
  are copied into a staging buffer the daemon shares, stored as one pdstor
  chunk per ``slot_size`` bytes (one, for a chunk that fits a slot), flushed and
  published: the key is stored only once it is READY, durable on the device.
  The READY receipt is kept, keyed by the LMCache key.
* **contains**: a key this process published, or whose READY receipt the
  daemon hands out by name (``lookup``: the decode process finds what the
  prefill process stored). A key already claimed by a reader is not contained.
* **get** (``batched_get_blocking`` / ``batched_get_non_blocking``): claim →
  adopt (the layout is checked) → load into the staging buffer, each chunk's
  crc32c taken in place there and checked against the manifest → ack → copy into a memory object of the
  local CPU allocator. pdstor is a *handoff*: a restored key is consumed (its
  slots free); LMCache keeps its own copy in ``LocalCPUBackend``. Strict: a
  load that fails or does not verify raises (``pdstor.LoadFailed``,
  ``pdstor.VerifyFailed``) through LMCache's ``get``/``batched_get`` — never a
  silent miss — and the publication stays RETAINED, its bytes kept.
* **remove**: an exact unread release of a READY publication.
* **pin / unpin**: a containment check. pdstor evicts nothing unless the
  operator opted in (``pdstor serve --evict-unread``, or ``evict_unread`` for
  the tenant); then it may release a key nobody has claimed, pinned or not,
  and a get that finds its key gone is a miss (counted ``get_missed``).

Layouts: a publication's pdstor layout is LMCache's KV geometry — model name,
dtype, layers, KV heads, head size, tokens per chunk (``chunk_size``) and the
memory format (``kv_format`` = ``lmcache/KV_2LTD``, or ``lmcache/KV_MLA_FMT``).
A reader configured with another geometry is refused when it claims
(``pdstor.LayoutMismatch``, raised from ``get`` and logged): nothing is
claimed, and the publication stays READY for a reader with the writer's
geometry. A last, partial chunk of a
prompt keeps the layout; its token count is its stored length over the bytes
per token.

Further ``extra_config`` keys: ``pdstor.reader_id`` / ``pdstor.writer_id``
(default: ``lmcache-<worker id>``), ``pdstor.io_threads`` (parallel puts and
gets, default 8), ``pdstor.lease_ms`` (default 60000),
``pdstor.admission_timeout_ms`` (how long a put waits for free slots,
default 5000; a put that cannot be admitted is dropped and logged, as LMCache
drops puts a full backend refuses).

Failing loudly: at start-up the backend checks both planes — the control
socket answers (``pdstor.server``) and the data socket takes its staging
buffer (``pdstor.data_socket``) — and raises after an ERROR through
LMCache's logger that names the setting to fix (LMCache then runs without the
backend, so that line is the one to look for). Afterwards every dropped put
and failed get is logged (WARNING / ERROR, with the cause) and counted:
``stats()`` answers the counts.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, List, Optional, Sequence

import torch

import pdstor

try:  # LMCache is needed only to load this module as its plugin.
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface
except ImportError as e:  # pragma: no cover - exercised only without LMCache
    raise ImportError(f"pdstor.lmcache needs LMCache (pip install lmcache): {e}") from e

try:  # LMCache's own logger, so the plugin's lines land where LMCache's do.
    from lmcache.logging import init_logger

    logger = init_logger("pdstor.lmcache")
except ImportError:  # pragma: no cover - an LMCache without lmcache.logging
    logger = logging.getLogger("pdstor.lmcache")

_PAGE = 4096


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Staging:
    """One memfd the daemon shares, cut into regions of one full chunk each;
    a put or get holds a region while its bytes are in flight."""

    def __init__(self, regions: int, region_bytes: int):
        self.region_bytes = region_bytes
        self.buffer = pdstor.Buffer(regions * region_bytes, "pdstor-lmcache")
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(regions):
            self._free.put(i)

    def acquire(self) -> int:
        return self._free.get() * self.region_bytes

    def release(self, offset: int) -> None:
        self._free.put(offset // self.region_bytes)


class PdstorBackend(StoragePluginInterface):
    """LMCache storage plugin: puts publish through ``pdstor serve``, gets
    claim, load, verify and acknowledge. See the module's documentation."""

    def __init__(
        self,
        config=None,
        metadata=None,
        local_cpu_backend=None,
        loop: Optional[asyncio.AbstractEventLoop] = None,
        dst_device: str = "cpu",
    ):
        super().__init__(
            dst_device=dst_device,
            config=config,
            metadata=metadata,
            local_cpu_backend=local_cpu_backend,
            loop=loop,
        )
        if config is None or metadata is None:
            raise ValueError("PdstorBackend needs LMCache's config and metadata")
        if local_cpu_backend is None:
            raise ValueError("PdstorBackend needs LMCache's local_cpu_backend (it allocates the objects a get fills)")
        extra = dict(config.extra_config or {})
        self._server = str(extra.get("pdstor.server", "unix:/run/pdstor/control.sock"))
        self._data_socket = str(extra.get("pdstor.data_socket", "/run/pdstor/data.sock"))
        who = f"lmcache-{metadata.worker_id}"
        self._writer_id = str(extra.get("pdstor.writer_id", who))
        self._reader_id = str(extra.get("pdstor.reader_id", who))
        self._lease_ms = int(extra.get("pdstor.lease_ms", 60_000))
        self._admission_timeout_ms = int(extra.get("pdstor.admission_timeout_ms", 5_000))
        threads = int(extra.get("pdstor.io_threads", 8))
        if threads < 1:
            raise ValueError(f"pdstor.io_threads must be at least 1, not {threads}")

        self._dtype = metadata.kv_dtype
        self._fmt = MemoryFormat.KV_MLA_FMT if metadata.use_mla else MemoryFormat.KV_2LTD
        layers, _, _, kv_heads, head_dim = metadata.kv_shape
        self._layout = pdstor.layout(
            model_id=metadata.model_name,
            dtype=_dtype_name(self._dtype),
            layers=layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            chunk_tokens=metadata.chunk_size,
            kv_format=f"lmcache/{self._fmt.name}",
        )
        self._token_shape = metadata.get_shapes(1)[0]
        self._bytes_per_token = self._token_shape.numel() * self._dtype.itemsize
        full = self._bytes_per_token * metadata.chunk_size
        self._metadata = metadata

        self._staging = _Staging(threads, -(-full // _PAGE) * _PAGE)
        self._slot = self._check_planes()
        self.failures: Counter[str] = Counter()
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pdstor-lmcache")
        self._lock = threading.Lock()
        self._ready: dict[str, pdstor.Receipt] = {}
        self._put_tasks: set[str] = set()
        self._closed = False

    def __str__(self) -> str:
        return "PdstorBackend"

    def _check_planes(self) -> int:
        """Start-up: the control plane answers and the data plane takes the
        staging buffer, or an ERROR names the setting and this raises (LMCache
        then runs without the backend). Returns the namespace's slot size."""
        try:
            control = pdstor.Client(self._server, self._data_socket)
            control.healthz()
            slot = int(control.namespace()["slot_size"])
        except pdstor.Error as e:
            logger.error(
                "pdstor: no daemon answers on pdstor.server = %s (%s); LMCache will run WITHOUT the pdstor "
                "backend and store nothing there. Start `pdstor serve` or fix pdstor.server in extra_config.",
                self._server,
                e,
            )
            raise
        try:
            control.register(self._staging.buffer)
        except pdstor.Error as e:
            logger.error(
                "pdstor: the daemon at %s answers, but its data socket pdstor.data_socket = %s does not take a "
                "buffer (%s); LMCache will run WITHOUT the pdstor backend. Set pdstor.data_socket to the "
                "--data-socket of that `pdstor serve`.",
                self._server,
                self._data_socket,
                e,
            )
            raise
        return slot

    def stats(self) -> dict[str, int]:
        """What went wrong since start-up, counted: ``put_dropped`` (a put
        not stored, logged at WARNING), ``get_failed`` (a get that raised,
        logged at ERROR) and ``get_missed`` (a key evicted or released between
        its lookup and its get: a miss, logged at WARNING) and
        ``get_discarded`` (a key a non-blocking get restored after such a
        miss in its batch, which LMCache does not take)."""
        with self._lock:
            return {k: self.failures[k] for k in ("put_dropped", "get_failed", "get_missed", "get_discarded")}

    # --- per-thread connections -------------------------------------------------

    def _conn(self) -> Any:
        t = self._local
        if not hasattr(t, "client"):
            t.client = pdstor.Client(self._server, self._data_socket)
            t.writer = pdstor.Writer(t.client, self._writer_id)
            t.reader = pdstor.Reader(t.client, self._reader_id)
        return t

    def _chunks(self, offset: int, size: int) -> list[tuple[pdstor.Buffer, int, int]]:
        """The staging bytes of one object, one pdstor chunk per slot."""
        buf = self._staging.buffer
        return [(buf, offset + at, min(self._slot, size - at)) for at in range(0, size, self._slot)]

    # --- put ----------------------------------------------------------------------

    def exists_in_put_tasks(self, key) -> bool:
        with self._lock:
            return key.to_string() in self._put_tasks

    def batched_submit_put_task(
        self,
        keys: Sequence[Any],
        objs: List[Any],
        transfer_spec: Any = None,
        on_complete_callback: Optional[Callable[[Any], None]] = None,
    ) -> Optional[List[Future]]:
        del transfer_spec
        futures: list[Future] = []
        for key, obj in zip(keys, objs, strict=True):
            name = key.to_string()
            with self._lock:
                if self._closed or name in self._put_tasks or name in self._ready:
                    continue
                self._put_tasks.add(name)
            obj.ref_count_up()
            futures.append(self._pool.submit(self._put_one, key, name, obj, on_complete_callback))
        return futures or None

    def _put_one(self, key, name: str, obj, on_complete: Optional[Callable[[Any], None]]) -> None:
        offset = self._staging.acquire()
        try:
            size = obj.get_size()
            if obj.get_memory_format() != self._fmt:
                raise pdstor.UsageError(
                    f"put {name}: memory format {obj.get_memory_format().name}, this backend stores "
                    f"{self._fmt.name} (the layout a reader adopts)"
                )
            if size > self._staging.region_bytes:
                raise pdstor.UsageError(f"put {name}: {size} bytes is more than a full chunk ({self._staging.region_bytes})")
            try:
                self._staging.buffer.write(offset, obj.byte_array)
            finally:
                obj.ref_count_down()
            receipt = self._conn().writer.put(
                name,
                self._layout,
                self._chunks(offset, size),
                timeout_ms=self._admission_timeout_ms,
            )
            with self._lock:
                self._ready[name] = receipt
        except pdstor.DuplicateRequest:
            logger.debug("put %s: already published", name)
        except pdstor.Error as e:
            # LMCache's contract for puts: a put the backend cannot take is
            # dropped, and the key is simply not stored. Say so.
            with self._lock:
                self.failures["put_dropped"] += 1
            logger.warning("pdstor: put %s dropped, not stored: %s", name, e)
            raise
        finally:
            self._staging.release(offset)
            with self._lock:
                self._put_tasks.discard(name)
        if on_complete is not None:
            try:
                on_complete(key)
            except Exception as e:  # LMCache's own callbacks: logged, as its backends do
                logger.warning("on_complete_callback failed for %s: %s", name, e)

    # --- contains -----------------------------------------------------------------

    def _receipts(self, names: list[str], stop_at_miss: bool) -> list[Optional[pdstor.Receipt]]:
        """The READY receipt of each name: this process's own, else the daemon's."""
        with self._lock:
            known = [self._ready.get(n) for n in names]
        unknown = [n for n, r in zip(names, known) if r is None]
        if unknown:
            found = dict(zip(unknown, self._conn().client.lookup(unknown)))
            known = [r if r is not None else found[n] for n, r in zip(names, known)]
            with self._lock:
                for n, r in found.items():
                    if r is not None:
                        self._ready.setdefault(n, r)
        if stop_at_miss and None in known:
            known = known[: known.index(None)]
        return known

    def contains(self, key, pin: bool = False) -> bool:
        del pin
        return self._receipts([key.to_string()], False)[0] is not None

    def batched_contains(self, keys: List[Any], pin: bool = False) -> int:
        del pin
        return len(self._receipts([k.to_string() for k in keys], True))

    async def batched_async_contains(self, lookup_id: str, keys: List[Any], pin: bool = False) -> int:
        del lookup_id
        return await asyncio.to_thread(self.batched_contains, keys, pin)

    def pin(self, key) -> bool:
        return self.contains(key)

    def unpin(self, key) -> bool:
        return self.contains(key)

    # --- get ----------------------------------------------------------------------

    def _get_one(self, name: str, receipt: pdstor.Receipt):
        offset = self._staging.acquire()
        try:
            try:
                manifest = self._conn().reader.get(receipt, self._layout, self._staging.buffer, offset, self._lease_ms)
            except pdstor.UnknownPublication as e:
                # Released or evicted (`serve --evict-unread`) since it was
                # looked up: nothing was claimed, and it is a miss.
                with self._lock:
                    self.failures["get_missed"] += 1
                logger.warning("pdstor: get %s: gone since it was looked up (evicted or released): %s", name, e)
                return None
            size = sum(c["len"] for c in manifest["chunks"])
            tokens, rest = divmod(size, self._bytes_per_token)
            if rest or tokens == 0 or tokens > self._metadata.chunk_size:
                raise pdstor.LoadFailed(
                    f"get {name}: {size} stored bytes are not a whole number of tokens "
                    f"({self._bytes_per_token} bytes each, at most {self._metadata.chunk_size})"
                )
            obj = self.local_cpu_backend.allocate(self._metadata.get_shapes(tokens)[0], self._dtype, self._fmt)
            if obj is None:
                raise pdstor.LoadFailed(f"get {name}: LMCache's CPU allocator has no room for {size} bytes")
            try:
                self._staging.buffer.read_into(offset, obj.byte_array)
            except BaseException:
                obj.ref_count_down()
                raise
            return obj
        finally:
            self._staging.release(offset)
            with self._lock:
                self._ready.pop(name, None)

    def batched_get_blocking(self, keys: List[Any]) -> List[Optional[Any]]:
        names = [k.to_string() for k in keys]
        receipts = self._receipts(names, True)
        futures = [self._pool.submit(self._get_one, n, r) for n, r in zip(names, receipts)]
        objs, failure = [], None
        for f in futures:
            try:
                objs.append(f.result())
            except BaseException as e:  # every get completes before one raises
                failure = failure or e
                with self._lock:
                    self.failures["get_failed"] += 1
                logger.error("pdstor: get failed: %s", e)
        if failure is not None:
            for o in objs:
                if o is not None:
                    o.ref_count_down()
            raise failure
        return [*objs, *([None] * (len(keys) - len(objs)))]

    def get_blocking(self, key) -> Optional[Any]:
        return self.batched_get_blocking([key])[0]

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[Any], transfer_spec: Any = None) -> list[Any]:
        del lookup_id, transfer_spec
        got = await asyncio.to_thread(self.batched_get_blocking, keys)
        # LMCache takes the hits before the first miss. A key restored after a
        # miss (one evicted since its lookup) was consumed here: dropped, said.
        hits = next((i for i, o in enumerate(got) if o is None), len(got))
        for o in got[hits:]:
            if o is not None:
                o.ref_count_down()
                with self._lock:
                    self.failures["get_discarded"] += 1
                logger.warning("pdstor: a key restored after a miss in the same batch was discarded")
        return got[:hits]

    # --- remove, allocator, close -------------------------------------------------

    def remove(self, key, force: bool = True) -> bool:
        del force
        name = key.to_string()
        (receipt,) = self._receipts([name], False)
        if receipt is None:
            return False
        try:
            self._conn().client.release(receipt)
        except (pdstor.AlreadyClaimed, pdstor.UnknownPublication, pdstor.NotOwner):
            return False
        finally:
            with self._lock:
                self._ready.pop(name, None)
        return True

    def get_allocator_backend(self):
        return self.local_cpu_backend

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)
