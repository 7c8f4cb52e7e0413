"""Calling a kvfabric endpoint: one request, a typed reply or a typed `KvfError`.

Caller side, shared by the client, kvctl and the services when they call another service (the
server side, `KvfError` -> ADR-32 service error, is `kvfabric.runtime.replies`).

Outcomes of `request`:
- a reply: decoded with `reply_decoder` and returned;
- an error reply: the `KvfError` subclass it names (`BadRequest`, `Busy`, ...) is raised;
- nobody subscribed (`no responders`), or the connection is closed: `Unavailable`; the request
  certainly did not run;
- no reply in `timeout_s`, a connection failure after sending, or a reply that cannot be
  decoded: `Indeterminate`: the request may or may not have taken effect. Resolve it by a read
  or by an idempotent retry with the same request id, never by assuming it failed.

`error_from_response` rebuilds the right `KvfError` subclass from an error reply's body, falling
back to the headers when the body is not an `ErrorReply` (a non-kvfabric micro service, or a
500 sent by `nats.micro` itself), and returns None for a success reply.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient

from kvfabric.format.errors import BadRequest, Indeterminate, KvfError, Unavailable, error_from_wire
from kvfabric.format.invariant import invariant
from kvfabric.proto.codec import FamilyDecoder, encode
from kvfabric.proto.common import (
    ERROR_CODE_HEADER,
    NATS_SERVICE_ERROR_CODE_HEADER,
    NATS_SERVICE_ERROR_HEADER,
    REQUEST_ID_HEADER,
    TIMEOUT_MS_HEADER,
    ErrorReply,
    error_from_reply,
)

__all__ = ["error_from_response", "request"]

T = TypeVar("T")

_error_reply_decoder: FamilyDecoder[ErrorReply] = FamilyDecoder(ErrorReply, "common.error")


async def request(
    nc: NatsClient,
    subject: str,
    message: msgspec.Struct,
    reply_decoder: FamilyDecoder[T],
    timeout_s: float,
    *,
    headers: Mapping[str, str] | None = None,
    request_id: str | None = None,
) -> T:
    """Send `message` to `subject` and wait up to `timeout_s` for the reply. See the module doc."""
    invariant(timeout_s > 0, "request timeout must be positive", timeout_s=timeout_s)
    if nc.is_closed or nc.is_draining:
        raise Unavailable("nats connection is closed", subject=subject)
    payload = encode(message)
    request_headers = dict(headers) if headers else {}
    request_headers[TIMEOUT_MS_HEADER] = str(max(1, int(timeout_s * 1000)))  # no use after it
    if request_id is not None:
        request_headers[REQUEST_ID_HEADER] = request_id
    try:
        reply = await nc.request(subject, payload, timeout=timeout_s, headers=request_headers or None)
    except nats.errors.NoRespondersError:
        raise Unavailable(f"no responders on {subject}", subject=subject) from None
    except nats.errors.TimeoutError:
        raise Indeterminate(
            f"no reply on {subject} within {timeout_s} s", subject=subject, timeout_s=timeout_s
        ) from None
    except nats.errors.MaxPayloadError:
        raise BadRequest(
            f"request to {subject} exceeds the server's max payload", subject=subject, bytes=len(payload)
        ) from None
    except (
        nats.errors.ConnectionClosedError,
        nats.errors.ConnectionDrainingError,
        nats.errors.OutboundBufferLimitError,  # reconnecting, its buffer full (review, stop 68)
    ) as exc:
        # Raised before the message is written: it never left.
        raise Unavailable(f"nats connection unusable: {type(exc).__name__}", subject=subject) from None
    except nats.errors.Error as exc:
        raise Indeterminate(f"request to {subject} failed: {type(exc).__name__}", subject=subject) from None
    error = error_from_response(reply.headers, reply.data)
    if error is not None:
        raise error
    try:
        return reply_decoder.decode(reply.data)
    except BadRequest as exc:
        raise Indeterminate(f"undecodable reply from {subject}: {exc.message}", subject=subject) from None


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
