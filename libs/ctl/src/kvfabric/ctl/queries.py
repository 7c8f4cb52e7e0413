"""The NATS side of kvctl: one connection per command, typed calls, service discovery, events.

Every failure surfaces as a `KvfError` (`Unavailable` when nats or the service is unreachable,
the service's own typed error otherwise), so the CLI prints one line for all of them.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Final

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from kvfabric.format.errors import Indeterminate, Unavailable
from kvfabric.proto import directory as m
from kvfabric.proto.segment import DrainRequest, SegmentState, segment_decoder
from kvfabric.proto.subjects import Service, endpoint_subject, events_wildcard, segment_subject
from kvfabric.runtime.client import request
from kvfabric.runtime.natsauth import nats_auth_from_env

__all__ = [
    "EVENTS_STREAM",
    "Event",
    "NatsClient",
    "ServiceInstance",
    "connect",
    "directory",
    "drain_segment",
    "list_all_groups",
    "ping_services",
    "tail_events",
]

EVENTS_STREAM: Final = "KVF_DIRECTORY_EVENTS"
PING_WINDOW_S: Final = 0.3
LIST_PAGE_MAX: Final = 1000


class ServiceInstance(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    id: str
    version: str


class Event(msgspec.Struct, frozen=True, kw_only=True):
    seq: int
    subject: str
    time: str
    kind: str
    event: dict[str, Any]


@asynccontextmanager
async def connect(url: str, timeout_s: float) -> AsyncIterator[NatsClient]:
    """A NATS connection that fails fast (no reconnect loop) with `Unavailable`."""
    nc = NatsClient()

    async def quiet(_exc: Exception) -> None:
        return None

    try:
        connecting = nc.connect(
            servers=[url],
            **nats_auth_from_env(os.environ).connect_options(),
            connect_timeout=max(1, int(timeout_s)),
            allow_reconnect=False,
            max_reconnect_attempts=0,
            error_cb=quiet,
            name="kvctl",
        )
        await asyncio.wait_for(connecting, timeout_s)
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        raise Unavailable(f"cannot connect to nats at {url}: {type(exc).__name__}", url=url) from None
    try:
        yield nc
    finally:
        await nc.close()


async def directory(nc: NatsClient, verb: str, message: msgspec.Struct, timeout_s: float) -> m.DirectoryReply:
    """One directory call with a typed reply."""
    return await request(nc, endpoint_subject(Service.DIRECTORY, verb), message, m.reply_decoder, timeout_s)


async def list_all_groups(
    nc: NatsClient, domain_digest: bytes, limit: int, timeout_s: float
) -> list[m.GroupSummary]:
    """Published chunk groups, following `next_after` pages until `limit` groups or the end."""
    out: list[m.GroupSummary] = []
    after = b""
    while len(out) < limit:
        page = min(limit - len(out), LIST_PAGE_MAX)
        reply = await directory(
            nc, "list_groups", m.ListGroups(domain_digest=domain_digest, after=after, limit=page), timeout_s
        )
        if not isinstance(reply, m.GroupList):
            raise Indeterminate(f"list_groups answered {type(reply).__name__}")
        out.extend(reply.groups)
        if not reply.next_after or not reply.groups:
            break
        after = reply.next_after
    return out[:limit]


async def drain_segment(nc: NatsClient, segment_id: str, draining: bool, timeout_s: float) -> SegmentState:
    reply = await request(
        nc, segment_subject(segment_id, "drain"), DrainRequest(draining=draining), segment_decoder, timeout_s
    )
    if not isinstance(reply, SegmentState):
        raise Indeterminate(f"drain answered {type(reply).__name__}")
    return reply


async def ping_services(nc: NatsClient, window_s: float = PING_WINDOW_S) -> list[ServiceInstance]:
    """Every `nats.micro` service instance that answers `$SRV.PING` within `window_s`."""
    inbox = nc.new_inbox()
    replies: list[Msg] = []

    async def collect(msg: Msg) -> None:
        replies.append(msg)

    sub = await nc.subscribe(inbox, cb=collect)
    try:
        await nc.publish("$SRV.PING", b"", reply=inbox)
        await nc.flush()
        await asyncio.sleep(window_s)
    finally:
        await sub.unsubscribe()
    found: list[ServiceInstance] = []
    for msg in replies:
        try:
            body = json.loads(msg.data)
        except ValueError:
            continue
        if isinstance(body, dict):
            found.append(
                ServiceInstance(
                    name=str(body.get("name", "")),
                    id=str(body.get("id", "")),
                    version=str(body.get("version", "")),
                )
            )
    return sorted(found, key=lambda s: (s.name, s.id))


async def tail_events(nc: NatsClient, n: int, timeout_s: float) -> list[Event]:
    """The last `n` directory events, read by an ephemeral pull consumer (no acks, auto-deleted)."""
    js = nc.jetstream(timeout=timeout_s)
    try:
        info = await js.stream_info(EVENTS_STREAM)
    except nats.js.errors.NotFoundError:
        raise Unavailable(f"no stream {EVENTS_STREAM} (is the directory running?)") from None
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
        raise Unavailable("jetstream is not available on this nats server") from None
    state = info.state
    if state.messages == 0 or n <= 0:
        return []
    start = max(state.first_seq, state.last_seq - n + 1)
    count = state.last_seq - start + 1
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=start,
        ack_policy=AckPolicy.NONE,
        inactive_threshold=30.0,
    )
    sub = await js.pull_subscribe(events_wildcard(Service.DIRECTORY), stream=EVENTS_STREAM, config=config)
    events: list[Event] = []
    try:
        while len(events) < count:
            try:
                batch = await sub.fetch(count - len(events), timeout=timeout_s)
            except nats.errors.TimeoutError:
                break
            for msg in batch:
                events.append(_event_of(msg))
                if msg.metadata.sequence.stream >= state.last_seq:
                    count = len(events)
    finally:
        await sub.unsubscribe()
    return events


def _event_of(msg: Msg) -> Event:
    meta = msg.metadata
    try:
        decoded = m.event_decoder.decode(msg.data)
        kind = type(decoded).__name__
        body = jsonable(decoded)
    except Exception as exc:  # an event this build cannot read: show it, do not fail the tail
        kind, body = "undecodable", {"error": str(exc), "bytes": len(msg.data)}
    stamp = meta.timestamp.isoformat(timespec="milliseconds")
    return Event(seq=meta.sequence.stream, subject=msg.subject, time=stamp, kind=kind, event=body)


def jsonable(value: Any) -> Any:
    """Builtins of a msgspec value, bytes as lowercase hex."""
    return _hexify(msgspec.to_builtins(value, builtin_types=(bytes,)))


def _hexify(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {k: _hexify(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_hexify(v) for v in value]
    return value
