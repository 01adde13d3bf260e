"""pdstor as an LMCache storage backend.

Load it the way LMCache loads any storage plugin, from its configuration::

    storage_plugins: ["pdstor"]
    extra_config:
      storage_plugin.pdstor.module_path: pdstor.lmcache
      storage_plugin.pdstor.class_name: PdstorBackend
      pdstor.server: unix:/run/pdstor/control.sock
      pdstor.data_socket: /run/pdstor/data.sock
      shm_name: lmcache-pdstor      # LMCache's own key: its CPU pool in /dev/shm

With ``shm_name`` LMCache allocates its CPU pool — where its memory objects
live — in a shared-memory file, and the plugin shares that file with the
daemon: the daemon moves each object's bytes straight between the device and
LMCache's memory, with no staging copy either way. Without it every put and
get is copied through a staging buffer (said once at start-up, at INFO). The
daemon maps the pool per connection and reads or writes it itself only
through the file (so LMCache shrinking it fails a transfer, never the
daemon); a pool over 1 GiB is registered in 1 GiB windows (io_uring
registers at most 1 GiB per table entry), and the daemon's
``--max-pinned-per-connection`` must be at least the pool's size.

How LMCache's operations map onto pdstor's protocol:

* **put** (``batched_submit_put_task``): each LMCache key — one chunk of
  ``chunk_size`` (256) tokens of every layer — becomes one publication whose
  request id is the key's string (``CacheEngineKey.to_string()``). Its bytes
  are read by the daemon in place in LMCache's shared pool (or copied into a
  staging buffer the daemon shares, without ``shm_name``), stored as one pdstor
  chunk per ``slot_size`` bytes (one, for a chunk that fits a slot), flushed and
  published: the key is stored only once it is READY, durable on the device.
  The READY receipt is kept, keyed by the LMCache key. A batch of keys goes
  in groups of up to ``pdstor.batch_keys``, each group in three round trips
  whatever its size (``Writer.put_many``: one prepare batch, one data-plane
  frame of stores, one publish batch and one commit), groups in parallel.
* **contains**: a key this process published, or whose READY receipt the
  daemon hands out by name (``lookup``: the decode process finds what the
  prefill process stored). A key already claimed by a reader is not contained.
* **get** (``batched_get_blocking`` / ``batched_get_non_blocking``): claim →
  adopt (the layout is checked; the manifest gives the size) → memory
  objects allocated from LMCache's CPU allocator (the group's objects of one
  size in one batched allocation where the pool has the room at once, else
  one by one) → load straight into them,
  each chunk's crc32c taken in place and checked against the manifest (or,
  without ``shm_name``, into the staging buffer and then copied on, each
  chunk checked in that copy: one pass over the bytes) → ack; a group of
  keys in three round trips (``Reader.get_many``: one batch of claims that
  adopt too, one frame of loads, one batch of acks). An object LMCache cannot allocate fails its key before
  anything is loaded: the publication stays RETAINED. pdstor is a *handoff*: a restored key is consumed (its
  slots free); LMCache keeps its own copy in ``LocalCPUBackend``. Strict: a
  load that fails or does not verify raises (``pdstor.LoadFailed``,
  ``pdstor.VerifyFailed``) through LMCache's ``get``/``batched_get`` — never a
  silent miss — and the publication stays RETAINED, its bytes kept. A
  claim fenced (a daemon restart, or its session closed by an operator)
  raises ``pdstor.Fenced``, and the plugin's next claims are made in a new
  reader session. The READY receipts of this process's puts are kept, the
  newest ``READY_KEPT`` (8,192); an older key is found again by name.
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
(default: ``lmcache-<worker id>``), ``pdstor.io_threads`` (groups of puts and
gets in parallel, default 8), ``pdstor.batch_keys`` (keys per group, default
128: a batch of up to that many keys takes a constant number of round trips;
a bigger one is split into groups that overlap), ``pdstor.staging_mib`` (the staging buffer the
daemon shares: enough for every thread's group within this many MiB, at least one chunk per thread;
default 256), ``pdstor.lease_ms`` (default 60000),
``pdstor.admission_timeout_ms`` (how long a put waits for free slots,
default 5000; a put that cannot be admitted is dropped and logged, as LMCache
drops puts a full backend refuses), ``pdstor.unread_release_s`` (a key no
reader claims this long after it is stored is released unread by the daemon —
a decode that never came, a prefill whose consumer crashed — as the vLLM
connector's are; default 480, vLLM's own bound on a prefill's blocks no
decode reads; 0 keeps every key until LMCache removes it or an operator
acts).

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
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

import pdstor
from pdstor._policy import unread_window_ms

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
# READY receipts a backend keeps at most (the newest): older ones the daemon
# hands out again by name.
READY_KEPT = 8192


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Staging:
    """One memfd the daemon shares, cut into regions of one full chunk each;
    a group of puts or gets holds one region per key while its bytes are in
    flight, taken all at once (so two groups never wait on each other)."""

    def __init__(self, regions: int, region_bytes: int):
        self.regions = regions
        self.region_bytes = region_bytes
        # A get's bytes only pass through: each chunk is checked as it is
        # copied on into LMCache's memory object (one pass, not two).
        self.buffer = pdstor.Buffer(regions * region_bytes, "pdstor-lmcache", staging=True)
        self._free = list(range(regions))
        self._changed = threading.Condition()

    def acquire(self, n: int) -> list[int]:
        """The offsets of `n` regions (at most all of them), once free."""
        with self._changed:
            self._changed.wait_for(lambda: len(self._free) >= n)
            taken, self._free = self._free[:n], self._free[n:]
        return [i * self.region_bytes for i in taken]

    def release(self, offsets: list[int]) -> None:
        with self._changed:
            self._free.extend(o // self.region_bytes for o in offsets)
            self._changed.notify_all()


class _SharedPool:
    """LMCache's CPU pool when it lives in shared memory (``shm_name`` in
    ``extra_config``): the daemon maps that file once per connection and
    moves each memory object's bytes straight to and from the device — no
    staging copy."""

    def __init__(self, path: str, base: int, size: int):
        self.buffer = pdstor.Buffer.shared_file(path, size)
        self.base = base
        self.size = size

    @staticmethod
    def of(local_cpu_backend) -> _SharedPool | None:
        allocator = getattr(local_cpu_backend, "memory_allocator", None)
        name = getattr(allocator, "shm_name", None)
        pool = getattr(allocator, "buffer", None)
        if not name or not isinstance(pool, torch.Tensor) or pool.numel() == 0:
            return None
        path = f"/dev/shm/{name.lstrip('/')}"
        try:
            return _SharedPool(path, pool.data_ptr(), pool.numel() * pool.element_size())
        except (OSError, ValueError) as e:
            logger.warning("pdstor: LMCache's pool %s cannot be shared with the daemon (%s): staging instead", path, e)
            return None

    def offset_of(self, obj) -> int | None:
        """Where `obj`'s bytes start in the pool, or None if they are not in it."""
        # `data_ptr`, not `obj.tensor`: the tensor property builds a fresh
        # view of the object each time (a third of a get's Python time).
        at = obj.data_ptr - self.base
        return at if 0 <= at and at + obj.get_physical_size() <= self.size else None


def _groups(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class PdstorBackend(StoragePluginInterface):
    """LMCache storage plugin: puts publish through ``pdstor serve``, gets
    claim, load, verify and acknowledge. See the module's documentation."""

    def __init__(
        self,
        config=None,
        metadata=None,
        local_cpu_backend=None,
        loop: asyncio.AbstractEventLoop | None = None,
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
        self._unread_release_ms = unread_window_ms("pdstor.unread_release_s", extra.get("pdstor.unread_release_s", 480))
        threads = int(extra.get("pdstor.io_threads", 8))
        if threads < 1:
            raise ValueError(f"pdstor.io_threads must be at least 1, not {threads}")
        batch_keys = int(extra.get("pdstor.batch_keys", 128))
        if batch_keys < 1:
            raise ValueError(f"pdstor.batch_keys must be at least 1, not {batch_keys}")
        staging_mib = int(extra.get("pdstor.staging_mib", 256))

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

        region = -(-full // _PAGE) * _PAGE
        self._pool = _SharedPool.of(local_cpu_backend)
        if self._pool is not None:
            # The daemon moves bytes straight to and from LMCache's memory
            # objects; staging only for an object outside the pool (rare).
            staging_mib = min(staging_mib, max(1, (threads * region) >> 20))
        # Enough staging for every thread to move a group at once, within
        # pdstor.staging_mib (at least one region per thread).
        regions = max(threads, min(threads * batch_keys, (staging_mib << 20) // region))
        self._group = batch_keys if self._pool is not None else max(1, min(batch_keys, regions // threads))
        self._staging = _Staging(regions, region)
        self._slot = self._check_planes()
        if self._pool is None:
            logger.info(
                "pdstor: LMCache's CPU pool is not shared memory, so every put and get is copied through a "
                "staging buffer; set extra_config shm_name (e.g. lmcache-pdstor) to let the daemon move bytes "
                "straight to and from LMCache's memory objects"
            )
        self.failures: Counter[str] = Counter()
        self._local = threading.local()
        self._threads = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pdstor-lmcache")
        self._lock = threading.Lock()
        # READY receipts by key, newest last: a cache of what the daemon
        # hands out by name (`lookup`), bounded: a prefill's keys are consumed
        # by another process, and a map of every key ever put only grew.
        self._ready: OrderedDict[str, pdstor.Receipt] = OrderedDict()
        self._put_tasks: set[str] = set()
        # Reader sessions begun: each thread's reader is of the newest.
        self._sessions = 0
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
            if self._pool is not None:
                control.register(self._pool.buffer)
        except pdstor.Error as e:
            logger.error(
                "pdstor: the daemon at %s answers, but its data socket pdstor.data_socket = %s does not take a "
                "buffer (%s); LMCache will run WITHOUT the pdstor backend. Set pdstor.data_socket to the "
                "--data-socket of that `pdstor serve` (and, for LMCache's shared pool, give that daemon a "
                "--max-pinned-per-connection of at least max_local_cpu_size).",
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
        if getattr(t, "sessions", None) != self._sessions:
            # A reader session of its own per thread, a new one after a claim
            # was fenced: the operator who reclaims a fenced claim closes its
            # session, and every later claim made in it would be fenced too.
            t.reader = pdstor.Reader(t.client, self._reader_id)
            t.sessions = self._sessions
        return t

    def _chunks(self, buffer: pdstor.Buffer, offset: int, size: int) -> list[tuple[pdstor.Buffer, int, int]]:
        """One object's bytes at `offset` of `buffer`, one pdstor chunk per slot."""
        return [(buffer, offset + at, min(self._slot, size - at)) for at in range(0, size, self._slot)]

    # --- put ----------------------------------------------------------------------

    def exists_in_put_tasks(self, key) -> bool:
        with self._lock:
            return key.to_string() in self._put_tasks

    def batched_submit_put_task(
        self,
        keys: Sequence[Any],
        objs: list[Any],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[Any], None] | None = None,
    ) -> list[Future] | None:
        del transfer_spec
        accepted: list[tuple[Any, str, Any]] = []
        for key, obj in zip(keys, objs, strict=True):
            name = key.to_string()
            with self._lock:
                if self._closed or name in self._put_tasks or name in self._ready:
                    continue
                self._put_tasks.add(name)
            obj.ref_count_up()
            accepted.append((key, name, obj))
        futures = [
            self._threads.submit(self._put_group, group, on_complete_callback)
            for group in _groups(accepted, self._group)
        ]
        return futures or None

    def _dropped(self, name: str, why: Exception) -> None:
        # LMCache's contract for puts: a put the backend cannot take is
        # dropped, and the key is simply not stored. Say so.
        with self._lock:
            self.failures["put_dropped"] += 1
        logger.warning("pdstor: put %s dropped, not stored: %s", name, why)

    def _put_group(self, group: list[tuple[Any, str, Any]], on_complete: Callable[[Any], None] | None) -> None:
        """A group of puts in three round trips (``Writer.put_many``): the
        daemon reads each object in place in LMCache's shared pool, or from
        a staging copy of it."""
        pool = self._pool
        places = [pool.offset_of(obj) if pool is not None else None for _, _, obj in group]
        # Every staging region the group needs, taken at once (at most all).
        offsets = self._staging.acquire(min(self._staging.regions, sum(at is None for at in places)))
        free = iter(offsets)
        in_place: list[Any] = []  # objects the daemon reads in place: held until stored
        stored: list[Any] = []
        try:
            items, sent = [], []
            for (key, name, obj), at in zip(group, places):
                try:
                    size = obj.get_size()
                    if obj.get_memory_format() != self._fmt:
                        raise pdstor.UsageError(
                            f"put {name}: memory format {obj.get_memory_format().name}, this backend stores "
                            f"{self._fmt.name} (the layout a reader adopts)"
                        )
                    if size > self._staging.region_bytes:
                        raise pdstor.UsageError(
                            f"put {name}: {size} bytes is more than a full chunk ({self._staging.region_bytes})"
                        )
                    if pool is not None and at is not None:
                        items.append((name, self._chunks(pool.buffer, at, size)))
                        in_place.append(obj)
                        obj = None
                    else:
                        offset = next(free, None)
                        if offset is None:
                            raise pdstor.UsageError(f"put {name}: every staging region is taken (pdstor.staging_mib)")
                        self._staging.buffer.write(offset, obj.byte_array)
                        items.append((name, self._chunks(self._staging.buffer, offset, size)))
                    sent.append(key)
                except pdstor.Error as e:
                    self._dropped(name, e)
                finally:
                    if obj is not None:
                        obj.ref_count_down()
            try:
                answers = self._conn().writer.put_many(
                    items,
                    self._layout,
                    timeout_ms=self._admission_timeout_ms,
                    unread_release_ms=self._unread_release_ms,
                )
            except pdstor.Error as e:
                answers = [e] * len(items)
            for key, (name, _), answer in zip(sent, items, answers):
                if isinstance(answer, pdstor.Receipt):
                    with self._lock:
                        self._remember(name, answer)
                    stored.append(key)
                elif isinstance(answer, pdstor.DuplicateRequest):
                    logger.debug("put %s: already published", name)
                else:
                    self._dropped(name, answer)
        finally:
            for obj in in_place:
                obj.ref_count_down()
            self._staging.release(offsets)
            with self._lock:
                for _, name, _ in group:
                    self._put_tasks.discard(name)
        if on_complete is not None:
            for key in stored:
                try:
                    on_complete(key)
                except Exception as e:  # LMCache's own callbacks: logged, as its backends do
                    logger.warning("on_complete_callback failed for %s: %s", key.to_string(), e)

    # --- contains -----------------------------------------------------------------

    def _receipts(self, names: list[str], stop_at_miss: bool) -> list[pdstor.Receipt | None]:
        """The READY receipt of each name: this process's own, else the daemon's."""
        with self._lock:
            known = [self._ready.get(n) for n in names]
        unknown = [n for n, r in zip(names, known) if r is None]
        if unknown:
            found = dict(zip(unknown, self._conn().client.lookup(unknown)))
            known = [r if r is not None else found[n] for n, r in zip(names, known)]
            with self._lock:
                for n, r in found.items():
                    if r is not None and n not in self._ready:
                        self._remember(n, r)
        if stop_at_miss and None in known:
            known = known[: known.index(None)]
        return known

    def _remember(self, name: str, receipt: pdstor.Receipt) -> None:
        """Keeps `name`'s READY receipt, forgetting the oldest past
        READY_KEPT (with the lock held)."""
        self._ready[name] = receipt
        self._ready.move_to_end(name)
        while len(self._ready) > READY_KEPT:
            self._ready.popitem(last=False)

    def contains(self, key, pin: bool = False) -> bool:
        del pin
        return self._receipts([key.to_string()], False)[0] is not None

    def batched_contains(self, keys: list[Any], pin: bool = False) -> int:
        del pin
        return len(self._receipts([k.to_string() for k in keys], True))

    async def batched_async_contains(self, lookup_id: str, keys: list[Any], pin: bool = False) -> int:
        del lookup_id
        return await asyncio.to_thread(self.batched_contains, keys, pin)

    def pin(self, key) -> bool:
        return self.contains(key)

    def unpin(self, key) -> bool:
        return self.contains(key)

    # --- get ----------------------------------------------------------------------

    def _tokens(self, name: str, manifest: dict) -> int:
        """How many tokens a publication's bytes hold (it must hold whole ones)."""
        size = sum(c["len"] for c in manifest["chunks"])
        tokens, rest = divmod(size, self._bytes_per_token)
        if rest or tokens == 0 or tokens > self._metadata.chunk_size:
            raise pdstor.LoadFailed(
                f"get {name}: {size} stored bytes are not a whole number of tokens "
                f"({self._bytes_per_token} bytes each, at most {self._metadata.chunk_size})"
            )
        return tokens

    def _allocate(self, name: str, manifest: dict):
        """A memory object of LMCache's CPU allocator for a publication's bytes."""
        tokens = self._tokens(name, manifest)
        obj = self.local_cpu_backend.allocate(self._metadata.get_shapes(tokens)[0], self._dtype, self._fmt)
        if obj is None:
            raise pdstor.LoadFailed(f"get {name}: LMCache's CPU allocator has no room for {tokens} tokens")
        return obj

    def _missed(self, name: str, why: Exception) -> None:
        # Released or evicted (`serve --evict-unread`) since it was looked
        # up: nothing was claimed, and it is a miss.
        with self._lock:
            self.failures["get_missed"] += 1
        logger.warning("pdstor: get %s: gone since it was looked up (evicted or released): %s", name, why)

    def _get_group(self, group: list[tuple[str, pdstor.Receipt]]) -> list[Any]:
        """A group of gets in three round trips (``Reader.get_many``) and, in
        place, one batched allocation per object size: per key
        its memory object, None for a miss, or the exception it failed with."""
        try:
            pool = self._pool
            return self._get_in_place(pool, group) if pool is not None else self._get_staged(group)
        finally:
            with self._lock:
                for name, _ in group:
                    self._ready.pop(name, None)

    def _get_in_place(self, pool: _SharedPool, group: list[tuple[str, pdstor.Receipt]]) -> list[Any]:
        """Each publication loaded straight into a memory object allocated
        in LMCache's shared pool once its adopted manifest gives its size:
        the objects of one size allocated in one batch."""
        names = {receipt.publication: name for name, receipt in group}
        objs: dict[int, Any] = {}

        def place_many(manifests: list[dict | None]) -> list[Any]:
            places: list[Any] = [None] * len(manifests)
            by_tokens: dict[int, list[tuple[int, dict]]] = {}
            for i, m in enumerate(manifests):
                if m is None:
                    continue
                try:
                    by_tokens.setdefault(self._tokens(names[m["publication"]], m), []).append((i, m))
                except pdstor.LoadFailed as e:
                    places[i] = e
            for tokens, items in by_tokens.items():
                shape = self._metadata.get_shapes(tokens)[0]
                # All at once only where the pool has the room now (no
                # eviction, no wait: a contiguous run may never come free);
                # else one by one, as LMCache's own retrieves allocate.
                batch = self.local_cpu_backend.batched_allocate(
                    shape, self._dtype, len(items), self._fmt, eviction=False, busy_loop=False
                )
                if batch is None:
                    batch = []
                    for _, m in items:
                        obj = self.local_cpu_backend.allocate(shape, self._dtype, self._fmt)
                        if obj is not None:  # held at once: given back however this call ends
                            objs[m["publication"]] = obj
                        batch.append(obj)
                else:
                    for (_, m), obj in zip(items, batch):
                        objs[m["publication"]] = obj
                for (i, m), obj in zip(items, batch):
                    name = names[m["publication"]]
                    if obj is None:
                        places[i] = pdstor.LoadFailed(f"get {name}: LMCache's CPU allocator has no room for it")
                        continue
                    at = pool.offset_of(obj)
                    places[i] = (
                        (pool.buffer, at)
                        if at is not None
                        else pdstor.LoadFailed(f"get {name}: LMCache allocated outside its shared pool")
                    )
            return places

        try:
            answers = self._conn().reader.get_many(
                [r for _, r in group], self._layout, self._lease_ms, place_many=place_many
            )
        except pdstor.Error as e:
            answers = [e] * len(group)
        except BaseException:
            for obj in objs.values():
                obj.ref_count_down()
            raise
        return self._answered(group, answers, objs)

    def _get_staged(self, group: list[tuple[str, pdstor.Receipt]]) -> list[Any]:
        """Each publication loaded into a staging region, then copied on into
        a memory object of LMCache's allocator — every chunk checked against
        its manifest in that copy, before the ack."""
        names = {receipt.publication: name for name, receipt in group}
        objs: dict[int, Any] = {}

        def into(manifest: dict) -> Any:
            publication = manifest["publication"]
            obj = self._allocate(names[publication], manifest)
            objs[publication] = obj
            return obj.byte_array

        offsets = self._staging.acquire(len(group))
        try:
            items = [(receipt, self._staging.buffer, offset) for (_, receipt), offset in zip(group, offsets)]
            try:
                answers = self._conn().reader.get_many(items, self._layout, self._lease_ms, into=into)
            except pdstor.Error as e:
                answers = [e] * len(group)
            except BaseException:
                for obj in objs.values():
                    obj.ref_count_down()
                raise
        finally:
            self._staging.release(offsets)
        return self._answered(group, answers, objs)

    def _answered(self, group: list[tuple[str, pdstor.Receipt]], answers: list, objs: dict[int, Any]) -> list[Any]:
        """Per key its memory object, None for a miss, or the exception it
        failed with; every object allocated for a key that failed given back."""
        out: list[Any] = []
        for (name, receipt), answer in zip(group, answers):
            obj = objs.pop(receipt.publication, None)
            if isinstance(answer, BaseException):
                if obj is not None:
                    obj.ref_count_down()
                if isinstance(answer, pdstor.UnknownPublication):
                    self._missed(name, answer)
                    answer = None
            else:
                answer = obj
            out.append(answer)
        for obj in objs.values():
            obj.ref_count_down()
        return out

    def batched_get_blocking(self, keys: list[Any]) -> list[Any | None]:
        names = [k.to_string() for k in keys]
        receipts = self._receipts(names, True)
        futures = [self._threads.submit(self._get_group, g) for g in _groups(list(zip(names, receipts)), self._group)]
        objs, failure = [], None
        for f in futures:
            try:
                got = f.result()
            except BaseException as e:  # the group as a whole
                got = [e]
            for o in got:
                if isinstance(o, pdstor.Fenced):
                    with self._lock:
                        self._sessions += 1
                if isinstance(o, BaseException):
                    failure = failure or o
                    with self._lock:
                        self.failures["get_failed"] += 1
                    logger.error("pdstor: get failed: %s", o)
                else:
                    objs.append(o)
        if failure is not None:
            for o in objs:
                if o is not None:
                    o.ref_count_down()
            raise failure
        return [*objs, *([None] * (len(keys) - len(objs)))]

    def get_blocking(self, key) -> Any | None:
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
        self._threads.shutdown(wait=True)


# The L2 adapter for LMCache's multiprocess server, under this module's name too.
from .lmcache_l2 import L2Adapter  # noqa: E402,F401
