"""The load of `cargo xtask soak`: one process of the mix, or the verdict.

    driver.py writer --id N --dir D --server S --data-socket P --slot B --seed X
    driver.py reader --id N ...     (takes writer N's handoffs)
    driver.py hang --dir D --data-socket P     (a data-plane connection that stalls mid-frame)
    driver.py verdict --dir D --server S --data-socket P
    driver.py lmcache-prefill|lmcache-decode|vllm-prefill|vllm-decode --id N ...
                                    (LMCache with the plugin, vLLM with the connector: engines.py, vllm_engines.py)

Every process appends what it did to its ledger (`D/ledger-<role>-<id>.jsonl`,
one JSON object a line, written before it is acted on where a kill could
fall between): a process killed with SIGKILL loses nothing it wrote, and its
successor (same role and id) takes up what it left. A writer hands each
READY publication to its reader through `D/queue-<id>.jsonl` (the READY
receipt itself, as a proxy hands metadata over). The payload of chunk `i` of
request `r` is a function of the run's seed, `r` and `i` alone, so a reader
checks every byte it restores against bytes it makes itself, independently
of pdstor's own checksums.

The mix, per writer request: a handoff a reader restores and acknowledges;
a slow handoff the reader takes only after `--slow-s` (the store kept full);
an orphan no reader ever takes (released by its unread window); a prepare
cancelled midway; a request put twice (the second is refused or answered
again, never stored twice). Per reader handoff: restored, or (a decode
that fails its load) failed, fenced and reclaimed. Sizes are long-tailed,
1 to 512 chunks. The verdict reads every ledger and the daemon and says
whether anything was lost, corrupt, or is still held.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import pdstor

LAYOUT = pdstor.layout(
    model_id="soak", dtype="bf16", layers=1, kv_heads=1, head_dim=64, chunk_tokens=16, kv_format="pdstor-soak"
)
MAX_CHUNKS = 512
# What a daemon going away (killed, restarting) looks like to a client.
GONE = (pdstor.TransportError, pdstor.DataPlaneError)
ORPHAN_WINDOW_MS = 15_000
# The engines' roles (engines.py, vllm_engines.py).
ENGINES = ["lmcache-prefill", "lmcache-decode", "vllm-prefill", "vllm-decode"]


class Payload:
    """Chunk `i` of request `r`: a 32-byte header naming both, then bytes of
    a seeded random block at an offset both choose."""

    def __init__(self, seed: int, slot: int):
        self.slot = slot
        self.block = np.random.default_rng(seed).integers(0, 256, size=4 << 20, dtype=np.uint8).tobytes()

    def chunk(self, req: str, i: int) -> bytes:
        h = hashlib.sha256(f"{req}/{i}".encode()).digest()
        off = int.from_bytes(h[:4], "little") % (len(self.block) - self.slot)
        return h[:24] + i.to_bytes(8, "little") + self.block[off : off + self.slot - 32]


class Ledger:
    """Append-only JSON lines, each written whole before the next step."""

    def __init__(self, path: Path):
        self.path = path
        self.f = open(path, "a", buffering=1)

    def put(self, **event: Any) -> None:
        event["t"] = round(time.time(), 3)
        self.f.write(json.dumps(event, separators=(",", ":")) + "\n")

    @staticmethod
    def read(path: Path) -> list[dict[str, Any]]:
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut short by a kill: nothing acted on it yet
        return out


def chunks_drawn(rng: random.Random) -> int:
    """Long-tailed: P(n > x) ~ x^-1.1, 1 to 512."""
    return min(MAX_CHUNKS, int(1.0 / (1.0 - rng.random()) ** (1.0 / 1.1)))


def connected(args: argparse.Namespace) -> pdstor.Client:
    """A client once the daemon answers (it may be restarting)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            c = pdstor.Client(args.server, args.data_socket)
            c.healthz()
            return c
        except pdstor.Error:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def stopping(dir: Path) -> bool:
    return (dir / "stop").exists()


# --- the writer ---------------------------------------------------------------


def writer(args: argparse.Namespace) -> None:
    dir = Path(args.dir)
    # The pid in the seed and the names: a writer started in place of a
    # killed one draws other requests, never the names its predecessor used.
    rng = random.Random(args.seed * 1000 + args.id + os.getpid())
    ledger = Ledger(dir / f"ledger-writer-{args.id}.jsonl")
    queue = Ledger(dir / f"queue-{args.id}.jsonl")
    payload = Payload(args.seed, args.slot)
    buf = pdstor.Buffer(4 * MAX_CHUNKS * args.slot, "soak-writer")
    unresolved = unhanded(ledger)
    client, w, n = None, None, 0
    while not stopping(dir):
        kind = rng.choices(["handoff", "slow", "orphan", "cancel", "twice"], [60, 15, 12, 7, 6])[0]
        group = [(f"w{args.id}-{os.getpid()}-{n + k}", chunks_drawn(rng)) for k in range(rng.randint(1, 4))]
        n += len(group)
        try:
            if client is None:
                client = connected(args)
                client.register(buf)
                w = pdstor.Writer(client, f"soak-writer-{args.id}")
            if unresolved:
                # What a killed predecessor put and never handed on: found by name.
                hand_found(args, unresolved, ledger, queue)
                unresolved = []
            if kind == "cancel":
                cancel_midway(client, args, buf, payload, group[0], ledger)
            else:
                put(w, args, buf, payload, group, kind, ledger, queue)
        except GONE as e:
            # The daemon went away mid-step: what became READY is found by name.
            ledger.put(ev="interrupted", reqs=[r for r, _ in group], why=str(e)[:200])
            client = None
            time.sleep(0.5)
            hand_found(args, [(r, c, kind) for r, c in group], ledger, queue)


def unhanded(ledger: Ledger) -> list[tuple[str, int, str]]:
    """Requests this writer's predecessors began to put and never resolved
    (killed between the answer and the ledger): (name, chunks, kind)."""
    past = Ledger.read(ledger.path)
    resolved = {e["req"] for e in past if e["ev"] in ("ready", "refused", "error", "lost_put")}
    resolved |= {r for e in past if e["ev"] == "interrupted" for r in e["reqs"]}
    out = []
    for e in past:
        if e["ev"] == "putting":
            out += [(r, c, e["kind"]) for r, c in zip(e["reqs"], e["chunks"]) if r not in resolved]
    return out


def hand_found(args: argparse.Namespace, items: list[tuple[str, int, str]], ledger: Ledger, queue: Ledger) -> None:
    found = found_by_name(args, [r for r, _, _ in items])
    for (req, chunks, kind), ready in zip(items, found):
        if ready is not None:
            handed(ready, req, chunks, kind, ledger, queue)
        else:
            ledger.put(ev="lost_put", req=req, why="not READY after an interruption: rolled back, or never stored")


def found_by_name(args: argparse.Namespace, names: list[str]) -> list[Any]:
    """READY receipts by name, once the daemon answers (it may go away again)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            return connected(args).lookup(names)
        except GONE:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def put(w, args, buf, payload, group, kind, ledger, queue) -> None:
    items, at = [], 0
    for req, chunks in group:
        for i in range(chunks):
            buf.write(at + i * args.slot, payload.chunk(req, i))
        items.append((req, [(buf, at + i * args.slot, args.slot) for i in range(chunks)]))
        at += chunks * args.slot
    window = ORPHAN_WINDOW_MS if kind == "orphan" else None
    ledger.put(ev="putting", reqs=[r for r, _ in group], chunks=[c for _, c in group], kind=kind)
    answers = w.put_many(items, LAYOUT, timeout_ms=10_000, unread_release_ms=window)
    if any(isinstance(a, GONE) for a in answers):
        raise next(a for a in answers if isinstance(a, GONE))
    if kind == "twice":
        put_again(w, items, answers, ledger)
    for (req, chunks), answer in zip(group, answers):
        if isinstance(answer, pdstor.Receipt):
            handed(answer, req, chunks, kind, ledger, queue)
        elif isinstance(answer, (pdstor.AdmissionTimeout, pdstor.TooManyPrepares)):
            ledger.put(ev="refused", req=req, code=answer.code)
        else:
            ledger.put(ev="error", req=req, code=getattr(answer, "code", "?"), why=str(answer)[:300])


def put_again(w, items, answers, ledger: Ledger) -> None:
    """The first item that became READY put again, before any reader can
    have taken it: refused as a duplicate, or answered with the same
    publication — never stored twice."""
    first = next((i for i, a in enumerate(answers) if isinstance(a, pdstor.Receipt)), None)
    if first is None:
        return
    (again,) = w.put_many(items[first : first + 1], LAYOUT, timeout_ms=10_000)
    if isinstance(again, GONE):
        raise again
    same = isinstance(again, pdstor.Receipt) and again.publication == answers[first].publication
    if isinstance(again, pdstor.DuplicateRequest) or same:
        ledger.put(ev="twice", req=items[first][0], code="repeated" if same else again.code)
    else:
        ledger.put(ev="error", req=items[first][0], code=getattr(again, "code", "?"), why=f"put twice: {again}"[:300])


def handed(ready, req: str, chunks: int, kind: str, ledger: Ledger, queue: Ledger) -> None:
    # The queue first: a kill between the two leaves a handoff its reader
    # takes and the verdict finds in the queue, never one nobody takes.
    if kind != "orphan":
        queue.put(req=req, chunks=chunks, slow=kind == "slow", receipt=ready.to_json())
    ledger.put(ev="ready", req=req, chunks=chunks, kind=kind, publication=ready.publication)


def cancel_midway(client, args, buf, payload, item, ledger: Ledger) -> None:
    req, chunks = item
    w = pdstor.Writer(client, f"soak-writer-{args.id}")
    ledger.put(ev="cancelling", req=req)
    try:
        w.prepare(req, LAYOUT, max(chunks, 2), timeout_ms=10_000)
    except (pdstor.AdmissionTimeout, pdstor.TooManyPrepares) as e:
        ledger.put(ev="refused", req=req, code=e.code)
        return
    buf.write(0, payload.chunk(req, 0))
    w.store([(0, buf, 0, args.slot)])
    ledger.put(ev="cancelled", req=req, outcome=client.cancel(req))


# --- the reader ---------------------------------------------------------------


def reader(args: argparse.Namespace) -> None:
    """Takes writer `--id`'s handoffs until it is done; every time the daemon
    goes away, connects again and finishes what was claimed first."""
    rng = random.Random(args.seed * 7 + args.id + os.getpid())
    payload = Payload(args.seed, args.slot)
    buf = pdstor.Buffer(MAX_CHUNKS * args.slot, "soak-reader", staging=True)
    ledger = Ledger(Path(args.dir) / f"ledger-reader-{args.id}.jsonl")
    while True:
        try:
            return reading(args, buf, payload, ledger, rng)
        except GONE:
            time.sleep(0.5)


def reading(args, buf, payload, ledger: Ledger, rng: random.Random) -> None:
    dir = Path(args.dir)
    past = Ledger.read(ledger.path)
    done = {e["req"] for e in past if e["ev"] in TERMINAL}
    client = connected(args)
    client.register(buf)
    # What a killed predecessor (or a daemon restart) left claimed: finished first.
    for e in {e["req"]: e for e in past if e["ev"] == "claiming"}.values():
        if e["req"] not in done:
            finish_claim(client, args, buf, payload, e, ledger)
            done.add(e["req"])
    queue, offset, waiting = dir / f"queue-{args.id}.jsonl", 0, []
    r = pdstor.Reader(client, f"soak-reader-{args.id}", verify="local")
    while True:
        # The writer's end first, then the queue: an entry written before
        # the writer ended is read before this reader does.
        ended = stopping(dir) and (dir / f"writer-{args.id}.done").exists()
        entries, offset = tail(queue, offset)
        waiting += [e for e in entries if e["req"] not in done]
        if not waiting:
            if ended:
                return
            time.sleep(0.05)
            continue
        group = next_group(waiting, args.slow_s)
        if not group:
            time.sleep(0.05)
            continue
        for e in group:
            waiting.remove(e)
        if rng.random() < 0.05:
            fail_decode(client, args, group[0], ledger)
            group = group[1:]
        if group:
            take(r, args, buf, payload, group, ledger)
        done.update(e["req"] for e in group)


def queued(dir: Path, name: str, ended_by: str):
    """The entries of `D/queue-<name>.jsonl` as they are appended, until the
    load stops and `D/<ended_by>` (its writer's end) exists."""
    offset = 0
    while True:
        # The writer's end first, then the queue: an entry written before
        # the writer ended is read before this ends.
        ended = stopping(dir) and (dir / ended_by).exists()
        entries, offset = tail(dir / f"queue-{name}.jsonl", offset)
        if not entries:
            if ended:
                return
            time.sleep(0.05)
            continue
        yield from entries


def next_group(waiting: list[dict[str, Any]], slow_s: float) -> list[dict[str, Any]]:
    """The handoffs to take now, together: due (a slow one 20 s after it was
    handed over), at most 512 chunks in all (the reader's buffer)."""
    now, group, chunks = time.time(), [], 0
    for e in waiting:
        if e["slow"] and e["t"] + slow_s > now:
            continue
        if group and chunks + e["chunks"] > MAX_CHUNKS:
            break
        group.append(e)
        chunks += e["chunks"]
    return group


TERMINAL = {"acked", "acked_unrecorded", "fenced_reclaimed", "failed_reclaimed", "reclaimed", "lost", "corrupt"}


def tail(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """Whole lines appended to `path` since `offset`, and the new offset."""
    if not path.exists():
        return [], offset
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    whole = data[: data.rfind(b"\n") + 1]
    out = []
    for line in whole.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # never written whole (a line is one write(2): a kill cannot tear it)
    return out, offset + len(whole)


def take(r, args, buf, payload, group: list[dict[str, Any]], ledger: Ledger) -> None:
    """Each handoff of `group` claimed, adopted, loaded, verified and acked
    in one `get_many`; every byte then compared with bytes made here."""
    items, at = [], 0
    for e in group:
        ledger.put(ev="claiming", req=e["req"], session=r.session, receipt=e["receipt"], chunks=e["chunks"])
        items.append((pdstor.Receipt.from_json(e["receipt"]), buf, at))
        at += e["chunks"] * args.slot
    answers = r.get_many(items, LAYOUT, 60_000)
    if any(isinstance(a, GONE) for a in answers):
        raise next(a for a in answers if isinstance(a, GONE))
    for (e, (_, _, at)), got in zip(zip(group, items), answers):
        if isinstance(got, pdstor.Error):
            ledger.put(ev=lost_or_corrupt(got), req=e["req"], code=got.code, why=str(got)[:300])
        else:
            verify(buf, payload, e["req"], e["chunks"], args.slot, ledger, at)


def fail_decode(client, args, e: dict[str, Any], ledger: Ledger) -> None:
    """A decode that fails its load: its own session, failed, fenced, reclaimed."""
    own = pdstor.Reader(client, f"soak-reader-{args.id}")
    ledger.put(ev="claiming", req=e["req"], session=own.session, receipt=e["receipt"], chunks=e["chunks"])
    try:
        claim = own.claim(pdstor.Receipt.from_json(e["receipt"]), lease_ms=60_000, layout=LAYOUT)
        own.fail(claim, "soak: the decode's load failed")
        client.close_session(claim)
        client.reclaim(claim)
    except GONE:
        raise
    except pdstor.Error as refused:
        ledger.put(ev="lost", req=e["req"], code=refused.code, why=f"failing its decode: {refused}"[:300])
        return
    ledger.put(ev="failed_reclaimed", req=e["req"])


def lost_or_corrupt(e: pdstor.Error) -> str:
    return "corrupt" if isinstance(e, pdstor.LoadFailed) else "lost"


def verify(buf, payload, req: str, chunks: int, slot: int, ledger: Ledger, at: int = 0) -> None:
    """Every byte against bytes made here, not pdstor's checksums."""
    bad = [i for i in range(chunks) if buf.read(at + i * slot, slot) != payload.chunk(req, i)]
    if bad:
        ledger.put(ev="corrupt", req=req, chunks=bad[:16], why="restored bytes differ from the written ones")
    else:
        ledger.put(ev="acked", req=req, chunks=chunks)


def finish_claim(client, args, buf, payload, e: dict[str, Any], ledger: Ledger) -> None:
    """A claim a killed reader (or a daemon restart) left: claimed again with
    its session — the same receipt — and restored; or, fenced by a restart
    (or its lease run out), reclaimed; or, already acknowledged, answered by
    its absence; or, failed or its session closed, reclaimed by number."""
    ready = pdstor.Receipt.from_json(e["receipt"])
    r = pdstor.Reader(client, f"soak-reader-{args.id}", session=e["session"], verify="local")
    try:
        claim = r.claim(ready, lease_ms=60_000, layout=LAYOUT)
    except GONE:
        raise
    except pdstor.UnknownPublication:
        ledger.put(ev="acked_unrecorded", req=e["req"])  # its ack committed; its answer died with the reader
        return
    except pdstor.Error as refused:
        client.reclaim_publication(ready.publication, f"soak: its reader was killed ({refused.code})")
        ledger.put(ev="reclaimed", req=e["req"], code=refused.code)
        return
    try:
        manifest = r.adopt(claim, LAYOUT)
        r.load(claim, [(c["index"], buf, c["index"] * args.slot) for c in manifest["chunks"]])
        # Loads into a staging buffer are checked as they are copied out:
        # nothing to copy here (the bytes are compared in place below).
        for c in manifest["chunks"]:
            r.scatter(claim, c["index"], [])
        r.ack(claim)
    except GONE:
        raise
    except (pdstor.Fenced, pdstor.LeaseExpired):
        client.close_session(claim)
        client.reclaim(claim)
        ledger.put(ev="fenced_reclaimed", req=e["req"])
        return
    except pdstor.LoadFailed as bad:
        ledger.put(ev="corrupt", req=e["req"], code=bad.code, why=str(bad)[:300])
        return
    verify(buf, payload, e["req"], e["chunks"], args.slot, ledger)


# --- a data-plane connection that hangs ----------------------------------------


def hang(args: argparse.Namespace) -> None:
    """Connects to the data socket, sends half a frame and waits: the daemon
    must close it (its idle timeout) and serve everyone else meanwhile."""
    ledger = Ledger(Path(args.dir) / "ledger-hang-0.jsonl")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(args.data_socket)
    s.sendall(b"\x00\x00")
    started = time.monotonic()
    s.settimeout(60)
    closed = False
    try:
        while s.recv(1 << 16):
            pass  # what the daemon says before it hangs up
        closed = True
    except ConnectionResetError:
        closed = True
    except OSError:
        pass  # still open after 60 s: not closed
    ledger.put(ev="hang", closed=closed, after_s=round(time.monotonic() - started, 1))


# --- the verdict --------------------------------------------------------------


def verdict(args: argparse.Namespace) -> None:
    dir = Path(args.dir)
    ready: dict[str, dict[str, Any]] = {}
    ends: dict[str, str] = {}
    counts: dict[str, int] = {}
    # Per decoding process (reader, LMCache decode, vLLM decode): what it
    # acknowledged, and what it found gone after the daemon cut it short.
    decoders: dict[str, dict[str, int]] = {}
    for path in sorted(dir.glob("ledger-*.jsonl")):
        decoding = path.stem.startswith(("ledger-reader-", "ledger-lmcache-decode-", "ledger-vllm-decode-"))
        mine = {"acked": 0, "acked_unrecorded": 0}
        if decoding:
            decoders[path.stem.removeprefix("ledger-")] = mine
        for e in Ledger.read(path):
            counts[e["ev"]] = counts.get(e["ev"], 0) + 1
            if e["ev"] in mine:
                mine[e["ev"]] += 1
            if e["ev"] == "ready":
                ready[e["req"]] = e
            elif e["ev"] in TERMINAL:
                ends[e["req"]] = e["ev"]
    client = connected(args)
    held = client.publications()
    handoffs = {r: e for r, e in ready.items() if e["kind"] != "orphan"}
    orphans = [r for r, e in ready.items() if e["kind"] == "orphan"]
    unaccounted = sorted(r for r in handoffs if r not in ends)
    lost = sorted(r for r, v in ends.items() if v == "lost") + unaccounted
    corrupt = sorted(r for r, v in ends.items() if v == "corrupt")
    still = [r for r in orphans if r in {p["req_id"] for p in held}]
    hangs = [e for e in Ledger.read(dir / "ledger-hang-0.jsonl")]
    out = {
        "counts": counts,
        "decoders": decoders,
        "handoffs": len(handoffs),
        "orphans": len(orphans),
        "lost": lost[:50],
        "lost_count": len(lost),
        "corrupt": corrupt[:50],
        "corrupt_count": len(corrupt),
        "held_at_end": [{k: p.get(k) for k in ("req_id", "state", "publication")} for p in held][:50],
        "held_count": len(held),
        "orphans_held": len(still),
        "hangs": len(hangs),
        "hangs_not_closed": sum(1 for h in hangs if not h["closed"]),
    }
    json.dump(out, sys.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("role", choices=["writer", "reader", "hang", "verdict", *ENGINES])
    p.add_argument("--id", type=int, default=0)
    p.add_argument("--dir", required=True)
    p.add_argument("--server", default="unix:/run/pdstor/control.sock")
    p.add_argument("--data-socket", default="/run/pdstor/data.sock")
    p.add_argument("--slot", type=int, default=64 << 10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--slow-s", type=float, default=20.0)
    args = p.parse_args()
    if args.role.startswith("lmcache-"):
        import engines  # LMCache and torch: only in the processes that are LMCache

        if args.role == "lmcache-prefill":
            return engines.lmcache_prefill(args, Ledger, stopping, chunks_drawn)
        return engines.lmcache_decode(args, Ledger, queued)
    if args.role.startswith("vllm-"):
        import vllm_engines  # vLLM's scheduler and the connector: only in the processes that are vLLM

        if args.role == "vllm-prefill":
            return vllm_engines.vllm_prefill(args, Ledger, stopping)
        return vllm_engines.vllm_decode(args, Ledger, queued)
    {"writer": writer_to_end, "reader": reader, "hang": hang, "verdict": verdict}[args.role](args)


def writer_to_end(args: argparse.Namespace) -> None:
    writer(args)
    (Path(args.dir) / f"writer-{args.id}.done").touch()


if __name__ == "__main__":
    main()
