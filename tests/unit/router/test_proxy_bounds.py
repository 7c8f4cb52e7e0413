"""The HTTP front's bounds before and after routing (review, 2026-12-06): requests whose bodies
are still being read count against their tenant's share and the total; a body has a deadline; a
client gone before the engine's first byte cancels the engine request; an answer that breaks
after the first byte is never ended as if whole; the NATS `route` query keys a prompt's head."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from kvfabric.core import routing_events
from kvfabric.core.routing import RoutingCore, prompt_keys
from kvfabric.core.routing_index import RoutingIndex
from kvfabric.format.clock import now_ms
from kvfabric.proto import router as r
from kvfabric.router import proxy as proxy_module
from kvfabric.router import shell as shell_module
from kvfabric.router.metrics import RouterMetrics
from kvfabric.router.proxy import Proxy
from kvfabric.router.settings import load_router_settings
from kvfabric.runtime.core_driver import CoreDriver
from tests.unit.router.test_proxy_request_end import FakeResponse, _proxy, asgi_scope
from tests.unit.router.test_settings_refit import ENV

BODY = json.dumps({"prompt": [5] * 40, "stream": True}).encode()


async def _request(proxy: Proxy, receive: Any) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        await asyncio.sleep(0)

    await proxy.app(asgi_scope(), receive, send)  # type: ignore[arg-type]
    return sent


def test_bodies_being_read_count_against_the_tenants_share_and_have_a_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tenant at 0 in flight opened twice its share of slow 16 MiB bodies: every one was
    read, parsed and keyed at once. Now its share are read, the rest refused unread; a body
    that stalls gets 408 and leaves nothing counted."""
    monkeypatch.setattr(proxy_module, "BODY_READ_TIMEOUT_S", 0.3)
    proxy = _proxy()
    share = proxy.core.config.tenant_inflight_max
    read_by: list[int] = []

    def stalled(i: int) -> Any:
        first = True

        async def receive() -> dict[str, Any]:
            nonlocal first
            read_by.append(i)
            if first:
                first = False
                return {"type": "http.request", "body": BODY[:10], "more_body": True}
            await asyncio.sleep(3600)  # the rest never comes
            return {"type": "http.disconnect"}

        return receive

    async def run() -> list[list[dict[str, Any]]]:
        await proxy.driver.feed(routing_events.Health("e1", True))
        tasks = [asyncio.create_task(_request(proxy, stalled(i))) for i in range(2 * share)]
        await asyncio.sleep(0.1)
        assert proxy._reading == {"default": share} and proxy._reading_total == share
        return await asyncio.gather(*tasks)

    answers = asyncio.run(run())
    statuses = sorted(a[0]["status"] for a in answers)
    assert statuses == [408] * share + [429] * share
    refused = {i for i, a in enumerate(answers) if a[0]["status"] == 429}
    assert not refused & set(read_by)  # refused before a byte of their bodies was read
    assert proxy._reading == {} and proxy._reading_total == 0 and proxy.core.in_flight == 0


def test_a_client_gone_before_the_first_byte_cancels_the_engine_request() -> None:
    proxy = _proxy()
    opened = asyncio.Event()
    cancelled = asyncio.Event()

    async def slow_open(*args: Any) -> Any:
        opened.set()
        try:
            await asyncio.sleep(30)  # the engine generates the whole answer first
        except asyncio.CancelledError:
            cancelled.set()
            raise

    proxy._open = slow_open  # type: ignore[method-assign,assignment]
    messages = [{"type": "http.request", "body": BODY, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await opened.wait()
        return {"type": "http.disconnect"}  # the client leaves while the engine works

    async def run() -> None:
        await proxy.driver.feed(routing_events.Health("e1", True))
        await asyncio.wait_for(_request(proxy, receive), 2.0)

    asyncio.run(run())
    assert cancelled.is_set() and proxy.core.in_flight == 0


def _engine_answers(proxy: Proxy, chunks: AsyncIterator[bytes], first: bytes = b"") -> FakeResponse:
    """The engine `proxy` opens answers `first`, then `chunks`; its response (to see it closed)."""
    response = FakeResponse()

    async def opened(*args: Any) -> Any:
        return proxy_module._Upstream(response, chunks, first)  # type: ignore[arg-type]

    proxy._open = opened  # type: ignore[method-assign,assignment]
    return response


def _body_then_silence() -> Any:
    """An ASGI `receive`: the request's body (`BODY`), then nothing (the client stays)."""
    messages = [{"type": "http.request", "body": BODY, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    return receive


def test_an_answer_broken_after_the_first_byte_is_not_ended_as_whole() -> None:
    """The client took a truncated answer for a complete one: the body's last chunk was sent."""
    proxy = _proxy()

    async def broken() -> AsyncIterator[bytes]:
        yield b'{"choices":[{"text":"hal'
        raise httpx.ReadError("engine gone")

    response = _engine_answers(proxy, broken())

    async def run() -> list[dict[str, Any]]:
        await proxy.driver.feed(routing_events.Health("e1", True))
        return await _request(proxy, _body_then_silence())

    sent = asyncio.run(run())
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert bodies and bodies[0]["body"] == b'{"choices":[{"text":"hal'
    assert all(m.get("more_body", False) for m in bodies)  # never the end of the body
    assert proxy.core.in_flight == 0 and response.closed == 1


def test_a_client_that_stops_reading_is_cut_and_its_request_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that takes no part of the answer for `SEND_STALL_S` is cut (`client_stalled`):
    its admission slot and the engine's queue place come back (review, stop 66: two streams
    nobody read answered every other tenant 503 `queues_full` for as long as the client lived)."""
    monkeypatch.setattr(proxy_module, "SEND_STALL_S", 0.2)
    proxy = _proxy()

    async def endless() -> AsyncIterator[bytes]:
        while True:
            yield b"data: token\n\n"
            await asyncio.sleep(0)

    response = _engine_answers(proxy, endless(), b"data: first\n\n")
    receive = _body_then_silence()

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if len(sent) >= 3:  # the client stops reading after the first chunks
            await asyncio.sleep(3600)

    async def run() -> None:
        await proxy.driver.feed(routing_events.Health("e1", True))
        await asyncio.wait_for(proxy.app(asgi_scope(), receive, send), 10)  # type: ignore[arg-type]

    asyncio.run(run())
    assert proxy.core.in_flight == 0 and response.closed == 1
    assert not any(m["type"] == "http.response.body" and not m.get("more_body", False) for m in sent)
    done = proxy.registry.get_sample_value(
        "kvfabric_router_http_requests_total", {"instance": "e1", "outcome": "client_stalled"}
    )
    assert done == 1


def test_the_route_query_keys_only_a_prompts_head(monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = _proxy()
    keyed: list[int] = []
    real = prompt_keys

    def counting(domain: Any, model: Any, layout: Any, tokens: list[int]) -> Any:
        keyed.append(len(tokens))
        return real(domain, model, layout, tokens)

    monkeypatch.setattr("kvfabric.router.shell.prompt_keys", counting)
    router = shell_module.RouterShell.__new__(shell_module.RouterShell)
    router.settings = proxy.settings
    router.driver = proxy.driver
    router.core = proxy.core
    tokens = [3] * (proxy_module.KEYED_TOKENS_MAX + 1000)

    async def run() -> Any:
        await proxy.driver.feed(routing_events.Health("e1", True))
        return await router._on_route(r.RouteRequest(tokens=tokens), {})

    reply = asyncio.run(run())
    assert keyed == [proxy_module.KEYED_TOKENS_MAX] and reply.instance == "e1"


def test_the_refits_ttft_leaves_out_the_clients_upload() -> None:
    settings = load_router_settings({**ENV, "KVF_ROUTER_REFIT": "on"})
    core = RoutingCore(settings.routing, [e.spec for e in settings.engines], RoutingIndex())
    registry = CollectorRegistry()
    proxy = Proxy(settings, core, RouterMetrics(registry), registry, CoreDriver(core, clock=now_ms))
    response = FakeResponse()

    async def opened(*args: Any) -> Any:
        return proxy_module._Upstream(response, _none(), b"data: 1\n\n")  # type: ignore[arg-type]

    proxy._open = opened  # type: ignore[method-assign,assignment]
    messages = [
        {"type": "http.request", "body": BODY[:10], "more_body": True},
        {"type": "http.request", "body": BODY[10:], "more_body": False},
    ]

    async def receive() -> dict[str, Any]:
        if messages:
            await asyncio.sleep(0.5)  # a slow upload
            return messages.pop(0)
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def run() -> None:
        await proxy.driver.feed(routing_events.Health("e1", True))
        await _request(proxy, receive)

    asyncio.run(run())
    assert core.refit is not None and len(core.refit.window) == 1
    assert core.refit.window[-1].ttft_s < 0.3  # the upload took 1 s


async def _none() -> AsyncIterator[bytes]:
    return
    yield b""
