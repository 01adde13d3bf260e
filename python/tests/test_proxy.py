"""``python -m pdstor.proxy`` over real sockets, between two engines that
answer as vLLM's OpenAI server does (the prefill's ``kv_transfer_params``,
the decode's answer plain or streamed): what each engine is sent, what the
client gets, and every failure answered with its phase and words. The proxy
under ``vllm serve`` itself runs in ``cargo xtask vllm``."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

import pdstor
from conftest import LAYOUT

PARAMS = {"pdstor": {"receipt": "{}", "req": "vllm-prefill-7", "prompt_tokens": 3, "first_token": 42}}


class Engine(ThreadingHTTPServer):
    """An engine that records what it was sent and answers as told."""

    def __init__(self, role: str):
        self.role = role
        self.seen: list[dict[str, Any]] = []
        self.status = 200
        self.handover = True
        super().__init__(("127.0.0.1", 0), EngineHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"


class EngineHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Engine

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        self.answer(200, {"object": "list", "data": [{"id": "tiny"}]} if self.path == "/v1/models" else {})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append({"path": self.path, **body})
        if self.server.status != 200:
            self.answer(self.server.status, {"error": {"message": f"{self.server.role} refused"}})
        elif self.server.role == "prefill":
            self.answer(200, {"choices": [{"text": "w42"}], "kv_transfer_params": PARAMS if self.server.handover else None})
        elif body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for word in ("w42", " w7", " w9"):
                event = f"data: {json.dumps({'choices': [{'text': word}]})}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
            self.wfile.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
        else:
            self.answer(200, {"choices": [{"text": "w42 w7 w9"}]})

    def answer(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def engines():
    p, d = Engine("prefill"), Engine("decode")
    yield p, d
    p.shutdown()
    d.shutdown()


@pytest.fixture
def proxy(engines):
    yield from started_proxy(engines)


def started_proxy(engines, *extra: str):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p, d = engines
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdstor.proxy", "--prefill", p.url, "--decode", d.url, "--port", str(port), *extra],
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            break
        except (urllib.error.URLError, ConnectionError):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode() if proc.stderr else ""
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def post(url: str, body: Any) -> tuple[int, bytes, dict[str, str]]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def test_each_request_goes_to_prefill_for_one_token_then_unchanged_to_decode(engines, proxy):
    p, d = engines
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 16, "min_tokens": 4, "stream_options": {"include_usage": True}}
    status, data, headers = post(proxy + "/v1/completions", body)
    assert status == 200 and json.loads(data)["choices"][0]["text"] == "w42 w7 w9"
    assert headers["X-Pdstor-Publication"] == "vllm-prefill-7"
    [pre] = p.seen
    assert pre["max_tokens"] == 1 and pre["stream"] is False
    assert "min_tokens" not in pre and "stream_options" not in pre
    assert pre["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    [dec] = d.seen
    # The original request, with the prefill's kv_transfer_params.
    assert dec == {"path": "/v1/completions", **body, "kv_transfer_params": PARAMS}


def test_a_chat_request_is_streamed_back_as_the_decode_streams_it(engines, proxy):
    p, d = engines
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w5"}], "max_completion_tokens": 8, "stream": True}
    status, data, _ = post(proxy + "/v1/chat/completions", body)
    assert status == 200
    events = [line for line in data.decode().splitlines() if line.startswith("data: ")]
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]] == ["w42", " w7", " w9"]
    assert events[-1] == "data: [DONE]"
    assert p.seen[0]["max_completion_tokens"] == 1 and p.seen[0]["stream"] is False
    assert d.seen[0]["stream"] is True and d.seen[0]["max_completion_tokens"] == 8


def test_a_prefill_that_fails_or_hands_nothing_over_fails_the_request_and_decode_is_never_asked(engines, proxy):
    p, d = engines
    p.status = 503
    status, data, _ = post(proxy + "/v1/completions", {"prompt": [1], "max_tokens": 2})
    err = json.loads(data)["error"]
    assert status == 503 and err["phase"] == "prefill" and "prefill refused" in err["message"]
    p.status, p.handover = 200, False
    status, data, _ = post(proxy + "/v1/completions", {"prompt": [1], "max_tokens": 2})
    assert status == 502 and "handed nothing over" in json.loads(data)["error"]["message"]
    assert d.seen == []


def test_requests_the_protocol_cannot_carry_are_refused_before_any_engine_is_asked(engines, proxy):
    p, d = engines
    for body, words in (
        ({"prompt": [1], "n": 2}, "n=2"),
        ({"prompt": [1], "kv_transfer_params": {"x": 1}}, "kv_transfer_params are this proxy's"),
    ):
        status, data, _ = post(proxy + "/v1/completions", body)
        assert status == 400 and words in json.loads(data)["error"]["message"]
    status, data, _ = post(proxy + "/v1/completions", b"not json".decode())
    assert status == 400
    status, _, _ = post(proxy + "/v1/embeddings", {"input": "w1"})
    assert status == 404
    assert p.seen == [] and d.seen == []
    stats = json.loads(urllib.request.urlopen(proxy + "/pdstor/stats", timeout=5).read())
    assert stats["refused"] == 3 and stats["requests"] == 3


def test_a_decode_that_fails_answers_its_status_and_words(engines, proxy):
    _, d = engines
    d.status = 500
    status, data, _ = post(proxy + "/v1/completions", {"prompt": [1], "max_tokens": 2})
    assert status == 500 and json.loads(data)["error"]["message"] == "decode refused"


def test_an_engine_url_with_a_path_is_refused_at_start():
    out = subprocess.run(
        [sys.executable, "-m", "pdstor.proxy", "--prefill", "http://h:1/v1", "--decode", "http://h:2"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "give http://HOST:PORT" in out.stderr


@pytest.fixture
def gated_proxy(engines, daemon):
    yield from started_proxy(engines, "--pdstor", daemon.server)


def test_with_the_daemon_a_decode_is_sent_once_its_publication_is_ready_or_gone(engines, daemon, gated_proxy):
    """--pdstor: the decode request waits in the proxy while the prefill's
    publication is PREPARED, goes on once it is READY; one that is rolled
    back goes on at once (the decode answers for it), counted."""
    p, d = engines
    url = gated_proxy
    client = daemon.client()
    buf = pdstor.Buffer(1 << 20)
    w = pdstor.Writer(client)
    w.prepare(PARAMS["pdstor"]["req"], LAYOUT, total_chunks=1, timeout_ms=1000)
    answers: list[int] = []
    sent = threading.Thread(target=lambda: answers.append(post(url + "/v1/completions", {"prompt": [5], "max_tokens": 4})[0]))
    sent.start()
    time.sleep(0.5)
    assert len(p.seen) == 1 and d.seen == [], "the decode is not asked while the publication is PREPARED"
    w.store([(0, buf, 0, 1 << 20)], last=True)
    ready = w.publish(first_token=42)
    sent.join(10)
    assert answers == [200] and len(d.seen) == 1
    client.release(ready)

    w.prepare(PARAMS["pdstor"]["req"], LAYOUT, total_chunks=1, timeout_ms=1000)
    w.abort()
    assert post(url + "/v1/completions", {"prompt": [5], "max_tokens": 4})[0] == 200 and len(d.seen) == 2
    with urllib.request.urlopen(url + "/pdstor/stats", timeout=5) as r:
        assert json.loads(r.read())["sent_unready"] == 1


def test_a_daemon_that_does_not_answer_stops_the_proxy_at_start(engines, tmp_path):
    p, d = engines
    ran = subprocess.run(
        [sys.executable, "-m", "pdstor.proxy", "--prefill", p.url, "--decode", d.url, "--pdstor", f"unix:{tmp_path}/none.sock"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert ran.returncode == 2 and "does not answer" in ran.stderr and "leave --pdstor out" in ran.stderr
