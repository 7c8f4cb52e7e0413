"""What the router answers itself, and what a request not streamed counts as while it generates
(stop 70's list): a 502 (every engine failed it) and a 504 (a response timeout) were not counted
as requests; a 504 was counted a failover though it never is one; a failover that found the
engines left full was answered 502 as if they had failed it (now 429/503 with Retry-After); and
a request not streamed counted as queued prefill on its engine for its whole generation."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

from prometheus_client import generate_latest

from kvfabric.core import routing_events
from kvfabric.router import proxy as proxy_module
from kvfabric.router.proxy import Proxy, _Failed
from tests.unit.router.test_proxy_request_end import FakeResponse, _chunks, _proxy, asgi_scope
from tests.unit.router.test_settings_refit import ENV

TWO_ENGINES = {
    **ENV,
    "KVF_ROUTER_ENGINES": json.dumps(
        [{"id": "e1", "url": "http://127.0.0.1:1"}, {"id": "e2", "url": "http://127.0.0.1:2"}]
    ),
}


async def _ask(proxy: Proxy, *, stream: bool, prompt: list[int] | None = None) -> list[dict[str, Any]]:
    for iid in proxy.core.instances:
        await proxy.driver.feed(routing_events.Health(iid, True))
    body = json.dumps({"prompt": prompt or [5] * 40, "stream": stream}).encode()
    messages: list[dict[str, Any]] = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await proxy.app(asgi_scope(), receive, send)  # type: ignore[arg-type]
    return sent


def _counted(proxy: Proxy) -> dict[tuple[str, str, str], float]:
    """`http_requests_total` and `failovers_total` samples: (metric, instance, outcome or why)."""
    out: dict[tuple[str, str, str], float] = {}
    for metric in (proxy.metrics.requests, proxy.metrics.failovers):
        for family in metric.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    label = sample.labels.get("outcome", sample.labels.get("why", ""))
                    out[(family.name, sample.labels["instance"], label)] = sample.value
    return out


def test_a_response_timeout_is_a_counted_504_and_no_failover() -> None:
    proxy = _proxy()

    async def timed_out(*args: Any) -> Any:
        raise _Failed("timeout")

    proxy._open = timed_out  # type: ignore[method-assign,assignment]
    sent = asyncio.run(_ask(proxy, stream=False))
    assert sent[0]["status"] == 504 and proxy.core.in_flight == 0
    assert _counted(proxy) == {("kvfabric_router_http_requests", "e1", "response_timeout"): 1.0}
    assert b"response_timeout" in generate_latest(proxy.registry)


def test_engines_that_all_failed_are_a_counted_502() -> None:
    proxy = _proxy()

    async def failing(*args: Any) -> Any:
        raise _Failed("status_500")

    proxy._open = failing  # type: ignore[method-assign,assignment]
    sent = asyncio.run(_ask(proxy, stream=True))
    assert sent[0]["status"] == 502 and proxy.core.in_flight == 0
    counted = _counted(proxy)
    assert counted[("kvfabric_router_http_requests", "e1", "engines_failed")] == 1.0
    assert counted[("kvfabric_router_failovers", "e1", "status_500")] == 1.0


def test_a_failover_to_full_engines_is_refused_with_retry_after_not_502() -> None:
    proxy = _proxy(TWO_ENGINES)
    tried: list[str] = []

    async def fails_then_the_other_is_full(iid: str, *args: Any) -> Any:
        tried.append(iid)
        other = "e2" if iid == "e1" else "e1"
        inst = proxy.core.instances[other]
        inst.spec = dataclasses.replace(inst.spec, queue_max=0)  # full while this one failed
        raise _Failed("status_503")

    proxy._open = fails_then_the_other_is_full  # type: ignore[method-assign,assignment]
    sent = asyncio.run(_ask(proxy, stream=True))
    assert len(tried) == 1 and proxy.core.in_flight == 0
    assert sent[0]["status"] == 503
    assert int(dict(sent[0]["headers"])[b"retry-after"]) >= 1
    assert _counted(proxy)[("kvfabric_router_http_requests", tried[0], "refused_queues_full")] == 1.0


def test_a_request_not_streamed_leaves_the_prefill_queue_once_its_estimate_passed() -> None:
    proxy = _proxy()
    seen: dict[str, int] = {}
    response = FakeResponse()
    response.headers = {"content-type": "application/json"}

    async def generating(iid: str, *args: Any) -> Any:
        inst = proxy.core.instances[iid]
        seen["queued_at_start"] = inst.queued_prefill_tokens
        await asyncio.sleep(1.0)  # the whole generation (the estimate is ~0.1 s or less)
        seen["queued_later"], seen["running_later"] = inst.queued_prefill_tokens, inst.running
        return proxy_module._Upstream(response, _chunks(), b'{"choices": []}')  # type: ignore[arg-type]

    proxy._open = generating  # type: ignore[method-assign,assignment]
    sent = asyncio.run(_ask(proxy, stream=False, prompt=[5] * 400))
    assert sent[0]["status"] == 200
    assert seen["queued_at_start"] > 0
    assert seen["queued_later"] == 0 and seen["running_later"] == 1
    assert proxy.core.counters["prefill_presumed"] == 1 and proxy.core.in_flight == 0
    proxy.core.check_invariants()
