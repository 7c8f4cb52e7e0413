"""Errors on the wire, server side. Pure functions: no NATS, no event loop.

A `KvfError` becomes an ADR-32 service error (`ErrorResponse`):
- header `Nats-Service-Error-Code`: `str(err.status)` (HTTP-like), set by `respond_error`;
- header `Nats-Service-Error`: the message, on one line, capped at `DESCRIPTION_CHARS_MAX`;
- header `Kvf-Error-Code`: the stable snake_case wire code;
- body: an `ErrorReply` (msgpack) with code, message, retryable and details.

The caller side, `error_from_response` (the `KvfError` a reply carries), is in
`kvfabric.cluster.requests`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from kvfabric.format.errors import KvfError
from kvfabric.proto.codec import encode
from kvfabric.proto.common import ERROR_CODE_HEADER, error_reply_from

__all__ = [
    "DESCRIPTION_CHARS_MAX",
    "ErrorResponse",
    "error_response",
    "internal_error",
]

# A header value is one line; keep it short, the body carries the full message.
DESCRIPTION_CHARS_MAX: Final = 256


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
