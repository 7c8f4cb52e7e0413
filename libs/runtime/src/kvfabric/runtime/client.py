"""Calling a kvfabric endpoint: one request, a typed reply or a typed `KvfError`.

Outcomes of `request`:
- a reply: decoded with `reply_decoder` and returned;
- an error reply: the `KvfError` subclass it names (`BadRequest`, `Busy`, ...) is raised;
- nobody subscribed (`no responders`), or the connection is closed: `Unavailable`; the request
  certainly did not run;
- no reply in `timeout_s`, a connection failure after sending, or a reply that cannot be
  decoded: `Indeterminate`: the request may or may not have taken effect. Resolve it by a read
  or by an idempotent retry with the same request id, never by assuming it failed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient

from kvfabric.format.errors import BadRequest, Indeterminate, Unavailable
from kvfabric.format.invariant import invariant
from kvfabric.proto.codec import FamilyDecoder, encode
from kvfabric.proto.common import REQUEST_ID_HEADER
from kvfabric.runtime.replies import error_from_response

__all__ = ["request"]

T = TypeVar("T")


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
    except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError) as exc:
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
