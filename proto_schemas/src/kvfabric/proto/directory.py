"""Messages of the `directory` service (subjects `kvf.v1.directory.<verb>`).

Keys travel in their compact binary form, typed `ObjectKey` (`KVKey.object_key()`), chunk groups
as `GroupId` (`ChunkGroupId.group_id()`); events and listings name a group by `ChainHash` and
`DomainDigest` (`kvfabric.format.ids`: `NewType`s that msgspec encodes as `bytes`). Every reply
carries the directory `epoch`; every request may carry the `epoch` its sender last saw (0 = none
yet) and is rejected with `stale_generation` when it is older than the current one. Batches are
bounded by the limits below; a larger batch gets `batch_too_large`.

Verbs and their request → reply:

| verb | request | reply |
|---|---|---|
| `register` | `RegisterSegment` | `SegmentRegistered` |
| `heartbeat` | `Heartbeat` | `HeartbeatAck` |
| `put_begin` | `PutBegin` | `PutBeginReply` |
| `confirm` | `ConfirmReplicas` | `ConfirmReply` |
| `put_commit` | `PutCommit` | `PutCommitReply` |
| `put_abort` | `PutAbort` | `PutAbortReply` |
| `lookup` | `Lookup` | `LookupReply` |
| `lookup_many` | `LookupMany` | `LookupManyReply` |
| `lease_release_many` | `LeaseReleaseMany` | `LeaseReleaseManyReply` |
| `lease_release` / `lease_renew` | `LeaseRelease` / `LeaseRenew` | `LeaseReply` |
| `pin` / `unpin` | `Pin` / `Unpin` | `PinReply` |
| `evict` | `Evict` | `EvictReply` |
| `freed` | `SlotsFreed` | `FreedAck` |
| `replicate_begin` | `ReplicateBegin` | `ReplicateBeginReply` |
| `replica_corrupt` | `ReplicaCorrupt` | `ReplicaCorruptReply` |
| `replicate_begin_many` | `ReplicateBeginMany` | `ReplicateBeginManyReply` |
| `replica_corrupt_many` | `ReplicaCorruptMany` | `ReplicaCorruptManyReply` |
| `replica_suspect` | `ReplicaSuspect` | `ReplicaSuspectReply` |
| `list_segments` | `ListSegments` | `SegmentList` |
| `list_groups` / `show_group` | `ListGroups` / `ShowGroup` | `GroupList` |
| `list_leases` | `ListLeases` | `LeaseList` |
| `list_tenants` | `ListTenants` | `TenantList` |
| `shard_map` | `GetShardMap` | `ShardMapReply` |

## Shards
Keys map to `shards` virtual shards by their chain hash (`kvfabric.proto.shards.shard_of`); each
shard is led by one directory instance under its own epoch. Requests for a shard go to the
leading instance's subjects `kvf.v1.directory.<verb>.<instance>` (tenants:
`kvf.v1.directory.t.<tenant>.<verb>.<instance>`); the `epoch` in a request or reply is that
shard's. A request must name keys of one shard only, except `lookup_many` and
`lease_release_many`: one prefix's lookups (the leases of a hit) for every shard the instance
leads, each part under its shard's epoch and answered (or refused) on its own (one round trip
per instance, not per shard). `shard_map` is answered by every instance (standbys included)
with the shards it leads; callers assemble and cache the map
(`kvfabric.cluster.directory_router`). An instance that does not lead the shard answers
`wrong_shard`. `register`, `heartbeat` and the listings go to every instance; their replies
cover the shards that instance leads.

## Events
Events go to the JetStream stream `KVF_DIRECTORY_EVENTS` (subjects
`kvf.v1.events.directory.<kind>`). Each event a shard's core publishes carries the NATS header
`Kvf-Shard-Epoch: <shard>.<epoch>` (`SHARD_EPOCH_HEADER`; built by `shard_epoch_header`, read by
`shard_epoch_of`): its core's epoch when the event was queued. A follower drops an event whose
epoch is below the highest it has seen for that shard (a replaced core's late publication,
`ShardStarted`); an event without the header (an older directory's) is applied unfenced.

Not split (over 600 lines): one tagged union per message family (docs/design.md, house style),
decoded by one typed `Decoder`; the file is the directory's wire schema, message by message.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Final, Literal

import msgspec

from kvfabric.format.ids import ChainHash, DomainDigest, GroupId, GroupKey, Namespace, ObjectKey
from kvfabric.proto.codec import FamilyDecoder
from kvfabric.proto.shards import SHARDS_MAX

# Batch limits (per message). Named once; the directory core enforces them.
PUT_BATCH_OBJECTS_MAX: Final = 4096
LOOKUP_BATCH_GROUPS_MAX: Final = 4096
LOOKUP_MEMBERS_MAX: Final = 1024
EVICT_BATCH_GROUPS_MAX: Final = 4096
FREED_BATCH_MAX: Final = 8192
LIST_LIMIT_MAX: Final = 10_000
# Leases a `list_leases` page examines at most (a `pins_only` page skips the read leases among them)
LEASES_EXAMINED_MAX: Final = 50_000
LEASE_TTL_MS_MAX: Final = 600_000
PIN_TTL_MS_MAX: Final = 86_400_000
WRITE_TTL_MS_MAX: Final = 600_000
ACCESS_BATCH_MAX: Final = 4096  # groups per GroupsAccessed event
# Members of one chunk group the directory takes (tp_size x pp_size x layer_group_count): its
# record counts them in a byte. A key of a larger group is `bad_request` (docs/formats.md).
GROUP_MEMBERS_MAX: Final = 255
# Groups per GroupsPublished event (one put_commit's groups; more go in several events), and
# its encoded bytes: a group names every segment that holds a replica of any of its members (up
# to members x replicas), so 256 groups can pass NATS' 1 MiB payload limit (64 members, 96
# segments with 64-char ids, 2 replicas: 1.3 MB in one event; review). An event over it is never
# sent: nats-py refuses it, the ordered outbox retries it forever and the shard's events stop.
PUBLISHED_BATCH_MAX: Final = 256
PUBLISHED_BATCH_BYTES_MAX: Final = 512 * 1024
LOOKUP_MANY_PARTS_MAX: Final = 1024  # shards per LookupMany (its groups together <= LOOKUP_BATCH_GROUPS_MAX)
RELEASE_BATCH_LEASES_MAX: Final = 64  # leases per batched LeaseRelease (each ends O(its groups))
RELEASE_MANY_LEASES_MAX: Final = 1024  # leases per LeaseReleaseMany, all parts together
# Confirms per ConfirmReplicas: a segment's confirm batcher sends at most 64; a request is one
# core call (never in steps), so its stall of the directory's loop is bounded by this (issue 21).
CONFIRM_BATCH_MAX: Final = 256
REPLICA_BATCH_MAX: Final = (
    64  # items per ReplicateBeginMany / ReplicaCorruptMany (a demote request's objects)
)
# Names a caller chooses, kept by the directory for as long as what they name (a lease, a pin, a
# write, a cached reply): longer ones fail to decode (`bad_request`), so no caller can make the
# directory hold megabytes per entry. Counted in characters (at most 4 bytes each in UTF-8).
HOLDER_ID_CHARS_MAX: Final = 128
REQUEST_ID_CHARS_MAX: Final = 128
# The largest reply body the directory sends: NATS's default max_payload (1 MiB) less room for
# headers. A put_begin whose reply could be larger is refused (`batch_too_large`) before anything
# is placed, never answered with a message NATS drops.
REPLY_BYTES_MAX: Final = (1 << 20) - (64 << 10)
# Objects per put_begin whose reply always fits in REPLY_BYTES_MAX: 5 replicas, ids at their
# maxima, a segment id and data address of up to ~250 characters together. Clients split by it.
PUT_BEGIN_BATCH_OBJECTS_FIT: Final = 256

HolderId = Annotated[str, msgspec.Meta(max_length=HOLDER_ID_CHARS_MAX)]
WriterId = Annotated[str, msgspec.Meta(max_length=HOLDER_ID_CHARS_MAX)]
RequestId = Annotated[str, msgspec.Meta(max_length=REQUEST_ID_CHARS_MAX)]


class _Msg(msgspec.Struct, frozen=True, kw_only=True, tag_field="t"):
    """Base of every directory message: frozen, keyword-only, tagged by `t`."""


# ---- shared shapes -------------------------------------------------------------------------


class FailureDomain(msgspec.Struct, frozen=True, kw_only=True):
    """Where a segment lives. Replicas of one object go to distinct domains, widest level first."""

    zone: str = "zone0"
    rack: str = "rack0"
    host: str


class Member(msgspec.Struct, frozen=True, array_like=True):
    """One member of a chunk group: the (TP rank, PP stage, layer group) that wrote an object."""

    tp_rank: int
    pp_stage: int
    layer_group: int


class ObjectSpec(msgspec.Struct, frozen=True, kw_only=True):
    key: ObjectKey
    size_bytes: int
    # xxh3-128 of the bytes (16 bytes), or empty: the segment that stores them hashes them, and
    # the first receipt the writer commits gives the object its checksum (a confirm before it is
    # `pending`; every other replica must match it). Such a PUT asks for a receipt; one that
    # sends its bytes names their checksum (`PutRequest.checksum`), one whose bytes the segment
    # reads from the writer's own pages (a staged put) names none (docs/segment.md "Write").
    checksum: bytes
    # The chain hash (32 bytes) of the previous chunk of the same prefix, empty for the first
    # chunk: eviction evicts a prefix tail first (a chunk is useless without its parent).
    parent: ChainHash = ChainHash(b"")


class WriteTicket(msgspec.Struct, frozen=True, kw_only=True):
    """Permission to write one replica of one object into one segment, signed by the directory.

    The segment checks `signature` (keyed with the cluster secret), the incarnation, the size
    and, after the bytes arrive, the checksum (an empty one: the PUT's own, if it names one;
    `ObjectSpec.checksum`). It confirms with `ticket_id` and the checksum of what it stored.
    """

    ticket_id: int
    key: ObjectKey
    segment_id: str
    incarnation: int
    size_bytes: int
    checksum: bytes
    writer_id: str
    deadline_ms: int
    epoch: int
    data_addr: str = ""
    signature: bytes = b""
    shard: int = 0  # the key's shard: `epoch` is that shard's (segments fence per shard)


class Replica(msgspec.Struct, frozen=True, kw_only=True):
    segment_id: str
    incarnation: int
    slot: int
    slot_generation: int
    data_addr: str = ""
    # Lookup hits and copy sources: the directory's MAC that lets the holder read this replica
    # until `read_expires_ms` (its lease's expiry); segments refuse reads without one.
    read_token: bytes = b""
    read_expires_ms: int = 0


class ObjectLocation(msgspec.Struct, frozen=True, kw_only=True):
    """A readable object: where its replicas are and what its bytes must hash to. The caller
    knows its key from (chunk index, member) of the groups it asked for."""

    chunk_index: int
    member: Member
    size_bytes: int
    checksum: bytes
    replicas: list[Replica]


# ---- segments -------------------------------------------------------------------------------


class RegisterSegment(_Msg, frozen=True, kw_only=True, tag="dir.register.v1"):
    segment_id: str
    incarnation: int
    domain: FailureDomain
    capacity_bytes: int
    # The segment's transport URLs, space-separated, preferred first (`kvfabric.dataplane.addresses`);
    # handed out unchanged in tickets and replica locations.
    data_addr: str = ""
    epoch: int = 0
    # Objects in the segment's disk tier as it registers: what it recovered after a restart (a new
    # incarnation). > 0 asks the directory to adopt them: each shard it leads is rebuilt from the
    # segments' reports (the HA rebuild; docs/segment.md, "Disk tier").
    disk_objects: int = 0


class ShardEpoch(msgspec.Struct, frozen=True, array_like=True):
    shard: int
    epoch: int


class SegmentRegistered(_Msg, frozen=True, kw_only=True, tag="dir.registered.v1"):
    epoch: int
    heartbeat_interval_ms: int
    heartbeat_timeout_ms: int
    shard_epochs: list[ShardEpoch] = []  # the shards the answering instance leads


class Heartbeat(_Msg, frozen=True, kw_only=True, tag="dir.heartbeat.v1"):
    segment_id: str
    incarnation: int
    used_bytes: int
    draining: bool = False
    epoch: int = 0
    # Objects in its disk tier (`used_bytes` is the arena's): a shard core that never saw this
    # segment rebuilds to adopt them, as it does for arena bytes (docs/directory-ha.md).
    disk_objects: int = 0


class HeartbeatAck(_Msg, frozen=True, kw_only=True, tag="dir.heartbeat_ack.v1"):
    epoch: int
    shard_epochs: list[ShardEpoch] = []


# ---- two-phase publish ---------------------------------------------------------------------


class PutBegin(_Msg, frozen=True, kw_only=True, tag="dir.put_begin.v1"):
    writer_id: WriterId
    request_id: RequestId
    objects: list[ObjectSpec]
    replicas: int = 0  # 0 = the namespace default
    write_ttl_ms: int = 30_000
    epoch: int = 0


# quota_exceeded: this object would take its tenant (share domain) over its bytes or objects quota.
# not_admitted: the eviction policy's admission filter refuses it (nothing reserved; the writer
# does not write it and recomputes it next time, as on a miss).
BeginStatus = Literal["placed", "exists", "in_flight", "no_capacity", "quota_exceeded", "not_admitted"]


class BeginResult(msgspec.Struct, frozen=True, kw_only=True):
    key: ObjectKey
    status: BeginStatus
    tickets: list[WriteTicket] = msgspec.field(default_factory=list)
    # placed: this writer's deadline; in_flight: the other writer's deadline.
    deadline_ms: int = 0


class PutBeginReply(_Msg, frozen=True, kw_only=True, tag="dir.put_begin_reply.v1"):
    epoch: int
    results: list[BeginResult]


class ReplicaConfirm(msgspec.Struct, frozen=True, kw_only=True):
    ticket_id: int
    key: ObjectKey
    slot: int
    slot_generation: int
    size_bytes: int
    checksum: bytes


class ConfirmReplicas(_Msg, frozen=True, kw_only=True, tag="dir.confirm.v1"):
    """Sent by a segment after it stored and checksummed the bytes of each ticket (at most
    `CONFIRM_BATCH_MAX`)."""

    segment_id: str
    incarnation: int
    confirms: list[ReplicaConfirm]
    epoch: int = 0


ConfirmStatus = Literal["ok", "unknown_ticket", "mismatch", "pending"]


class ConfirmResult(msgspec.Struct, frozen=True, kw_only=True):
    ticket_id: int
    # unknown_ticket / mismatch: the directory will never publish this slot; free it now.
    # pending: a ticket without a checksum whose writer has not committed a receipt yet: only
    # the writer's receipt gives the object its checksum and slot (a confirm could come from
    # anyone who saw the ticket); ask again (a synchronous confirm frees the slot).
    status: ConfirmStatus


class ConfirmReply(_Msg, frozen=True, kw_only=True, tag="dir.confirm_reply.v1"):
    epoch: int
    results: list[ConfirmResult]


class WriteReceipt(msgspec.Struct, frozen=True, array_like=True):
    """A segment's proof that it stored and verified one ticket's bytes in (slot, generation):
    `mac` is `tickets.write_receipt` over them, the ticket and the segment (cluster secret). A
    writer carries it in put_commit; the directory applies it as that replica's confirm."""

    ticket_id: int
    slot: int
    slot_generation: int
    mac: bytes
    # The checksum the segment stored (`PutReply.checksum`), for a ticket that carried none
    # (the MAC covers it); empty otherwise.
    checksum: bytes = b""


class PutCommit(_Msg, frozen=True, kw_only=True, tag="dir.put_commit.v1"):
    writer_id: WriterId
    request_id: RequestId
    keys: list[ObjectKey]
    epoch: int = 0
    # Receipts of replicas written for these keys (at most PUT_BATCH_OBJECTS_MAX): each confirms
    # its replica before the commit, as the segment's own confirm would.
    receipts: list[WriteReceipt] = []


CommitStatus = Literal["published", "degraded", "waiting_group", "missing", "not_found", "exists"]


class CommitResult(msgspec.Struct, frozen=True, kw_only=True):
    key: ObjectKey
    # published: the whole chunk group is readable; degraded: readable with fewer replicas than
    # the target (flagged for repair); waiting_group: this object is committed but other members
    # of its chunk group are not yet; missing: no replica confirmed yet (retry commit later).
    status: CommitStatus
    replicas_confirmed: int = 0
    replicas_target: int = 0


class PutCommitReply(_Msg, frozen=True, kw_only=True, tag="dir.put_commit_reply.v1"):
    epoch: int
    results: list[CommitResult]


class PutAbort(_Msg, frozen=True, kw_only=True, tag="dir.put_abort.v1"):
    writer_id: WriterId
    request_id: RequestId
    keys: list[ObjectKey]
    epoch: int = 0


class PutAbortReply(_Msg, frozen=True, kw_only=True, tag="dir.put_abort_reply.v1"):
    epoch: int
    aborted: int


# ---- reads and leases ----------------------------------------------------------------------


class Lookup(_Msg, frozen=True, kw_only=True, tag="dir.lookup.v1"):
    """The chunk groups of one prefix, in order; `members` = the (rank, stage, group) objects the
    caller needs (empty = every member). The reply folds to the longest complete run."""

    holder_id: HolderId
    groups: list[GroupId]
    members: list[Member] = msgspec.field(default_factory=list)
    lease_ttl_ms: int = 30_000
    epoch: int = 0
    # False: no engine reads these (a service's own lookup: prefetch resolving a hint), so the
    # hits are not told to the eviction policy and prefetch as reads (`accessed` events)
    count_hits: bool = True


class LookupReply(_Msg, frozen=True, kw_only=True, tag="dir.lookup_reply.v1"):
    epoch: int
    hit_chunks: int
    lease_id: int = 0  # 0 = no lease (no hit)
    lease_expires_ms: int = 0
    objects: list[ObjectLocation] = msgspec.field(default_factory=list)


class LookupPart(msgspec.Struct, frozen=True, kw_only=True):
    """One shard's groups of a `LookupMany`, in prefix order, under that shard's `epoch`."""

    shard: int
    groups: list[GroupId]
    epoch: int = 0


class LookupMany(_Msg, frozen=True, kw_only=True, tag="dir.lookup_many.v1"):
    """One prefix's lookups for several shards one instance leads: each part is exactly a
    `Lookup` of its shard (same holder, members, lease ttl; authorized, charged and leased per
    shard). Distinct shards; at most `LOOKUP_MANY_PARTS_MAX` parts and `LOOKUP_BATCH_GROUPS_MAX`
    groups in all."""

    holder_id: HolderId
    parts: list[LookupPart]
    members: list[Member] = msgspec.field(default_factory=list)
    lease_ttl_ms: int = 30_000
    count_hits: bool = True  # as `Lookup.count_hits`, for every part


class LookupPartReply(msgspec.Struct, frozen=True, kw_only=True):
    """A part's answer: `reply`, or the error its shard gave (`error` = its wire code: the caller
    asks that shard alone, e.g. after `wrong_shard` refreshes its map)."""

    shard: int
    reply: LookupReply | None = None
    error: str = ""
    message: str = ""


class LookupManyReply(_Msg, frozen=True, kw_only=True, tag="dir.lookup_many_reply.v1"):
    epoch: int = 0  # per part, in each `reply`
    parts: list[LookupPartReply] = msgspec.field(default_factory=list)


class LeaseRelease(_Msg, frozen=True, kw_only=True, tag="dir.lease_release.v1"):
    """One lease (`lease_id`; one the holder does not hold is `not_found`), or a batch: `lease_id`
    0 and up to `RELEASE_BATCH_LEASES_MAX` ids of one shard in `lease_ids`. A batch releases each
    one the holder holds, skips the rest (already released or expired: nothing to give back) and
    lists what it released in `LeaseReply.released`. A directory older than the batch ignores
    `lease_ids` and answers `not_found` for lease 0: the caller then releases one by one."""

    holder_id: HolderId
    lease_id: int
    epoch: int = 0
    shard: int = 0  # the shard this lease / listing belongs to (one core each)
    lease_ids: list[int] = msgspec.field(default_factory=list)


class ReleasePart(msgspec.Struct, frozen=True, kw_only=True):
    """One shard's leases of a `LeaseReleaseMany` (at most `RELEASE_BATCH_LEASES_MAX`)."""

    shard: int
    lease_ids: list[int]
    epoch: int = 0


class LeaseReleaseMany(_Msg, frozen=True, kw_only=True, tag="dir.lease_release_many.v1"):
    """Leases of several shards one instance leads, given back in one request: each part is
    exactly the batched `LeaseRelease` of its shard. Distinct shards; at most
    `RELEASE_MANY_LEASES_MAX` leases in all. Never refused for load (it only gives back)."""

    holder_id: HolderId
    parts: list[ReleasePart]


class ReleasePartReply(msgspec.Struct, frozen=True, kw_only=True):
    """A part's answer: the leases it released, or its shard's error (wire code)."""

    shard: int
    released: list[int] = msgspec.field(default_factory=list)
    error: str = ""
    message: str = ""


class LeaseReleaseManyReply(_Msg, frozen=True, kw_only=True, tag="dir.lease_release_many_reply.v1"):
    epoch: int = 0  # per shard: not one for the whole reply
    parts: list[ReleasePartReply] = msgspec.field(default_factory=list)


class LeaseRenew(_Msg, frozen=True, kw_only=True, tag="dir.lease_renew.v1"):
    holder_id: HolderId
    lease_id: int
    lease_ttl_ms: int = 30_000
    epoch: int = 0
    shard: int = 0  # the shard this lease / listing belongs to (one core each)


class LeaseReply(_Msg, frozen=True, kw_only=True, tag="dir.lease_reply.v1"):
    epoch: int
    lease_id: int
    expires_ms: int  # 0 after release
    released: list[int] = msgspec.field(default_factory=list)  # a batch release's: those released


class Pin(_Msg, frozen=True, kw_only=True, tag="dir.pin.v1"):
    holder_id: HolderId
    groups: list[GroupId]
    ttl_ms: int
    epoch: int = 0


class Unpin(_Msg, frozen=True, kw_only=True, tag="dir.unpin.v1"):
    holder_id: HolderId
    pin_id: int
    epoch: int = 0
    shard: int = 0  # the shard this lease / listing belongs to (one core each)


class PinReply(_Msg, frozen=True, kw_only=True, tag="dir.pin_reply.v1"):
    epoch: int
    pin_id: int
    pinned_groups: int
    expires_ms: int


# ---- eviction and frees --------------------------------------------------------------------


EvictTier = Literal["all", "ssd"]


class Evict(_Msg, frozen=True, kw_only=True, tag="dir.evict.v1"):
    groups: list[GroupId]
    reason: str = "policy"
    epoch: int = 0
    # "ssd": a disk tier's victims (the eviction policy's `<segment>#ssd` pools). A group that
    # every member also holds in a live arena loses only its disk replicas (`disk_dropped`: it
    # stays published, and is published again with its tiers); any other group is evicted.
    tier: EvictTier = "all"
    # Per group, the indexes of earlier groups of this request that are its tails (empty: none
    # said). A group one of whose tails stays (answered `leased`, `pinned` or `tail_stays`) stays
    # too, answered `tail_stays`: a tail never outlives its head within a request either.
    tails: list[list[int]] = msgspec.field(default_factory=list)


EvictStatus = Literal[
    "evicting", "leased", "pinned", "not_found", "not_published", "disk_dropped", "tail_stays"
]
# The answers that leave a group where it was (its head, named with it, stays too).
EVICT_STAYS: Final[frozenset[str]] = frozenset({"leased", "pinned", "tail_stays"})


class EvictResult(msgspec.Struct, frozen=True, kw_only=True):
    group: GroupId
    status: EvictStatus


class EvictReply(_Msg, frozen=True, kw_only=True, tag="dir.evict_reply.v1"):
    epoch: int
    results: list[EvictResult]


class FreedSlot(msgspec.Struct, frozen=True, array_like=True):
    key: ObjectKey
    slot: int
    slot_generation: int


class SlotsFreed(_Msg, frozen=True, kw_only=True, tag="dir.freed.v1"):
    segment_id: str
    incarnation: int
    freed: list[FreedSlot]
    epoch: int = 0


class FreedAck(_Msg, frozen=True, kw_only=True, tag="dir.freed_ack.v1"):
    epoch: int
    accepted: int


# ---- repair: extra replicas of published objects, corrupt replicas -------------------------


class ReplicateBegin(_Msg, frozen=True, kw_only=True, tag="dir.replicate_begin.v1"):
    """A ticket to write one more replica of a published object onto `segment_id` (repair,
    prefetch, drain). The bytes come from an existing replica, segment to segment (`seg.copy`);
    the destination confirms like any write and the replica joins the published record."""

    writer_id: WriterId
    request_id: RequestId
    key: ObjectKey
    segment_id: str
    write_ttl_ms: int = 30_000
    epoch: int = 0
    # The tier of the new replica: "ssd" puts it in the segment's disk tier (a demotion: the
    # segment copies its own arena replica, `seg.demote`; the confirmed slot must be a disk slot,
    # id from SSD_SLOT_BASE). One replica per (segment, tier); a disk replica reserves no arena bytes.
    tier: Literal["dram", "ssd"] = "dram"
    # A copy that keeps the replica it was made from (`seg.demote`'s `keep_arena`: a demoted tail's
    # head copied to disk; tier "ssd"). No drop follows it to publish the group again, so its
    # confirm does once every member of the group has its disk replica on that segment: a
    # `published` event with the group's tiers now (consumers such as the eviction policy follow).
    keep_source: bool = False


ReplicateStatus = Literal["placed", "not_found", "already_there", "no_capacity", "segment_down"]


class ReplicateBeginReply(_Msg, frozen=True, kw_only=True, tag="dir.replicate_begin_reply.v1"):
    epoch: int
    status: ReplicateStatus
    ticket: WriteTicket | None = None
    # placed: where to copy from (the object's live replicas, the destination excluded);
    # already_there: the object's live replicas (the destination's own among them, if any)
    sources: list[Replica] = msgspec.field(default_factory=list)


class ReplicaCorrupt(_Msg, frozen=True, kw_only=True, tag="dir.replica_corrupt.v1"):
    """A segment's scrubber found a stored object whose bytes no longer match its checksum:
    the directory drops that replica (and frees the slot); repair restores the target."""

    segment_id: str
    incarnation: int
    key: ObjectKey
    slot: int
    slot_generation: int
    epoch: int = 0
    # "corrupt" (a scrubber's finding: dropped even if it was the last copy) or another reason
    # to drop one replica, e.g. "cold_extra" (prefetch): then a last replica is never dropped.
    reason: str = "corrupt"


class ReplicateItem(msgspec.Struct, frozen=True, kw_only=True):
    key: ObjectKey
    request_id: RequestId
    keep_source: bool = False  # as `ReplicateBegin.keep_source`


class ReplicateBeginMany(_Msg, frozen=True, kw_only=True, tag="dir.replicate_begin_many.v1"):
    """`ReplicateBegin` for up to `REPLICA_BATCH_MAX` keys of one shard onto one segment and tier
    in one round trip (a segment's demotion of a batch of objects): each item is answered exactly
    as its own `ReplicateBegin` would be, in order, in `ReplicateBeginManyReply.replies`. A
    whole-request error (epoch, TTL, batch size) applies to none."""

    writer_id: WriterId
    segment_id: str
    items: list[ReplicateItem]
    write_ttl_ms: int = 30_000
    epoch: int = 0
    tier: Literal["dram", "ssd"] = "dram"


class ReplicateBeginManyReply(_Msg, frozen=True, kw_only=True, tag="dir.replicate_begin_many_reply.v1"):
    epoch: int
    replies: list[ReplicateBeginReply]


class CorruptItem(msgspec.Struct, frozen=True, kw_only=True):
    key: ObjectKey
    slot: int
    slot_generation: int


class ReplicaCorruptMany(_Msg, frozen=True, kw_only=True, tag="dir.replica_corrupt_many.v1"):
    """`ReplicaCorrupt` for up to `REPLICA_BATCH_MAX` replicas of one shard's keys on one segment
    incarnation, one `reason` for all (a demotion's arena replicas: "demoted"): each item is
    dropped or not exactly as its own `ReplicaCorrupt` would be, in order."""

    segment_id: str
    incarnation: int
    items: list[CorruptItem]
    epoch: int = 0
    reason: str = "corrupt"


class ReplicaCorruptManyReply(_Msg, frozen=True, kw_only=True, tag="dir.replica_corrupt_many_reply.v1"):
    epoch: int
    dropped: list[bool]  # per item, as `ReplicaCorruptReply.dropped`


class ReplicaSuspect(_Msg, frozen=True, kw_only=True, tag="dir.replica_suspect.v1"):
    """A reader's report (`replica_suspect`, any instance): bytes read from this replica did not
    match the object's checksum. The directory only relays it to the segment, which re-verifies
    the slot (when it holds an object of the reporter's share domains) and, when it is corrupt,
    frees it and reports `ReplicaCorrupt` (the scrubber's path): a forged report costs one
    re-hash and drops nothing. Rate-limited per tenant; the reply says only whether it was
    passed on."""

    segment_id: str
    incarnation: int
    slot: int
    slot_generation: int


class ReplicaSuspectReply(_Msg, frozen=True, kw_only=True, tag="dir.replica_suspect_reply.v1"):
    epoch: int = 0  # not a shard's: any instance relays
    relayed: bool


class ReplicaCorruptReply(_Msg, frozen=True, kw_only=True, tag="dir.replica_corrupt_reply.v1"):
    epoch: int
    dropped: bool  # False: not a replica the directory knows (already gone): free it anyway


# ---- read-only queries for tools (grant no lease) --------------------------------------------


class ListSegments(_Msg, frozen=True, kw_only=True, tag="dir.list_segments.v1"):
    epoch: int = 0
    shard: int = 0  # the shard this lease / listing belongs to (one core each)


class SegmentInfo(msgspec.Struct, frozen=True, kw_only=True):
    segment_id: str
    incarnation: int
    domain: FailureDomain
    up: bool
    draining: bool
    capacity_bytes: int
    reserved_bytes: int
    reported_used_bytes: int
    last_heartbeat_ms: int
    data_addr: str


class SegmentList(_Msg, frozen=True, kw_only=True, tag="dir.segment_list.v1"):
    epoch: int
    segments: list[SegmentInfo]


class ListGroups(_Msg, frozen=True, kw_only=True, tag="dir.list_groups.v1"):
    """Published chunk groups, optionally of one share domain (its 16-byte digest), paged by
    `after` (the last group key of the previous page: `GroupList.next_after`)."""

    domain_digest: DomainDigest = DomainDigest(b"")
    after: GroupKey = GroupKey(b"")
    limit: int = 100
    epoch: int = 0
    shard: int = 0  # the shard this lease / listing belongs to (one core each)
    below_target: bool = False  # only groups with a member below its replica target (repair)
    with_objects: bool = False  # include every member's live replicas


class ShowGroup(_Msg, frozen=True, kw_only=True, tag="dir.show_group.v1"):
    """One chunk group's manifest entry: members, sizes, checksums, replicas."""

    # chunk group id (90 bytes), group key (domain digest + chain hash, 48 bytes: events name
    # both parts), or chain hash alone (32 bytes: a full scan, for tools)
    group: bytes
    epoch: int = 0


class GroupSummary(msgspec.Struct, frozen=True, kw_only=True):
    group: ChainHash
    namespace: Namespace  # the chunk group id's leading 54 bytes (format, domain, model, layout)
    chunk_index: int
    state: Literal["building", "published", "evicting"]
    members: int
    expected_members: int
    degraded: bool = False
    leases: int = 0
    pins: int = 0
    objects: list[ObjectLocation] = msgspec.field(default_factory=list)


class GroupList(_Msg, frozen=True, kw_only=True, tag="dir.group_list.v1"):
    epoch: int
    groups: list[GroupSummary]
    next_after: GroupKey = GroupKey(b"")  # empty: no more pages


class ListLeases(_Msg, frozen=True, kw_only=True, tag="dir.list_leases.v1"):
    """Leases and pins in id order: those after `after` (a page's `next_after`), pins only
    with `pins_only`; at most `limit`, `LEASES_EXAMINED_MAX` examined, the reply within
    `REPLY_BYTES_MAX` (the rest in the next page)."""

    limit: int = 100
    epoch: int = 0
    shard: int = 0  # the shard this lease / listing belongs to (one core each)
    after: int = 0
    pins_only: bool = False


class LeaseInfo(msgspec.Struct, frozen=True, kw_only=True):
    lease_id: int
    holder_id: str
    is_pin: bool
    groups: int
    expires_ms: int


class LeaseList(_Msg, frozen=True, kw_only=True, tag="dir.lease_list.v1"):
    epoch: int
    leases: list[LeaseInfo]
    next_after: int = 0  # more to list: ask again with `after` = this; 0: the end


class ListTenants(_Msg, frozen=True, kw_only=True, tag="dir.list_tenants.v1"):
    """Tenants (share domains) with their usage and limits, in domain digest order."""

    limit: int = 100
    epoch: int = 0
    shard: int = 0  # the shard this lease / listing belongs to (one core each)


class TenantInfo(msgspec.Struct, frozen=True, kw_only=True):
    domain_digest: DomainDigest
    used_bytes: int  # size × replicas of what it holds (building, published, copying, freeing)
    objects: int  # members of its building and published chunk groups
    bytes_max: int = 0  # 0 = unlimited
    objects_max: int = 0
    requests_per_s: float = 0.0
    burst: int = 0
    # Refusals since the directory last started tracking this tenant (it forgets idle ones).
    quota_exceeded: int = 0  # objects put_begin answered quota_exceeded
    rate_limited: int = 0  # requests answered rate_limited


class TenantList(_Msg, frozen=True, kw_only=True, tag="dir.tenant_list.v1"):
    epoch: int
    tenants: list[TenantInfo]
    default: TenantInfo | None = None  # the limits of a tenant not configured (digest empty)


# ---- events (JetStream stream of subject `kvf.v1.events.directory.<kind>`) ---------------


class SegmentUp(_Msg, frozen=True, kw_only=True, tag="dir.ev.segment_up.v1"):
    segment_id: str
    incarnation: int
    capacity_bytes: int = 0


class SegmentDown(_Msg, frozen=True, kw_only=True, tag="dir.ev.segment_down.v1"):
    segment_id: str
    incarnation: int
    reason: str


class SegmentBytes(msgspec.Struct, frozen=True, array_like=True):
    segment_id: str
    bytes: int


class GroupPublished(_Msg, frozen=True, kw_only=True, tag="dir.ev.published.v1"):
    group: ChainHash
    chunk_index: int
    members: int
    degraded: bool = False
    namespace: Namespace = Namespace(b"")  # the group id's leading 54 bytes; [4:20]: the share domain
    parent: ChainHash = ChainHash(b"")  # the previous chunk's chain hash, as its writer told it
    placements: list[SegmentBytes] = msgspec.field(default_factory=list)  # bytes held per segment
    # Of those, the bytes in each segment's disk tier (issue 23). The same group is published
    # again when its placements change tier: its arena replicas dropped after a demotion, or its
    # disk replicas adopted by a rebuild (docs/ssd-tier.md); a consumer updates what it knows.
    disk_placements: list[SegmentBytes] = msgspec.field(default_factory=list)
    # One copy of the group: its members' sizes summed (a segment's placement may count two
    # replicas of a member, arena and disk, or hold some members only). 0: an older directory.
    group_bytes: int = 0


class GroupsPublished(_Msg, frozen=True, kw_only=True, tag="dir.ev.published_many.v1"):
    """The groups one `put_commit` published, in the order it published them (at most
    `PUBLISHED_BATCH_MAX`; a larger commit emits several, in order): one JetStream event per
    commit, not per group. Each is what a `GroupPublished` of its own says; consumers apply
    them in order as such. A group published again (a demotion, a rebuild's adoption) still
    comes as a single `GroupPublished`, and so did every publish of a directory before this
    event existed: consumers handle both."""

    groups: Annotated[list[GroupPublished], msgspec.Meta(max_length=PUBLISHED_BATCH_MAX)]


class GroupHits(msgspec.Struct, frozen=True, array_like=True):
    group: ChainHash
    hits: int
    domain: DomainDigest = DomainDigest(b"")  # the share domain digest: (domain, chain hash) names the group


class GroupsAccessed(_Msg, frozen=True, kw_only=True, tag="dir.ev.accessed.v1"):
    """Lookup hits since the previous such event, batched (at most `ACCESS_BATCH_MAX` groups):
    the recency and frequency signal of the eviction policy."""

    groups: list[GroupHits]


class GroupRef(msgspec.Struct, frozen=True, array_like=True):
    group: ChainHash
    domain: DomainDigest = DomainDigest(b"")  # the share domain digest: (domain, chain hash) names the group


class GroupsUnpinned(_Msg, frozen=True, kw_only=True, tag="dir.ev.unpinned.v1"):
    """Groups whose last pin ended (an unpin, or the pin's expiry), at most `ACCESS_BATCH_MAX`
    an event (more: several). The eviction policy backs off a victim the directory refused as
    pinned (5 s doubling to 80 s); this tells it to ask again at once (docs/eviction-policy.md).
    A group may have been evicted or invalidated since: a consumer ignores one it does not hold."""

    groups: Annotated[list[GroupRef], msgspec.Meta(max_length=ACCESS_BATCH_MAX)]


class GroupUnderReplicated(_Msg, frozen=True, kw_only=True, tag="dir.ev.under_replicated.v1"):
    group: ChainHash
    domain: DomainDigest = DomainDigest(b"")  # two domains may hold the same chain hash


class GroupEvicted(_Msg, frozen=True, kw_only=True, tag="dir.ev.evicted.v1"):
    group: ChainHash
    reason: str
    domain: DomainDigest = DomainDigest(b"")  # two domains may hold the same chain hash


class GroupInvalidated(_Msg, frozen=True, kw_only=True, tag="dir.ev.invalidated.v1"):
    group: ChainHash
    reason: str
    domain: DomainDigest = DomainDigest(b"")  # two domains may hold the same chain hash


class ShardStarted(_Msg, frozen=True, kw_only=True, tag="dir.ev.shard_started.v1"):
    """A shard's new core began serving (a new leader's, or a rebuild's under the same epoch):
    its first event, before any of its own. The core it replaces may have stopped with events
    queued and not published (a handover drains them for at most 1 s; a stopping instance not
    at all): they never got a stream sequence, so no gap shows them; and the rebuild emits no
    event for what it adopted or lost. A follower takes this as a gap and lists the directory
    again (the router's index: `RoutingIndex`; the eviction policy: its adoption).

    Late events of the core it replaces: a handover's drain of the old core's queued events runs
    while its lease key is released, and nats-py may flush a publish it had cancelled when it
    reconnects, so the old core's events can land in the stream *after* this marker, past the
    listing it asks for. Every event a shard's shell publishes (this one too) therefore carries
    the NATS header `SHARD_EPOCH_HEADER` (`Kvf-Shard-Epoch: <shard>.<epoch>`, its core's;
    `shard_epoch_header`, read back by `shard_epoch_of`). A follower keeps, per shard, the
    highest epoch any event named (this marker's `epoch` too) and drops, counted
    `events_fenced`, an event naming a lower one for that shard, a stale marker included (no
    listing on it): `kvfabric.core.shard_fence`. An event without the header (an older
    directory) is applied as before."""

    shard: int
    epoch: int


# The NATS header every event of a shard's core carries: `<shard>.<epoch>` (decimal), so that a
# follower drops the late events of a core a newer epoch replaced (`ShardStarted`). Shard ids are
# at most `SHARD_ID_MAX`, the cluster's (`kvfabric.proto.shards.SHARDS_MAX` shards, 0-4095): a
# header naming one past it names nothing, so that a foreign publisher's made-up shards cannot
# fill a follower's fence table (`kvfabric.core.shard_fence`); an epoch is a JetStream KV revision
# (uint64).
SHARD_EPOCH_HEADER: Final = "Kvf-Shard-Epoch"
SHARD_ID_MAX: Final = SHARDS_MAX - 1
_SHARD_ID_CHARS_MAX: Final = len(str(SHARD_ID_MAX))
_SHARD_EPOCH_VALUE_CHARS_MAX: Final = _SHARD_ID_CHARS_MAX + 1 + 20


def shard_epoch_header(shard: int, epoch: int) -> dict[str, str]:
    """The headers of an event the core of `shard` under `epoch` publishes."""
    return {SHARD_EPOCH_HEADER: f"{shard}.{epoch}"}


def shard_epoch_of(headers: object) -> tuple[int, int] | None:
    """The (shard, epoch) an event's headers name (`SHARD_EPOCH_HEADER`); None when absent or
    malformed (not `<shard>.<epoch>` in ASCII digits, a shard past `SHARD_ID_MAX`, an epoch past
    uint64). Never raises: the headers are whatever the message carried (nats-py's dict, None)."""
    if not isinstance(headers, Mapping) or not headers:
        return None
    value = headers.get(SHARD_EPOCH_HEADER)
    if value is None:  # a header name's case is not guaranteed by every NATS client
        wanted = SHARD_EPOCH_HEADER.lower()
        value = next((v for k, v in headers.items() if isinstance(k, str) and k.lower() == wanted), None)
    if not isinstance(value, str) or len(value) > _SHARD_EPOCH_VALUE_CHARS_MAX:
        return None
    shard, dot, epoch = value.strip().partition(".")
    if not dot or not _digits(shard, _SHARD_ID_CHARS_MAX) or not _digits(epoch, 20):
        return None
    parsed = int(shard), int(epoch)
    if parsed[0] > SHARD_ID_MAX or parsed[1] >= 1 << 64:
        return None
    return parsed


def _digits(text: str, chars_max: int) -> bool:
    return 0 < len(text) <= chars_max and text.isascii() and text.isdigit()


# ---- shard map -----------------------------------------------------------------------------


class GetShardMap(_Msg, frozen=True, kw_only=True, tag="dir.shard_map.v1"):
    epoch: int = 0


class ShardLeader(msgspec.Struct, frozen=True, array_like=True):
    shard: int
    instance: str
    epoch: int


class ShardMapReply(_Msg, frozen=True, kw_only=True, tag="dir.shard_map_reply.v1"):
    """One instance's part of the map: the shards it leads now (none for a standby)."""

    epoch: int = 0
    shards: int
    instance: str
    leaders: list[ShardLeader]


DirectoryRequest = (
    RegisterSegment
    | Heartbeat
    | PutBegin
    | ConfirmReplicas
    | PutCommit
    | PutAbort
    | Lookup
    | LookupMany
    | LeaseRelease
    | LeaseReleaseMany
    | LeaseRenew
    | Pin
    | Unpin
    | Evict
    | SlotsFreed
    | ReplicateBegin
    | ReplicaCorrupt
    | ReplicateBeginMany
    | ReplicaCorruptMany
    | ReplicaSuspect
    | ListSegments
    | ListGroups
    | ShowGroup
    | ListLeases
    | ListTenants
    | GetShardMap
)
DirectoryReply = (
    SegmentRegistered
    | HeartbeatAck
    | PutBeginReply
    | ConfirmReply
    | PutCommitReply
    | PutAbortReply
    | LookupReply
    | LookupManyReply
    | LeaseReply
    | LeaseReleaseManyReply
    | PinReply
    | EvictReply
    | FreedAck
    | ReplicateBeginReply
    | ReplicaCorruptReply
    | ReplicateBeginManyReply
    | ReplicaCorruptManyReply
    | ReplicaSuspectReply
    | SegmentList
    | GroupList
    | LeaseList
    | TenantList
    | ShardMapReply
)
DirectoryEvent = (
    SegmentUp
    | SegmentDown
    | GroupPublished
    | GroupsPublished
    | GroupUnderReplicated
    | GroupEvicted
    | GroupInvalidated
    | GroupsAccessed
    | GroupsUnpinned
    | ShardStarted
)

request_decoder: FamilyDecoder[DirectoryRequest] = FamilyDecoder(DirectoryRequest, "directory request")
reply_decoder: FamilyDecoder[DirectoryReply] = FamilyDecoder(DirectoryReply, "directory reply")
event_decoder: FamilyDecoder[DirectoryEvent] = FamilyDecoder(DirectoryEvent, "directory event")
