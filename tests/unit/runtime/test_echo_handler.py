"""The echo handler alone: validate, reply; its endpoint's decode and type check (the runtime's).
No NATS, no sleeps."""

from __future__ import annotations

import pytest

from kvfabric.format.errors import BadRequest
from kvfabric.proto.codec import encode
from kvfabric.proto.echo import ECHO_DELAY_MS_MAX, ECHO_TEXT_BYTES_MAX, EchoReply, EchoRequest
from kvfabric.runtime.config import RuntimeSettings
from kvfabric.runtime.echo_service import EchoHandler, build_echo_runtime

HANDLER = EchoHandler("inst-1")


async def test_echoes_text_with_instance_id() -> None:
    reply = await HANDLER.say(EchoRequest(text="hi ✓"), {})
    assert reply == EchoReply(text="hi ✓", instance_id="inst-1")


async def test_text_limit_counts_utf8_bytes() -> None:
    at_limit = "é" * (ECHO_TEXT_BYTES_MAX // 2)  # 2 bytes each
    assert (await HANDLER.say(EchoRequest(text=at_limit), {})).text == at_limit
    with pytest.raises(BadRequest, match=f"over {ECHO_TEXT_BYTES_MAX}"):
        await HANDLER.say(EchoRequest(text=at_limit + "x"), {})


@pytest.mark.parametrize("delay_ms", [-1, ECHO_DELAY_MS_MAX + 1])
async def test_delay_out_of_range(delay_ms: int) -> None:
    with pytest.raises(BadRequest, match="delay_ms") as err:
        await HANDLER.say(EchoRequest(text="x", delay_ms=delay_ms), {})
    assert err.value.details["delay_ms"] == delay_ms


@pytest.mark.parametrize("data", [b"", b"\xc1", encode(EchoReply(text="x", instance_id="y"))])
async def test_malformed_or_wrong_message_is_bad_request(data: bytes) -> None:
    say = build_echo_runtime(RuntimeSettings(instance_id="inst-1"))._endpoints["say"].handler
    with pytest.raises(BadRequest):
        await say(data, {})


def test_runtime_serves_say_under_the_echo_group() -> None:
    runtime = build_echo_runtime(RuntimeSettings(instance_id="inst-1"))
    assert runtime.subjects == ["kvf.v1.echo.say"]
    assert runtime.group == "kvf.v1.echo"
