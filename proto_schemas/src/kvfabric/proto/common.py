"""Shapes shared by every service: the error body and the header names."""

from __future__ import annotations

import uuid
from typing import Any, Final

import msgspec

from kvfabric.format.errors import KvfError, error_from_wire

__all__ = [
    "ERROR_CODE_HEADER",
    "NATS_SERVICE_ERROR_CODE_HEADER",
    "NATS_SERVICE_ERROR_HEADER",
    "REQUEST_ID_HEADER",
    "TIMEOUT_MS_HEADER",
    "TRACE_ID_CHARS_MAX",
    "TRACE_ID_HEADER",
    "ErrorReply",
    "error_from_reply",
    "error_reply_from",
    "header_trace_id",
    "trace_id_of",
]

# Set by nats.micro's respond_error (ADR-32): the HTTP-like status and a description.
NATS_SERVICE_ERROR_HEADER: Final = "Nats-Service-Error"
NATS_SERVICE_ERROR_CODE_HEADER: Final = "Nats-Service-Error-Code"
# Ours: the stable snake_case wire code of the `KvfError` subclass.
ERROR_CODE_HEADER: Final = "Kvf-Error-Code"
REQUEST_ID_HEADER: Final = "Kvf-Request-Id"
TRACE_ID_HEADER: Final = "Kvf-Trace-Id"
# A trace id that goes into a NATS header: printable ASCII without spaces, at most this long. A
# segment put a writer's (as its PUT carried it) into the header of its confirm request to the
# directory, and a megabyte one (the frame meta's bound) made that message exceed max_payload,
# or a CR/LF in it broke the header: either way NATS closed the segment's connection, every
# tenant's confirms with it (review, stop 68). Senders cut or replace theirs (`trace_id_of`);
# a receiver forwards only one that fits (`header_trace_id`). The wire field stays a plain
# string: refused at decode, an older client's id dropped its whole data connection.
TRACE_ID_CHARS_MAX: Final = 128


def _fits(trace_id: str) -> bool:
    return (
        len(trace_id) <= TRACE_ID_CHARS_MAX
        and trace_id.isascii()
        and trace_id.isprintable()
        and " " not in trace_id
    )


def trace_id_of(given: str | None) -> str:
    """`given` cut at `TRACE_ID_CHARS_MAX` when the rest fits a header, else a new one: an
    engine's own request id is never a reason for a save or lookup to fail."""
    given = (given or "")[:TRACE_ID_CHARS_MAX]
    return given if given and _fits(given) else uuid.uuid4().hex


def header_trace_id(given: str) -> str:
    """A received trace id to forward in a NATS header: itself when it fits, else "" (none)."""
    return given if _fits(given) else ""


# How long the sender waits for the reply, in ms (`kvfabric.cluster.requests.request` sets it):
# a service may give up on a request its sender has given up on (the directory's fair turns).
TIMEOUT_MS_HEADER: Final = "Kvf-Timeout-Ms"


class ErrorReply(msgspec.Struct, frozen=True, kw_only=True):
    """The body of every error reply (the headers carry the code too, for routers)."""

    code: str
    message: str
    retryable: bool = False
    details: dict[str, Any] = msgspec.field(default_factory=dict)


def error_reply_from(err: KvfError) -> ErrorReply:
    return ErrorReply(code=err.code, message=err.message, retryable=err.retryable, details=err.details)


def error_from_reply(reply: ErrorReply) -> KvfError:
    return error_from_wire(reply.code, reply.message, reply.details, retryable=reply.retryable)
