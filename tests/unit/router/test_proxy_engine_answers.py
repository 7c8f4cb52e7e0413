"""What an engine answers that the router must not pass on as it is (review, stop 68): its 401
(the router's key for it is wrong) went to the client as the client's own auth failure; a write
that timed out (the engine never had the whole body) was answered 504 instead of failing over; a
response header starlette cannot encode leaked the request's admission slot and the engine's
response; a non-ASCII trace id from the client made the engine request unencodable (a 500)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import httpx
import pytest
from starlette.requests import Request

from kvfabric.proto.common import TRACE_ID_CHARS_MAX, trace_id_of
from kvfabric.router import proxy as proxy_module
from kvfabric.router.proxy import _Failed
from tests.unit.router.test_proxy_request_end import FakeResponse, _call, _chunks, _proxy, asgi_scope


def _open_with(handler: Any) -> str:
    """What `_open` makes of an engine answering through `handler`: the failure's why."""
    proxy = _proxy()
    proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))

    async def run() -> str:
        try:
            up = await proxy._open("e1", "/v1/completions", b"{}", "t1", False)
        except _Failed as failed:
            return failed.why
        finally:
            await proxy.client.aclose()
        await up.response.aclose()
        return f"status_{up.response.status_code}"

    return asyncio.run(run())


@pytest.mark.parametrize("status", [401, 403, 407])
def test_an_engine_refusing_the_routers_key_is_failed_over(status: int) -> None:
    assert _open_with(lambda request: httpx.Response(status, content=b"Unauthorized")) == "engine_auth"
    assert (
        _open_with(lambda request: httpx.Response(400, stream=httpx.ByteStream(b"bad prompt")))
        == "status_400"
    )  # the client's


def test_a_write_that_timed_out_is_failed_over_not_a_response_timeout() -> None:
    def write_timeout(request: httpx.Request) -> httpx.Response:
        raise httpx.WriteTimeout("the engine did not read the body", request=request)

    def read_timeout(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("no answer", request=request)

    assert _open_with(write_timeout) == "write_timeout"
    assert _open_with(read_timeout) == "timeout"  # (not streamed: 504, the engine may be generating)


def test_the_router_keeps_a_trace_id_as_the_engines_client_would() -> None:
    """The router's rule is the clients' (`trace_id_of`): an id the engine's client would replace
    (a space in it) was kept by the router, so the trace broke at the engine (stop 70); a latin-1
    byte made the engine request unencodable (a 500; review, stop 68)."""
    proxy = _proxy()
    proxy.settings = dataclasses.replace(proxy.settings, api_keys={})  # every request: 401

    def traced(given: bytes) -> str:
        scope = asgi_scope()
        scope["headers"] = [*scope["headers"], (b"x-kvf-trace-id", given)]
        response = asyncio.run(proxy.completions(Request(scope)))
        assert response.status_code == 401
        return str(response.headers["x-kvf-trace-id"])

    assert traced(b"cmpl-42-0") == "cmpl-42-0"
    assert traced(b"x" * 500) == "x" * proxy_module.TRACE_ID_CHARS_ROUTER_MAX  # whole inside vLLM's id
    assert len(f"chatcmpl-{'x' * proxy_module.TRACE_ID_CHARS_ROUTER_MAX}-999-abcdefgh") <= TRACE_ID_CHARS_MAX
    for bad in (b"caf\xe9", b"a b", b" "):
        new = traced(bad)
        assert new != bad.decode("latin-1") and new == trace_id_of(new) and len(new) == 32


def test_headers_that_cannot_be_relayed_end_the_request_with_502() -> None:
    proxy = _proxy()
    response = FakeResponse()
    response.headers["x-engine-note"] = "\u4e2d"  # UTF-8 from the engine: not latin-1

    async def opened(*args: Any) -> Any:
        return proxy_module._Upstream(response, _chunks(), b"data: 1\n\n")  # type: ignore[arg-type]

    proxy._open = opened  # type: ignore[method-assign,assignment]
    sent = asyncio.run(_call(proxy, disconnect_at_once=False))
    assert sent[0]["status"] == 502
    assert proxy.core.in_flight == 0 and response.closed == 1
