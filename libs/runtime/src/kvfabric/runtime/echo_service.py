"""The minimal service: `kvf.v1.echo.say`, EchoRequest → EchoReply. Proves the runtime end to end.

Run: `python -m kvfabric.runtime.echo_service --nats-url nats://127.0.0.1:4222 --metrics-port 0`
(flags fall back to `KVF_*` env vars; `--help` lists them). The `service_started` log line
carries the bound `metrics_port`.

Validation: text ≤ `ECHO_TEXT_BYTES_MAX` UTF-8 bytes and 0 ≤ delay_ms ≤ `ECHO_DELAY_MS_MAX`,
else `BadRequest`; a reply-type message sent as a request is a `BadRequest` too (the runtime's:
`say` is registered with its request type, so the handler gets an `EchoRequest`). The handler
sleeps `delay_ms` before replying (a test aid to fill the in-flight limit).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Final

from kvfabric.format.errors import BadRequest
from kvfabric.proto.echo import ECHO_DELAY_MS_MAX, ECHO_TEXT_BYTES_MAX, EchoReply, EchoRequest, echo_decoder
from kvfabric.proto.subjects import Service
from kvfabric.runtime.cli import service_cli
from kvfabric.runtime.config import RuntimeSettings
from kvfabric.runtime.service import ServiceRuntime

__all__ = ["ECHO_SERVICE_VERSION", "EchoHandler", "build_echo_runtime", "main", "serve"]

ECHO_SERVICE_VERSION: Final = "0.1.0"
SAY_VERB: Final = "say"


class EchoHandler:
    """`say`: validate, sleep `delay_ms`, echo the text with this instance's id."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id

    async def say(self, message: EchoRequest, headers: Mapping[str, str]) -> EchoReply:
        text_bytes = len(message.text.encode("utf-8"))
        if text_bytes > ECHO_TEXT_BYTES_MAX:
            raise BadRequest(
                f"text is {text_bytes} bytes, over {ECHO_TEXT_BYTES_MAX}",
                text_bytes=text_bytes,
                text_bytes_max=ECHO_TEXT_BYTES_MAX,
            )
        if not 0 <= message.delay_ms <= ECHO_DELAY_MS_MAX:
            raise BadRequest(
                f"delay_ms {message.delay_ms} outside 0..{ECHO_DELAY_MS_MAX}",
                delay_ms=message.delay_ms,
                delay_ms_max=ECHO_DELAY_MS_MAX,
            )
        if message.delay_ms > 0:
            await asyncio.sleep(message.delay_ms / 1000)
        return EchoReply(text=message.text, instance_id=self.instance_id)


def build_echo_runtime(settings: RuntimeSettings) -> ServiceRuntime:
    runtime = ServiceRuntime(
        Service.ECHO,
        settings,
        version=ECHO_SERVICE_VERSION,
        description="Echo: the minimal kvfabric service, exercising the runtime.",
    )
    runtime.add_endpoint(
        SAY_VERB, EchoHandler(settings.instance_id).say, request=EchoRequest, decoder=echo_decoder
    )
    return runtime


async def serve(settings: RuntimeSettings) -> int:
    return await build_echo_runtime(settings).run()


app = service_cli(name="echo_service", help="kvfabric echo service (kvf.v1.echo.say).", main=serve)


def main() -> None:
    app(prog_name="python -m kvfabric.runtime.echo_service")


if __name__ == "__main__":
    main()
