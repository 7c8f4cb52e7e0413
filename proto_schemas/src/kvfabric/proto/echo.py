"""Messages of the `echo` service: the minimal service that exercises the runtime lib.

Subject: `kvf.v1.echo.say`. Not a product feature: it proves the runtime (micro registration,
metrics, bounded in-flight handlers, error headers, graceful stop) against a real nats-server.
"""

from __future__ import annotations

from typing import Final

import msgspec

from kvfabric.proto.codec import FamilyDecoder

__all__ = ["ECHO_DELAY_MS_MAX", "ECHO_TEXT_BYTES_MAX", "EchoReply", "EchoRequest", "echo_decoder"]

ECHO_TEXT_BYTES_MAX: Final = 4096
ECHO_DELAY_MS_MAX: Final = 10_000


class EchoRequest(msgspec.Struct, frozen=True, kw_only=True, tag="echo.say.v1", tag_field="t"):
    text: str
    # Test aid: the handler sleeps this long before replying, to fill the in-flight limit.
    delay_ms: int = 0


class EchoReply(msgspec.Struct, frozen=True, kw_only=True, tag="echo.said.v1", tag_field="t"):
    text: str
    instance_id: str


EchoMessage = EchoRequest | EchoReply

echo_decoder: FamilyDecoder[EchoMessage] = FamilyDecoder(EchoMessage, "echo")
