"""The router service on a live cluster (directory + two segments) in front of two stand-in
engines (`tests.integration.fake_engine`): the index follows the directory (listing at start,
events after, a segment's death within seconds), the `route` endpoint answers from it, the HTTP
front passes streams through byte for byte, fails over before the first byte when an engine
dies, and refuses past its admission bounds with 429 + Retry-After."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

from kvfabric.cluster.requests import request as nats_request
from kvfabric.proto import router as r
from kvfabric.proto.subjects import Service, endpoint_subject
from kvfabric.router.tenants import key_digest
from kvfabric.testing import NatsServer, ServiceProcess, metric_value
from kvfabric.testing.ports import free_port
from tests.integration.clientkit import SPEC, TOKENS_PER_CHUNK, client, objects_for, prompt
from tests.integration.cluster import directory_process, segment_process, service_process

pytestmark = pytest.mark.integration

CHUNKS = 8
SEG_A, SEG_B = "seg-a", "seg-b"
KEYSPACE = {
    "tenant_id": SPEC.domain.tenant_id,
    "domain_salt_hex": SPEC.domain.salt.hex(),
    "model_id": SPEC.model.model_id,
    "weights_revision": SPEC.model.weights_revision,
    "kv_dtype": SPEC.model.kv_dtype,
    "attn_config_digest": SPEC.model.attn_config_digest,
    "tensor_layout": SPEC.layout.tensor_layout,
    "tokens_per_chunk": TOKENS_PER_CHUNK,
}
# Loading is far cheaper than computing here (16-token chunks of 64 KiB: compute would win).
COEFFICIENTS = {
    "overhead_s": 0.01,
    "prefill_tokens_per_s": 1000,
    "colocated_bytes_per_s": 1e10,
    "remote_bytes_per_s": 1e8,
}


@contextlib.contextmanager
def fake_engine(name: str, port: int, *models_sleep_and_pad: str) -> Iterator[ServiceProcess]:
    # The repository root on the path: `tests.` is importable whatever pytest's working directory
    # (run from tests/integration, the engine never started and every route named A alone).
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    proc = ServiceProcess.python_module(
        "tests.integration.fake_engine", str(port), name, *models_sleep_and_pad, env=env
    )
    proc.start()
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline or proc.returncode is not None:
                pytest.fail(f"fake engine {name} did not start: {proc.output_tail(20)}")
            time.sleep(0.1)
        yield proc
    finally:
        proc.stop(timeout_s=5.0)


@contextlib.contextmanager
def router(
    nats_server: NatsServer, ports: dict[str, int], **env: str
) -> Iterator[tuple[ServiceProcess, int]]:
    http_port = free_port()
    engines = [
        {"id": "A", "url": f"http://127.0.0.1:{ports['A']}", "segments": [SEG_A], "cache_chunks": 0},
        {"id": "B", "url": f"http://127.0.0.1:{ports['B']}", "segments": [SEG_B], "cache_chunks": 0},
    ]
    settings = {
        "KVF_ROUTER_ENGINES": json.dumps(engines),
        "KVF_ROUTER_KEYSPACE": json.dumps(KEYSPACE),
        "KVF_ROUTER_COEFFICIENTS": json.dumps(COEFFICIENTS),
        "KVF_ROUTER_HTTP_PORT": str(http_port),
        "KVF_ROUTER_HEALTH_INTERVAL_MS": "200",
        **env,
    }
    with service_process(nats_server, "kvfabric.router", "router_started", **settings) as proc:
        yield proc, http_port


async def ask_route(url: str, tokens: list[int]) -> r.RouteReply:
    nc = await nats.connect(url)
    try:
        reply: Any = await nats_request(
            nc,
            endpoint_subject(Service.ROUTER, "route"),
            r.RouteRequest(tokens=tokens),
            r.router_decoder,
            5.0,
        )
        assert isinstance(reply, r.RouteReply)
        return reply
    finally:
        await nc.close()


def wait_until(what: str, check: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s} s (last: {got!r})")
        time.sleep(0.1)


def wait_in_flight(base: str, n: int) -> None:
    """Until the router has admitted `n` requests (a fixed sleep was a guess at how soon a pool
    thread's request reaches it on a loaded host)."""

    def admitted() -> bool:
        text = httpx.get(f"{base}/metrics", timeout=5).text
        return (metric_value(text, "kvfabric_router_state", name="in_flight") or 0) >= n

    wait_until(f"{n} in flight", admitted, 10)


def by_instance(reply: r.RouteReply) -> dict[str, r.InstanceEstimate]:
    return {e.instance: e for e in reply.estimates}


def test_router_follows_the_directory_and_fails_over(nats_server: NatsServer) -> None:
    saved_before = prompt(CHUNKS * TOKENS_PER_CHUNK + 5, seed=1)
    saved_after = prompt(CHUNKS * TOKENS_PER_CHUNK + 5, seed=2)
    ports = {"A": free_port(), "B": free_port()}
    with contextlib.ExitStack() as stack:
        stack.enter_context(  # 6 beats in the timeout: a late beat on a loaded host is not a death
            directory_process(
                nats_server,
                KVF_DIRECTORY_HEARTBEAT_TIMEOUT_MS="1500",
                KVF_DIRECTORY_HEARTBEAT_INTERVAL_MS="250",
            )
        )
        seg_a = stack.enter_context(segment_process(nats_server, SEG_A, KVF_SEGMENT_ZONE="za"))
        with client(nats_server) as writer:  # only seg-a exists: the prefix lands there
            assert writer.save(saved_before, objects_for(saved_before, 0, CHUNKS)).chunks_saved == CHUNKS
        stack.enter_context(segment_process(nats_server, SEG_B, KVF_SEGMENT_ZONE="zb"))
        stack.enter_context(fake_engine("A", ports["A"]))
        engine_b = stack.enter_context(fake_engine("B", ports["B"]))
        proc, http_port = stack.enter_context(router(nats_server, ports))
        base = f"http://127.0.0.1:{http_port}"

        # Listing at start: the prefix saved before the router existed is known, co-located on A.
        # (B too must have answered its first health check: a route asked before that names A
        # alone, as a local run of 2026-12-05 found.)
        def routed_to_a() -> r.RouteReply | None:
            reply = asyncio.run(ask_route(nats_server.url, saved_before))
            est = by_instance(reply)
            return reply if reply.instance == "A" and est["A"].colocated_tokens and "B" in est else None

        reply = wait_until("the listed prefix routes to A", routed_to_a, 15)
        est = by_instance(reply)
        assert est["A"].colocated_tokens == CHUNKS * TOKENS_PER_CHUNK and est["A"].remote_tokens == 0
        assert est["B"].remote_tokens == CHUNKS * TOKENS_PER_CHUNK and est["B"].colocated_tokens == 0
        assert reply.reason == "cache_aware"
        proc.wait_for_event("index_resynced", 5.0)

        # Events after: a prefix saved now (on both segments) is known within a second or so.
        with client(nats_server) as writer:
            assert writer.save(saved_after, objects_for(saved_after, 0, CHUNKS)).chunks_saved == CHUNKS
        wait_until(
            "the new prefix is indexed",
            lambda: (
                max(
                    e.colocated_tokens + e.remote_tokens
                    for e in asyncio.run(ask_route(nats_server.url, saved_after)).estimates
                )
                == CHUNKS * TOKENS_PER_CHUNK
            ),
            10,
        )

        # Streaming passthrough: the engine's bytes, unchanged; the trace id goes to the engine.
        body = {"prompt": saved_before, "max_tokens": 5, "stream": True}
        with httpx.stream(
            "POST", f"{base}/v1/completions", json=body, headers={"X-Kvf-Trace-Id": "trace-123"}, timeout=10
        ) as resp:
            assert resp.status_code == 200 and resp.headers["x-kvf-trace-id"] == "trace-123"
            streamed = b"".join(resp.iter_raw())
        events = [
            json.loads(line[6:]) for line in streamed.decode().split("\n\n") if line.startswith("data: {")
        ]
        assert [e["i"] for e in events] == list(range(5))
        assert {e["engine"] for e in events} == {"A"} and events[0]["rid"] == "trace-123"
        assert streamed.endswith(b"data: [DONE]\n\n")

        # The segment holding the first prefix dies: within seconds the router stops counting it.
        seg_a.send_signal(signal.SIGKILL)
        wait_until(
            "seg-a's chunks forgotten",
            lambda: all(
                e.colocated_tokens + e.remote_tokens == 0
                for e in asyncio.run(ask_route(nats_server.url, saved_before)).estimates
            ),
            10,
        )

        # Failover: B dies while requests wait for their first byte there; none is lost.
        slow = {"prompt": [7] * 40, "max_tokens": 2, "stream": True, "fake_first_byte_s": 1.5}

        def send(i: int) -> tuple[int, str]:
            with httpx.stream("POST", f"{base}/v1/completions", json=slow, timeout=30) as resp:
                return resp.status_code, resp.headers.get("x-kvf-instance", "")

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(send, i) for i in range(6)]
            time.sleep(0.6)  # every request is at an engine, none has its first byte
            engine_b.send_signal(signal.SIGKILL)
            results = [f.result() for f in futures]
        assert all(status == 200 for status, _ in results), results
        assert {inst for _, inst in results} == {"A"}
        metrics = httpx.get(f"{base}/metrics", timeout=5).text
        assert 'kvfabric_router_failovers_total{instance="B"' in metrics
        assert (
            "kvfabric_router_ttft_seconds_count" in metrics and "kvfabric_router_estimate_seconds" in metrics
        )
        assert "kvfabric_router_ttft_error_seconds" in metrics
        # B is dead: the health checks keep it out.
        wait_until(
            "B seen down", lambda: httpx.get(f"{base}/health", timeout=5).json()["engines_up"] == ["A"], 5
        )
        reply = asyncio.run(ask_route(nats_server.url, saved_after))
        assert reply.instance == "A" and [e.instance for e in reply.estimates] == ["A"]


def test_router_admission_refuses_with_retry_after(nats_server: NatsServer) -> None:
    ports = {"A": free_port(), "B": free_port()}
    with contextlib.ExitStack() as stack:
        stack.enter_context(directory_process(nats_server))
        stack.enter_context(fake_engine("A", ports["A"]))
        stack.enter_context(fake_engine("B", ports["B"]))
        _, http_port = stack.enter_context(
            router(nats_server, ports, KVF_ROUTER_ADMITTED_MAX="3", KVF_ROUTER_TENANT_INFLIGHT_MAX="2")
        )
        base = f"http://127.0.0.1:{http_port}"
        wait_until(
            "engines up", lambda: len(httpx.get(f"{base}/health", timeout=5).json()["engines_up"]) == 2, 10
        )
        slow = {"prompt": [5] * 40, "max_tokens": 1, "fake_first_byte_s": 4.0}  # in flight meanwhile

        def send(tenant: str) -> httpx.Response:
            return httpx.post(
                f"{base}/v1/completions", json=slow, headers={"X-Kvf-Tenant": tenant}, timeout=30
            )

        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            first = [pool.submit(send, "t1") for _ in range(2)]
            wait_in_flight(base, 2)
            over_tenant = send("t1")  # t1 holds its 2
            other = pool.submit(send, "t2")  # t2 still gets in: 3 in flight
            wait_in_flight(base, 3)
            over_total = send("t3")
            done = [f.result() for f in [*first, other]]
        assert over_tenant.status_code == 429 and int(over_tenant.headers["retry-after"]) >= 1
        assert over_tenant.json()["error"]["message"] == "tenant_inflight_max"
        assert over_total.status_code == 429 and over_total.json()["error"]["message"] == "admitted_max"
        assert all(resp.status_code == 200 for resp in done)
        assert (
            httpx.post(
                f"{base}/v1/completions", json={**slow, "fake_first_byte_s": 0}, timeout=10
            ).status_code
            == 200
        )
        metrics = httpx.get(f"{base}/metrics", timeout=5).text
        assert 'kvfabric_router_refused_total{reason="tenant_inflight_max"} 1.0' in metrics
        assert 'kvfabric_router_refused_total{reason="admitted_max"} 1.0' in metrics


def test_router_api_keys_name_the_tenant_and_the_engine_key_is_sent(nats_server: NatsServer) -> None:
    """With `KVF_ROUTER_API_KEYS`, a request without a known key is 401; the key, not the
    `X-Kvf-Tenant` header, names the tenant whose in-flight bound it counts against (bob cannot
    take alice's share by naming her, nor dodge his own); `KVF_ROUTER_ENGINE_API_KEY` reaches the
    engines, on completions and on `/v1/models`."""
    ports = {"A": free_port(), "B": free_port()}
    keys = {"alice": [key_digest("alice-key")], "bob": [key_digest("bob-key")]}
    with contextlib.ExitStack() as stack:
        stack.enter_context(directory_process(nats_server))
        stack.enter_context(fake_engine("A", ports["A"]))
        stack.enter_context(fake_engine("B", ports["B"]))
        _, http_port = stack.enter_context(
            router(
                nats_server,
                ports,
                KVF_ROUTER_TENANT_INFLIGHT_MAX="1",
                KVF_ROUTER_API_KEYS=json.dumps(keys),
                KVF_ROUTER_ENGINE_API_KEY="engine-secret",
            )
        )
        base = f"http://127.0.0.1:{http_port}"
        wait_until(
            "engines up", lambda: len(httpx.get(f"{base}/health", timeout=5).json()["engines_up"]) == 2, 10
        )
        quick = {"prompt": [5] * 40, "max_tokens": 1}

        def send(key: str | None, tenant: str = "", first_byte_s: float = 0.0) -> httpx.Response:
            headers = {"X-Kvf-Tenant": tenant} if tenant else {}
            if key is not None:
                headers["Authorization"] = f"Bearer {key}"
            body = {**quick, "fake_first_byte_s": first_byte_s}
            return httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=30)

        for refused in (send(None, "alice"), send("not-a-key"), send("x" * 600)):
            assert refused.status_code == 401, refused.text
            assert refused.headers["www-authenticate"] == "Bearer"
        ok = send("bob-key")
        assert ok.status_code == 200 and ok.json()["auth"] == "Bearer engine-secret"
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            alices = pool.submit(send, "alice-key", "", 2.0)
            wait_in_flight(base, 1)
            as_bob = send("alice-key", "bob")  # alice's key, bob's name: still alice's bound
            bobs = send("bob-key", "alice")  # bob's key, alice's name: bob's bound, free
            assert alices.result().status_code == 200
        assert as_bob.status_code == 429 and as_bob.json()["error"]["message"] == "tenant_inflight_max"
        assert bobs.status_code == 200
        assert httpx.get(f"{base}/v1/models", timeout=5).status_code == 401
        listed = httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer bob-key"}, timeout=5)
        assert listed.status_code == 200
        assert listed.json()["data"][0]["id"] in ("A", "B")
        assert listed.json()["auth"] == "Bearer engine-secret"
        metrics = httpx.get(f"{base}/metrics", timeout=5).text
        assert 'kvfabric_router_refused_total{reason="unauthenticated"} 3.0' in metrics


def test_router_bounds_v1_models_calls_and_answers(nats_server: NatsServer) -> None:
    """`/v1/models` is relayed at most 4 at a time (the rest 429 at once, so a flood of it cannot
    take the pool's connections from completions) and an engine's answer over 1 MiB is a 502,
    not buffered whole."""
    ports = {"A": free_port(), "B": free_port()}
    with contextlib.ExitStack() as stack:
        stack.enter_context(directory_process(nats_server))
        stack.enter_context(fake_engine("A", ports["A"], "1.5", str(2 << 20)))
        stack.enter_context(fake_engine("B", ports["B"], "1.5", str(2 << 20)))
        _, http_port = stack.enter_context(router(nats_server, ports))
        base = f"http://127.0.0.1:{http_port}"
        wait_until(
            "engines up", lambda: len(httpx.get(f"{base}/health", timeout=5).json()["engines_up"]) == 2, 10
        )
        with concurrent.futures.ThreadPoolExecutor(7) as pool:
            calls = [pool.submit(httpx.get, f"{base}/v1/models", timeout=30) for _ in range(7)]
            time.sleep(0.5)  # the first four are waiting on the engine
            answered = httpx.post(
                f"{base}/v1/completions", json={"prompt": [5] * 40, "max_tokens": 1}, timeout=10
            )
            statuses = sorted(c.result().status_code for c in calls)
        assert statuses == [429, 429, 429, 502, 502, 502, 502], statuses
        assert answered.status_code == 200


def test_router_refits_coefficients_from_realised_ttft(nats_server: NatsServer) -> None:
    """With `KVF_ROUTER_REFIT` on, each request's realised TTFT (engines answering after 0.3 s,
    30x the configured overhead) is an observation: after a few the `route` endpoint estimates
    about 0.3 s and /metrics shows the refitted coefficients; without the proxy reporting
    realised TTFTs nothing would be observed and the estimate would stay at the prior (0.05 s)."""
    ports = {"A": free_port(), "B": free_port()}
    tokens = [5] * 40
    with contextlib.ExitStack() as stack:
        stack.enter_context(directory_process(nats_server))
        stack.enter_context(fake_engine("A", ports["A"]))
        stack.enter_context(fake_engine("B", ports["B"]))
        _, http_port = stack.enter_context(
            router(nats_server, ports, KVF_ROUTER_REFIT='{"min_observations": 4, "refit_every": 1}')
        )
        base = f"http://127.0.0.1:{http_port}"
        wait_until(
            "engines up", lambda: len(httpx.get(f"{base}/health", timeout=5).json()["engines_up"]) == 2, 10
        )
        prior = by_instance(asyncio.run(ask_route(nats_server.url, tokens)))
        assert all(abs(e.ttft_s - 0.05) < 0.001 for e in prior.values())  # 0.01 + 40 / 1000
        for _ in range(6):
            resp = httpx.post(
                f"{base}/v1/completions",
                json={"prompt": tokens, "max_tokens": 2, "stream": True, "fake_first_byte_s": 0.3},
                timeout=30,
            )
            assert resp.status_code == 200
        metrics = httpx.get(f"{base}/metrics", timeout=5).text
        assert 'kvfabric_router_state{name="refit_fitted"} 1.0' in metrics
        assert 'kvfabric_router_state{name="refit_observations"} 6.0' in metrics
        assert 'kvfabric_router_coefficient{name="overhead_s"}' in metrics
        fitted = by_instance(asyncio.run(ask_route(nats_server.url, tokens)))
        assert all(0.28 <= e.ttft_s <= 0.6 for e in fitted.values()), fitted  # 0.3 s + the relay


def test_an_engine_answering_5xx_stays_in_routing_and_an_oversized_body_is_refused(
    nats_server: NatsServer,
) -> None:
    """Review, 2026-12-05: a 5xx (a poison input, say) or a slow first byte marked the engine down
    and wiped what the router learned of its cache; a request 500ing everywhere took every engine
    out. Now only an engine that cannot be reached is marked down. And a body was read whole
    before its size was checked: one over 16 MiB is refused from its Content-Length."""
    ports = {"A": free_port(), "B": free_port()}
    with contextlib.ExitStack() as stack:
        stack.enter_context(directory_process(nats_server))
        stack.enter_context(fake_engine("A", ports["A"]))
        stack.enter_context(fake_engine("B", ports["B"]))
        _, http_port = stack.enter_context(router(nats_server, ports))
        base = f"http://127.0.0.1:{http_port}"
        wait_until(
            "engines up", lambda: len(httpx.get(f"{base}/health", timeout=5).json()["engines_up"]) == 2, 10
        )
        broken = {"prompt": [0] * 20, "max_tokens": 1, "stream": True}  # the fake answers 500
        failed = httpx.post(f"{base}/v1/completions", json=broken, timeout=10)
        assert failed.status_code == 502, failed.text
        metrics = httpx.get(f"{base}/metrics", timeout=5).text
        assert 'kvfabric_router_state{name="core_instance_down"} 0.0' in metrics, metrics
        assert 'kvfabric_router_failovers_total{instance="A"' in metrics
        assert 'kvfabric_router_failovers_total{instance="B"' in metrics
        assert httpx.get(f"{base}/health", timeout=5).json()["engines_up"] == ["A", "B"]
        too_big = httpx.post(
            f"{base}/v1/completions",
            content=b" " * ((16 << 20) + 1),
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert too_big.status_code == 413
        ok = httpx.post(f"{base}/v1/completions", json={"prompt": [5] * 20, "max_tokens": 1}, timeout=10)
        assert ok.status_code == 200 and ok.json()["engine"] in ("A", "B")
        metrics = httpx.get(f"{base}/metrics", timeout=5).text
        assert 'kvfabric_router_state{name="in_flight"} 0.0' in metrics, metrics
