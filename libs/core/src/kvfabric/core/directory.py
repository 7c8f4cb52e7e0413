"""The directory core: object lifecycle, two-phase publish, read leases, pins, placement.

Synchronous and I/O-free. The service shell decodes a request, calls `handle(request, now_ms)`
(and `tick(now_ms)` periodically), performs the returned effects and sends the reply. Time is
passed in; nothing here reads a clock, sleeps or does I/O.

## Unit of visibility: the chunk group
A chunk group is every object of one chunk of one prefix: one per member (TP rank, PP stage,
layer group); `tp_size × pp_size × layer_group_count` members are expected. It is identified by its group
key (domain digest + chain hash, `directory_keys`; events and listings show the chain hash), and
published as a whole.

## States of a chunk group
    (absent) --put_begin--> BUILDING --every expected member committed--> PUBLISHED
    BUILDING --abort / write deadline passed--> members reclaimed --> (absent)
    PUBLISHED --evict (no lease, no pin)--> EVICTING --all replica slots freed--> (absent)
    PUBLISHED --a member lost its last live replica (segment down / new incarnation)--> (absent)
Members inside a BUILDING group: placed (tickets issued) → confirmed replicas (segments stored
and checksummed the bytes) → committed (the writer says it is done).

## Invariants (checked by `check_invariants()` in tests, after every step)
1. Nothing is readable before publish: `lookup` only returns PUBLISHED groups, and only their
   replicas on live segment incarnations.
2. A folded hit is a run of consecutive chunks from the first: it never skips a gap.
3. A group under a read lease or a pin is never evicted; a lease expiry only makes the group
   evictable, it never frees memory by itself (segments keep their own transfer references).
4. One writer per key: a second `put_begin` of a member another writer holds gets `in_flight`; of a
   published key gets `exists`.
5. Stale generations are rejected (`StaleGeneration`) and counted, never applied: an older
   directory epoch, an older segment incarnation, a confirm for a ticket that no longer exists.
6. No leaks: when writers die and leases expire, every placement is either published or its
   reservation released and its confirmed slot sent a free; `reserved_bytes` of a segment equals
   the sum of its live placements in its arena (a replica in its disk tier, slot id from
   `SSD_SLOT_BASE`, reserves no arena bytes: docs/segment.md, "Disk tier").
7. The per-domain index (`directory_index`) holds exactly the published group keys.

## What a call costs (issue 21: the shell runs every call on its one event loop)
Never the size of the store, nor another tenant's data: a listing pages through the index of
the domain asked (at most `LIST_SCAN_GROUPS_MAX` groups examined a call, its reply within
`reply_bytes_max`), `show_group` looks a group up by key (a chain hash alone: under each domain
holding something), a lookup parses its ids only as far as its fold and is charged
`quotas.request_tokens` of its size before any work; the shell folds a long lookup in slices
(`groups_max`, then `lookup_more`). A lookup's hit is cut short where its reply would no longer
fit (`reply_bytes_max`).

## A new leader (`adopt`)
A directory that takes over a shard rebuilds its index from the segments' reports
(`directory_rebuild`) under a new, higher epoch. Until `grace_until_ms` (now +
`lease_ttl_ms_max`) it sends no free: every read lease the old leader granted is shorter than
that, so no leased slot is reused under its reader. Frees of adopted slots due meanwhile are kept
and sent after; slots written under the new epoch are not held back.

## Ownership
Tickets belong to the writer until its deadline; after that the directory reclaims them (a late
confirm gets `unknown_ticket` and the segment frees the slot). A slot named in a `FreeSlots`
effect belongs to the segment: the directory never hands it out again, even if the free is lost
(it is retried on `tick` until the segment acknowledges or its incarnation dies).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from kvfabric.core.directory_index import DomainIndex
from kvfabric.core.directory_keys import (
    CHAIN_BYTES,
    GROUP_KEY_BYTES,
    GroupInfo,
    KeyInfo,
    chain_of,
    domain_of,
    parse_group,
    parse_key,
)
from kvfabric.core.directory_rebuild import SegmentHolding, plan_rebuild
from kvfabric.core.directory_records import (
    FLAG_DEGRADED,
    MemberRecord,
    PublishedGroup,
    ReplicaRecord,
    pack_group,
    unpack_group,
)
from kvfabric.core.placement import Candidate, choose_segments
from kvfabric.core.quotas import (
    UNLIMITED,
    Quotas,
    Tenant,
    TenantQuota,
    TenantUsage,
    request_tokens,
    tenant_of,
)
from kvfabric.format.errors import (
    BadRequest,
    BatchTooLarge,
    Busy,
    KvfError,
    NotFound,
    RateLimited,
    StaleGeneration,
    Unavailable,
)
from kvfabric.format.invariant import invariant
from kvfabric.proto import directory as m
from kvfabric.proto.segment import tier_of_slot
from kvfabric.proto.tickets import read_token, sign_ticket

__all__ = [
    "LIST_SCAN_GROUPS_MAX",
    "DirectoryConfig",
    "DirectoryCore",
    "Effect",
    "EmitEvent",
    "FreeSlots",
    "Outcome",
]

Member = tuple[int, int, int]
CHECKSUM_BYTES: Final = 16
SLOT_MAX: Final = 2**32 - 1  # the published record packs slots as u32 ...
GENERATION_MAX: Final = 2**64 - 1  # ... and generations as u64 (a generation starts at 1)
_U64: Final = 2**64 - 1  # the widest integer msgpack encodes (9 bytes): reply size bounds
_ARRAY_HEADER_BYTES: Final = 5  # msgpack array32 header: the widest a list's length takes
_encode: Final = msgspec.msgpack.Encoder().encode
# Groups one `list_groups` call examines at most (its page may hold fewer: filtered, or cut to
# fit the reply): a listing stalls the event loop for O(this), whatever the store holds.
LIST_SCAN_GROUPS_MAX: Final = 1_000
_LIST_ENVELOPE_BYTES: Final = (
    len(_encode(m.GroupList(epoch=_U64, groups=[], next_after=bytes(GROUP_KEY_BYTES)))) + _ARRAY_HEADER_BYTES
)


def _str_bytes(n: int) -> int:
    """The most bytes a msgpack str or bin of `n` bytes takes: its header (up to 5) and itself."""
    return n + 5


@dataclass(frozen=True, slots=True)
class _ReplySizes:
    """Encoded sizes of a put_begin reply's and a lookup reply's parts with every string and
    byte field empty and every integer at its widest; `_check_reply_fits` and `_lookup` add the
    strings' lengths."""

    ticket: int
    result: int
    envelope: int
    # a lookup reply: its envelope, an object's location without replicas, a replica with a token
    lookup_envelope: int
    location: int
    replica: int

    @classmethod
    def measure(cls, secret: bytes) -> _ReplySizes:
        ticket = m.WriteTicket(
            ticket_id=_U64,
            key=b"",
            segment_id="",
            incarnation=_U64,
            size_bytes=_U64,
            checksum=bytes(CHECKSUM_BYTES),
            writer_id="",
            deadline_ms=_U64,
            epoch=_U64,
            shard=_U64,
        )
        return cls(
            ticket=len(_encode(sign_ticket(ticket, secret))),
            result=len(_encode(m.BeginResult(key=b"", status="quota_exceeded", deadline_ms=_U64))),
            envelope=len(_encode(m.PutBeginReply(epoch=_U64, results=[]))) + _ARRAY_HEADER_BYTES,
            lookup_envelope=len(
                _encode(
                    m.LookupReply(
                        epoch=_U64, hit_chunks=_U64, lease_id=_U64, lease_expires_ms=_U64, objects=[]
                    )
                )
            )
            + _ARRAY_HEADER_BYTES,
            location=len(
                _encode(
                    m.ObjectLocation(
                        chunk_index=_U64,
                        member=m.Member(_U64, _U64, _U64),
                        size_bytes=_U64,
                        checksum=bytes(CHECKSUM_BYTES),
                        replicas=[],
                    )
                )
            )
            + _ARRAY_HEADER_BYTES,
            replica=len(
                _encode(
                    m.Replica(
                        segment_id="",
                        incarnation=_U64,
                        slot=_U64,
                        slot_generation=_U64,
                        read_token=read_token(secret, "", _U64, _U64, _U64, _U64, _U64),
                        read_expires_ms=_U64,
                    )
                )
            ),
        )


# Replies kept for retried requests, by verb: decoded again on a retry (see `_reply_cache`).
_REPLY_DECODERS: Final[Mapping[str, msgspec.msgpack.Decoder[Any]]] = {
    "begin": msgspec.msgpack.Decoder(m.PutBeginReply),
}


def _scope_of(holder_id: str) -> str | None:
    """The tenant a holder id was scoped to by the directory shell (`<tenant>/<holder>`), if any."""
    scope, sep, _ = holder_id.partition("/")
    return scope if sep else None


@dataclass(frozen=True, slots=True)
class DirectoryConfig:
    ticket_secret: bytes
    replicas_default: int = 1
    replicas_max: int = 5
    heartbeat_interval_ms: int = 1_000
    heartbeat_timeout_ms: int = 5_000
    object_bytes_max: int = 1 << 30
    pending_objects_max: int = 200_000
    leases_max: int = 200_000
    pins_max: int = 10_000
    # Bounded by the number of per-object results held (an empty reply counts as one), not by
    # replies (a reply may hold 4096).
    reply_cache_objects_max: int = 16_384
    free_retry_ms: int = 2_000
    sweep_batch_max: int = 10_000
    # Read leases are granted for at most this long (a longer request is shortened). A new leader
    # waits this long (its grace period) before freeing anything, so leases of the old one hold.
    lease_ttl_ms_max: int = 60_000
    # Per-tenant (share domain digest) quotas and request rates; see `kvfabric.core.quotas`.
    tenant_quota_default: TenantQuota = UNLIMITED
    tenant_quotas: Mapping[bytes, TenantQuota] = field(default_factory=dict)
    tenants_max: int = 10_000  # token buckets and rejection counts kept (least recently used go)
    # Leases and pins one authenticated tenant may hold at once (its holder ids are scoped
    # `<tenant>/<holder>` by the directory shell), so no tenant fills the shared tables.
    tenant_leases_max: int = 50_000
    tenant_pins_max: int = 2_500
    # Per-tenant budgets of the write path (issue 21), for the same scoped writer ids: members
    # being written (building, not yet published), and the bytes they hold reserved (size ×
    # replicas), as a fraction of the capacity of the live segments this core places on (the
    # service divides it by the shard count). Over either, the whole put_begin is `busy`.
    tenant_pending_objects_max: int = 50_000
    tenant_pending_capacity_fraction: float = 0.25
    # A tenant's pins last at most this long (a longer request is shortened; services' pins may
    # ask up to PIN_TTL_MS_MAX).
    tenant_pin_ttl_ms_max: int = 3_600_000
    # Write deadlines are granted for at most this long (a longer request is shortened): what a
    # write needs, the client's save timeout; a dead writer's reservation lasts no longer.
    write_ttl_ms_max: int = 30_000
    # Placement sees a segment's free bytes rounded down to a 1/free_bytes_granules part of its
    # capacity (0 = exact), so which objects fit tells a writer free space only to that grain.
    free_bytes_granules: int = 64
    # The largest encoded reply body: a put_begin whose reply could be larger is refused
    # (`batch_too_large`) before anything is placed (NATS drops a message over max_payload).
    reply_bytes_max: int = m.REPLY_BYTES_MAX
    # Groups one `list_groups` call examines at most (tests lower it to page often).
    list_scan_groups_max: int = LIST_SCAN_GROUPS_MAX
    # True when other shards' cores place on the same segments (a sharded directory): a
    # segment's free space is then its capacity minus the larger of this core's reservations
    # and the usage the segment reports (all shards'; a heartbeat old).
    segments_shared: bool = False


# ---- effects -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EmitEvent:
    """Publish an event to JetStream (`kvf.v1.events.directory.<kind>`)."""

    kind: str
    event: msgspec.Struct


@dataclass(frozen=True, slots=True)
class FreeSlots:
    """Tell a segment to free these slots. It answers with `SlotsFreed`."""

    segment_id: str
    incarnation: int
    slots: tuple[m.FreedSlot, ...]


Effect = EmitEvent | FreeSlots


@dataclass(slots=True)
class Outcome:
    reply: msgspec.Struct
    effects: list[Effect] = field(default_factory=list)


# ---- internal state ------------------------------------------------------------------------


@dataclass(slots=True)
class _Segment:
    segment_id: str
    incarnation: int
    domain: m.FailureDomain
    capacity_bytes: int
    data_addr: str
    last_heartbeat_ms: int
    up: bool = True
    draining: bool = False
    reserved_bytes: int = 0  # sum of sizes of live placements (pending, published, freeing)
    reported_used_bytes: int = 0


@dataclass(slots=True)
class _Placement:
    ticket_id: int
    placement: int  # interned (segment id, incarnation)
    slot: int = -1
    slot_generation: int = -1

    @property
    def confirmed(self) -> bool:
        return self.slot >= 0


@dataclass(slots=True)
class _PendingMember:
    key: bytes
    writer_id: str
    size_bytes: int
    checksum: bytes
    deadline_ms: int
    replicas_target: int
    placements: list[_Placement]
    committed: bool = False


@dataclass(slots=True)
class _BuildingGroup:
    info: GroupInfo
    members: dict[Member, _PendingMember] = field(default_factory=dict)
    parent: bytes = b""  # the previous chunk's chain hash, as the first writer told it


@dataclass(frozen=True, slots=True)
class _ReplicaTicket:
    group: bytes
    member: Member
    placement: int
    size_bytes: int
    checksum: bytes
    key: bytes
    deadline_ms: int
    writer_id: str = ""
    tier: str = "dram"  # "ssd": a copy into the segment's own disk tier (demotion), no arena bytes


@dataclass(slots=True)
class _Lease:
    holder_id: str
    groups: tuple[bytes, ...]
    expires_ms: int
    is_pin: bool


# ---- the core ------------------------------------------------------------------------------


class DirectoryCore:
    """One directory shard's state machine. See the module docstring for states and invariants."""

    def __init__(self, config: DirectoryConfig, epoch: int = 1, shard: int = 0) -> None:
        invariant(epoch >= 1, "epoch starts at 1")
        self.config = config
        self.epoch = epoch
        self.shard = shard  # the virtual shard this core leads (tickets name it: per-shard fencing)
        self.segments: dict[str, _Segment] = {}
        self._placements: list[tuple[str, int]] = []
        self._placement_index: dict[tuple[str, int], int] = {}
        self._namespaces: list[bytes] = []
        self._namespace_index: dict[bytes, int] = {}
        self.building: dict[bytes, _BuildingGroup] = {}
        self.published: dict[bytes, bytes] = {}  # group key -> packed record
        # The published group keys per share domain, in order: listings page through one
        # domain's keys only (`directory_index`; the same key objects as `published`'s).
        self._index = DomainIndex()
        # (tenant scope of the holder id, is_pin) -> leases or pins held (tenant holders only)
        self._scope_held: dict[tuple[str, bool], int] = {}
        self.evicting: dict[bytes, PublishedGroup] = {}
        self._evicting_frees: dict[bytes, int] = {}  # evicting group -> frees not yet acknowledged
        self._tickets: dict[int, tuple[bytes, Member]] = {}
        # (segment id, incarnation, slot, generation) ->
        #     (size, group id or b"" if not evicting, sent at ms (0 not yet, -1 deferred), tenant)
        self._freeing: dict[tuple[str, int, int, int], tuple[int, bytes, int, Tenant]] = {}
        self._leases: dict[int, _Lease] = {}  # read leases and pins
        self._lease_heap: list[tuple[int, int]] = []
        self._lease_count: dict[bytes, int] = {}
        self._pin_count: dict[bytes, int] = {}
        self._pins_held = 0
        # Groups that lost a member's last replica while leased/pinned: unreadable now, their
        # remaining slots are freed only once the last lease or pin on them ends.
        self._sweep_deferred: set[bytes] = set()
        self._deadline_heap: list[tuple[int, bytes]] = []
        self._sweep_queue: list[bytes] = []
        # (verb, writer id, request id) -> (the reply, msgpack-encoded, objects it answers for).
        # Kept encoded: bytes are never walked by the cyclic GC, a Struct with its lists would
        # be (up to reply_cache_objects_max results; kvfabric.runtime.gcpolicy).
        self._reply_cache: OrderedDict[tuple[str, str, str], tuple[bytes, int]] = OrderedDict()
        self._reply_cache_objects = 0
        self._ids = itertools.count(1)
        self.pending_objects = 0
        # tenant scope of the writer id -> its building members / the bytes they hold reserved
        self._scope_pending_objects: dict[str, int] = {}
        self._scope_pending_bytes: dict[str, int] = {}
        self.counters: dict[str, int] = {}
        # Lookup hits since the last GroupsAccessed event (≤ ACCESS_BATCH_MAX groups).
        self._hits: dict[bytes, int] = {}
        # After a rebuild (`adopt`), frees wait until this time: the old leader's leases hold.
        self.grace_until_ms = 0
        self._in_grace = False
        self._adopted: set[tuple[str, int, int, int]] = set()  # slots a reader of the old leader may hold
        # Extra replicas being copied into place (repair, prefetch, drain): ticket id -> ticket.
        self._replicating: dict[int, _ReplicaTicket] = {}
        self._replica_deadlines: list[tuple[int, int]] = []  # (deadline_ms, ticket id)
        # Published groups a member of which has no good replica left (its last one was corrupt):
        # unreadable at once, invalidated by the sweep once no lease or pin holds them.
        self._unreadable: set[bytes] = set()
        self.quotas = Quotas(
            config.tenant_quota_default, config.tenant_quotas, config.tenants_max, self._count
        )
        # The longest segment id and data address ever registered (UTF-8 bytes): an upper bound
        # of what a ticket names, for `_check_reply_fits`.
        self._reply_sizes = _ReplySizes.measure(config.ticket_secret)
        self._segment_id_bytes_max = 0
        self._data_addr_bytes_max = 0

    # ---- plumbing ------------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def _check_epoch(self, epoch: int) -> None:
        if epoch and epoch < self.epoch:
            self._count("stale_epoch_rejected_total")
            raise StaleGeneration("directory_epoch", epoch, self.epoch)
        if epoch > self.epoch:
            self._count("future_epoch_rejected_total")
            raise Unavailable(
                f"directory epoch {self.epoch} is behind the caller's {epoch}", epoch=self.epoch
            )

    def _intern_placement(self, segment_id: str, incarnation: int) -> int:
        key = (segment_id, incarnation)
        idx = self._placement_index.get(key)
        if idx is None:
            idx = len(self._placements)
            self._placements.append(key)
            self._placement_index[key] = idx
        return idx

    def _intern_namespace(self, namespace: bytes) -> int:
        idx = self._namespace_index.get(namespace)
        if idx is None:
            idx = len(self._namespaces)
            self._namespaces.append(namespace)
            self._namespace_index[namespace] = idx
        return idx

    def _placement_live(self, placement: int) -> bool:
        return self._segment_of(placement) is not None

    def _segment_of(self, placement: int) -> _Segment | None:
        """The segment of a placement while that incarnation is up; its reservations live there."""
        segment_id, incarnation = self._placements[placement]
        seg = self.segments.get(segment_id)
        return seg if seg is not None and seg.up and seg.incarnation == incarnation else None

    def _release_reservation(self, placement: int, size_bytes: int, tenant: Tenant) -> None:
        self.quotas.add(tenant, -size_bytes)
        seg = self._segment_of(placement)
        if seg is not None:
            seg.reserved_bytes -= size_bytes
            invariant(seg.reserved_bytes >= 0, "negative reservation", segment=seg.segment_id)

    def _end_replica_ticket(self, rt: _ReplicaTicket) -> None:
        """A replica ticket that added nothing: its tenant bytes (and arena reservation) go back."""
        if rt.tier == "dram":
            self._release_reservation(rt.placement, rt.size_bytes, tenant_of(rt.key))
        else:
            self.quotas.add(tenant_of(rt.key), -rt.size_bytes)

    def _pending_add(self, writer_id: str, objects: int, nbytes: int) -> None:
        """Adjust what a tenant's writer holds in building members (negative: given back)."""
        scope = _scope_of(writer_id)
        if scope is None:
            return
        for table, n in ((self._scope_pending_objects, objects), (self._scope_pending_bytes, nbytes)):
            left = table.get(scope, 0) + n
            invariant(left >= 0, "negative tenant pending count", scope=scope)
            if left:
                table[scope] = left
            else:
                table.pop(scope, None)

    def _free_slot(
        self,
        placement: int,
        slot: int,
        generation: int,
        size: int,
        key: bytes,
        group: bytes,
        effects: list[Effect],
        tenant: Tenant,
    ) -> None:
        """Hand a confirmed slot back to its segment. The reservation (and the tenant's bytes) is
        released on `SlotsFreed`."""
        segment_id, incarnation = self._placements[placement]
        if not self._placement_live(placement):
            self._release_reservation(placement, size, tenant)  # dead incarnation: its memory is gone
            return
        if group:
            self._evicting_frees[group] = self._evicting_frees.get(group, 0) + 1
        if self._in_grace and (segment_id, incarnation, slot, generation) in self._adopted:
            # a reader leased by the old leader may still read it: not yet
            self._freeing[(segment_id, incarnation, slot, generation)] = (size, group, -1, tenant)
            self._count("frees_deferred_grace_total")
            return
        self._freeing[(segment_id, incarnation, slot, generation)] = (size, group, 0, tenant)
        effects.append(FreeSlots(segment_id, incarnation, (m.FreedSlot(key, slot, generation),)))

    def _cached(self, verb: str, writer_id: str, request_id: str) -> msgspec.Struct | None:
        cached = self._reply_cache.get((verb, writer_id, request_id))
        if cached is None:
            return None
        self._count("retried_request_total")
        reply: msgspec.Struct = _REPLY_DECODERS[verb].decode(cached[0])
        return reply

    def _remember(
        self, verb: str, writer_id: str, request_id: str, reply: msgspec.Struct, n_objects: int
    ) -> None:
        invariant(verb in _REPLY_DECODERS, "no decoder for cached replies of this verb", verb=verb)
        n_objects = max(1, n_objects)  # an empty reply is an entry too: counted, so entries are bounded
        old = self._reply_cache.pop((verb, writer_id, request_id), None)
        self._reply_cache_objects += n_objects - (old[1] if old else 0)
        self._reply_cache[(verb, writer_id, request_id)] = (msgspec.msgpack.encode(reply), n_objects)
        while self._reply_cache_objects > self.config.reply_cache_objects_max:
            _, (_, n) = self._reply_cache.popitem(last=False)
            self._reply_cache_objects -= n

    def charge_domains(self, domain_digests: Iterable[bytes], now_ms: int) -> None:
        """Charge one request to these share domains' rate limits (the shell, for tenant requests
        that name no key); raises `RateLimited` and charges nothing when one is out of tokens."""
        wait_ms = self.quotas.charge((Tenant(d) for d in domain_digests), now_ms)
        if wait_ms:
            raise RateLimited(
                f"request rate over the tenant's limit; retry in {wait_ms} ms", retry_after_ms=wait_ms
            )

    def _check_rate(self, raw_ids: Iterable[bytes], now_ms: int, tokens: int = 1) -> None:
        """Charge one request of `tokens` to the tenants of these keys / chunk group ids (all
        or none; see `quotas.Quotas.charge`)."""
        if not self.quotas.rate_limited:
            return
        wait_ms = self.quotas.charge(map(tenant_of, raw_ids), now_ms, tokens)
        if wait_ms:
            raise RateLimited(
                f"request rate over the tenant's limit; retry in {wait_ms} ms", retry_after_ms=wait_ms
            )

    @staticmethod
    def _check_batch(what: str, n: int, limit: int) -> None:
        if n > limit:
            raise BatchTooLarge(f"{what}: {n} items exceed the limit of {limit}", n=n, limit=limit)

    # ---- dispatch ------------------------------------------------------------------------

    @property
    def leases_held(self) -> int:
        """Read leases plus pins held now."""
        return len(self._leases)

    @property
    def pins_held(self) -> int:
        return self._pins_held

    def handle(
        self,
        request: msgspec.Struct,
        now_ms: int,
        *,
        reply_bytes_max: int | None = None,
        groups_max: int | None = None,
    ) -> Outcome:
        """Apply one request. Raises a `KvfError` for a whole-request error (nothing applied).
        For a lookup: `reply_bytes_max` lowers its reply bound (a part of a `lookup_many`, whose
        reply holds every part's), `groups_max` folds only its first groups (the first slice of
        a lookup the shell runs in slices; `lookup_more` goes on)."""
        handler = _HANDLERS.get(type(request))
        if handler is None:
            raise BadRequest(f"not a directory request: {type(request).__name__}")
        try:
            if isinstance(request, m.Lookup):
                return self._lookup(request, now_ms, reply_bytes_max, groups_max)
            return handler(self, request, now_ms)
        except KvfError as err:
            self._count(f"error_{err.code}_total")
            raise

    # ---- segments ------------------------------------------------------------------------

    def _register(self, req: m.RegisterSegment, now_ms: int) -> Outcome:
        self._check_epoch(req.epoch)
        if req.capacity_bytes <= 0 or not req.segment_id:
            raise BadRequest("segment needs an id and a positive capacity")
        effects: list[Effect] = []
        seg = self.segments.get(req.segment_id)
        if seg is not None:
            if req.incarnation < seg.incarnation or (req.incarnation == seg.incarnation and not seg.up):
                # An old process, or one declared down that must restart empty with a new incarnation.
                self._count("stale_incarnation_rejected_total")
                raise StaleGeneration("segment_incarnation", req.incarnation, seg.incarnation + 1)
            if req.incarnation == seg.incarnation:  # idempotent re-register
                seg.last_heartbeat_ms = now_ms
                return Outcome(self._registered())
            self._segment_lost(seg, "restarted", effects)
        self._note_segment_text(req.segment_id, req.data_addr)
        self.segments[req.segment_id] = _Segment(
            req.segment_id, req.incarnation, req.domain, req.capacity_bytes, req.data_addr, now_ms
        )
        effects.append(
            EmitEvent(
                "segment_up",
                m.SegmentUp(
                    segment_id=req.segment_id, incarnation=req.incarnation, capacity_bytes=req.capacity_bytes
                ),
            )
        )
        return Outcome(self._registered(), effects)

    def _note_segment_text(self, segment_id: str, data_addr: str) -> None:
        self._segment_id_bytes_max = max(self._segment_id_bytes_max, len(segment_id.encode()))
        self._data_addr_bytes_max = max(self._data_addr_bytes_max, len(data_addr.encode()))

    def _registered(self) -> m.SegmentRegistered:
        return m.SegmentRegistered(
            epoch=self.epoch,
            heartbeat_interval_ms=self.config.heartbeat_interval_ms,
            heartbeat_timeout_ms=self.config.heartbeat_timeout_ms,
        )

    def _live_segment(self, segment_id: str, incarnation: int) -> _Segment:
        seg = self.segments.get(segment_id)
        if seg is None or not seg.up:
            raise NotFound(f"segment {segment_id!r} is not registered: register again", segment_id=segment_id)
        if incarnation != seg.incarnation:
            self._count("stale_incarnation_rejected_total")
            raise StaleGeneration("segment_incarnation", incarnation, seg.incarnation)
        return seg

    def _heartbeat(self, req: m.Heartbeat, now_ms: int) -> Outcome:
        self._check_epoch(req.epoch)
        seg = self._live_segment(req.segment_id, req.incarnation)
        seg.last_heartbeat_ms = now_ms
        seg.reported_used_bytes = req.used_bytes
        seg.draining = req.draining
        return Outcome(m.HeartbeatAck(epoch=self.epoch))

    def _segment_lost(self, seg: _Segment, reason: str, effects: list[Effect]) -> None:
        """Its placements die with it; published groups are swept lazily, building ones now."""
        seg.up = False
        seg.reserved_bytes = 0
        effects.append(
            EmitEvent(
                "segment_down",
                m.SegmentDown(segment_id=seg.segment_id, incarnation=seg.incarnation, reason=reason),
            )
        )
        self._sweep_queue.extend(self.published.keys())
        for key in [k for k in self._freeing if k[0] == seg.segment_id and k[1] == seg.incarnation]:
            self._finish_free(key, effects)
        for gid, group in list(self.building.items()):
            for member, pm in list(group.members.items()):
                dead = [p for p in pm.placements if not self._placement_live(p.placement)]
                for p in dead:
                    pm.placements.remove(p)
                    self._tickets.pop(p.ticket_id, None)
                self.quotas.add(tenant_of(group.info.namespace), -pm.size_bytes * len(dead))
                self._pending_add(pm.writer_id, 0, -pm.size_bytes * len(dead))
                if dead and pm.committed and not pm.placements:
                    self._drop_member(gid, group, member, effects)

    # ---- two-phase publish ---------------------------------------------------------------

    def _begin(self, req: m.PutBegin, now_ms: int) -> Outcome:
        self._check_epoch(req.epoch)
        cached = self._cached("begin", req.writer_id, req.request_id)
        if cached is not None:
            return Outcome(cached)
        self._check_batch("put_begin objects", len(req.objects), m.PUT_BATCH_OBJECTS_MAX)
        if not 0 < req.write_ttl_ms <= m.WRITE_TTL_MS_MAX:
            raise BadRequest(f"write_ttl_ms must be in 1..{m.WRITE_TTL_MS_MAX}")
        replicas = req.replicas or self.config.replicas_default
        if not 1 <= replicas <= self.config.replicas_max:
            raise BadRequest(f"replicas must be in 1..{self.config.replicas_max}")
        infos = [self._validate_spec(spec) for spec in req.objects]
        # Identity conflicts refuse the whole request before anything is placed (not half of it).
        seen: dict[bytes, GroupInfo] = {}
        for info in infos:
            building = self.building.get(info.group.group_id)
            known = seen.setdefault(info.group.group_id, building.info if building else info.group)
            if known != info.group:
                raise BadRequest("key conflicts with the identity of its chain hash's chunk group")
        self._check_reply_fits(req, replicas)
        # Before the rate charge: a refused request did not run, and a writer backing off and
        # asking again (kvfabric.client.busy) must not spend the tenant's tokens each time.
        self._check_tenant_pending(req, infos, replicas)
        if self.pending_objects + len(infos) > self.config.pending_objects_max:
            self._count("busy_pending_total")
            raise Busy("too many objects being written; retry later", limit=self.config.pending_objects_max)
        self._check_rate((spec.key for spec in req.objects), now_ms, request_tokens(len(req.objects)))
        deadline = now_ms + min(req.write_ttl_ms, self.config.write_ttl_ms_max)
        results = [
            self._begin_one(req.writer_id, spec, info, replicas, deadline)
            for spec, info in zip(req.objects, infos, strict=True)
        ]
        reply = m.PutBeginReply(epoch=self.epoch, results=results)
        self._remember("begin", req.writer_id, req.request_id, reply, len(results))
        return Outcome(reply)

    def _check_tenant_pending(self, req: m.PutBegin, infos: Sequence[KeyInfo], replicas: int) -> None:
        """A tenant's writes in progress stay within its budgets (`tenant_pending_*`): the
        members this request would newly begin, and their bytes at `replicas` each (an upper
        bound: fewer may fit), or the whole request is `busy` and nothing is placed."""
        scope = _scope_of(req.writer_id)
        if scope is None:
            return
        new: dict[tuple[bytes, Member], int] = {}
        for spec, info in zip(req.objects, infos, strict=True):
            gid = info.group.group_id
            if gid in self.published or gid in self.evicting:
                continue
            group = self.building.get(gid)
            if group is None or info.member not in group.members:
                new[(gid, info.member)] = spec.size_bytes
        if not new:
            return
        objects_max = self.config.tenant_pending_objects_max
        if self._scope_pending_objects.get(scope, 0) + len(new) > objects_max:
            self._count("busy_tenant_pending_objects_total")
            raise Busy("this tenant has its share of objects being written; retry later", limit=objects_max)
        capacity = sum(s.capacity_bytes for s in self.segments.values() if s.up)
        bytes_max = int(capacity * self.config.tenant_pending_capacity_fraction)
        if self._scope_pending_bytes.get(scope, 0) + sum(new.values()) * replicas > bytes_max:
            self._count("busy_tenant_pending_bytes_total")
            raise Busy("this tenant has its share of bytes being written; retry later")

    def _check_reply_fits(self, req: m.PutBegin, replicas: int) -> None:
        """Refuse (`batch_too_large`, nothing placed) a put_begin whose reply could exceed
        `reply_bytes_max`: every object placed with `replicas` tickets naming the longest segment
        id and data address ever registered here, every integer at its widest (`_ReplySizes`)."""
        if not req.objects:
            return
        key_bytes = max(len(spec.key) for spec in req.objects)
        sizes = self._reply_sizes
        ticket = sizes.ticket + _str_bytes(key_bytes) + _str_bytes(len(req.writer_id.encode()))
        ticket += _str_bytes(self._segment_id_bytes_max) + _str_bytes(self._data_addr_bytes_max)
        per_object = sizes.result + _str_bytes(key_bytes) + _ARRAY_HEADER_BYTES + replicas * ticket
        fits = max(0, (self.config.reply_bytes_max - sizes.envelope) // per_object)
        if len(req.objects) > fits:
            self._count("put_begin_reply_too_large_total")
            raise BatchTooLarge(
                f"put_begin objects: a reply for {len(req.objects)} objects could exceed "
                f"{self.config.reply_bytes_max} bytes; send at most {fits} a request",
                n=len(req.objects),
                limit=fits,
            )

    def _validate_spec(self, spec: m.ObjectSpec) -> KeyInfo:
        info = parse_key(spec.key)
        if not 0 < spec.size_bytes <= self.config.object_bytes_max:
            raise BadRequest(f"object size {spec.size_bytes} out of range 1..{self.config.object_bytes_max}")
        if len(spec.checksum) != CHECKSUM_BYTES:
            raise BadRequest(f"checksum must be {CHECKSUM_BYTES} bytes (xxh3-128)")
        if len(spec.parent) not in (0, CHAIN_BYTES):
            raise BadRequest("parent must be empty or a 32-byte chain hash")
        return info

    def _begin_one(
        self, writer_id: str, spec: m.ObjectSpec, info: KeyInfo, replicas: int, deadline: int
    ) -> m.BeginResult:
        gid = info.group.group_id
        if gid in self.published or gid in self.evicting:
            return m.BeginResult(key=spec.key, status="exists")
        group = self.building.get(gid)
        if group is not None and group.info != info.group:
            raise BadRequest("key conflicts with the identity of its chain hash's chunk group")
        if group is not None and info.member in group.members:
            held = group.members[info.member]
            if held.writer_id != writer_id:
                return m.BeginResult(key=spec.key, status="in_flight", deadline_ms=held.deadline_ms)
            return m.BeginResult(
                key=spec.key, status="placed", tickets=self._tickets_of(held), deadline_ms=held.deadline_ms
            )
        chosen = choose_segments(self._candidates(), replicas, spec.size_bytes, spec.key)
        if not chosen:
            self._count("no_capacity_total")
            return m.BeginResult(key=spec.key, status="no_capacity")
        tenant = tenant_of(spec.key)
        if not self.quotas.admits(tenant, spec.size_bytes * len(chosen), 1):
            self._count("quota_exceeded_objects_total")
            return m.BeginResult(key=spec.key, status="quota_exceeded")
        self.quotas.add(tenant, spec.size_bytes * len(chosen), 1)
        if group is None:
            group = self.building[gid] = _BuildingGroup(info.group, parent=spec.parent)
        placements = []
        for cand in chosen:
            seg = self.segments[cand.segment_id]
            seg.reserved_bytes += spec.size_bytes
            ticket_id = next(self._ids)
            placements.append(_Placement(ticket_id, self._intern_placement(seg.segment_id, seg.incarnation)))
            self._tickets[ticket_id] = (gid, info.member)
        held = _PendingMember(
            spec.key, writer_id, spec.size_bytes, spec.checksum, deadline, replicas, placements
        )
        group.members[info.member] = held
        self.pending_objects += 1
        self._pending_add(writer_id, 1, spec.size_bytes * len(placements))
        heapq.heappush(self._deadline_heap, (deadline, gid))
        return m.BeginResult(
            key=spec.key, status="placed", tickets=self._tickets_of(held), deadline_ms=deadline
        )

    def _candidates(self) -> list[Candidate]:
        shared = self.config.segments_shared
        granules = self.config.free_bytes_granules
        out = []
        for s in self.segments.values():
            if not s.up or s.draining:
                continue
            free = s.capacity_bytes - (
                max(s.reserved_bytes, s.reported_used_bytes) if shared else s.reserved_bytes
            )
            if granules:  # coarse: what fits must not tell a writer the exact free space
                grain = max(1, s.capacity_bytes // granules)
                free = free // grain * grain
            out.append(Candidate(s.segment_id, s.domain.zone, s.domain.rack, s.domain.host, free))
        return out

    def _tickets_of(self, held: _PendingMember) -> list[m.WriteTicket]:
        tickets = []
        for p in held.placements:
            segment_id, incarnation = self._placements[p.placement]
            ticket = m.WriteTicket(
                ticket_id=p.ticket_id,
                key=held.key,
                segment_id=segment_id,
                incarnation=incarnation,
                size_bytes=held.size_bytes,
                checksum=held.checksum,
                writer_id=held.writer_id,
                deadline_ms=held.deadline_ms,
                epoch=self.epoch,
                data_addr=self.segments[segment_id].data_addr,
                shard=self.shard,
            )
            tickets.append(sign_ticket(ticket, self.config.ticket_secret))
        return tickets

    def _confirm(self, req: m.ConfirmReplicas, now_ms: int) -> Outcome:
        self._check_epoch(req.epoch)
        self._check_batch("confirms", len(req.confirms), m.PUT_BATCH_OBJECTS_MAX)
        self._live_segment(req.segment_id, req.incarnation)
        results = [
            m.ConfirmResult(ticket_id=c.ticket_id, status=self._confirm_one(req, c)) for c in req.confirms
        ]
        return Outcome(m.ConfirmReply(epoch=self.epoch, results=results))

    def _confirm_one(self, req: m.ConfirmReplicas, c: m.ReplicaConfirm) -> m.ConfirmStatus:
        if not (0 <= c.slot <= SLOT_MAX and 1 <= c.slot_generation <= GENERATION_MAX):
            self._count("confirm_mismatch_total")  # no segment hands these out: refuse, keep nothing
            return "mismatch"
        where = self._tickets.get(c.ticket_id)
        if where is None and c.ticket_id in self._replicating:
            return self._confirm_extra_replica(req, c)
        if where is None:
            if self._is_published_replica(req, c):
                # A retried confirm (its first reply was lost) of a replica published since: its
                # ticket is gone, but "unknown_ticket" would tell the segment to free a readable slot.
                self._count("confirm_retried_published_total")
                return "ok"
            self._count("confirm_unknown_ticket_total")
            return "unknown_ticket"
        gid, member = where
        held = self.building[gid].members[member]
        placement = next(p for p in held.placements if p.ticket_id == c.ticket_id)
        if (
            self._placements[placement.placement] != (req.segment_id, req.incarnation)
            or c.key != held.key
            or c.size_bytes != held.size_bytes
            or c.checksum != held.checksum
        ):
            self._count("confirm_mismatch_total")
            return "mismatch"
        placement.slot, placement.slot_generation = c.slot, c.slot_generation
        return "ok"

    def _is_published_replica(self, req: m.ConfirmReplicas, c: m.ReplicaConfirm) -> bool:
        """Whether this confirm names exactly a replica of a published member (same bytes, slot)."""
        placement = self._placement_index.get((req.segment_id, req.incarnation))
        try:
            info = parse_key(c.key)
        except BadRequest:
            return False
        record = self.published.get(info.group.group_id)
        if placement is None or record is None:
            return False
        return any(
            mem.member == info.member
            and (mem.size_bytes, mem.checksum) == (c.size_bytes, c.checksum)
            and ReplicaRecord(placement, c.slot, c.slot_generation) in mem.replicas
            for mem in unpack_group(record).members
        )

    def _commit(self, req: m.PutCommit, now_ms: int) -> Outcome:
        self._check_epoch(req.epoch)
        self._check_batch("put_commit keys", len(req.keys), m.PUT_BATCH_OBJECTS_MAX)
        infos = [parse_key(k) for k in req.keys]
        self._check_rate(req.keys, now_ms, request_tokens(len(req.keys)))
        effects: list[Effect] = []
        results = [
            self._commit_one(req.writer_id, key, info, effects)
            for key, info in zip(req.keys, infos, strict=True)
        ]
        return Outcome(m.PutCommitReply(epoch=self.epoch, results=results), effects)

    def _commit_one(self, writer_id: str, key: bytes, info: KeyInfo, effects: list[Effect]) -> m.CommitResult:
        gid = info.group.group_id
        record = self.published.get(gid)
        if record is not None:
            group = unpack_group(record)
            status: m.CommitStatus = "degraded" if group.degraded else "published"
            return m.CommitResult(key=key, status=status)
        building = self.building.get(gid)
        held = building.members.get(info.member) if building is not None else None
        if building is None or held is None or held.writer_id != writer_id or held.key != key:
            return m.CommitResult(key=key, status="not_found")
        confirmed = [p for p in held.placements if p.confirmed]
        if not confirmed:
            return m.CommitResult(key=key, status="missing", replicas_target=held.replicas_target)
        for p in held.placements:
            if not p.confirmed:  # an unconfirmed ticket dies: a late confirm will be refused
                self._tickets.pop(p.ticket_id, None)
                self._release_reservation(p.placement, held.size_bytes, tenant_of(key))
        self._pending_add(writer_id, 0, -held.size_bytes * (len(held.placements) - len(confirmed)))
        held.placements = confirmed
        held.committed = True
        n = len(confirmed)
        if len(building.members) == info.group.expected_members and all(
            pm.committed for pm in building.members.values()
        ):
            degraded = self._publish(gid, building, effects)
            return m.CommitResult(
                key=key,
                status="degraded" if degraded else "published",
                replicas_confirmed=n,
                replicas_target=held.replicas_target,
            )
        return m.CommitResult(
            key=key, status="waiting_group", replicas_confirmed=n, replicas_target=held.replicas_target
        )

    def _publish(self, gid: bytes, building: _BuildingGroup, effects: list[Effect]) -> bool:
        members = []
        degraded = False
        for member, pm in sorted(building.members.items()):
            degraded |= len(pm.placements) < pm.replicas_target
            replicas = tuple(ReplicaRecord(p.placement, p.slot, p.slot_generation) for p in pm.placements)
            members.append(MemberRecord(*member, pm.size_bytes, pm.checksum, replicas))
            self._pending_add(pm.writer_id, -1, -pm.size_bytes * len(pm.placements))
            for p in pm.placements:
                del self._tickets[p.ticket_id]
        group = PublishedGroup(
            self._intern_namespace(building.info.namespace),
            building.info.chunk_index,
            FLAG_DEGRADED if degraded else 0,
            tuple(members),
        )
        self.published[gid] = pack_group(group)
        self._index.add(gid)
        del self.building[gid]
        self.pending_objects -= len(members)
        self._count("groups_published_total")
        self._count("objects_published_total", len(members))
        held: dict[str, int] = {}
        for mem in members:
            for r in mem.replicas:
                segment_id = self._placements[r.placement][0]
                held[segment_id] = held.get(segment_id, 0) + mem.size_bytes
        effects.append(
            EmitEvent(
                "published",
                m.GroupPublished(
                    group=chain_of(gid),
                    chunk_index=group.chunk_index,
                    members=len(members),
                    degraded=degraded,
                    namespace=building.info.namespace,
                    parent=building.parent,
                    placements=[m.SegmentBytes(s, b) for s, b in sorted(held.items())],
                ),
            )
        )
        if degraded:
            self._count("groups_degraded_total")
            effects.append(
                EmitEvent(
                    "under_replicated", m.GroupUnderReplicated(group=chain_of(gid), domain=domain_of(gid))
                )
            )
        return degraded

    def _drop_member(self, gid: bytes, group: _BuildingGroup, member: Member, effects: list[Effect]) -> None:
        """Reclaim one member of a building group: free confirmed slots, release the rest."""
        held = group.members.pop(member)
        self.pending_objects -= 1
        self._pending_add(held.writer_id, -1, -held.size_bytes * len(held.placements))
        tenant = tenant_of(held.key)
        self.quotas.add(tenant, 0, -1)
        for p in held.placements:
            self._tickets.pop(p.ticket_id, None)
            if p.confirmed:
                self._free_slot(
                    p.placement, p.slot, p.slot_generation, held.size_bytes, held.key, b"", effects, tenant
                )
            else:
                self._release_reservation(p.placement, held.size_bytes, tenant)
        if not group.members:
            del self.building[gid]

    def _abort(self, req: m.PutAbort, now_ms: int) -> Outcome:
        self._check_epoch(req.epoch)
        self._check_batch("put_abort keys", len(req.keys), m.PUT_BATCH_OBJECTS_MAX)
        effects: list[Effect] = []
        aborted = 0
        for key in req.keys:
            info = parse_key(key)
            group = self.building.get(info.group.group_id)
            held = group.members.get(info.member) if group is not None else None
            if group is not None and held is not None and held.writer_id == req.writer_id:
                self._drop_member(info.group.group_id, group, info.member, effects)
                aborted += 1
                continue
            # An extra replica's copy that failed: its reservation goes now, not at its deadline.
            for ticket_id, rt in list(self._replicating.items()):
                if rt.key == key and rt.writer_id == req.writer_id:
                    del self._replicating[ticket_id]
                    self._end_replica_ticket(rt)
                    aborted += 1
        self._count("objects_aborted_total", aborted)
        return Outcome(m.PutAbortReply(epoch=self.epoch, aborted=aborted), effects)

    # ---- reads, leases, pins -------------------------------------------------------------

    def _lookup(
        self,
        req: m.Lookup,
        now_ms: int,
        reply_bytes_max: int | None = None,
        groups_max: int | None = None,
    ) -> Outcome:
        """The longest run of the asked groups that is readable, leased (see the module
        docstring). Charged before any work: `request_tokens` of the groups asked, so a refused
        request costs a slice per id and nothing more. The ids are parsed as the fold reaches
        them (a miss at the first costs one parse, whatever the length). The fold also stops
        before the reply could exceed `reply_bytes_max` (at most the configured one): a shorter
        hit is always correct, a reply NATS drops is not. With `groups_max`, only the first
        that many groups are folded (the whole request is charged): a shell running a long
        lookup in slices goes on with `lookup_more` when all of them hit."""
        self._check_epoch(req.epoch)
        self._check_batch("lookup groups", len(req.groups), m.LOOKUP_BATCH_GROUPS_MAX)
        self._check_batch("lookup members", len(req.members), m.LOOKUP_MEMBERS_MAX)
        if not 0 < req.lease_ttl_ms <= m.LEASE_TTL_MS_MAX:
            raise BadRequest(f"lease_ttl_ms must be in 1..{m.LEASE_TTL_MS_MAX}")
        self._check_rate(req.groups, now_ms, request_tokens(len(req.groups)))
        ttl_ms = min(req.lease_ttl_ms, self.config.lease_ttl_ms_max)
        groups = req.groups if groups_max is None else req.groups[:groups_max]
        objects, hit = self._fold(groups, req.members, now_ms + ttl_ms, reply_bytes_max)
        self._count("lookups_total")
        self._count("lookup_groups_total", len(req.groups))
        self._count("lookup_hit_groups_total", len(hit))
        if not hit:
            return Outcome(m.LookupReply(epoch=self.epoch, hit_chunks=0))
        lease_id, expires = self._grant(req.holder_id, tuple(hit), now_ms + ttl_ms, is_pin=False)
        effects: list[Effect] = []
        self._note_hits(hit, effects)
        return Outcome(
            m.LookupReply(
                epoch=self.epoch,
                hit_chunks=len(hit),
                lease_id=lease_id,
                lease_expires_ms=expires,
                objects=objects,
            ),
            effects,
        )

    def lookup_more(
        self,
        req: m.Lookup,
        lease_id: int,
        first: int,
        now_ms: int,
        *,
        reply_bytes_max: int,
        groups_max: int,
    ) -> Outcome:
        """Go on with a lookup run in slices (see `_lookup`'s `groups_max`): its groups
        [first, first + groups_max) are folded and their hits added to lease `lease_id`, which
        the earlier slices granted to `req.holder_id` (its expiry unchanged: every read token
        expires with it). The reply holds this slice's hits only, within `reply_bytes_max`.
        Between slices other requests ran: a group evicted or lost meanwhile ends the fold
        there (a shorter hit, as if it had been missing at the start); a lease ended
        meanwhile (expired, or its instance's core replaced) ends it at once (hit 0)."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.holder_id != req.holder_id or lease.is_pin or lease.expires_ms <= now_ms:
            return Outcome(m.LookupReply(epoch=self.epoch, hit_chunks=0))
        groups = req.groups[first : first + groups_max]
        objects, hit = self._fold(groups, req.members, lease.expires_ms, reply_bytes_max)
        self._count("lookup_hit_groups_total", len(hit))
        if not hit:
            return Outcome(m.LookupReply(epoch=self.epoch, hit_chunks=0))
        lease.groups += tuple(hit)
        for gid in hit:
            self._lease_count[gid] = self._lease_count.get(gid, 0) + 1
        effects: list[Effect] = []
        self._note_hits(hit, effects)
        return Outcome(
            m.LookupReply(
                epoch=self.epoch,
                hit_chunks=len(hit),
                lease_id=lease_id,
                lease_expires_ms=lease.expires_ms,
                objects=objects,
            ),
            effects,
        )

    def _fold(
        self,
        groups: Sequence[bytes],
        members: Sequence[m.Member],
        expires_ms: int,
        reply_bytes_max: int | None,
    ) -> tuple[list[m.ObjectLocation], list[bytes]]:
        """The readable run of `groups` from the first (their objects, with read tokens until
        `expires_ms`, and group keys), cut where a lookup reply holding them would exceed
        `reply_bytes_max` (at most the configured bound)."""
        wanted = {(x.tp_rank, x.pp_stage, x.layer_group) for x in members}
        room = self.config.reply_bytes_max
        if reply_bytes_max is not None:
            room = min(room, reply_bytes_max)
        # Reply size: an upper bound per object (integers at their widest, the longest segment id
        # and address) while it fits easily; once it might not, the encoded sizes themselves.
        sizes = self._reply_sizes
        used = sizes.lookup_envelope
        replica_bytes = (
            sizes.replica + _str_bytes(self._segment_id_bytes_max) + _str_bytes(self._data_addr_bytes_max)
        )
        exact = False
        objects: list[m.ObjectLocation] = []
        hit: list[bytes] = []
        for raw in groups:
            info = parse_group(raw)
            located = self._locate(info, wanted, expires_ms)
            if located is None:
                break  # fold: never skip a gap
            grow = sum(sizes.location + len(o.replicas) * replica_bytes for o in located)
            if not exact and used + grow > room:
                exact = True
                used = sizes.lookup_envelope + len(_encode(objects))
            if exact:
                grow = len(_encode(located))
            if used + grow > room:
                self._count("lookup_hits_cut_to_fit_total")
                break  # the reply would not fit: the hit ends before this group
            used += grow
            objects.extend(located)
            hit.append(info.group_id)
        return objects, hit

    def _note_hits(self, hit: Sequence[bytes], effects: list[Effect]) -> None:
        """Count the hits for the eviction policy (`GroupsAccessed`, batched)."""
        for gid in hit:
            if gid not in self._hits and len(self._hits) >= m.ACCESS_BATCH_MAX:
                self._flush_hits(effects)
            self._hits[gid] = self._hits.get(gid, 0) + 1

    def _flush_hits(self, effects: list[Effect]) -> None:
        """Tell the eviction policy which groups were read (recency and frequency)."""
        if self._hits:
            hits = [m.GroupHits(chain_of(g), n, domain_of(g)) for g, n in self._hits.items()]
            effects.append(EmitEvent("accessed", m.GroupsAccessed(groups=hits)))
            self._hits = {}

    def _published_as(self, info: GroupInfo) -> PublishedGroup | None:
        """The published group under `info`'s group key if it has `info`'s identity. A known
        group key paired with other identity fields (model, layout) is treated as absent by every
        verb, so such ids answer exactly like missing groups."""
        record = self.published.get(info.group_id)
        if record is None:
            return None
        group = unpack_group(record)
        if (
            self._namespace_index.get(info.namespace) != group.namespace
            or group.chunk_index != info.chunk_index
        ):
            self._count("lookup_identity_mismatch_total")
            return None
        return group

    def _locate(self, info: GroupInfo, wanted: set[Member], expires_ms: int) -> list[m.ObjectLocation] | None:
        """The group's wanted members with their live replicas, each with a read token valid until
        `expires_ms` (the lease's expiry); None when the fold must stop here."""
        group = None if info.group_id in self._unreadable else self._published_as(info)
        if group is None:
            return None
        out = []
        for mem in group.members:
            if wanted and mem.member not in wanted:
                continue
            replicas = [
                self._replica(r, mem.size_bytes, expires_ms)
                for r in mem.replicas
                if self._placement_live(r.placement)
            ]
            if not replicas:
                return None
            replicas.sort(key=lambda r: tier_of_slot(r.slot) == "ssd")  # readers try DRAM first
            out.append(
                m.ObjectLocation(
                    chunk_index=group.chunk_index,
                    member=m.Member(*mem.member),
                    size_bytes=mem.size_bytes,
                    checksum=mem.checksum,
                    replicas=replicas,
                )
            )
        if wanted and len(out) != len(wanted):
            return None  # a required member this group does not have
        return out

    def _replica(self, r: ReplicaRecord, size_bytes: int = 0, read_expires_ms: int = 0) -> m.Replica:
        """Where a replica is; with `read_expires_ms`, also the token that lets its holder read it
        until then (segments refuse reads without one: no lease, no bytes)."""
        segment_id, incarnation = self._placements[r.placement]
        token = b""
        if read_expires_ms:
            token = read_token(
                self.config.ticket_secret,
                segment_id,
                incarnation,
                r.slot,
                r.slot_generation,
                size_bytes,
                read_expires_ms,
            )
        return m.Replica(
            segment_id=segment_id,
            incarnation=incarnation,
            slot=r.slot,
            slot_generation=r.slot_generation,
            data_addr=self.segments[segment_id].data_addr,
            read_token=token,
            read_expires_ms=read_expires_ms if token else 0,
        )

    def _grant(
        self, holder_id: str, groups: tuple[bytes, ...], expires_ms: int, *, is_pin: bool
    ) -> tuple[int, int]:
        limit = self.config.pins_max if is_pin else self.config.leases_max
        held = self._pins_held if is_pin else len(self._leases) - self._pins_held
        if held >= limit:
            self._count("busy_pins_total" if is_pin else "busy_leases_total")
            raise Busy("lease table full; retry later", limit=limit)
        scope = _scope_of(holder_id)
        if scope is not None:
            scope_limit = self.config.tenant_pins_max if is_pin else self.config.tenant_leases_max
            if self._scope_held.get((scope, is_pin), 0) >= scope_limit:
                self._count("busy_tenant_pins_total" if is_pin else "busy_tenant_leases_total")
                raise Busy("this tenant holds its share of the lease table; retry later", limit=scope_limit)
            self._scope_held[(scope, is_pin)] = self._scope_held.get((scope, is_pin), 0) + 1
        lease_id = next(self._ids)
        self._leases[lease_id] = _Lease(holder_id, groups, expires_ms, is_pin)
        self._pins_held += is_pin
        heapq.heappush(self._lease_heap, (expires_ms, lease_id))
        counts = self._pin_count if is_pin else self._lease_count
        for gid in groups:
            counts[gid] = counts.get(gid, 0) + 1
        return lease_id, expires_ms

    def _end_lease(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id)
        self._pins_held -= lease.is_pin
        scope = _scope_of(lease.holder_id)
        if scope is not None:
            left = self._scope_held[(scope, lease.is_pin)] - 1
            if left:
                self._scope_held[(scope, lease.is_pin)] = left
            else:
                del self._scope_held[(scope, lease.is_pin)]
        counts = self._pin_count if lease.is_pin else self._lease_count
        for gid in lease.groups:
            left = counts[gid] - 1
            invariant(left >= 0, "negative lease count")
            if left:
                counts[gid] = left
            else:
                del counts[gid]
                if (
                    gid in self._sweep_deferred
                    and not self._lease_count.get(gid)
                    and not self._pin_count.get(gid)
                ):
                    self._sweep_deferred.discard(gid)
                    self._sweep_queue.append(gid)

    def _held_lease(self, holder_id: str, lease_id: int, is_pin: bool) -> _Lease:
        lease = self._leases.get(lease_id)
        if lease is None or lease.holder_id != holder_id or lease.is_pin != is_pin:
            raise NotFound(
                f"no {'pin' if is_pin else 'lease'} {lease_id} held by {holder_id!r}", lease_id=lease_id
            )
        return lease

    def _release(self, req: m.LeaseRelease, now_ms: int) -> Outcome:
        self._check_epoch(req.epoch)
        if req.lease_ids:
            return self._release_batch(req)
        self._held_lease(req.holder_id, req.lease_id, is_pin=False)
        self._end_lease(req.lease_id)
        return Outcome(m.LeaseReply(epoch=self.epoch, lease_id=req.lease_id, expires_ms=0))

    def _release_batch(self, req: m.LeaseRelease) -> Outcome:
        """Every listed lease the holder holds ends; the others are skipped (released or expired
        already: nothing to give back, so a retried batch is a no-op), never an error."""
        if req.lease_id:
            raise BadRequest("a batch release names its leases in lease_ids only (lease_id 0)")
        self._check_batch("lease_release lease_ids", len(req.lease_ids), m.RELEASE_BATCH_LEASES_MAX)
        released = []
        for lease_id in req.lease_ids:
            lease = self._leases.get(lease_id)
            if lease is None or lease.holder_id != req.holder_id or lease.is_pin:
                continue
            self._end_lease(lease_id)
            released.append(lease_id)
        return Outcome(m.LeaseReply(epoch=self.epoch, lease_id=0, expires_ms=0, released=released))

    def _renew(self, req: m.LeaseRenew, now_ms: int) -> Outcome:
        self._check_epoch(req.epoch)
        if not 0 < req.lease_ttl_ms <= m.LEASE_TTL_MS_MAX:
            raise BadRequest(f"lease_ttl_ms must be in 1..{m.LEASE_TTL_MS_MAX}")
        lease = self._held_lease(req.holder_id, req.lease_id, is_pin=False)
        ttl_ms = min(req.lease_ttl_ms, self.config.lease_ttl_ms_max)
        lease.expires_ms = max(lease.expires_ms, now_ms + ttl_ms)
        heapq.heappush(self._lease_heap, (lease.expires_ms, req.lease_id))
        return Outcome(m.LeaseReply(epoch=self.epoch, lease_id=req.lease_id, expires_ms=lease.expires_ms))

    def _pin(self, req: m.Pin, now_ms: int) -> Outcome:
        self._check_epoch(req.epoch)
        self._check_batch("pin groups", len(req.groups), m.LOOKUP_BATCH_GROUPS_MAX)
        if not 0 < req.ttl_ms <= m.PIN_TTL_MS_MAX:
            raise BadRequest(f"ttl_ms must be in 1..{m.PIN_TTL_MS_MAX}")
        self._check_rate(req.groups, now_ms, request_tokens(len(req.groups)))
        parsed = [parse_group(g) for g in req.groups]
        gids = tuple(g.group_id for g in parsed if self._published_as(g) is not None)
        if not gids:  # nothing to protect: no pin is held (an empty pin would only fill the table)
            return Outcome(m.PinReply(epoch=self.epoch, pin_id=0, pinned_groups=0, expires_ms=0))
        ttl_ms = req.ttl_ms
        if _scope_of(req.holder_id) is not None:  # a tenant's pin: shortened to the tenant maximum
            ttl_ms = min(ttl_ms, self.config.tenant_pin_ttl_ms_max)
        pin_id, expires = self._grant(req.holder_id, gids, now_ms + ttl_ms, is_pin=True)
        return Outcome(
            m.PinReply(epoch=self.epoch, pin_id=pin_id, pinned_groups=len(gids), expires_ms=expires)
        )

    def _unpin(self, req: m.Unpin, now_ms: int) -> Outcome:
        self._check_epoch(req.epoch)
        self._held_lease(req.holder_id, req.pin_id, is_pin=True)
        self._end_lease(req.pin_id)
        return Outcome(m.PinReply(epoch=self.epoch, pin_id=req.pin_id, pinned_groups=0, expires_ms=0))

    # ---- eviction and frees --------------------------------------------------------------

    def _evict(self, req: m.Evict, now_ms: int) -> Outcome:
        self._check_epoch(req.epoch)
        self._check_batch("evict groups", len(req.groups), m.EVICT_BATCH_GROUPS_MAX)
        effects: list[Effect] = []
        results = []
        for raw in req.groups:
            info = parse_group(raw)
            building = self.building.get(info.group_id)
            if (info.group_id in self.published and self._published_as(info) is None) or (
                building is not None and building.info != info
            ):
                results.append(m.EvictResult(group=raw, status="not_found"))  # forged identity
                continue
            results.append(
                m.EvictResult(group=raw, status=self._evict_one(info.group_id, req.reason, effects))
            )
        return Outcome(m.EvictReply(epoch=self.epoch, results=results), effects)

    def _evict_one(self, gid: bytes, reason: str, effects: list[Effect]) -> m.EvictStatus:
        record = self.published.get(gid)
        if record is None:
            return "not_published" if gid in self.building or gid in self.evicting else "not_found"
        if self._lease_count.get(gid):
            self._count("evict_refused_leased_total")
            return "leased"
        if self._pin_count.get(gid):
            self._count("evict_refused_pinned_total")
            return "pinned"
        del self.published[gid]
        self._index.remove(gid)
        self._unreadable.discard(gid)
        group = unpack_group(record)
        self.evicting[gid] = group
        tenant = tenant_of(self._namespaces[group.namespace])
        self.quotas.add(tenant, 0, -len(group.members))
        for mem in group.members:
            for r in mem.replicas:
                self._free_slot(
                    r.placement, r.slot, r.slot_generation, mem.size_bytes, b"", gid, effects, tenant
                )
        self._count("groups_evicted_total")
        effects.append(
            EmitEvent("evicted", m.GroupEvicted(group=chain_of(gid), reason=reason, domain=domain_of(gid)))
        )
        self._maybe_forget_evicting(gid)
        return "evicting"

    def _maybe_forget_evicting(self, gid: bytes) -> None:
        if not self._evicting_frees.get(gid):
            self._evicting_frees.pop(gid, None)
            self.evicting.pop(gid, None)

    def _freed(self, req: m.SlotsFreed, now_ms: int) -> Outcome:
        self._check_epoch(req.epoch)
        self._check_batch("freed slots", len(req.freed), m.FREED_BATCH_MAX)
        self._live_segment(req.segment_id, req.incarnation)
        effects: list[Effect] = []
        accepted = 0
        for f in req.freed:
            key = (req.segment_id, req.incarnation, f.slot, f.slot_generation)
            if key in self._freeing:
                self._finish_free(key, effects)
                accepted += 1
        return Outcome(m.FreedAck(epoch=self.epoch, accepted=accepted), effects)

    def _finish_free(self, key: tuple[str, int, int, int], effects: list[Effect]) -> None:
        size, gid, _, tenant = self._freeing.pop(key)
        self.quotas.add(tenant, -size)
        seg = self.segments.get(key[0])
        if seg is not None and seg.incarnation == key[1] and seg.up and tier_of_slot(key[2]) == "dram":
            seg.reserved_bytes -= size
            invariant(seg.reserved_bytes >= 0, "negative reservation", segment=seg.segment_id)
        if gid:
            self._evicting_frees[gid] -= 1
            self._maybe_forget_evicting(gid)

    # ---- time ----------------------------------------------------------------------------

    def tick(self, now_ms: int) -> list[Effect]:
        """Expire leases, pins and write deadlines; mark silent segments down; retry frees."""
        effects: list[Effect] = []
        if self._in_grace and now_ms >= self.grace_until_ms:
            self._in_grace = False  # the old leader's leases have all expired: frees may go
            self._adopted = set()
        while self._lease_heap and self._lease_heap[0][0] <= now_ms:
            _, lease_id = heapq.heappop(self._lease_heap)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.expires_ms <= now_ms:
                self._count("pins_expired_total" if lease.is_pin else "leases_expired_total")
                self._end_lease(lease_id)
        while self._deadline_heap and self._deadline_heap[0][0] <= now_ms:
            _, gid = heapq.heappop(self._deadline_heap)
            self._expire_writes(gid, now_ms, effects)
        for seg in self.segments.values():
            if seg.up and now_ms - seg.last_heartbeat_ms > self.config.heartbeat_timeout_ms:
                self._count("segments_down_total")
                self._segment_lost(seg, "heartbeat_timeout", effects)
        while self._replica_deadlines and self._replica_deadlines[0][0] <= now_ms:
            _, ticket_id = heapq.heappop(self._replica_deadlines)
            rt = self._replicating.pop(ticket_id, None)
            if rt is not None:  # never confirmed: a late confirm gets unknown_ticket, the segment frees
                self._end_replica_ticket(rt)
                self._count("replica_tickets_expired_total")
        self._sweep(effects)
        self._retry_frees(now_ms, effects)
        self._flush_hits(effects)
        return effects

    def _expire_writes(self, gid: bytes, now_ms: int, effects: list[Effect]) -> None:
        group = self.building.get(gid)
        if group is None:
            return
        expired = [mem for mem, pm in group.members.items() if not pm.committed and pm.deadline_ms <= now_ms]
        for mem in expired:
            self._count("write_leases_expired_total")
            self._drop_member(gid, group, mem, effects)
        # A group whose present members all committed but that never completed: reclaim all of it
        # once the latest writer's deadline has passed.
        if gid in self.building and all(
            pm.committed and pm.deadline_ms <= now_ms for pm in group.members.values()
        ):
            self._count("groups_incomplete_reclaimed_total")
            for mem in list(group.members):
                self._drop_member(gid, group, mem, effects)

    def _sweep(self, effects: list[Effect]) -> None:
        """Drop replicas on dead incarnations; a group whose member lost every replica is gone."""
        for _ in range(min(len(self._sweep_queue), self.config.sweep_batch_max)):
            gid = self._sweep_queue.pop()
            record = self.published.get(gid)
            if record is None:
                continue
            group = unpack_group(record)
            forced = gid in self._unreadable
            if not forced and all(
                self._placement_live(r.placement) for mem in group.members for r in mem.replicas
            ):
                continue
            members = []
            lost = forced
            dead_bytes = 0
            for mem in group.members:
                live = tuple(r for r in mem.replicas if self._placement_live(r.placement))
                lost |= not live
                dead_bytes += mem.size_bytes * (len(mem.replicas) - len(live))
                members.append(MemberRecord(*mem.member, mem.size_bytes, mem.checksum, live))
            tenant = tenant_of(self._namespaces[group.namespace])
            if lost and (self._lease_count.get(gid) or self._pin_count.get(gid)):
                self._sweep_deferred.add(gid)  # lookups already skip it: a member has no live replica
                continue
            self.quotas.add(tenant, -dead_bytes)  # replicas on dead incarnations leave the record
            if lost:
                del self.published[gid]
                self._index.remove(gid)
                self._unreadable.discard(gid)
                self.quotas.add(tenant, 0, -len(members))
                for mem in members:
                    for r in mem.replicas:
                        self._free_slot(
                            r.placement, r.slot, r.slot_generation, mem.size_bytes, b"", b"", effects, tenant
                        )
                self._count("groups_invalidated_total")
                effects.append(
                    EmitEvent(
                        "invalidated",
                        m.GroupInvalidated(group=chain_of(gid), reason="replica_lost", domain=domain_of(gid)),
                    )
                )
            else:
                self.published[gid] = pack_group(
                    PublishedGroup(
                        group.namespace, group.chunk_index, group.flags | FLAG_DEGRADED, tuple(members)
                    )
                )
                effects.append(
                    EmitEvent(
                        "under_replicated", m.GroupUnderReplicated(group=chain_of(gid), domain=domain_of(gid))
                    )
                )

    def _retry_frees(self, now_ms: int, effects: list[Effect]) -> None:
        for key, (size, gid, sent_ms, tenant) in list(self._freeing.items()):
            if sent_ms < 0:  # deferred by the grace period
                if self._in_grace:
                    continue
                self._freeing[key] = (size, gid, now_ms, tenant)
                segment_id, incarnation, slot, generation = key
                effects.append(FreeSlots(segment_id, incarnation, (m.FreedSlot(b"", slot, generation),)))
            elif sent_ms == 0:
                self._freeing[key] = (size, gid, now_ms, tenant)
            elif now_ms - sent_ms >= self.config.free_retry_ms:
                self._count("free_retries_total")
                self._freeing[key] = (size, gid, now_ms, tenant)
                segment_id, incarnation, slot, generation = key
                effects.append(FreeSlots(segment_id, incarnation, (m.FreedSlot(b"", slot, generation),)))

    # ---- read-only queries (grant nothing, change nothing but counters) -------------------

    def _list_segments(self, req: m.ListSegments, now_ms: int) -> Outcome:
        self._check_epoch(req.epoch)
        segments = [
            m.SegmentInfo(
                segment_id=s.segment_id,
                incarnation=s.incarnation,
                domain=s.domain,
                up=s.up,
                draining=s.draining,
                capacity_bytes=s.capacity_bytes,
                reserved_bytes=s.reserved_bytes,
                reported_used_bytes=s.reported_used_bytes,
                last_heartbeat_ms=s.last_heartbeat_ms,
                data_addr=s.data_addr,
            )
            for s in sorted(self.segments.values(), key=lambda s: s.segment_id)
        ]
        return Outcome(m.SegmentList(epoch=self.epoch, segments=segments))

    def _published_summary(
        self, gid: bytes, group: PublishedGroup, *, with_objects: bool, evicting: bool = False
    ) -> m.GroupSummary:
        objects = []
        if with_objects:
            for mem in group.members:
                objects.append(
                    m.ObjectLocation(
                        chunk_index=group.chunk_index,
                        member=m.Member(*mem.member),
                        size_bytes=mem.size_bytes,
                        checksum=mem.checksum,
                        replicas=[
                            self._replica(r) for r in mem.replicas if self._placement_live(r.placement)
                        ],
                    )
                )
        return m.GroupSummary(
            group=chain_of(gid),
            namespace=self._namespaces[group.namespace],
            chunk_index=group.chunk_index,
            state="evicting" if evicting else "published",
            members=len(group.members),
            expected_members=len(group.members),
            degraded=group.degraded,
            leases=self._lease_count.get(gid, 0),
            pins=self._pin_count.get(gid, 0),
            objects=objects,
        )

    def _summary(self, gid: bytes, *, with_objects: bool) -> m.GroupSummary | None:
        record = self.published.get(gid)
        group = unpack_group(record) if record is not None else self.evicting.get(gid)
        if group is not None:
            return self._published_summary(gid, group, with_objects=with_objects, evicting=record is None)
        building = self.building.get(gid)
        if building is None:
            return None
        return m.GroupSummary(
            group=chain_of(gid),
            namespace=building.info.namespace,
            chunk_index=building.info.chunk_index,
            state="building",
            members=len(building.members),
            expected_members=building.info.expected_members,
        )

    def _list_groups(self, req: m.ListGroups, now_ms: int) -> Outcome:
        """A page of published groups in group-key order (domain digest, chain hash) after
        `req.after`, from the per-domain index: a domain's page touches only that domain's
        groups, an admin page the domains it crosses. At most `list_scan_groups_max` groups
        are examined (the `below_target` filter may skip them), and the page ends before its
        reply could exceed `reply_bytes_max`; `next_after` is then the last group examined, so
        the caller resumes there. Cost: O(log n + list_scan_groups_max), never the store's size."""
        self._check_epoch(req.epoch)
        if not 0 < req.limit <= m.LIST_LIMIT_MAX:
            raise BadRequest(f"limit must be in 1..{m.LIST_LIMIT_MAX}")
        if req.domain_digest:
            keys = self._index.groups(req.domain_digest, req.after)
        else:
            keys = self._index.all_groups(req.after)
        summaries: list[m.GroupSummary] = []
        room = self.config.reply_bytes_max - _LIST_ENVELOPE_BYTES
        next_after = last = b""
        for scanned, gid in enumerate(keys):
            if len(summaries) == req.limit or scanned == self.config.list_scan_groups_max:
                next_after = last  # more remain: the next page resumes after the last one examined
                break
            group = unpack_group(self.published[gid])
            if not req.below_target or self._below_target(group):
                summary = self._published_summary(gid, group, with_objects=req.with_objects)
                room -= len(_encode(summary))
                if room < 0 and summaries:  # a page holds at least one group, else it could not go on
                    next_after = last
                    break
                summaries.append(summary)
            last = gid
        return Outcome(m.GroupList(epoch=self.epoch, groups=summaries, next_after=next_after))

    def _show_group(self, req: m.ShowGroup, now_ms: int) -> Outcome:
        """One group by chunk group id, group key, or chain hash alone. A chain hash is looked
        up under each share domain holding something here (O(domains), never O(groups)):
        every building, published or evicting group counts towards its domain's usage."""
        self._check_epoch(req.epoch)
        keys: Sequence[bytes]
        if len(req.group) == GROUP_KEY_BYTES:  # domain digest + chain hash: the group key itself
            keys = (req.group,)
        elif len(req.group) == CHAIN_BYTES:  # the published groups with this chain hash, else
            # the building or evicting ones
            domains = self.quotas.usage.keys() | set(self._index.domains())
            candidates = [d + req.group for d in sorted(domains)]
            keys = [k for k in candidates if k in self.published] or [
                k for k in candidates if k in self.building or k in self.evicting
            ]
        else:
            info = parse_group(req.group)
            if info.group_id in self.published and self._published_as(info) is None:
                raise NotFound("no such chunk group", group=chain_of(info.group_id).hex())  # other identity
            keys = (info.group_id,)
        summaries = [s for s in (self._summary(k, with_objects=True) for k in keys) if s is not None]
        if not summaries:
            raise NotFound("no such chunk group", group=req.group[-CHAIN_BYTES:].hex())
        return Outcome(m.GroupList(epoch=self.epoch, groups=summaries))

    def _list_leases(self, req: m.ListLeases, now_ms: int) -> Outcome:
        self._check_epoch(req.epoch)
        if not 0 < req.limit <= m.LIST_LIMIT_MAX:
            raise BadRequest(f"limit must be in 1..{m.LIST_LIMIT_MAX}")
        leases = [
            m.LeaseInfo(
                lease_id=i,
                holder_id=x.holder_id,
                is_pin=x.is_pin,
                groups=len(x.groups),
                expires_ms=x.expires_ms,
            )
            # ids only grow and a lease is inserted once: insertion order is id order
            for i, x in itertools.islice(self._leases.items(), req.limit)
        ]
        return Outcome(m.LeaseList(epoch=self.epoch, leases=leases))

    def _list_tenants(self, req: m.ListTenants, now_ms: int) -> Outcome:
        self._check_epoch(req.epoch)
        if not 0 < req.limit <= m.LIST_LIMIT_MAX:
            raise BadRequest(f"limit must be in 1..{m.LIST_LIMIT_MAX}")
        tenants = [self._tenant_info(t) for t in itertools.islice(self.quotas.tenants(), req.limit)]
        default = self._tenant_info(Tenant(b""))
        return Outcome(m.TenantList(epoch=self.epoch, tenants=tenants, default=default))

    def _tenant_info(self, tenant: Tenant) -> m.TenantInfo:
        quota = self.quotas.quota(tenant)
        use = self.quotas.usage.get(tenant) or TenantUsage()
        stats = self.quotas.stats.get(tenant)
        return m.TenantInfo(
            domain_digest=tenant,
            used_bytes=use.bytes,
            objects=use.objects,
            bytes_max=quota.bytes_max,
            objects_max=quota.objects_max,
            requests_per_s=quota.requests_per_s,
            burst=quota.burst_effective if quota.requests_per_s else 0,
            quota_exceeded=stats.quota_exceeded if stats else 0,
            rate_limited=stats.rate_limited if stats else 0,
        )

    # ---- extra replicas and corrupt replicas (repair, prefetch, scrub) ------------------------

    def _below_target(self, group: PublishedGroup) -> bool:
        """Some member has fewer replicas than the target on segments that are up and not
        draining (a draining segment's replicas are readable but must move)."""
        target = self.config.replicas_default

        def healthy(placement: int) -> bool:
            seg = self._segment_of(placement)
            return seg is not None and not seg.draining

        return any(sum(healthy(r.placement) for r in mem.replicas) < target for mem in group.members)

    def _published_member(self, key: bytes) -> tuple[bytes, PublishedGroup, MemberRecord] | None:
        info = parse_key(key)
        record = self.published.get(info.group.group_id)
        if record is None:
            return None
        group = unpack_group(record)
        if self._namespaces[group.namespace] != info.group.namespace:
            return None
        mem = next((x for x in group.members if x.member == info.member), None)
        return None if mem is None else (info.group.group_id, group, mem)

    def _replace_member(self, gid: bytes, group: PublishedGroup, new: MemberRecord) -> None:
        members = tuple(new if x.member == new.member else x for x in group.members)
        target = self.config.replicas_default
        degraded = any(len(x.replicas) < target for x in members)
        flags = (group.flags | FLAG_DEGRADED) if degraded else (group.flags & ~FLAG_DEGRADED)
        self.published[gid] = pack_group(PublishedGroup(group.namespace, group.chunk_index, flags, members))

    def _replicate_begin(self, req: m.ReplicateBegin, now_ms: int) -> Outcome:
        self._check_epoch(req.epoch)
        if not 0 < req.write_ttl_ms <= m.WRITE_TTL_MS_MAX:
            raise BadRequest(f"write_ttl_ms must be in 1..{m.WRITE_TTL_MS_MAX}")
        found = self._published_member(req.key)
        if found is None:
            return Outcome(m.ReplicateBeginReply(epoch=self.epoch, status="not_found"))
        gid, _, mem = found
        seg = self.segments.get(req.segment_id)
        if seg is None or not seg.up or seg.draining:
            return Outcome(m.ReplicateBeginReply(epoch=self.epoch, status="segment_down"))
        placement = self._intern_placement(seg.segment_id, seg.incarnation)
        # One replica per (segment, tier): a segment may hold an object in its arena and in its
        # disk tier at once (demotion copies to disk before the arena replica is dropped;
        # promotion copies back before the disk one goes).
        if (
            any(r.placement == placement and tier_of_slot(r.slot) == req.tier for r in mem.replicas)
            or len(mem.replicas) >= 255
        ):
            return Outcome(m.ReplicateBeginReply(epoch=self.epoch, status="already_there"))
        sources = [  # readable by the copying segment until the ticket's deadline
            self._replica(r, mem.size_bytes, now_ms + req.write_ttl_ms)
            for r in mem.replicas
            if self._placement_live(r.placement)
        ]
        for ticket_id, rt in self._replicating.items():
            if (rt.group, rt.member, rt.placement, rt.tier) == (gid, mem.member, placement, req.tier):
                # A retry (the first copy failed or its answer was lost): the same ticket again;
                # whichever copy confirms first wins, a later one gets unknown_ticket and is freed.
                ticket = self._replica_ticket(ticket_id, rt, seg, req.writer_id)
                return Outcome(
                    m.ReplicateBeginReply(epoch=self.epoch, status="placed", ticket=ticket, sources=sources)
                )
        if req.tier == "dram":  # a disk replica reserves no arena bytes (the segment's tier says full)
            if seg.capacity_bytes - seg.reserved_bytes < mem.size_bytes:
                self._count("no_capacity_total")
                return Outcome(m.ReplicateBeginReply(epoch=self.epoch, status="no_capacity"))
            seg.reserved_bytes += mem.size_bytes
        self.quotas.add(tenant_of(req.key), mem.size_bytes)  # counted, never refused (repair)
        ticket_id = next(self._ids)
        deadline = now_ms + req.write_ttl_ms
        self._replicating[ticket_id] = _ReplicaTicket(
            gid,
            mem.member,
            placement,
            mem.size_bytes,
            mem.checksum,
            req.key,
            deadline,
            req.writer_id,
            req.tier,
        )
        heapq.heappush(self._replica_deadlines, (deadline, ticket_id))
        self._count("replica_tickets_total" if req.tier == "dram" else "replica_tickets_ssd_total")
        ticket = self._replica_ticket(ticket_id, self._replicating[ticket_id], seg, req.writer_id)
        return Outcome(
            m.ReplicateBeginReply(epoch=self.epoch, status="placed", ticket=ticket, sources=sources)
        )

    def _replica_ticket(
        self, ticket_id: int, rt: _ReplicaTicket, seg: _Segment, writer_id: str
    ) -> m.WriteTicket:
        ticket = m.WriteTicket(
            ticket_id=ticket_id,
            key=rt.key,
            segment_id=seg.segment_id,
            incarnation=seg.incarnation,
            size_bytes=rt.size_bytes,
            checksum=rt.checksum,
            writer_id=writer_id,
            deadline_ms=rt.deadline_ms,
            epoch=self.epoch,
            data_addr=seg.data_addr,
            shard=self.shard,
        )
        return sign_ticket(ticket, self.config.ticket_secret)

    def _confirm_extra_replica(self, req: m.ConfirmReplicas, c: m.ReplicaConfirm) -> m.ConfirmStatus:
        rt = self._replicating.pop(c.ticket_id)
        if self._placements[rt.placement] != (req.segment_id, req.incarnation) or (
            c.key,
            c.size_bytes,
            c.checksum,
            tier_of_slot(c.slot),
        ) != (rt.key, rt.size_bytes, rt.checksum, rt.tier):
            self._end_replica_ticket(rt)
            self._count("confirm_mismatch_total")
            return "mismatch"
        found = self._published_member(rt.key)
        if found is None:  # evicted or lost meanwhile: the segment frees the copy
            self._end_replica_ticket(rt)
            self._count("replica_confirm_gone_total")
            return "unknown_ticket"
        gid, group, mem = found
        replica = ReplicaRecord(rt.placement, c.slot, c.slot_generation)
        self._replace_member(
            gid, group, MemberRecord(*mem.member, mem.size_bytes, mem.checksum, (*mem.replicas, replica))
        )
        self._count("replicas_added_total" if rt.tier == "dram" else "replicas_added_ssd_total")
        return "ok"

    def _replica_corrupt(self, req: m.ReplicaCorrupt, now_ms: int) -> Outcome:
        """A scrubber found bad bytes: that replica goes (freed); a member left without any
        replica makes its group unreadable at once and it is invalidated (swept)."""
        self._check_epoch(req.epoch)
        self._live_segment(req.segment_id, req.incarnation)
        effects: list[Effect] = []
        placement = self._intern_placement(req.segment_id, req.incarnation)
        found = self._published_member(req.key)
        bad = ReplicaRecord(placement, req.slot, req.slot_generation)
        if found is None or bad not in found[2].replicas:
            return Outcome(m.ReplicaCorruptReply(epoch=self.epoch, dropped=False))
        gid, group, mem = found
        left = tuple(r for r in mem.replicas if r != bad)
        if req.reason != "corrupt":  # a healthy replica nobody needs (a cold extra): never the last
            if not left:
                return Outcome(m.ReplicaCorruptReply(epoch=self.epoch, dropped=False))
            if req.reason == "demoted" and (self._lease_count.get(gid) or self._pin_count.get(gid)):
                # a reader leased it with a lookup that may name only this replica: not under it
                self._count("demote_drop_refused_leased_total")
                return Outcome(m.ReplicaCorruptReply(epoch=self.epoch, dropped=False))
            self._replace_member(gid, group, MemberRecord(*mem.member, mem.size_bytes, mem.checksum, left))
            self._free_slot(
                placement,
                req.slot,
                req.slot_generation,
                mem.size_bytes,
                req.key,
                b"",
                effects,
                tenant_of(req.key),
            )
            self._count("replicas_dropped_total")
            if req.reason == "demoted":  # its bytes changed tier: consumers (the policy) follow
                effects.append(self._republished(gid, unpack_group(self.published[gid])))
            return Outcome(m.ReplicaCorruptReply(epoch=self.epoch, dropped=True), effects)
        self._count("replicas_corrupt_total")
        if not left:  # its only good copy is gone: nobody may read the group any more
            self._unreadable.add(gid)
            self._sweep_queue.append(gid)
            return Outcome(m.ReplicaCorruptReply(epoch=self.epoch, dropped=True), effects)
        self._replace_member(gid, group, MemberRecord(*mem.member, mem.size_bytes, mem.checksum, left))
        self._free_slot(
            placement,
            req.slot,
            req.slot_generation,
            mem.size_bytes,
            req.key,
            b"",
            effects,
            tenant_of(req.key),
        )
        self._sweep_queue.append(gid)  # gone entirely if that was the member's last replica
        effects.append(
            EmitEvent("under_replicated", m.GroupUnderReplicated(group=chain_of(gid), domain=domain_of(gid)))
        )
        return Outcome(m.ReplicaCorruptReply(epoch=self.epoch, dropped=True), effects)

    # ---- rebuild (a new leader) -------------------------------------------------------------

    def adopt(self, holdings: Sequence[SegmentHolding], now_ms: int) -> list[Effect]:
        """Become the index of what `holdings` store (see `directory_rebuild`): their segments are
        up, complete groups are published, orphans are freed once the grace period
        (`lease_ttl_ms_max`, the longest lease the old leader could have granted) has passed."""
        invariant(not self.segments and not self.published and not self.building, "adopt into a used core")
        self.grace_until_ms = now_ms + self.config.lease_ttl_ms_max
        self._in_grace = True
        for holding in holdings:
            reg = holding.registration
            self._adopted.update(
                (reg.segment_id, reg.incarnation, o.slot, o.slot_generation) for o in holding.objects
            )
            seg = _Segment(
                reg.segment_id, reg.incarnation, reg.domain, reg.capacity_bytes, reg.data_addr, now_ms
            )
            # freed orphans give it back; disk-tier objects hold no arena bytes (docs/segment.md)
            seg.reserved_bytes = sum(o.size_bytes for o in holding.objects if tier_of_slot(o.slot) == "dram")
            self.segments[reg.segment_id] = seg
            self._note_segment_text(reg.segment_id, reg.data_addr)
        plan = plan_rebuild(holdings)
        effects: list[Effect] = []
        for gid, (info, members) in plan.groups.items():
            records = []
            degraded = False
            for member, rebuilt in sorted(members.items()):
                replicas = tuple(
                    ReplicaRecord(
                        self._intern_placement(r.segment_id, r.incarnation), r.slot, r.slot_generation
                    )
                    for r in rebuilt.replicas
                )
                degraded |= len(replicas) < self.config.replicas_default
                records.append(MemberRecord(*member, rebuilt.size_bytes, rebuilt.checksum, replicas))
            group = PublishedGroup(
                self._intern_namespace(info.namespace),
                info.chunk_index,
                FLAG_DEGRADED if degraded else 0,
                tuple(records),
            )
            self.published[gid] = pack_group(group)
            self._index.add(gid)
            if any(tier_of_slot(r.slot) == "ssd" for x in records for r in x.replicas):
                effects.append(self._republished(gid, group))  # the policy learns its disk bytes
            self.quotas.add(
                tenant_of(info.namespace),
                sum(x.size_bytes * len(x.replicas) for x in records),
                len(records),
            )
        for r in plan.orphans:
            placement = self._intern_placement(r.segment_id, r.incarnation)
            tenant = tenant_of(r.key)
            self.quotas.add(tenant, r.size_bytes)  # held until the segment frees it
            self._free_slot(placement, r.slot, r.slot_generation, r.size_bytes, r.key, b"", effects, tenant)
        self._count("adopted_groups_total", len(plan.groups))
        self._count("adopted_objects_total", sum(len(g[1]) for g in plan.groups.values()))
        self._count("adopted_orphans_total", len(plan.orphans))
        return effects

    def _republished(self, gid: bytes, group: PublishedGroup) -> EmitEvent:
        """A `published` event for a group already published, with its live placements now and
        the disk share of them (after a demotion, or adopted with disk replicas)."""
        held: dict[str, int] = {}
        disk: dict[str, int] = {}
        for mem in group.members:
            for r in mem.replicas:
                if not self._placement_live(r.placement):
                    continue
                segment_id = self._placements[r.placement][0]
                held[segment_id] = held.get(segment_id, 0) + mem.size_bytes
                if tier_of_slot(r.slot) == "ssd":
                    disk[segment_id] = disk.get(segment_id, 0) + mem.size_bytes
        self._count("groups_republished_total")
        return EmitEvent(
            "published",
            m.GroupPublished(
                group=chain_of(gid),
                chunk_index=group.chunk_index,
                members=len(group.members),
                degraded=bool(group.flags & FLAG_DEGRADED),
                namespace=self._namespaces[group.namespace],
                placements=[m.SegmentBytes(s, b) for s, b in sorted(held.items())],
                disk_placements=[m.SegmentBytes(s, b) for s, b in sorted(disk.items())],
            ),
        )

    # ---- checks (tests call this after every step) ---------------------------------------

    def check_invariants(self) -> None:
        scoped: dict[tuple[str, bool], int] = {}
        for lease in self._leases.values():
            if (scope := _scope_of(lease.holder_id)) is not None:
                scoped[(scope, lease.is_pin)] = scoped.get((scope, lease.is_pin), 0) + 1
        invariant(scoped == self._scope_held, "per-tenant lease counts differ from the leases held")
        reserved: dict[str, int] = {}

        def add(placement: int, size: int) -> None:
            if self._placement_live(placement):
                sid = self._placements[placement][0]
                reserved[sid] = reserved.get(sid, 0) + size

        for group in self.building.values():
            for pm in group.members.values():
                for p in pm.placements:
                    add(p.placement, pm.size_bytes)
                    invariant(p.ticket_id in self._tickets, "placement without ticket")
        for record in self.published.values():
            for mem in unpack_group(record).members:
                for r in mem.replicas:
                    if tier_of_slot(r.slot) == "dram":  # a disk replica reserves no arena bytes
                        add(r.placement, mem.size_bytes)
        for (sid, inc, slot, _), (size, _, _, _) in self._freeing.items():
            if tier_of_slot(slot) == "dram":
                add(self._placement_index[(sid, inc)], size)
        for rt in self._replicating.values():
            if rt.tier == "dram":
                add(rt.placement, rt.size_bytes)
        for seg in self.segments.values():
            if seg.up:
                invariant(
                    seg.reserved_bytes == reserved.get(seg.segment_id, 0),
                    "reservation drift",
                    segment=seg.segment_id,
                    have=seg.reserved_bytes,
                    want=reserved.get(seg.segment_id, 0),
                )
        invariant(
            self.pending_objects == sum(len(g.members) for g in self.building.values()), "pending drift"
        )
        pending_objects: dict[str, int] = {}
        pending_bytes: dict[str, int] = {}
        for group in self.building.values():
            for pm in group.members.values():
                if (scope := _scope_of(pm.writer_id)) is not None:
                    pending_objects[scope] = pending_objects.get(scope, 0) + 1
                    if nbytes := pm.size_bytes * len(pm.placements):
                        pending_bytes[scope] = pending_bytes.get(scope, 0) + nbytes
        invariant(pending_objects == self._scope_pending_objects, "per-tenant pending objects drift")
        invariant(pending_bytes == self._scope_pending_bytes, "per-tenant pending bytes drift")
        invariant(not (self.published.keys() & self.building.keys()), "group both building and published")
        self._index.check(set(self.published))
        outstanding: dict[bytes, int] = {}
        for _, gid, _, _ in self._freeing.values():
            if gid:
                outstanding[gid] = outstanding.get(gid, 0) + 1
        invariant(outstanding == self._evicting_frees, "evicting free counts drift")
        invariant(self.evicting.keys() == outstanding.keys(), "evicting group without outstanding frees")
        for gid in self._lease_count.keys() | self._pin_count.keys():
            invariant(gid not in self.evicting, "evicting a leased or pinned group")
        self._check_tenant_usage()

    def _check_tenant_usage(self) -> None:
        """Recompute every tenant's usage from the records (see `kvfabric.core.quotas`)."""
        usage: dict[Tenant, TenantUsage] = {}

        def add(tenant: Tenant, nbytes: int, objects: int) -> None:
            use = usage.setdefault(tenant, TenantUsage())
            use.bytes += nbytes
            use.objects += objects

        for group in self.building.values():
            for pm in group.members.values():
                add(tenant_of(group.info.namespace), pm.size_bytes * len(pm.placements), 1)
        for record in self.published.values():
            published = unpack_group(record)
            tenant = tenant_of(self._namespaces[published.namespace])
            for mem in published.members:
                add(tenant, mem.size_bytes * len(mem.replicas), 1)
        for size, _, _, tenant in self._freeing.values():
            add(tenant, size, 0)
        for rt in self._replicating.values():
            add(tenant_of(rt.key), rt.size_bytes, 0)
        self.quotas.check(usage)


_HANDLERS: dict[type[msgspec.Struct], Callable[[DirectoryCore, Any, int], Outcome]] = {
    m.RegisterSegment: DirectoryCore._register,
    m.Heartbeat: DirectoryCore._heartbeat,
    m.PutBegin: DirectoryCore._begin,
    m.ConfirmReplicas: DirectoryCore._confirm,
    m.PutCommit: DirectoryCore._commit,
    m.PutAbort: DirectoryCore._abort,
    m.Lookup: DirectoryCore._lookup,
    m.LeaseRelease: DirectoryCore._release,
    m.LeaseRenew: DirectoryCore._renew,
    m.Pin: DirectoryCore._pin,
    m.Unpin: DirectoryCore._unpin,
    m.Evict: DirectoryCore._evict,
    m.SlotsFreed: DirectoryCore._freed,
    m.ReplicateBegin: DirectoryCore._replicate_begin,
    m.ReplicaCorrupt: DirectoryCore._replica_corrupt,
    m.ListSegments: DirectoryCore._list_segments,
    m.ListGroups: DirectoryCore._list_groups,
    m.ShowGroup: DirectoryCore._show_group,
    m.ListLeases: DirectoryCore._list_leases,
    m.ListTenants: DirectoryCore._list_tenants,
}
