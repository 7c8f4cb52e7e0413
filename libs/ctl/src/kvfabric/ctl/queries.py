"""The NATS side of kvctl: one connection per command, typed calls, service discovery, events.

Every failure surfaces as a `KvfError` (`Unavailable` when nats or the service is unreachable,
the service's own typed error otherwise), so the CLI prints one line for all of them.

The directory is sharded: calls go through a `DirectoryRouter` (`router`): a keyed call to the
leader of its key's shard, a listing to every shard, merged here (`list_segments`,
`list_all_groups`, `list_leases`, `list_tenants`). Lease and pin ids are per shard.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final, TypeVar

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.cluster.natsauth import (
    NATS_ENV_PREFIX,
    describe_nats_error,
    is_nats_refusal,
    nats_auth_from_env,
    nats_servers,
    servers_without_userinfo,
    url_without_userinfo,
)
from kvfabric.cluster.requests import request
from kvfabric.format.errors import BadRequest, Indeterminate, NotFound, Unauthorized, Unavailable
from kvfabric.format.ids import DomainDigest, GroupId, domain_in_id
from kvfabric.proto import directory as m
from kvfabric.proto import eviction as e
from kvfabric.proto.segment import DrainRequest, SegmentState, segment_decoder
from kvfabric.proto.subjects import Service, endpoint_subject, events_wildcard, segment_subject

__all__ = [
    "EVENTS_STREAM",
    "Event",
    "NatsClient",
    "ServiceInstance",
    "ShardLease",
    "connect",
    "directory",
    "drain_segment",
    "list_all_groups",
    "list_leases",
    "list_segments",
    "list_tenants",
    "newest_epoch",
    "pin",
    "ping_services",
    "router",
    "show_group",
    "tail_events",
    "unpin",
]

EVENTS_STREAM: Final = "KVF_DIRECTORY_EVENTS"
PING_WINDOW_S: Final = 0.3
LIST_PAGE_MAX: Final = 1000

T = TypeVar("T")


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
    """A NATS connection that fails fast (no reconnect loop) with `Unavailable` (`Unauthorized`
    when the server refuses it, `BadRequest` for an unreadable password file)."""
    nc = NatsClient()
    seen: list[Exception] = []  # the connect's own errors: a refused port or a name not found

    async def keep(exc: Exception) -> None:
        seen[:] = [exc]

    try:
        auth = nats_auth_from_env(os.environ)
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise BadRequest(f"cannot read {NATS_ENV_PREFIX}PASSWORD_FILE: {reason}") from None
    servers = nats_servers(url)  # one URL, or a NATS cluster's servers as a comma list
    try:
        connecting = nc.connect(
            servers=servers,
            **auth.connect_options(),
            # per server: each gets its share of the time (review, stop 71: a silent first
            # server took all of it, and without reconnects no other was ever tried)
            connect_timeout=max(1, int(timeout_s / len(servers))),
            allow_reconnect=len(servers) > 1,
            # One try: nats-py reads 0 as "no limit" on a first connect and retries a refused
            # port every `reconnect_time_wait` until the deadline (kvctl then waited its whole
            # timeout to say "refused"); with 1 it gives up after a second try, at once.
            max_reconnect_attempts=1,
            reconnect_time_wait=0,
            error_cb=keep,
            name="kvctl",
        )
        await asyncio.wait_for(connecting, timeout_s)
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        gave_up = isinstance(exc, TimeoutError | nats.errors.NoServersError)
        last = seen[0] if gave_up and seen else exc
        raise connect_error(url, last, auth.user, timeout_s) from None
    try:
        yield nc
    finally:
        await nc.close()


def connect_error(url: str, exc: BaseException, user: str, timeout_s: float) -> Unauthorized | Unavailable:
    """What kvctl says when it cannot connect (pure): a refusal names the credentials it used and
    where an operator's come from; anything else names the error, not only its type. A password
    in the URL is never printed."""
    _, url_user, url_credentials = url_without_userinfo(nats_servers(url)[0])
    url = servers_without_userinfo(url)
    if isinstance(exc, TimeoutError):  # no error seen: the server did not answer
        return Unavailable(
            f"cannot connect to nats at {url}: no connection within {timeout_s:g} s (is the cluster up?)",
            url=url,
        )
    text = describe_nats_error(exc)
    if is_nats_refusal(exc):
        if user:  # nats-py sends these before the URL's own
            used = f"{NATS_ENV_PREFIX}USER={user} and its password were refused"
        elif url_user:
            used = f"the user {url_user} of the URL and its password were refused"
        elif url_credentials:
            used = "the token in the URL was refused"
        else:
            used = (
                f"none are set ({NATS_ENV_PREFIX}USER, {NATS_ENV_PREFIX}PASSWORD_FILE); a local"
                " cluster's operator credentials: `set -a; . .data/auth/env/admin.env; set +a`"
            )
        return Unauthorized(f"nats at {url} refused this connection ({text}): {used}", url=url)
    return Unavailable(f"cannot connect to nats at {url}: {text}", url=url)


async def router(nc: NatsClient) -> DirectoryRouter:
    """A router with the shard map loaded; `Unavailable` when no directory instance answers."""
    routed = DirectoryRouter(nc)
    await routed.refresh()
    if not routed.shards:
        subject = endpoint_subject(Service.DIRECTORY, "shard_map")
        raise Unavailable(f"no responders on {subject} (no directory instance answered)", subject=subject)
    return routed


def newest_epoch(routed: DirectoryRouter) -> int:
    """The newest directory epoch the router has seen (of any shard): what kvctl shows."""
    return max(routed.epochs.values(), default=0)


async def directory(
    routed: DirectoryRouter, verb: str, message: msgspec.Struct, timeout_s: float, *, shard: int
) -> m.DirectoryReply:
    """One directory call to the leader of `shard`, with a typed reply."""
    return await routed.ask(shard, verb, message, timeout_s)


def _expect(reply: object, kind: type[T]) -> T:
    if not isinstance(reply, kind):
        raise Indeterminate(f"unexpected reply {type(reply).__name__}, want {kind.__name__}")
    return reply


async def list_segments(routed: DirectoryRouter, timeout_s: float) -> m.SegmentList:
    """The segment table merged over shards (placements summed), under the newest epoch."""
    merged = await routed.segments(timeout_s)
    return msgspec.structs.replace(merged, epoch=newest_epoch(routed))


def _group_order(g: m.GroupSummary) -> tuple[bytes, bytes]:
    return domain_in_id(g.namespace), g.group  # group-key order: domain digest, then chain hash


async def list_all_groups(
    routed: DirectoryRouter, domain_digest: DomainDigest, limit: int, timeout_s: float
) -> list[m.GroupSummary]:
    """Published chunk groups in group-key order (domain digest, chain hash), at most `limit`:
    the first `limit` of every shard (following `next_after` pages), merged."""

    query = m.ListGroups(domain_digest=domain_digest, limit=min(limit, LIST_PAGE_MAX))

    async def of_shard(shard: int) -> list[m.GroupSummary]:
        out: list[m.GroupSummary] = []
        async for page in routed.shard_pages(shard, query, timeout_s, pages_max=limit):
            out.extend(page.groups)
            if len(out) >= limit or not page.groups:
                break
        return out[:limit]

    parts = await asyncio.gather(*(of_shard(s) for s in range(routed.shards)))
    return sorted((g for part in parts for g in part), key=_group_order)[:limit]


async def show_group(routed: DirectoryRouter, group: bytes, timeout_s: float) -> m.GroupList:
    """One chunk group (id, key or chain hash) from the shard its chain hash belongs to."""
    shard = routed.shard_of(group)
    return _expect(
        await directory(routed, "show_group", m.ShowGroup(group=group), timeout_s, shard=shard), m.GroupList
    )


class ShardLease(msgspec.Struct, frozen=True, kw_only=True):
    """A lease or pin and the shard holding it (ids are per shard)."""

    shard: int
    lease: m.LeaseInfo


# Pages of one shard's leases a listing asks for at most (each examines at most
# `m.LEASES_EXAMINED_MAX` leases).
LEASE_PAGES_MAX: Final = 100


async def shard_leases(
    routed: DirectoryRouter, shard: int, limit: int, timeout_s: float, *, pins_only: bool = False
) -> list[m.LeaseInfo]:
    """One shard's leases (pins only, with `pins_only`) in id order, page by page: at most
    `limit`, `LEASE_PAGES_MAX` pages."""
    out: list[m.LeaseInfo] = []
    after = 0
    for _ in range(LEASE_PAGES_MAX):
        page_limit = min(m.LIST_LIMIT_MAX, limit - len(out))
        message = m.ListLeases(limit=page_limit, shard=shard, after=after, pins_only=pins_only)
        page = _expect(await routed.ask(shard, "list_leases", message, timeout_s), m.LeaseList)
        # (an older directory ignores `pins_only`: filtered here too)
        out += [x for x in page.leases if x.is_pin or not pins_only]
        if not page.next_after or len(out) >= limit:
            break
        after = page.next_after
    return out[:limit]


async def list_leases(
    routed: DirectoryRouter, limit: int, timeout_s: float, *, pins_only: bool = False
) -> list[ShardLease]:
    """Leases and pins (pins only, with `pins_only`: filtered by each shard, before its
    `limit`) of every shard, by (shard, id); at most `limit` in all. Each shard is paged (a
    listing cut at `limit` read leases of shard 0 showed no pin of another; review,
    2026-12-05)."""
    shards = await routed.known_shards()
    per_shard = await asyncio.gather(
        *(shard_leases(routed, s, limit, timeout_s, pins_only=pins_only) for s in range(shards))
    )
    out = [ShardLease(shard=shard, lease=lease) for shard, leases in enumerate(per_shard) for lease in leases]
    return out[:limit]


def _limit_sum(limits: list[int]) -> int:
    """Per-shard limits (0 = unlimited) summed: unlimited if any shard is."""
    return 0 if not limits or 0 in limits else sum(limits)


def _merge_tenant(
    digest: DomainDigest, rows: Sequence[m.TenantInfo | None], defaults: Sequence[m.TenantInfo]
) -> m.TenantInfo:
    """One tenant over every shard: usage and refusals summed; a shard's byte/object quota is
    its part of the tenant's (the default's where the shard does not list the tenant)."""
    seen = [r for r in rows if r is not None]
    limits = [r if r is not None else d for r, d in zip(rows, defaults, strict=True)]
    return m.TenantInfo(
        domain_digest=digest,
        used_bytes=sum(r.used_bytes for r in seen),
        objects=sum(r.objects for r in seen),
        bytes_max=_limit_sum([x.bytes_max for x in limits]),
        objects_max=_limit_sum([x.objects_max for x in limits]),
        requests_per_s=max((x.requests_per_s for x in limits), default=0.0),  # per shard, as configured
        burst=max((x.burst for x in limits), default=0),
        quota_exceeded=sum(r.quota_exceeded for r in seen),
        rate_limited=sum(r.rate_limited for r in seen),
    )


async def list_tenants(routed: DirectoryRouter, limit: int, timeout_s: float) -> m.TenantList:
    """Tenants merged over shards (see `_merge_tenant`), in domain digest order, at most `limit`;
    `default` the limits of a tenant not configured, summed the same way."""
    replies = [
        _expect(reply, m.TenantList)
        for _, reply in await routed.each_shard(
            "list_tenants", lambda s: m.ListTenants(limit=limit, shard=s), timeout_s
        )
    ]
    unlimited = m.TenantInfo(domain_digest=DomainDigest(b""), used_bytes=0, objects=0)
    defaults = [r.default or unlimited for r in replies]
    by_shard = [{t.domain_digest: t for t in r.tenants} for r in replies]
    digests = sorted({d for rows in by_shard for d in rows})[:limit]
    tenants = [_merge_tenant(d, [rows.get(d) for rows in by_shard], defaults) for d in digests]
    default = (
        _merge_tenant(DomainDigest(b""), defaults, defaults) if any(r.default for r in replies) else None
    )
    return m.TenantList(epoch=newest_epoch(routed), tenants=tenants, default=default)


async def pin(
    routed: DirectoryRouter, holder: str, groups: list[GroupId], ttl_ms: int, timeout_s: float
) -> list[tuple[int, m.PinReply]]:
    """Pin `groups`: one pin per shard they fall in, (shard, reply) in shard order. All or none:
    when one shard's pin fails, the pins the others made are removed before the error is
    raised (they were left for `ttl_ms`, their ids never printed; review, 2026-12-05)."""
    by_shard: dict[int, list[GroupId]] = {}
    for group in groups:
        by_shard.setdefault(routed.shard_of(group), []).append(group)

    async def one(shard: int) -> tuple[int, m.PinReply]:
        message = m.Pin(holder_id=holder, groups=by_shard[shard], ttl_ms=ttl_ms)
        return shard, _expect(await directory(routed, "pin", message, timeout_s, shard=shard), m.PinReply)

    answers = await asyncio.gather(*(one(s) for s in sorted(by_shard)), return_exceptions=True)
    failed = [a for a in answers if isinstance(a, BaseException)]
    if not failed:
        return [a for a in answers if not isinstance(a, BaseException)]
    made = [a for a in answers if not isinstance(a, BaseException) and a[1].pin_id]
    await asyncio.gather(
        *(unpin(routed, holder, reply.pin_id, shard, timeout_s) for shard, reply in made),
        return_exceptions=True,
    )
    raise failed[0]


async def unpin(
    routed: DirectoryRouter, holder: str, pin_id: int, shard: int | None, timeout_s: float
) -> m.PinReply:
    """Remove pin `pin_id` of `shard`; without a shard, of the one shard listing a pin with that
    id (`BadRequest` when several do: pin ids are per shard)."""
    if shard is None:
        pins = [
            x
            for x in await list_leases(routed, LEASE_PAGES_MAX * m.LIST_LIMIT_MAX, timeout_s, pins_only=True)
            if x.lease.lease_id == pin_id
        ]
        shards = sorted({x.shard for x in pins if x.lease.holder_id == holder} or {x.shard for x in pins})
        if not shards:
            raise NotFound(f"no pin {pin_id}", pin_id=pin_id)
        if len(shards) > 1:
            raise BadRequest(f"pin {pin_id} exists in shards {shards}: pass --shard", pin_id=pin_id)
        shard = shards[0]
    elif not 0 <= shard < routed.shards:
        raise BadRequest(f"--shard must be in 0..{routed.shards - 1}", shard=shard)
    message = m.Unpin(holder_id=holder, pin_id=pin_id, shard=shard)
    return _expect(await directory(routed, "unpin", message, timeout_s, shard=shard), m.PinReply)


async def drain_segment(nc: NatsClient, segment_id: str, draining: bool, timeout_s: float) -> SegmentState:
    reply = await request(
        nc, segment_subject(segment_id, "drain"), DrainRequest(draining=draining), segment_decoder, timeout_s
    )
    if not isinstance(reply, SegmentState):
        raise Indeterminate(f"drain answered {type(reply).__name__}")
    return reply


async def eviction_status(nc: NatsClient, timeout_s: float) -> e.EvictionStatus:
    """The eviction policy's pools, tenants and counters (`kvf.v1.eviction.status`)."""
    subject = endpoint_subject(Service.EVICTION, "status")
    reply = await request(nc, subject, e.EvictionStatusRequest(), e.eviction_decoder, timeout_s)
    return _expect(reply, e.EvictionStatus)


async def eviction_explain(nc: NatsClient, group: GroupId, timeout_s: float) -> e.EvictionExplain:
    """Why the eviction policy holds, held or dropped `group` (`kvf.v1.eviction.explain`)."""
    subject = endpoint_subject(Service.EVICTION, "explain")
    reply = await request(
        nc, subject, e.EvictionExplainRequest(group_id=group), e.eviction_decoder, timeout_s
    )
    return _expect(reply, e.EvictionExplain)


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
            except TimeoutError:  # nats-py raises a bare asyncio one too (fetch deadline)
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
