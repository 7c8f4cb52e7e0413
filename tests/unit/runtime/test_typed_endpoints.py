"""Typed endpoints (issue 26 item 5): an endpoint registered with its request type has its
request decoded and checked by the runtime, once; a malformed message or another message of the
family is a `BadRequest` reply and the handler never runs; the handler gets the typed message.
No NATS: requests go straight to the dispatcher."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from types import SimpleNamespace

import msgspec
import pytest

from kvfabric.format.invariant import InvariantViolation
from kvfabric.proto.codec import encode
from kvfabric.proto.common import ERROR_CODE_HEADER, ErrorReply
from kvfabric.proto.echo import EchoReply, EchoRequest, echo_decoder
from kvfabric.proto.subjects import Service, endpoint_subject, service_group
from kvfabric.runtime.config import RuntimeSettings
from kvfabric.runtime.service import RuntimeState, ServiceRuntime

_error_reply = msgspec.msgpack.Decoder(ErrorReply)


class FakeRequest:
    """What the dispatcher reads of a nats.micro request, and the answer it sends."""

    def __init__(self, subject: str, data: bytes, reply: str = "_INBOX.x") -> None:
        self.subject = subject
        self._msg = SimpleNamespace(reply=reply)
        self.headers: dict[str, str] | None = None
        self.data = data
        self.ok: bytes | None = None
        self.status: str | None = None
        self.error_headers: dict[str, str] = {}
        self.error: ErrorReply | None = None

    async def respond(self, data: bytes = b"", headers: Mapping[str, str] | None = None) -> None:
        self.ok = data

    async def respond_error(
        self, code: str, description: str, data: bytes = b"", headers: Mapping[str, str] | None = None
    ) -> None:
        self.status, self.error_headers, self.error = code, dict(headers or {}), _error_reply.decode(data)


class Harness:
    """A running runtime (no NATS) with a typed `say` and a typed tenant `say`; every call of
    either handler is recorded."""

    def __init__(self) -> None:
        settings = RuntimeSettings(metrics_port=-1, inflight_max=8, shutdown_grace_ms=10)
        self.runtime = ServiceRuntime(Service.ECHO, settings, version="0.0.1", description="test")
        self.calls: list[tuple[object, str | None]] = []

        async def say(message: EchoRequest, headers: Mapping[str, str]) -> EchoReply:
            self.calls.append((message, None))
            return EchoReply(text=message.text, instance_id="i")

        async def tenant_say(message: EchoRequest, headers: Mapping[str, str], tenant: str) -> EchoReply:
            self.calls.append((message, tenant))
            return EchoReply(text=message.text, instance_id=tenant)

        self.runtime.add_endpoint("say", say, request=EchoRequest, decoder=echo_decoder)
        self.runtime.add_tenant_endpoint("say", tenant_say, request=EchoRequest, decoder=echo_decoder)
        self.runtime._state = RuntimeState.RUNNING  # as after `start`, without NATS

    async def send(self, data: bytes, tenant: str | None = None) -> FakeRequest:
        if tenant is None:
            request = FakeRequest(endpoint_subject(Service.ECHO, "say"), data)
            endpoint = self.runtime._endpoints["say"]
        else:
            subject = f"{service_group(Service.ECHO)}.t.{tenant}.say"
            request = FakeRequest(subject, data, reply=f"_INBOX.t.{tenant}.r")
            endpoint = self.runtime._endpoints["tenant_say"]
        await self.runtime._dispatch(endpoint, request)  # type: ignore[arg-type]
        await asyncio.gather(*self.runtime._tasks)
        return request


def assert_bad_request(answer: FakeRequest, message: str) -> None:
    assert answer.ok is None
    assert answer.status == "400"
    assert answer.error_headers[ERROR_CODE_HEADER] == "bad_request"
    assert answer.error is not None
    assert answer.error.code == "bad_request"
    assert message in answer.error.message


@pytest.mark.parametrize("tenant", [None, "bob"])
async def test_another_message_of_the_family_is_refused_before_the_handler(tenant: str | None) -> None:
    svc = Harness()
    answer = await svc.send(encode(EchoReply(text="x", instance_id="y")), tenant)
    assert_bad_request(answer, "say takes EchoRequest, got EchoReply")
    assert svc.calls == []


@pytest.mark.parametrize("tenant", [None, "bob"])
async def test_a_malformed_message_is_refused_before_the_handler(tenant: str | None) -> None:
    svc = Harness()
    answer = await svc.send(b"\xc1 not msgpack", tenant)
    assert_bad_request(answer, "malformed echo message")
    assert svc.calls == []


@pytest.mark.parametrize("tenant", [None, "bob"])
async def test_the_handler_gets_the_typed_message(tenant: str | None) -> None:
    svc = Harness()
    answer = await svc.send(encode(EchoRequest(text="hi")), tenant)
    assert answer.status is None
    assert answer.ok == encode(EchoReply(text="hi", instance_id=tenant or "i"))
    assert svc.calls == [(EchoRequest(text="hi"), tenant)]


def test_a_request_type_needs_its_decoder() -> None:
    settings = RuntimeSettings(metrics_port=-1)
    runtime = ServiceRuntime(Service.ECHO, settings, version="0.0.1", description="test")

    async def say(message: EchoRequest, headers: Mapping[str, str]) -> EchoReply:
        return EchoReply(text=message.text, instance_id="i")

    with pytest.raises(InvariantViolation, match="needs its decoder"):
        runtime.add_endpoint("say", say, request=EchoRequest, decoder=None)  # type: ignore[call-overload]
