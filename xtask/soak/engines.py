"""The soak's serving engines: the load as LMCache and vLLM make it.

    driver.py lmcache-prefill --id N ...   (LMCache's StorageManager with the pdstor plugin, putting prompts)
    driver.py lmcache-decode --id N ...    (another StorageManager, retrieving them)

A prefill process is LMCache as a prefill engine runs it: its
StorageManager loads `pdstor.lmcache.PdstorBackend` from a configuration
file, with its CPU pool in shared memory, and each prompt's KV (1 to 64
chunks of 256 tokens, long-tailed) is put in one `batched_put`. A prompt's
keys the plugin holds once its puts are done are READY; the prompt is
handed to the decode process through `D/queue-lmcache-<id>.jsonl`, or (one
in ten) never: an orphan the plugin's `pdstor.unread_release_s` releases.
The decode process looks each prompt's keys up and gets them as LMCache's
engine does (`get_block_mapping`, then `batched_get`) and compares every
tensor with one it makes itself from the key's seed.

Both write ledgers the verdict reads with the others' (`ledger-lmcache-
prefill-<id>.jsonl`, `ledger-lmcache-decode-<id>.jsonl`). The daemon going
away mid-step (the soak kills and restarts it) is survived as a deployment
survives it: a put it dropped is not handed over; a get it cut short is
looked for by name afterwards: READY, got again; claimed and fenced by the
restart, reclaimed by the operator; gone, acknowledged before the answer
was lost.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.storage_manager import StorageManager

import pdstor

MODEL = "soak/lmcache"
# One chunk of 256 tokens of (1 layer, K and V, 1 head of 64, BF16): 64 KiB, one slot.
KV_SHAPE = (1, 2, 256, 1, 64)
MAX_KEYS = 64
WINDOW_S = 120


def manager(args: Any, role: str) -> StorageManager:
    """LMCache's StorageManager with the plugin, from a configuration file."""
    path = Path(args.dir) / f"lmcache-{role}-{args.id}.yaml"
    path.write_text(
        f"""chunk_size: 256
local_cpu: false
max_local_cpu_size: 0.1
shm_name: "pdstor-soak-{role}-{args.id}-{os.getpid()}"
storage_plugins: ["pdstor"]
extra_config:
  storage_plugin.pdstor.module_path: pdstor.lmcache
  storage_plugin.pdstor.class_name: PdstorBackend
  pdstor.server: "{args.server}"
  pdstor.data_socket: "{args.data_socket}"
  pdstor.io_threads: 2
  pdstor.admission_timeout_ms: 10000
  pdstor.unread_release_s: {WINDOW_S}
  pdstor.writer_id: "soak-lmcache-{args.id}"
  pdstor.reader_id: "soak-lmcache-{args.id}"
"""
    )
    md = LMCacheMetadata(
        model_name=MODEL,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=KV_SHAPE,
    )
    sm = StorageManager(LMCacheEngineConfig.from_file(str(path)), md, EventManager())
    if "pdstor" not in sm.storage_backends:
        raise SystemExit(f"LMCache did not load the pdstor plugin: {list(sm.storage_backends)}")
    return sm


def key(seed: int) -> CacheEngineKey:
    return CacheEngineKey(MODEL, 1, 0, seed, torch.bfloat16)


def kv(seed: int) -> torch.Tensor:
    """The KV of the chunk whose key is `seed`: made again anywhere from it."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((2, KV_SHAPE[0], KV_SHAPE[2], KV_SHAPE[3] * KV_SHAPE[4]), generator=g).to(torch.bfloat16)


def lmcache_prefill(args: Any, ledger_cls: Any, stopping: Any, chunks_drawn: Any) -> None:
    dir = Path(args.dir)
    rng = random.Random(args.seed * 31 + args.id + os.getpid())
    ledger = ledger_cls(dir / f"ledger-lmcache-prefill-{args.id}.jsonl")
    queue = ledger_cls(dir / f"queue-lmcache-{args.id}.jsonl")
    sm = manager(args, "prefill")
    backend = sm.storage_backends["pdstor"]
    n = 0
    while not stopping(dir):
        orphan = rng.random() < 0.1
        seeds = [rng.getrandbits(62) for _ in range(min(MAX_KEYS, chunks_drawn(rng)))]
        n += 1
        objs = []
        for s in seeds:
            obj = sm.allocate(kv(s).shape, torch.bfloat16)
            if obj is None:
                break
            obj.tensor.copy_(kv(s))
            objs.append(obj)
        seeds = seeds[: len(objs)]
        if not seeds:
            time.sleep(0.1)
            continue
        sm.batched_put([key(s) for s in seeds], objs)
        for obj in objs:
            obj.ref_count_down()  # LMCache's engine gives its reference up once put
        deadline = time.monotonic() + 60
        while any(backend.exists_in_put_tasks(key(s)) for s in seeds) and time.monotonic() < deadline:
            time.sleep(0.01)
        # What LMCache's lookup would find: the keys the plugin published.
        held = [s for s in seeds if held_now(backend, key(s))]
        kind = "orphan" if orphan else "handoff"
        if held and not orphan:
            queue.put(prompt=n, seeds=held)
        for s in held:
            ledger.put(ev="ready", req=key(s).to_string(), chunks=1, kind=kind)
        for s in seeds:
            if s not in held:
                ledger.put(ev="refused", req=key(s).to_string(), code="put_dropped")
    sm.close()
    (dir / f"lmcache-prefill-{args.id}.done").touch()


def held_now(backend: Any, k: CacheEngineKey) -> bool:
    """Whether the daemon holds `k` READY (a daemon away answers no)."""
    try:
        return backend.contains(k)
    except pdstor.Error:
        return False


def lmcache_decode(args: Any, ledger_cls: Any, queued: Any) -> None:
    dir = Path(args.dir)
    ledger = ledger_cls(dir / f"ledger-lmcache-decode-{args.id}.jsonl")
    sm = manager(args, "decode")
    client = pdstor.Client(args.server, args.data_socket)
    # A decode started in place of one that died takes up where it stopped.
    done = {e["req"] for e in ledger_cls.read(ledger.path)}
    for e in queued(dir, f"lmcache-{args.id}", f"lmcache-prefill-{args.id}.done"):
        seeds = [s for s in e["seeds"] if key(s).to_string() not in done]
        if seeds:
            retrieve(sm, client, seeds, ledger)
    sm.close()


def retrieve(sm: StorageManager, client: pdstor.Client, seeds: list[int], ledger: Any) -> None:
    """One prompt's keys got as LMCache's engine gets them; every tensor
    compared with the one made here."""
    keys = [key(s) for s in seeds]
    for _ in range(30):
        try:
            mapping = sm.get_block_mapping([(k, i * 256, (i + 1) * 256) for i, k in enumerate(keys)])
            found = [k for k, _, _ in mapping.get("pdstor", [])]
            got = sm.batched_get(found, location="pdstor") if found else []
            break
        except (pdstor.LoadFailed, pdstor.VerifyFailed) as e:
            for k in keys:
                ledger.put(ev="corrupt", req=k.to_string(), code=e.code, why=str(e)[:300])
            return
        except pdstor.Error:
            # Cut short (the daemon went away, or its restart fenced the claims).
            keys = interrupted(client, keys, ledger)
            if not keys:
                return
            time.sleep(1)
    else:
        for k in keys:
            ledger.put(ev="lost", req=k.to_string(), why="the daemon did not answer for 30 tries")
        return
    by_name = {k.to_string(): (k, obj) for k, obj in zip(found, got)}
    for k in keys:
        name = k.to_string()
        obj = by_name.get(name, (None, None))[1]
        if obj is None:
            ledger.put(ev="lost", req=name, why="not found, or a miss: released or never READY")
        elif torch.equal(obj.tensor, kv(k.chunk_hash)):
            ledger.put(ev="acked", req=name, chunks=1)
        else:
            ledger.put(ev="corrupt", req=name, why="restored tensor differs from the stored one")
        if obj is not None:
            obj.ref_count_down()


def interrupted(client: pdstor.Client, keys: list[CacheEngineKey], ledger: Any) -> list[CacheEngineKey]:
    """After a get the daemon cut short: the keys still READY (to get again);
    one claimed and fenced by the restart is reclaimed; one gone was
    acknowledged before the answer was lost."""
    again = []
    for k in keys:
        name = k.to_string()
        for _ in range(120):
            p = state_of(client, name)
            if p is None:
                ledger.put(ev="acked_unrecorded", req=name)
            elif p["state"] == "READY":
                again.append(k)
            elif reclaimed(client, p, f"soak: its LMCache get was cut short ({p['state']})"):
                ledger.put(ev="reclaimed", req=name, code=p["state"])
            else:
                time.sleep(0.5)  # acked or reclaimed meanwhile, or the daemon away: looked at again
                continue
            break
        else:
            ledger.put(ev="lost", req=name, why="neither READY, nor gone, nor reclaimed for 60 s")
    return again


def state_of(client: pdstor.Client, name: str) -> dict[str, Any] | None:
    """`name`'s publication as the daemon lists it, once it answers."""
    while True:
        try:
            return next((p for p in client.publications() if p["req_id"] == name), None)
        except pdstor.Error:
            time.sleep(0.5)


def reclaimed(client: pdstor.Client, p: dict[str, Any], why: str) -> bool:
    """An operator's reclaim of `p`; False where it did not happen (the
    daemon away, the publication acked or gone meanwhile)."""
    try:
        client.reclaim_publication(p["publication"], why)
        return True
    except pdstor.Error:
        return False
