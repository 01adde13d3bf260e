"""pdstor as an L2 adapter of LMCache's multiprocess server.

Load it with LMCache's ``plugin`` adapter type::

    python -m lmcache.v1.multiprocess.server --l1-size-gb 8 --eviction-policy LRU \\
        --l2-adapter '{"type": "plugin", "module_path": "pdstor.lmcache_l2",
                       "class_name": "L2Adapter",
                       "adapter_params": {"server": "unix:/run/pdstor/control.sock",
                                          "data_socket": "/run/pdstor/data.sock"}}'

(``pdstor.lmcache.L2Adapter`` names the same class.) How LMCache's L2
operations map onto pdstor:

* **store** (``submit_store_task``): each object becomes one *cache
  publication* named by its key (``object_key_to_string``), its bytes copied
  into a staging buffer the daemon shares (LMCache's L1 is anonymous memory
  the daemon cannot map) and stored one pdstor chunk per ``slot_size``
  bytes; a group of objects is one prepare batch, one data-plane frame and
  one publish batch (one commit) — stored only once READY, durable on the
  device. A key already stored counts as stored.
* **lookup and lock** (``submit_lookup_and_lock_task``): a *read* of each
  key's publication by its name, held — one ``read`` batch, the daemon
  finding each READY as ``lookup`` would in the same step: while the read is
  held no release or eviction takes the publication, whichever process asks.
* **load** (``submit_load_task``): each held read loaded into a staging
  buffer and copied on into LMCache's memory object, every chunk checked
  against its crc32c in that copy, then the read ended with its restore
  digest (one data-plane frame and one ``read/end`` batch). A key not locked
  first is looked up and read on the spot. A chunk that does not verify
  fails its key (bit 0), never a silent miss, and the publication stays.
* **unlock** (``submit_unlock``): a read still held (locked, never loaded) is
  given up (``read/end`` with a reason).
* **delete**: an exact release of the publication; one being read by another
  process is kept (logged) and LMCache may evict it again later.
* **list_l2_keys**: the daemon's READY cache publications whose names are
  LMCache keys, in name order, one page at a time.

Cache publications are read by many: two decode hosts' servers sharing a
prefix both load it, and neither consumes it.

``adapter_params``: ``server`` and ``data_socket`` (the daemon's control
and data sockets), ``reader_id`` / ``writer_id`` (default
``lmcache-l2-<pid>``), ``staging_mib`` (each of the store and load staging
buffers, default 256), ``admission_timeout_ms`` (how long a store waits for
free slots, default 5000), ``max_capacity_bytes`` (what LMCache's global
eviction measures usage against; default the daemon's capacity),
``unread_release_s`` (a key no one reads for this long is released by the
daemon; default 0: none — LMCache's own eviction governs its L2, and a
restarted server finds its keys again through ``list_l2_keys``; set it where
servers come and go for good, so that their keys do not outlive them).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import KeyEntry, KeyListPage
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.storage_backend.raw_block.key_codec import decode_object_key, object_key_to_string

import pdstor
from pdstor._policy import unread_window_ms

logger = logging.getLogger(__name__)

_PAGE = 4096
_LAYOUT = pdstor.layout(
    model_id="lmcache-l2",
    dtype="bytes",
    layers=1,
    kv_heads=1,
    head_dim=1,
    chunk_tokens=1,
    kv_format="lmcache/l2-object",
)


def _round_up(n: int) -> int:
    return -(-n // _PAGE) * _PAGE


class _SharedL1:
    """LMCache's L1 when it lives in a shared-memory file (the server's
    ``--no-l1-use-lazy --shm-name X``), found by where ``l1_memory_desc.ptr``
    is mapped: the daemon then moves each object's bytes straight between
    the device and L1, with no staging copy either way (it reaches the file
    through its own mapping; this process checksums what it stores, and each
    chunk loaded into it is checked here against the stored crc32c)."""

    def __init__(self, path: str, base: int, first: int, size: int):
        self.path = path
        self.buffer = pdstor.Buffer.shared_file(path, size)
        self.base = base  # where the file's byte 0 would be mapped
        self.first = first  # the file's first byte this mapping shows
        self.size = size

    @staticmethod
    def of(desc: Any) -> _SharedL1 | None:
        ptr = getattr(desc, "ptr", None)
        if not ptr:
            return None
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if not lo <= ptr < hi:
                    continue
                path = fields[5].strip() if len(fields) == 6 else ""
                if not path.startswith("/dev/shm/") or fields[1][3:4] != "s":
                    return None  # not a shared mapping of a shared-memory file
                try:
                    # What the daemon can reach: the file's bytes this mapping shows.
                    first = int(fields[2], 16)
                    base = lo - first
                    return _SharedL1(path, base, first, min(os.stat(path).st_size, hi - base))
                except (OSError, ValueError, pdstor.Error) as e:
                    logger.warning(
                        "pdstor L2 adapter: L1 in %s cannot be shared with the daemon (%s): staging", path, e
                    )
                    return None
        return None

    def offset_of(self, obj: Any) -> int | None:
        """Where `obj`'s bytes start in the file, or None if not in it."""
        at = obj.data_ptr - self.base
        return at if self.first <= at and at + len(obj.byte_array) <= self.size else None


class L2Adapter(L2AdapterInterface):
    """LMCache L2 adapter over ``pdstor serve``. See the module's documentation."""

    def __init__(self, config: Any = None, l1_memory_desc: Any = None) -> None:
        params = dict(config or {})
        self._server = str(params.get("server", "unix:/run/pdstor/control.sock"))
        self._data_socket = str(params.get("data_socket", "/run/pdstor/data.sock"))
        who = f"lmcache-l2-{os.getpid()}"
        staging = int(params.get("staging_mib", 256)) << 20
        self._timeout_ms = int(params.get("admission_timeout_ms", 5_000))
        self._unread_release_ms = unread_window_ms("unread_release_s", params.get("unread_release_s", 0))
        try:
            control = pdstor.Client(self._server, self._data_socket)
            control.healthz()
            ns = control.namespace()
        except pdstor.Error as e:
            logger.error(
                "pdstor L2 adapter: no daemon answers on server = %s (%s): start `pdstor serve`", self._server, e
            )
            raise
        self._slot = int(ns["slot_size"])
        capacity = int(params.get("max_capacity_bytes", int(ns["slot_size"]) * int(ns["slot_count"])))
        super().__init__(max_capacity_bytes=capacity)
        if staging < self._slot:
            raise ValueError(f"staging_mib: {staging >> 20} MiB is less than one {self._slot}-byte slot")
        # One connection per direction: the store pool's and the lookup and
        # load pools' (they share one reader, whose held reads they hand on).
        self._wclient = pdstor.Client(self._server, self._data_socket)
        self._rclient = pdstor.Client(self._server, self._data_socket)
        self._writer = pdstor.Writer(self._wclient, str(params.get("writer_id", who)))
        self._reader = pdstor.Reader(self._rclient, str(params.get("reader_id", who)))
        self._store_buf = pdstor.Buffer(staging, "pdstor-l2-store")
        self._load_buf = pdstor.Buffer(staging, "pdstor-l2-load", staging=True)
        self._wclient.register(self._store_buf)
        self._rclient.register(self._load_buf)
        self.shared = _SharedL1.of(l1_memory_desc)
        if self.shared is not None:
            self._wclient.register(self.shared.buffer)
            self._rclient.register(self.shared.buffer)
            logger.info("pdstor L2 adapter: L1 is %s: no staging copy", self.shared.path)
        else:
            logger.info("pdstor L2 adapter: L1 is not a shared-memory file: every object is copied through staging")
        self._fds = {op: os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for op in ("store", "lookup", "load")}
        self._pools = {op: ThreadPoolExecutor(1, thread_name_prefix=f"pdstor-l2-{op}") for op in self._fds}
        self._lock = threading.Lock()
        self._reader_lock = threading.Lock()
        self._next_id = 0
        self._stored: dict[int, L2StoreResult] = {}
        self._looked_up: dict[int, Bitmap] = {}
        self._loaded: dict[int, Bitmap] = {}
        # Reads held by lookup_and_lock, per key name, until a load or an unlock.
        self._held: dict[str, list[pdstor.Receipt]] = {}
        # Per key, the locks a load already ended (LMCache unlocks every key
        # it planned, loaded or not): the next unlocks of it end nothing,
        # rather than another request's read.
        self._ended_by_load: dict[str, int] = {}
        # Bytes of each key this adapter stored (LMCache's byte accounting).
        self._sizes: dict[str, int] = {}
        self._closed = False
        self.failures = {"store": 0, "load": 0, "unlock": 0, "delete_kept": 0}
        # Objects moved straight between the device and L1, and through staging.
        self.moved = {"in_place": 0, "staged": 0}

    # --- event fds and task plumbing ------------------------------------------

    def __str__(self) -> str:
        return f"pdstor L2 adapter ({self._server})"

    def get_store_event_fd(self) -> int:
        return self._fds["store"]

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._fds["lookup"]

    def get_load_event_fd(self) -> int:
        return self._fds["load"]

    def _submit(self, op: str, results: dict, work: Callable[[], Any], failed: Callable[[], Any]) -> int:
        """Runs `work` on `op`'s thread; its answer (or `failed()`'s, if it
        raised) is recorded, then `op`'s event fd is written."""
        with self._lock:
            if self._closed:
                raise RuntimeError("pdstor L2 adapter: submitted after close()")
            task = self._next_id
            self._next_id += 1

        def run() -> None:
            try:
                answer = work()
            except Exception:
                logger.exception("pdstor L2 adapter: a %s task failed", op)
                answer = failed()
            with self._lock:
                results[task] = answer
            os.eventfd_write(self._fds[op], 1)

        self._pools[op].submit(run)
        return task

    # --- store ----------------------------------------------------------------

    def submit_store_task(self, keys: list, objects: list) -> int:
        return self._submit("store", self._stored, lambda: self._store(keys, objects), lambda: L2StoreResult(False, 0))

    def pop_completed_store_tasks(self) -> dict:
        with self._lock:
            done, self._stored = self._stored, {}
        return done

    def _store(self, keys: list, objects: list) -> L2StoreResult:
        total, ok = 0, True
        for group in self._groups(objects):
            stored_keys, sizes = [], []
            items, names = [], []
            at = 0
            shared = self.shared
            for i in group:
                n = len(objects[i].byte_array)
                place = shared.offset_of(objects[i]) if shared is not None else None
                if shared is not None and place is not None:
                    buf = shared.buffer
                    self.moved["in_place"] += 1
                else:
                    buf, place = self._store_buf, at
                    self._store_buf.write(at, memoryview(objects[i].byte_array).cast("B"))
                    at += _round_up(n)
                    self.moved["staged"] += 1
                chunks = [(buf, place + o, min(self._slot, n - o)) for o in range(0, n, self._slot)]
                items.append((object_key_to_string(keys[i]), chunks))
                names.append(i)
            answers = self._writer.put_many(
                items, _LAYOUT, timeout_ms=self._timeout_ms, cache=True, unread_release_ms=self._unread_release_ms
            )
            for i, answer in zip(names, answers):
                if isinstance(answer, pdstor.DuplicateRequest):
                    continue  # already stored under this key: the same bytes
                if isinstance(answer, BaseException):
                    ok = False
                    with self._lock:
                        self.failures["store"] += 1
                    logger.warning("pdstor L2 adapter: %s not stored: %s", object_key_to_string(keys[i]), answer)
                    continue
                stored_keys.append(keys[i])
                sizes.append(len(objects[i].byte_array))
                with self._lock:
                    self._sizes[object_key_to_string(keys[i])] = sizes[-1]
            if stored_keys:  # each group counted as it lands
                self._notify_keys_stored(stored_keys, sizes)
                total += sum(sizes)
        return L2StoreResult(ok, total)

    def _groups(self, objects: list) -> list[list[int]]:
        """Indexes of `objects` in groups whose staged bytes fit a staging
        buffer (an object in shared L1 takes none)."""
        groups: list[list[int]] = []
        room = 0
        for i, obj in enumerate(objects):
            shared = self.shared is not None and self.shared.offset_of(obj) is not None
            need = 0 if shared else _round_up(len(obj.byte_array))
            if need > len(self._store_buf):
                raise ValueError(f"an object of {need} bytes is larger than the staging buffer (staging_mib)")
            if not groups or need > room:
                groups.append([])
                room = len(self._store_buf)
            groups[-1].append(i)
            room -= need
        return groups

    # --- lookup and lock, unlock ----------------------------------------------

    def submit_lookup_and_lock_task(self, keys: list, group_layout_descs: Any = None) -> int:
        del group_layout_descs
        return self._submit("lookup", self._looked_up, lambda: self._lock_keys(keys), lambda: Bitmap(len(keys)))

    def query_lookup_and_lock_result(self, task_id: int) -> Bitmap | None:
        with self._lock:
            return self._looked_up.pop(task_id, None)

    def _read(self, names: list[str]) -> list[pdstor.Receipt | None]:
        """A held read of each name's cache publication, or None: one
        ``read`` batch by name (the daemon finds each READY as ``lookup``
        would, in the same step)."""
        out: list[pdstor.Receipt | None] = [None] * len(names)
        if not names:
            return out
        with self._reader_lock:
            reads = self._reader.read_many(names)
        for i, read in enumerate(reads):
            if isinstance(read, pdstor.Receipt):
                out[i] = read
            elif not isinstance(read, (pdstor.UnknownPublication, pdstor.WrongState)):
                logger.warning("pdstor L2 adapter: %s not read: %s", names[i], read)
        return out

    def _lock_keys(self, keys: list) -> Bitmap:
        names = [object_key_to_string(k) for k in keys]
        bits = Bitmap(len(keys))
        reads = self._read(names)
        with self._lock:
            for i, (name, read) in enumerate(zip(names, reads)):
                if read is not None:
                    self._held.setdefault(name, []).append(read)
                    bits.set(i)
        if any(r is not None for r in reads):
            self._notify_keys_accessed([k for k, r in zip(keys, reads) if r is not None])
        return bits

    def _take_held(self, names: list[str]) -> list[pdstor.Receipt | None]:
        """One held read of each name (the oldest), or None; a load takes
        them, and what it takes the key's next unlock does not end again."""
        with self._lock:
            out = []
            for name in names:
                held = self._held.get(name)
                out.append(held.pop(0) if held else None)
                if held is not None and not held:
                    del self._held[name]
                self._ended_by_load[name] = self._ended_by_load.get(name, 0) + 1
            return out

    def submit_unlock(self, keys: list) -> None:
        reads = []
        with self._lock:
            for name in (object_key_to_string(k) for k in keys):
                if self._ended_by_load.get(name, 0) > 0:
                    self._ended_by_load[name] -= 1  # its load ended this lock's read
                    if not self._ended_by_load[name]:
                        del self._ended_by_load[name]
                    continue
                held = self._held.get(name)
                if held:
                    reads.append(held.pop(0))
                    if not held:
                        del self._held[name]
        self._abandon(reads, "unlocked by LMCache before a load")

    def _abandon(self, reads: list, why: str) -> None:
        """Gives up `reads`; one that cannot be (the daemon unreachable)
        stays held in the daemon until it restarts, and is counted."""
        if not reads:
            return
        answers: list[BaseException | None]
        try:
            with self._reader_lock:
                answers = list(self._reader.abandon_reads(reads, why))
        except Exception as e:  # never raise into LMCache's unlock
            answers = [e] * len(reads)
        for a in answers:
            if isinstance(a, BaseException) and not isinstance(a, (pdstor.ReadEnded, pdstor.UnknownPublication)):
                with self._lock:
                    self.failures["unlock"] += 1
                logger.warning("pdstor L2 adapter: a read not given up: %s", a)

    # --- load -----------------------------------------------------------------

    def submit_load_task(self, keys: list, objects: list) -> int:
        return self._submit("load", self._loaded, lambda: self._load(keys, objects), lambda: Bitmap(len(keys)))

    def query_load_result(self, task_id: int) -> Bitmap | None:
        with self._lock:
            return self._loaded.pop(task_id, None)

    def _load(self, keys: list, objects: list) -> Bitmap:
        names = [object_key_to_string(k) for k in keys]
        bits = Bitmap(len(keys))
        reads = self._take_held(names)
        try:
            missing = [i for i, r in enumerate(reads) if r is None]
            if missing:  # not locked first: read now
                for i, read in zip(missing, self._read([names[i] for i in missing])):
                    reads[i] = read
            return self._load_reads(names, reads, objects, bits)
        except BaseException:
            # Whatever a failed call left held is given up (a read already
            # ended answers read_ended, harmlessly).
            self._abandon([r for r in reads if r is not None], "the load task failed")
            raise

    def _load_reads(self, names: list[str], reads: list, objects: list, bits: Bitmap) -> Bitmap:
        todo = [i for i, r in enumerate(reads) if r is not None]
        by_publication = {reads[i].publication: i for i in todo}

        def into(manifest: dict) -> Any:
            i = by_publication[manifest["publication"]]
            size = sum(c["len"] for c in manifest["chunks"])
            dest = memoryview(objects[i].byte_array).cast("B")
            if len(dest) != size:
                raise ValueError(f"{names[i]}: LMCache's object holds {len(dest)} bytes, the publication {size}")
            return dest

        # Straight into L1 where it is shared and the sizes agree; the rest
        # through staging, each item copied on (and checked) by `into`.
        in_place: list[tuple[pdstor.Receipt, pdstor.Buffer, int]] = []
        in_place_of: list[int] = []
        staged: list[int] = []
        shared = self.shared
        for i in todo:
            at = shared.offset_of(objects[i]) if shared is not None else None
            if shared is not None and at is not None:
                with self._reader_lock:
                    manifest = self._reader.manifest(reads[i])
                if sum(c["len"] for c in manifest["chunks"]) == len(objects[i].byte_array):
                    in_place.append((reads[i], shared.buffer, at))
                    in_place_of.append(i)
                    continue
            staged.append(i)
        if in_place:
            self._finish(in_place, in_place_of, None, names, bits)
            self.moved["in_place"] += len(in_place)
        at = 0
        batch: list[tuple[pdstor.Receipt, pdstor.Buffer, int]] = []
        order: list[int] = []
        for i in staged:
            need = _round_up(len(objects[i].byte_array))
            if at + need > len(self._load_buf):
                self._finish(batch, order, into, names, bits)
                batch, order, at = [], [], 0
            batch.append((reads[i], self._load_buf, at))
            order.append(i)
            at += need
        self._finish(batch, order, into, names, bits)
        self.moved["staged"] += len(staged)
        return bits

    def _finish(self, batch: list, order: list[int], into: Callable | None, names: list[str], bits: Bitmap) -> None:
        """Loads and ends the held reads of `batch`; sets the bit of each restored."""
        if not batch:
            return
        with self._reader_lock:
            answers = self._reader.finish_reads(batch, into=into)
        for i, answer in zip(order, answers):
            if isinstance(answer, BaseException):
                with self._lock:
                    self.failures["load"] += 1
                logger.error("pdstor L2 adapter: %s not loaded: %s", names[i], answer)
            else:
                bits.set(i)

    # --- delete, listing, status ----------------------------------------------

    def delete(self, keys: list) -> None:
        names = [object_key_to_string(k) for k in keys]
        deleted, sizes = [], []

        def gone(key: Any, name: str) -> None:
            with self._lock:
                size = self._sizes.pop(name, None)
            if size is not None:  # counted as stored here: counted out
                deleted.append(key)
                sizes.append(size)

        try:
            for key, name, ready in zip(keys, names, self._wclient.lookup(names)):
                if ready is None:  # already gone (another process deleted it)
                    gone(key, name)
                    continue
                try:
                    self._wclient.release(ready)
                except pdstor.UnknownPublication:
                    gone(key, name)
                    continue
                except pdstor.WrongState as e:
                    with self._lock:
                        self.failures["delete_kept"] += 1
                    logger.info("pdstor L2 adapter: %s kept: %s", name, e)
                    continue
                gone(key, name)
        finally:
            if deleted:
                self._notify_keys_deleted(deleted, sizes)

    def list_l2_keys(
        self, model_name: str | None = None, page_size: int = 500, cursor: str | None = None
    ) -> KeyListPage:
        entries = []
        for p in sorted(self._wclient.publications(state="READY"), key=lambda p: p["req_id"]):
            if not p.get("cache") or (cursor is not None and p["req_id"] <= cursor):
                continue
            try:
                key = decode_object_key(p["req_id"])
            except Exception:
                continue  # not an LMCache key
            if model_name is not None and key.model_name != model_name:
                continue
            entries.append((p["req_id"], key))
            if len(entries) > page_size:
                break
        more = len(entries) > page_size
        entries = entries[:page_size]
        page = tuple(KeyEntry(key=key.to_encoded_object_key(), size_bytes=0) for _, key in entries)
        return KeyListPage(entries=page, next_page_token=entries[-1][0] if more and entries else None)

    def report_status(self) -> dict:
        try:
            self._rclient.healthz()
            healthy = True
        except pdstor.Error:
            healthy = False
        with self._lock:
            held = sum(len(v) for v in self._held.values())
        return {"is_healthy": healthy, "type": "pdstor", "server": self._server, "reads_held": held, **self.failures}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            for pool in self._pools.values():
                pool.shutdown(wait=True)
            with self._lock:
                held = [r for reads in self._held.values() for r in reads]
                self._held.clear()
            self._abandon(held, "the LMCache server closed its pdstor adapter")
        finally:
            for fd in self._fds.values():
                os.close(fd)
