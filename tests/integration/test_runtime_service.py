"""`ServiceRuntime` in process against a real nats-server: error mapping, log context, fatal
invariant violations, shutdown grace, NATS restarts and loss, and the client helper's outcomes."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import msgspec
import pytest
import pytest_asyncio
import structlog
from nats.aio.client import Client as NatsClient

from kvfabric.cluster.requests import request
from kvfabric.format.errors import Indeterminate, KvfError, NotFound, Unavailable
from kvfabric.format.invariant import invariant
from kvfabric.proto.common import TRACE_ID_HEADER
from kvfabric.proto.echo import EchoReply, EchoRequest, echo_decoder
from kvfabric.proto.subjects import Service, endpoint_subject
from kvfabric.runtime import (
    EXIT_OK,
    EXIT_SOFTWARE,
    EXIT_UNAVAILABLE,
    RuntimeSettings,
    ServiceRuntime,
)
from kvfabric.runtime.echo_service import EchoHandler
from kvfabric.runtime.service import RuntimeState
from kvfabric.testing import NatsServer, free_port, metric_value, scrape_metrics_async, wait_until

pytestmark = pytest.mark.integration

LogRecords = Callable[[], list[dict[str, Any]]]  # the `json_logs` fixture (tests/conftest.py)

TIMEOUT_S = 5.0
SAY = endpoint_subject(Service.ECHO, "say")
BOOM = endpoint_subject(Service.ECHO, "boom")
BUG = endpoint_subject(Service.ECHO, "bug")
MISSING = endpoint_subject(Service.ECHO, "missing")


async def boom(data: bytes, headers: Mapping[str, str]) -> EchoReply:
    raise RuntimeError("secret detail")


async def bug(data: bytes, headers: Mapping[str, str]) -> EchoReply:
    invariant(False, "slot generation went backwards", slot=7)
    raise AssertionError("unreachable")


async def missing(data: bytes, headers: Mapping[str, str]) -> EchoReply:
    structlog.get_logger("test.handler").info("lookup_missed")
    raise NotFound("no such prefix", shard=3)


def make_runtime(server: NatsServer, **overrides: Any) -> ServiceRuntime:
    values: dict[str, Any] = {
        "nats_url": server.url,
        "instance_id": "rt-1",
        "metrics_port": -1,
        "nats_reconnect_wait_ms": 50,
        "shutdown_grace_ms": 2_000,
    }
    values.update(overrides)
    runtime = ServiceRuntime(Service.ECHO, RuntimeSettings(**values), version="1.2.3", description="test")
    runtime.add_endpoint("say", EchoHandler("rt-1").say, request=EchoRequest, decoder=echo_decoder)
    runtime.add_endpoint("boom", boom)
    runtime.add_endpoint("bug", bug)
    runtime.add_endpoint("missing", missing)
    return runtime


@pytest_asyncio.fixture
async def started(nats_server: NatsServer) -> AsyncIterator[Callable[..., Awaitable[ServiceRuntime]]]:
    """`await started(**settings)`: a started runtime, stopped after the test."""
    runtimes: list[ServiceRuntime] = []

    async def start(**overrides: Any) -> ServiceRuntime:
        runtime = make_runtime(nats_server, **overrides)
        runtimes.append(runtime)
        await asyncio.wait_for(runtime.start(), TIMEOUT_S)
        return runtime

    yield start
    for runtime in runtimes:
        await asyncio.wait_for(runtime.stop(), TIMEOUT_S)


async def say(nc: NatsClient, text: str, delay_ms: int = 0, timeout_s: float = TIMEOUT_S) -> EchoReply:
    reply = await request(nc, SAY, EchoRequest(text=text, delay_ms=delay_ms), echo_decoder, timeout_s)
    assert isinstance(reply, EchoReply)
    return reply


async def until(condition: Callable[[], bool], timeout_s: float = TIMEOUT_S) -> None:
    await wait_until(condition, timeout_s)


async def test_unexpected_exception_is_a_500_and_service_keeps_serving(
    nats_client: NatsClient, started: Callable[..., Awaitable[ServiceRuntime]], json_logs: LogRecords
) -> None:
    runtime = await started()
    with pytest.raises(KvfError) as internal:
        await request(nats_client, BOOM, EchoRequest(text="x"), echo_decoder, TIMEOUT_S)
    assert type(internal.value) is KvfError
    assert internal.value.code == "internal"
    assert internal.value.message == "internal error (RuntimeError)"
    assert "secret detail" not in repr(internal.value), "exception text stays server-side"

    assert (await say(nats_client, "still here")).text == "still here"
    (failed,) = [r for r in json_logs() if r["event"] == "request_handled" and r["outcome"] == "internal"]
    assert failed["level"] == "error"
    assert "RuntimeError: secret detail" in failed["exception"]
    text = runtime.metrics.exposition().decode()
    assert metric_value(text, "kvfabric_echo_errors_total", code="internal") == 1.0
    assert metric_value(text, "kvfabric_echo_requests_total", endpoint="boom", outcome="internal") == 1.0


async def test_expected_error_keeps_its_type_and_details(
    nats_client: NatsClient, started: Callable[..., Awaitable[ServiceRuntime]]
) -> None:
    await started()
    with pytest.raises(NotFound) as missed:
        await request(nats_client, MISSING, EchoRequest(text="x"), echo_decoder, TIMEOUT_S)
    assert (missed.value.message, missed.value.details) == ("no such prefix", {"shard": 3})


async def test_request_context_is_bound_for_the_handler_and_the_summary_line(
    nats_client: NatsClient, started: Callable[..., Awaitable[ServiceRuntime]], json_logs: LogRecords
) -> None:
    await started()
    with pytest.raises(NotFound):
        await request(
            nats_client,
            MISSING,
            EchoRequest(text="payload-marker-51c2"),
            echo_decoder,
            TIMEOUT_S,
            request_id="req-1",
            headers={TRACE_ID_HEADER: "trace-1"},
        )
    records = json_logs()
    inner = next(r for r in records if r["event"] == "lookup_missed")
    summary = next(r for r in records if r["event"] == "request_handled")
    for record in (inner, summary):
        assert record["request_id"] == "req-1"
        assert record["trace_id"] == "trace-1"
        assert record["subject"] == MISSING
        assert (record["service"], record["instance_id"]) == ("echo", "rt-1")
    assert (summary["outcome"], summary["error_code"], summary["endpoint"]) == (
        "error",
        "not_found",
        "missing",
    )
    assert summary["duration_ms"] >= 0
    assert "payload-marker-51c2" not in json.dumps(records)
    # Bound per request only: later lines outside a request do not carry it.
    await say(nats_client, "next")
    last = [r for r in json_logs() if r["event"] == "request_handled"][-1]
    assert last["request_id"] is None


async def test_invariant_violation_logs_once_and_exits_non_zero(
    nats_server: NatsServer, nats_client: NatsClient, json_logs: LogRecords
) -> None:
    runtime = make_runtime(nats_server)
    run = asyncio.create_task(runtime.run())
    await until(lambda: runtime.state is RuntimeState.RUNNING)

    with pytest.raises(KvfError) as internal:
        await request(nats_client, BUG, EchoRequest(text="x"), echo_decoder, TIMEOUT_S)
    assert internal.value.code == "internal"
    assert await asyncio.wait_for(run, TIMEOUT_S) == EXIT_SOFTWARE

    records = json_logs()
    (violated,) = [r for r in records if r["event"] == "invariant_violated"]
    assert violated["level"] == "critical"
    assert "slot generation went backwards slot=7" in violated["exception"]
    stopped = next(r for r in records if r["event"] == "service_stopped")
    assert (stopped["reason"], stopped["exit_code"]) == ("invariant_violated", EXIT_SOFTWARE)


async def test_shutdown_grace_bounds_the_wait_and_client_sees_indeterminate(
    nats_client: NatsClient, started: Callable[..., Awaitable[ServiceRuntime]], json_logs: LogRecords
) -> None:
    runtime = await started(shutdown_grace_ms=100)
    stuck = asyncio.create_task(say(nats_client, "stuck", delay_ms=5_000, timeout_s=1.0))
    await until(lambda: runtime.inflight_count == 1)

    stop_s = time.monotonic()
    assert await asyncio.wait_for(runtime.stop(), TIMEOUT_S) == EXIT_OK
    assert time.monotonic() - stop_s < 1.0
    with pytest.raises(Indeterminate):
        await stuck
    records = json_logs()
    assert next(r for r in records if r["event"] == "inflight_cancelled")["count"] == 1
    assert [r["outcome"] for r in records if r["event"] == "request_handled"] == ["cancelled"]
    assert runtime.inflight_count == 0


async def test_stop_serving_ends_requests_first_and_keeps_nats_for_the_shells_stop(
    nats_client: NatsClient, started: Callable[..., Awaitable[ServiceRuntime]]
) -> None:
    """`stop_serving` (the first half of `stop`, run before a shell's stop): a request in
    flight is answered within its grace, no new one is taken (no responders), and the runtime's
    NATS connection stays up for the shell's own stop; `stop` then finishes (review,
    2026-12-05: shells stopped first, their handlers ran on what the stop released)."""
    runtime = await started()
    in_flight = asyncio.create_task(say(nats_client, "last", delay_ms=200))
    await until(lambda: runtime.inflight_count == 1)
    await asyncio.wait_for(runtime.stop_serving(), TIMEOUT_S)
    assert (await in_flight).text == "last"
    with pytest.raises(Unavailable):
        await say(nats_client, "after", timeout_s=1.0)
    assert runtime.nc is not None and runtime.nc.is_connected
    assert await asyncio.wait_for(runtime.stop(), TIMEOUT_S) == EXIT_OK


async def test_service_keeps_serving_across_a_nats_restart(
    nats_server: NatsServer, nats_client: NatsClient, started: Callable[..., Awaitable[ServiceRuntime]]
) -> None:
    runtime = await started()
    assert (await say(nats_client, "before")).text == "before"
    await asyncio.to_thread(nats_server.restart)

    async def until_answered(attempts_max: int = 40) -> EchoReply:
        for _ in range(attempts_max):
            try:
                return await say(nats_client, "after", timeout_s=0.5)
            except (Unavailable, Indeterminate):  # not reconnected / resubscribed yet
                await asyncio.sleep(0.05)
        raise TimeoutError("no reply after the NATS restart")

    assert (await asyncio.wait_for(until_answered(), TIMEOUT_S * 4)).text == "after"
    assert runtime.state is RuntimeState.RUNNING


async def test_nats_lost_past_the_reconnect_budget_exits_unavailable(
    nats_server: NatsServer, json_logs: LogRecords
) -> None:
    runtime = make_runtime(nats_server, nats_reconnect_attempts_max=1)
    run = asyncio.create_task(runtime.run())
    await until(lambda: runtime.state is RuntimeState.RUNNING)

    await asyncio.to_thread(nats_server.kill)
    assert await asyncio.wait_for(run, TIMEOUT_S * 2) == EXIT_UNAVAILABLE
    assert any(r["event"] == "nats_connection_lost" for r in json_logs())


async def test_start_fails_fast_when_nats_is_unreachable(nats_server: NatsServer) -> None:
    runtime = make_runtime(
        nats_server,
        nats_url=f"nats://127.0.0.1:{free_port()}",
        nats_reconnect_attempts_max=1,
        metrics_port=0,
    )
    with pytest.raises(Unavailable, match="cannot connect to NATS"):
        await asyncio.wait_for(runtime.start(), TIMEOUT_S)
    assert runtime.state is RuntimeState.STOPPED
    assert runtime.metrics_port is None, "the metrics port is released on a failed start"


async def test_metrics_port_zero_is_bound_reported_and_released(
    nats_client: NatsClient, started: Callable[..., Awaitable[ServiceRuntime]]
) -> None:
    runtime = await started(metrics_port=0)
    port = runtime.metrics_port
    assert port is not None
    await say(nats_client, "count me")
    text = await scrape_metrics_async(port)
    assert metric_value(text, "kvfabric_echo_requests_total", endpoint="say", outcome="ok") == 1.0

    await asyncio.wait_for(runtime.stop(), TIMEOUT_S)
    assert runtime.metrics_port is None
    with pytest.raises(urllib.error.URLError, match="refused"):
        await scrape_metrics_async(port)


async def test_client_no_responders_is_unavailable(nats_client: NatsClient) -> None:
    with pytest.raises(Unavailable, match="no responders"):
        await request(nats_client, SAY, EchoRequest(text="x"), echo_decoder, TIMEOUT_S)


async def test_client_timeout_is_indeterminate(nats_client: NatsClient) -> None:
    sub = await nats_client.subscribe(SAY)  # receives, never replies
    with pytest.raises(Indeterminate) as unknown:
        await request(nats_client, SAY, EchoRequest(text="x"), echo_decoder, 0.2)
    assert unknown.value.retryable
    assert (await sub.next_msg(timeout=1.0)).data == msgspec.msgpack.encode(EchoRequest(text="x"))


async def test_client_undecodable_reply_is_indeterminate(nats_client: NatsClient) -> None:
    async def reply_garbage(msg: Any) -> None:
        await msg.respond(b"\xc1")

    await nats_client.subscribe(SAY, cb=reply_garbage)
    with pytest.raises(Indeterminate, match="undecodable reply"):
        await request(nats_client, SAY, EchoRequest(text="x"), echo_decoder, TIMEOUT_S)


async def test_a_service_takes_a_nats_clusters_servers_as_a_comma_list(
    nats_server: NatsServer, nats_client: NatsClient, json_logs: LogRecords
) -> None:
    """`KVF_NATS_URL` may name several servers of one NATS cluster; one of them down, the service
    connects through another (a comma list was one malformed URL to nats-py: stop 70's list). A
    password in the URLs is in no log line (`service_started` printed it; review, stop 71)."""
    down = f"nats://kvf:s3cret-pw@127.0.0.1:{free_port()}"
    listed = nats_server.url.replace("nats://", "nats://kvf:s3cret-pw@")
    runtime = make_runtime(nats_server, nats_url=f"{down},{listed}", nats_reconnect_attempts_max=3)
    await asyncio.wait_for(runtime.start(), TIMEOUT_S)
    try:
        assert (await say(nats_client, "listed")).text == "listed"
    finally:
        await asyncio.wait_for(runtime.stop(), TIMEOUT_S)
    records = json_logs()
    assert any(r["event"] == "service_started" for r in records)
    assert [r for r in records if "s3cret-pw" in repr(r)] == []
