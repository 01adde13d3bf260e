"""What the end-to-end run serves with: a tiny Llama checkpoint a user's
``vllm serve`` loads (seeded weights, a word-level tokenizer, a chat
template), ``vllm serve`` processes, ``python -m pdstor.proxy``, and
OpenAI requests over HTTP (plain and streamed)."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from isa import avx2_env

BLOCK = 32  # the CPU backend needs a multiple of 32
MAX_MODEL_LEN = 512
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "vocab_size": 1024,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
# The chat template: each message's words, then the assistant's turn.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}w9"
# How long a server may take to start, and to answer one request (measured:
# 25-45 s to start on a 2-core VM).
START_S = 600
ANSWER_S = 300
# Servers run below the kernel's own workers and the daemon (see
# `server_cores` for what starved them here).
SERVER_NICE = 10


def make_model(model: Path, seed: int = 1234, config: dict | None = None, max_len: int = MAX_MODEL_LEN) -> str:
    """config.json (TINY_LLAMA, or `config`), model.safetensors and a
    tokenizer in `model`; answers the weights' SHA-256 (the connector's
    model_identity)."""
    config = config or TINY_LLAMA
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(config))
    write_tokenizer(model, max_len)
    return write_weights(model, seed, config)


def write_tokenizer(model: Path, max_len: int = MAX_MODEL_LEN) -> None:
    """A word-level tokenizer: ``<unk>`` ``<s>`` ``</s>``, then ``w3`` … ``w1023``
    (token id n is the word ``wn``), split on whitespace."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, TINY_LLAMA["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(str(model / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
    }
    (model / "tokenizer_config.json").write_text(json.dumps(config))


def write_weights(model: Path, seed: int, config: dict) -> str:
    """A seeded random checkpoint, scaled so that attention matters: vLLM's
    dummy weights (uniform ±1e-3) leave the output nearly independent of
    the KV cache, so a restore that wrote nothing would still match the
    oracle."""
    import torch
    from safetensors.torch import save_file

    c = config
    g = torch.Generator().manual_seed(seed)
    h, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * (h // c["num_attention_heads"])

    def w(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    tensors = {"model.embed_tokens.weight": w(v, h, std=1.0), "model.norm.weight": ones(h)}
    tensors["lm_head.weight"] = w(v, h, std=0.1)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "self_attn.q_proj.weight": w(h, h, std=0.15),
                p + "self_attn.k_proj.weight": w(kv, h, std=0.15),
                p + "self_attn.v_proj.weight": w(kv, h, std=0.15),
                p + "self_attn.o_proj.weight": w(h, h, std=0.15),
                p + "mlp.gate_proj.weight": w(f, h, std=0.05),
                p + "mlp.up_proj.weight": w(f, h, std=0.05),
                p + "mlp.down_proj.weight": w(h, f, std=0.05),
                p + "input_layernorm.weight": ones(h),
                p + "post_attention_layernorm.weight": ones(h),
            }
        )
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    return hashlib.sha256((model / "model.safetensors").read_bytes()).hexdigest()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A server in its own process group, its output in `log`."""

    def __init__(self, name: str, argv: list[str], log: Path, port: int, env: dict[str, str] | None = None):
        self.name, self.port, self.log = name, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.argv, self.env = argv, {**os.environ, **(env or {})}
        self.start()

    def start(self) -> None:
        """Starts it (again, after a kill): the same command, the same port."""
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )

    def wait_healthy(self, timeout_s: float = START_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                status, _ = request(self.url, "GET", "/health", None, 5)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not answer /health within {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def kill(self) -> None:
        """SIGKILL of its whole process group (vLLM's engine core is a child)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.kill()


def interrupt_cpus(path: Path) -> set[int]:
    """The CPUs that take the interrupts of the disk that holds `path` (the
    MSI vectors of its PCI device); empty where sysfs does not say (a loop
    device, zram, an overlay)."""
    dev = os.stat(path).st_dev
    node = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve()
    if (node / "partition").exists():
        node = node.parent
    device = (node / "device").resolve()
    while device != device.parent and not (device / "msi_irqs").is_dir():
        device = device.parent
    try:
        irqs = os.listdir(device / "msi_irqs")
    except OSError:
        return set()
    cpus: set[int] = set()
    for irq in irqs:
        try:
            text = Path(f"/proc/irq/{irq}/effective_affinity_list").read_text().strip()
        except OSError:
            continue
        for part in filter(None, text.split(",")):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def server_cores(out: Path) -> tuple[str, str]:
    """The cores for the prefill's side (prefill and oracle, which never
    compute at once) and for the decode: cores that do not take the
    interrupts of the disk the daemon's target is on, where there are any.

    Measured on a 2-core guest whose disk interrupts all land on CPU 1
    (6.18, `Dynamic Preempt: none`): with the decode bound to CPU 1, that
    core's per-CPU kernel workers starved for 37-189 s at a time (49
    `BUG: workqueue lockup`, every one on CPU 1), and among them the ext4
    O_DIRECT write completions (`iomap_dio_complete_work`) the daemon's
    stores wait for — publications then never became READY. With nothing of
    vLLM's bound to that core, none."""
    cpus = sorted(os.sched_getaffinity(0))
    busy = interrupt_cpus(out)
    # Where every core takes them, the prefill and the decode on two cores.
    quiet = [c for c in cpus if c not in busy] or cpus
    return str(quiet[0]), str(quiet[min(1, len(quiet) - 1)])


def written(path: Path, size: int) -> None:
    """`path` as `size` bytes of zeros, only its owner's, every block written
    (as an NVMe namespace is): a sparse file's first writes convert extents
    when they complete, on a kernel worker of the CPU that took the disk's
    interrupt (see `server_cores`)."""
    zeros = b"\0" * (1 << 20)
    path.unlink(missing_ok=True)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
        for _ in range(size >> 20):
            f.write(zeros)
        os.fsync(f.fileno())


def connector_config(role: str, daemon: Any, weights: str, timeline: Path | None = None) -> dict:
    """`--kv-transfer-config` for one engine of a pdstor P/D pair: the
    connector, its daemon's sockets and the weights' identity; `timeline`
    where the connector should record its side of each handoff."""
    extra: dict[str, Any] = {
        "server": daemon.server,
        "data_socket": daemon.data_socket,
        "model_identity": f"sha256:{weights[:16]}",
    }
    if timeline is not None:
        extra["timeline"] = str(timeline)
    return {
        "kv_connector": "PdstorConnector",
        "kv_connector_module_path": "pdstor.vllm",
        "kv_role": role,
        "engine_id": role,
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": extra,
    }


def vllm_serve(
    name: str,
    model: Path,
    out: Path,
    connector: dict[str, Any] | None,
    cores: str,
    max_len: int = MAX_MODEL_LEN,
    dtype: str = "bfloat16",
    batched_tokens: int | None = None,
    tp: int = 1,
) -> Process:
    """`vllm serve` of `model`, its model's threads bound to `cores` (vLLM's
    VLLM_CPU_OMP_THREADS_BIND, "0" or "0-1"; `server_cores` chooses). Bind
    each server to one core, or give servers that run at once cores of
    their own: a decode waiting for a handoff steps every millisecond
    (vLLM's engine loop), and an OpenMP team of several threads that shares
    its cores with that spins at its barriers — a prefill's forward pass
    then took 30 s instead of 30 ms here. Under tensor parallelism (`tp`)
    `cores` names each rank's, "|" between them ("0|1")."""
    port = free_port()
    argv = [
        # Below the kernel's own workers and the daemon: see the docstring.
        "nice", "-n", str(SERVER_NICE),
        # `vllm serve`'s server, launched by its module: vllm-cpu's `vllm`
        # command asks for the version of a distribution named "vllm" (it is
        # "vllm-cpu") and exits before it parses its arguments.
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--port", str(port), "--host", "127.0.0.1",
        "--block-size", str(BLOCK), "--dtype", dtype, "--max-model-len", str(max_len),
        "--enforce-eager", "--seed", "0", "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
        "--served-model-name", "tiny",
    ]  # fmt: skip
    if connector is not None:
        argv += ["--kv-transfer-config", json.dumps(connector)]
    if batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(batched_tokens)]
    if tp > 1:
        argv += ["--tensor-parallel-size", str(tp)]
    env = avx2_env(out, {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": cores})
    return Process(name, argv, out / f"{name}.log", port, env)


def proxy(prefill: Process, decode: Process, out: Path, server: str | None = None) -> Process:
    """`python -m pdstor.proxy`; given the daemon's control socket, decode
    requests wait in the proxy until their publication is READY."""
    port = free_port()
    argv = [sys.executable, "-m", "pdstor.proxy", "--prefill", prefill.url, "--decode", decode.url, "--port", str(port)]
    if server is not None:
        argv += ["--pdstor", server]
    return Process("proxy", argv, out / "proxy.log", port)


def request(url: str, method: str, path: str, body: dict | None, timeout_s: float = ANSWER_S) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, data, {"Content-Type": "application/json"} if data else {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def metric(url: str, series: str) -> float | None:
    """The sum of one series' samples (every label set) on the server's
    `/metrics`; None when `/metrics` does not answer 200."""
    status, body = request(url, "GET", "/metrics", None)
    if status != 200:
        return None
    return metric_text(body.decode(), series) or 0.0


def metric_text(text: str, series: str) -> float | None:
    """The sum of one series' samples (every label set, or none) in a
    `/metrics` exposition; None where it has none."""
    lines = [x for x in text.splitlines() if x.startswith((series + "{", series + " "))]
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines) if lines else None


def post(url: str, path: str, body: dict) -> tuple[int, dict, dict[str, str]]:
    """A request answered at once: its status, its JSON, its headers."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=ANSWER_S)
    try:
        conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = {"raw": raw.decode(errors="replace")}
        return resp.status, answer, {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def stream(url: str, path: str, body: dict) -> tuple[int, list[dict], dict[str, str]]:
    """A streamed request: its status, every server-sent event's JSON, its headers."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=ANSWER_S)
    try:
        conn.request("POST", path, json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        headers = {k.lower(): v for k, v in resp.getheaders()}
        events = []
        for line in resp.read().decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
        return resp.status, events, headers
    finally:
        conn.close()
