"""The disaggregated-serving proxy for ``vllm serve`` with
``pdstor.vllm.PdstorConnector``: the stock protocol, nothing of pdstor's own.

    python -m pdstor.proxy --prefill http://10.0.0.1:8100 --decode http://10.0.0.2:8200 --port 8000

Each OpenAI request (``/v1/completions`` and ``/v1/chat/completions``,
streaming or not) goes twice, as vLLM's disaggregated-serving examples send
it:

1. to a prefill engine (``kv_producer``) with ``max_tokens=1``, not
   streaming, and ``kv_transfer_params={"do_remote_decode": true}``; its
   response carries ``kv_transfer_params`` (the publication's name, its prompt and first token);
2. to a decode engine (``kv_consumer``) **unchanged** — the original prompt,
   the original budget, streaming as asked — plus those
   ``kv_transfer_params``. The decode restores the whole prompt, recomputes
   its last token as vLLM does for every full-prompt hit, and answers the
   client; this proxy relays that answer byte for byte.

The decode's answer carries ``X-Pdstor-Publication`` (the publication's
name, for the timeline and the operator). A prefill that fails, or that
hands nothing over (no ``kv_transfer_params``: not started with the
connector), fails the request with the prefill's own status and words,
never a silent recompute. Several ``--prefill`` and ``--decode`` URLs are
taken in turn.

The prefill answers before its stores are durable; a decode given the
publication's name waits for it to be READY (``WAITING_FOR_REMOTE_KVS``),
holding its blocks, and its engine steps meanwhile. With ``--pdstor`` (the
daemon's control socket) this proxy waits instead: it forwards the decode
request once the publication is READY, or once it is gone or
``--ready-timeout-s`` has passed (the decode then finds what the daemon says
and answers as its failure policy does). Without it, nothing here talks to
the daemon: standard library only.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import logging
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("pdstor.proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
# What the prefill's copy of a request must not carry: it answers one token, not streamed.
PREFILL_DROPS = ("stream_options", "min_tokens")


@dataclass(frozen=True)
class Upstream:
    """One engine's base URL, split for http.client."""

    url: str
    host: str
    port: int

    @staticmethod
    def parse(url: str) -> Upstream:
        u = urllib.parse.urlsplit(url)
        if u.scheme != "http" or not u.hostname or u.path not in ("", "/"):
            raise ValueError(f"{url!r} is not an engine's base URL: give http://HOST:PORT (no path)")
        return Upstream(url.rstrip("/"), u.hostname, u.port or 80)

    def connect(self, timeout_s: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)


class Rotation:
    """Upstreams taken in turn, from any thread."""

    def __init__(self, ups: list[Upstream]):
        self.ups = ups
        self._next = itertools.cycle(ups)
        self._lock = threading.Lock()

    def take(self) -> Upstream:
        with self._lock:
            return next(self._next)


class Refused(Exception):
    """A request this proxy answers itself: the status, and what to do."""

    def __init__(self, status: int, message: str, phase: str = "proxy"):
        super().__init__(message)
        self.status, self.message, self.phase = status, message, phase


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill's copy of a request: one token, not streamed, handed over."""
    out = {k: v for k, v in body.items() if k not in PREFILL_DROPS}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return out


def checked_request(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise Refused(400, f"the request body is not JSON: {e}") from e
    if not isinstance(body, dict):
        raise Refused(400, "the request body is not a JSON object")
    n = body.get("n", 1)
    if n not in (None, 1):
        raise Refused(
            400,
            f"n={n!r}: a handed-over prompt is claimed by one decode request; send n=1 "
            "(or send this request to a decode engine directly, where it is computed there)",
        )
    if "kv_transfer_params" in body:
        raise Refused(400, "kv_transfer_params are this proxy's to set: send the request without them")
    return body


class ReadyGate:
    """Holds a decode request until its publication is READY (``--pdstor``)."""

    POLL_FIRST_S, POLL_LAST_S = 0.001, 0.02

    def __init__(self, server: str, timeout_s: float):
        import pdstor  # the wheel's client; only with --pdstor
        from pdstor.vllm._identity import shard_name

        self.pdstor, self.server, self.timeout_s = pdstor, server, timeout_s
        self.shard_name = shard_name
        self.client = pdstor.Client(server)  # one for every request: it is shared across threads
        self.client.healthz()
        # The daemon's answers are waited for here, never longer than a wait's
        # deadline: a daemon that stops answering cannot hold a request.
        self.asks = ThreadPoolExecutor(8, thread_name_prefix="pdstor-proxy-gate")

    def _ask(self, deadline: float, what: Callable[[], Any]) -> Any:
        return self.asks.submit(what).result(timeout=max(0.0, deadline - time.monotonic()))

    def wait_shards(self, name: str, tp: int) -> str:
        """How the wait for every tensor-parallel shard of publication
        `name` ended: "ready" once each is, or why it went on without; all
        of them within one timeout."""
        deadline = time.monotonic() + self.timeout_s
        for rank in range(tp):
            shard = self.shard_name(name, rank, tp)
            ended = self.wait(shard, deadline)
            if ended != "ready":
                return ended if tp == 1 else f"{shard}: {ended}"
        return "ready"

    def wait(self, name: str, deadline: float | None = None) -> str:
        """How the wait for `name` ended (by `deadline`, else within the
        timeout): "ready", or why it went on without."""
        deadline = time.monotonic() + self.timeout_s if deadline is None else deadline
        delay = self.POLL_FIRST_S
        try:
            while True:
                if self._ask(deadline, lambda: self.client.lookup([name]))[0] is not None:
                    return "ready"
                prepared = self._ask(deadline, lambda: self.client.publications(state="PREPARED"))
                if not any(p["req_id"] == name for p in prepared):
                    # READY since the lookup (or READY and not this proxy's to
                    # claim), or gone: either way there is nothing to wait for.
                    found = self._ask(deadline, lambda: self.client.lookup([name]))[0]
                    return "ready" if found is not None else "not PREPARED, and no READY receipt for it"
                if time.monotonic() >= deadline:
                    return f"still PREPARED after {self.timeout_s} s"
                time.sleep(delay)
                delay = min(2 * delay, self.POLL_LAST_S)
        except FutureTimeout:
            return f"the daemon at {self.server} did not answer within {self.timeout_s} s"
        except Exception as e:  # noqa: BLE001 - whatever the daemon answered, the decode decides
            return f"the daemon at {self.server} answered an error ({e})"


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], timeout_s: float, gate: ReadyGate | None = None):
        self.prefill = Rotation([Upstream.parse(u) for u in prefill])
        self.decode = Rotation([Upstream.parse(u) for u in decode])
        self.timeout_s = timeout_s
        self.gate = gate
        self.lock = threading.Lock()
        self.counts = {
            "requests": 0, "handed_over": 0, "prefill_failed": 0, "decode_failed": 0, "refused": 0, "sent_unready": 0,
        }  # fmt: skip

    def count(self, what: str) -> None:
        with self.lock:
            self.counts[what] += 1

    def run_prefill(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
        """The prefill's answer (its kv_transfer_params), and how long it took."""
        up = self.prefill.take()
        started = time.monotonic()
        status, data = post(up, path, prefill_body(body), self.timeout_s, "prefill")
        if status != 200:
            raise Refused(
                status, f"the prefill at {up.url} answered {status}: {data[:2000].decode(errors='replace')}", "prefill"
            )
        try:
            kv = json.loads(data).get("kv_transfer_params")
        except (ValueError, AttributeError) as e:
            raise Refused(
                502, f"the prefill at {up.url} answered something that is not a JSON object: {e}", "prefill"
            ) from e
        if not isinstance(kv, dict):
            raise Refused(
                502,
                f"the prefill at {up.url} handed nothing over (no kv_transfer_params in its answer): start it with "
                '--kv-transfer-config \'{"kv_connector":"PdstorConnector","kv_connector_module_path":"pdstor.vllm",'
                '"kv_role":"kv_producer",...}\'',
                "prefill",
            )
        return kv, time.monotonic() - started


def post(up: Upstream, path: str, body: dict[str, Any], timeout_s: float, phase: str) -> tuple[int, bytes]:
    conn = up.connect(timeout_s)
    try:
        conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    except (OSError, http.client.HTTPException) as e:
        raise Refused(502, f"the {phase} engine at {up.url} could not be reached: {e}", phase) from e
    finally:
        conn.close()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("%s %s", self.address_string(), format % args)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        proxy = self.server.proxy
        if self.path == "/health":
            down = [u.url for u in proxy.prefill.ups + proxy.decode.ups if not healthy(u)]
            if down:
                self.reply_json(503, {"error": {"message": f"not answering /health: {down}"}})
            else:
                self.reply_json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self.relay_get(proxy.decode.take())
        elif self.path == "/pdstor/stats":
            with proxy.lock:
                self.reply_json(200, dict(proxy.counts))
        else:
            self.reply_json(
                404, {"error": {"message": f"{self.path}: this proxy serves {list(ROUTES)}, /v1/models, /health"}}
            )

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        proxy = self.server.proxy
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path not in ROUTES:
            self.reply_json(404, {"error": {"message": f"{self.path}: this proxy serves {list(ROUTES)}"}})
            return
        proxy.count("requests")
        started = time.monotonic()
        try:
            body = checked_request(raw)
            kv, prefill_s = proxy.run_prefill(self.path, body)
        except Refused as e:
            proxy.count("refused" if e.phase == "proxy" else "prefill_failed")
            log.error("pdstor.proxy: %s %s refused in %s: %s", self.path, e.status, e.phase, e.message)
            self.reply_json(e.status, {"error": {"message": e.message, "phase": e.phase}})
            return
        name, tp = (kv.get("pdstor") or {}).get("req"), (kv.get("pdstor") or {}).get("tp", 1)
        if name is not None:
            proxy.count("handed_over")
            shards = tp if isinstance(tp, int) and tp >= 1 else 1
            ended = proxy.gate.wait_shards(name, shards) if proxy.gate is not None else "ready"
            if ended != "ready":
                proxy.count("sent_unready")
                log.warning("pdstor.proxy: publication %s sent to the decode %s", name, ended)
        up = proxy.decode.take()
        status = self.relay_post(up, {**body, "kv_transfer_params": kv}, name)
        if status != 200:
            proxy.count("decode_failed")
        log.info(
            "pdstor.proxy: %s %s publication %s: prefill %.3f s, decode %s in %.3f s",
            self.path,
            up.url,
            name,
            prefill_s,
            status,
            time.monotonic() - started - prefill_s,
        )

    def relay_post(self, up: Upstream, body: dict[str, Any], publication: str | None) -> int:
        """The decode's answer, relayed as it comes (a stream chunk by chunk)."""
        conn = up.connect(self.server.proxy.timeout_s)
        try:
            try:
                conn.request("POST", self.path, json.dumps(body).encode(), {"Content-Type": "application/json"})
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                msg = f"the decode engine at {up.url} could not be reached: {e}"
                self.reply_json(502, {"error": {"message": msg, "phase": "decode"}})
                return 502
            self.send_response(resp.status)
            self.send_header("Content-Type", resp.getheader("Content-Type", "application/json"))
            self.send_header("Transfer-Encoding", "chunked")
            if publication is not None:
                self.send_header("X-Pdstor-Publication", publication)
            self.end_headers()
            try:
                while chunk := resp.read1(65536):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                # The client left: closing the decode's connection aborts its request there.
                log.info("pdstor.proxy: the client left during %s's answer from %s", publication, up.url)
                self.close_connection = True
            return resp.status
        finally:
            conn.close()

    def relay_get(self, up: Upstream) -> None:
        conn = up.connect(self.server.proxy.timeout_s)
        try:
            conn.request("GET", self.path)
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException) as e:
            self.reply_json(502, {"error": {"message": f"the decode engine at {up.url} could not be reached: {e}"}})
            return
        finally:
            conn.close()
        self.send_response(resp.status)
        self.send_header("Content-Type", resp.getheader("Content-Type", "application/json"))
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def reply_json(self, status: int, obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def healthy(up: Upstream) -> bool:
    conn = up.connect(5.0)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], proxy: Proxy):
        super().__init__(address, Handler)
        self.proxy = proxy


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdstor.proxy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", action="append", required=True, help="a prefill engine's base URL (repeatable)")
    ap.add_argument("--decode", action="append", required=True, help="a decode engine's base URL (repeatable)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout-s", type=float, default=600.0, help="the longest wait for an engine's answer")
    ap.add_argument("--pdstor", help="the daemon's control socket: decode requests wait here until READY")
    ap.add_argument("--ready-timeout-s", type=float, default=30.0, help="the longest such wait")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    gate = None
    if args.pdstor:
        try:
            gate = ReadyGate(args.pdstor, args.ready_timeout_s)
        except ImportError as e:
            print(f"pdstor.proxy: --pdstor needs the pdstor wheel's client: {e}", file=sys.stderr)
            return 2
        except Exception as e:  # noqa: BLE001 - pdstor.Error or a bad socket URL: said, and nothing starts
            print(f"pdstor.proxy: the daemon at {args.pdstor} does not answer ({e}): start `pdstor serve` there, "
                  "or leave --pdstor out", file=sys.stderr)  # fmt: skip
            return 2
    try:
        proxy = Proxy(args.prefill, args.decode, args.timeout_s, gate)
    except ValueError as e:
        print(f"pdstor.proxy: {e}", file=sys.stderr)
        return 2
    try:
        server = Server((args.host, args.port), proxy)
    except OSError as e:
        print(f"pdstor.proxy: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    log.info(
        "pdstor.proxy: on http://%s:%d, prefill %s, decode %s", args.host, server.server_port, args.prefill, args.decode
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
