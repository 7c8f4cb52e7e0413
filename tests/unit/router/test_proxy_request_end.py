"""A routed request's admission ends however the request ends (`Proxy.completions`): a client
that disconnects before the engine's body was relayed (Starlette cancels the body's task before
the generator runs, so its `finally` never did), or an `_open` that is cancelled or fails with
something other than an engine failure. Each leaked the request's slot and its tenant's before
(review, 2026-12-05); the engine's response is closed each time."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from kvfabric.core import routing_events
from kvfabric.core.routing import RoutingCore
from kvfabric.core.routing_index import RoutingIndex
from kvfabric.format.clock import now_ms
from kvfabric.router import proxy as proxy_module
from kvfabric.router.metrics import RouterMetrics
from kvfabric.router.proxy import Proxy
from kvfabric.router.settings import load_router_settings
from kvfabric.runtime.core_driver import CoreDriver
from tests.unit.router.test_settings_refit import ENV


class FakeResponse:
    status_code = 200

    def __init__(self) -> None:
        self.headers = {"content-type": "text/event-stream"}
        self.closed = 0

    async def aclose(self) -> None:
        self.closed += 1


async def _chunks() -> AsyncIterator[bytes]:
    yield b"data: 2\n\n"


def _proxy(env: dict[str, str] = ENV) -> Proxy:
    settings = load_router_settings(env)
    core = RoutingCore(settings.routing, [e.spec for e in settings.engines], RoutingIndex())
    driver = CoreDriver(core, clock=lambda: now_ms())
    registry = CollectorRegistry()
    return Proxy(settings, core, RouterMetrics(registry), registry, driver)


def asgi_scope() -> dict[str, Any]:
    """A `POST /v1/completions` request's ASGI scope."""
    return {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "http_version": "1.1",
        "scheme": "http",
        "server": ("127.0.0.1", 80),
        "client": ("127.0.0.1", 1),
        "root_path": "",
    }


async def _call(proxy: Proxy, *, disconnect_at_once: bool) -> list[dict[str, Any]]:
    await proxy.driver.feed(routing_events.Health("e1", True))
    body = json.dumps({"prompt": [5] * 40, "stream": True}).encode()
    messages: list[dict[str, Any]] = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        if not disconnect_at_once:
            await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        await asyncio.sleep(0)  # the disconnect listener runs here

    scope = asgi_scope()
    await proxy.app(scope, receive, send)  # type: ignore[arg-type]
    return sent


@pytest.mark.parametrize("disconnect_at_once", [True, False])
def test_a_client_gone_before_the_body_ends_the_request(disconnect_at_once: bool) -> None:
    proxy = _proxy()
    response = FakeResponse()

    async def opened(*args: Any) -> Any:
        return proxy_module._Upstream(response, _chunks(), b"data: 1\n\n")  # type: ignore[arg-type]

    proxy._open = opened  # type: ignore[method-assign,assignment]
    sent = asyncio.run(_call(proxy, disconnect_at_once=disconnect_at_once))
    assert proxy.core.in_flight == 0 and response.closed == 1
    if not disconnect_at_once:  # relayed whole: both chunks, then the end
        assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n", b"data: 2\n\n", b""]


@pytest.mark.parametrize("error", [asyncio.CancelledError, RuntimeError])
def test_an_open_that_is_cancelled_or_fails_oddly_ends_the_request(error: type[BaseException]) -> None:
    proxy = _proxy()

    async def opened(*args: Any) -> Any:
        raise error()

    proxy._open = opened  # type: ignore[method-assign,assignment]
    with pytest.raises(error):
        asyncio.run(_call(proxy, disconnect_at_once=False))
    assert proxy.core.in_flight == 0


def test_a_tenant_at_its_share_is_refused_before_its_body_is_read() -> None:
    """A tenant at `tenant_inflight_max` sent 16 MiB bodies (a 1.5 M-token prompt) that cost
    ~0.25 s of the router's loop each (JSON, the int check, keys) before their 429 (review,
    2026-12-06): refused now before the body is read."""
    proxy = _proxy()
    proxy.core._tenants["default"] = proxy.core.config.tenant_inflight_max
    keyed: list[object] = []
    proxy._keys = lambda body: keyed.append(body) or ([], 1, True)  # type: ignore[method-assign,func-returns-value]
    sent = asyncio.run(_call(proxy, disconnect_at_once=False))
    assert sent[0]["status"] == 429 and not keyed
    assert json.loads(sent[1]["body"])["error"]["message"] == "tenant_inflight_max"
    assert proxy.core.counters["refused"] == 1  # counted as the core's own refusals are


def test_only_a_long_prompts_head_is_keyed() -> None:
    proxy = _proxy()
    long = [7] * (proxy_module.KEYED_TOKENS_MAX + 5000)
    keys, tokens, _ = proxy._keys(routed({"prompt": long}))
    head_keys, _, _ = proxy._keys(routed({"prompt": long[: proxy_module.KEYED_TOKENS_MAX]}))
    assert tokens == len(long) and keys == head_keys and keys


def routed(body: dict[str, object]) -> Any:
    """A request body as the proxy reads it (what routing needs of it)."""
    return proxy_module._routed_fields.decode(json.dumps(body).encode())


def test_a_body_is_read_for_what_routing_needs_and_stream_must_be_a_boolean() -> None:
    """Fields routing does not read are skipped, never built (review, stop 66: `json.loads` of
    16 MiB of nested junk held the loop 1.65 s and 415 MiB); text, chat messages and several
    prompts are counted by their length; `"stream": "false"` is refused (it made the router treat
    a whole generation as a stream's first token, and fail it over)."""
    proxy = _proxy()
    junk = routed({"prompt": list(range(1000)), "junk": [[]] * 100_000})
    assert proxy._keys(junk) == proxy._keys(routed({"prompt": list(range(1000))}))
    assert proxy._keys(junk)[1] == 1000 and proxy._keys(junk)[0]
    assert proxy._keys(routed({"prompt": "some text to complete"}))[0] == []
    assert proxy._keys(routed({"prompt": "some text to complete"}))[2]  # its count is a guess
    assert proxy._keys(routed({"prompt": [1, 2, 3]})) == ([], 3, False)  # shorter than a chunk: exact
    assert proxy._keys(routed({"messages": [{"role": "user", "content": "hi " * 100}]}))[1] > 50
    assert proxy._keys(routed({"prompt": [[1, 2], [3]]})) == ([], 3, True)  # several prompts: a guess
    assert proxy._keys(routed({"prompt": None, "messages": "x" * 40}))[1] == 10
    assert proxy._keys(routed({})) == ([], 1, True)
    assert routed({"stream": True}).stream is True and routed({"stream": False}).stream is False
    for bad in ({"stream": "false"}, {"stream": 0}, [1, 2]):
        with pytest.raises(msgspec.ValidationError):
            routed(bad)  # type: ignore[arg-type]
