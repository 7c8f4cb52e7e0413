"""Shapes shared by every service: the error body and the header names."""

from __future__ import annotations

from typing import Any, Final

import msgspec

from kvfabric.format.errors import KvfError, error_from_wire

__all__ = [
    "ERROR_CODE_HEADER",
    "NATS_SERVICE_ERROR_CODE_HEADER",
    "NATS_SERVICE_ERROR_HEADER",
    "REQUEST_ID_HEADER",
    "TIMEOUT_MS_HEADER",
    "TRACE_ID_HEADER",
    "ErrorReply",
    "error_from_reply",
    "error_reply_from",
]

# Set by nats.micro's respond_error (ADR-32): the HTTP-like status and a description.
NATS_SERVICE_ERROR_HEADER: Final = "Nats-Service-Error"
NATS_SERVICE_ERROR_CODE_HEADER: Final = "Nats-Service-Error-Code"
# Ours: the stable snake_case wire code of the `KvfError` subclass.
ERROR_CODE_HEADER: Final = "Kvf-Error-Code"
REQUEST_ID_HEADER: Final = "Kvf-Request-Id"
TRACE_ID_HEADER: Final = "Kvf-Trace-Id"
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
    return error_from_wire(reply.code, reply.message, reply.details)
