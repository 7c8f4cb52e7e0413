"""Errors on the wire, both ways. Pure functions: no NATS, no event loop.

Server side, a `KvfError` becomes an ADR-32 service error (`ErrorResponse`):
- header `Nats-Service-Error-Code`: `str(err.status)` (HTTP-like), set by `respond_error`;
- header `Nats-Service-Error`: the message, on one line, capped at `DESCRIPTION_CHARS_MAX`;
- header `Kvf-Error-Code`: the stable snake_case wire code;
- body: an `ErrorReply` (msgpack) with code, message, retryable and details.

Client side, `error_from_response` rebuilds the right `KvfError` subclass from the body, falling
back to the headers when the body is not an `ErrorReply` (a non-kvfabric micro service, or a
500 sent by `nats.micro` itself), and returns None for a success reply.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from kvfabric.format.errors import BadRequest, KvfError, error_from_wire
from kvfabric.proto.codec import FamilyDecoder, encode
from kvfabric.proto.common import (
    ERROR_CODE_HEADER,
    NATS_SERVICE_ERROR_CODE_HEADER,
    NATS_SERVICE_ERROR_HEADER,
    ErrorReply,
    error_from_reply,
    error_reply_from,
)

__all__ = [
    "DESCRIPTION_CHARS_MAX",
    "ErrorResponse",
    "error_from_response",
    "error_response",
    "internal_error",
]

# A header value is one line; keep it short, the body carries the full message.
DESCRIPTION_CHARS_MAX: Final = 256

_error_reply_decoder: FamilyDecoder[ErrorReply] = FamilyDecoder(ErrorReply, "common.error")


@dataclass(frozen=True, slots=True)
class ErrorResponse:
    """The arguments of `nats.micro.Request.respond_error` for one error."""

    status: str
    description: str
    data: bytes
    headers: dict[str, str] = field(default_factory=dict)


def header_safe(text: str, chars_max: int = DESCRIPTION_CHARS_MAX) -> str:
    """One printable line of at most `chars_max` chars: NATS headers cannot carry CR/LF."""
    flat = "".join(ch if ch.isprintable() else " " for ch in text)
    return flat if len(flat) <= chars_max else flat[: chars_max - 1] + "…"


def error_response(err: KvfError) -> ErrorResponse:
    """How `err` goes on the wire."""
    return ErrorResponse(
        status=str(err.status),
        description=header_safe(err.message),
        data=encode(error_reply_from(err)),
        headers={ERROR_CODE_HEADER: err.code},
    )


def internal_error(exc: BaseException) -> KvfError:
    """The 500 sent for an unexpected exception: names its type, never its text (may hold data)."""
    return KvfError(f"internal error ({type(exc).__name__})", exception=type(exc).__name__)


def error_from_response(headers: Mapping[str, str] | None, data: bytes) -> KvfError | None:
    """The error a reply carries, or None when it is a success reply."""
    if not headers or NATS_SERVICE_ERROR_CODE_HEADER not in headers:
        return None
    status = headers[NATS_SERVICE_ERROR_CODE_HEADER]
    description = headers.get(NATS_SERVICE_ERROR_HEADER, "")
    if data:
        try:
            return error_from_reply(_error_reply_decoder.decode(data))
        except BadRequest:
            pass  # not our body: fall back to the headers
    code = headers.get(ERROR_CODE_HEADER)
    if code:
        return error_from_wire(code, description or code, {"status": status})
    return KvfError(f"service error {status}: {description}", status=status)
