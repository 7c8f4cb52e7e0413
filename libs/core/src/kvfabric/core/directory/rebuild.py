"""Rebuilding a directory shard's index from what the segments hold (pure).

A new leader knows nothing but the segments' reports (`kvf.v1.segment.report`): for every
stored slot its key, (slot, generation), size and checksum. No durable record of publishes is
kept, so the rule that decides what was published is:

- A chunk group is **published** when every expected member (TP rank × PP stage × layer group,
  from the key) has at least one stored replica, and all replicas of each member agree on size
  and checksum. Segments only hold a slot as STORED after they checksummed its bytes against the
  writer's checksum (the ticket's, or a sent PUT's own; a staged put's bytes are the writer's
  pages), so a complete group is exactly one whose bytes were all written: at worst a group
  whose writer had not sent `put_commit` yet becomes visible (its bytes are whole; the writer's
  commit then answers `published`).
- Everything else is an **orphan**: members of incomplete groups, every replica of a group with
  a member whose replicas disagree (a ticket without a checksum can leave two slots of other
  bytes, one of them never committed, and nothing here tells which), slots whose key does not
  parse. Orphans are freed, after the grace period (see `DirectoryCore.adopt`).

Cost: zero writes on the publish path; a rebuild reads every segment's slot table once
(≈ 140 B per object over NATS, paged).

Garbage collector: a plan holds a record per stored object and per member and group, alive for
the whole adoption (`DirectoryCore.adopt_steps`, which yields the event loop between steps), so
a full cyclic-GC collection landing in one of those steps walks every tracked one of them. As
slotted dataclasses, lists and tuples they were ~4.5 tracked objects per stored object, a full
collection of ~0.7 s at 500,000 objects (docs/directory.md, garbage collector). The records are
msgspec Structs declared `gc=False` (never tracked: their type has no GC support at all), a
member's replicas a tuple of them (CPython stops tracking such a tuple at its first
collection), a group's members a dict keyed by an int (`member_code`), so that dict, like the
dict of groups, never holds a tracked key or value and CPython never tracks it. An untracked
object in a reference cycle would never be freed; these cannot be in one: a `HeldReplica`
refers only to str, int and bytes, a `RebuiltMember` to ints, bytes and a tuple of
`HeldReplica`, a `RebuiltGroup` to bytes, ints and a dict of int to `RebuiltMember`: nothing
they reach refers back to a record.
"""

from __future__ import annotations

import heapq
from collections.abc import Generator, Sequence
from dataclasses import dataclass

import msgspec

from kvfabric.core.directory.keys import parse_key
from kvfabric.core.directory.records import MEMBER_REPLICAS_MAX
from kvfabric.format.errors import BadRequest
from kvfabric.format.ids import GroupKey, Namespace, ObjectKey
from kvfabric.proto import directory as m
from kvfabric.proto.segment import HeldObject

__all__ = [
    "HeldReplica",
    "RebuildPlan",
    "RebuiltGroup",
    "RebuiltMember",
    "SegmentHolding",
    "member_code",
    "plan_rebuild",
    "plan_rebuild_steps",
]

CHECKSUM_BYTES = 16


@dataclass(frozen=True, slots=True)
class SegmentHolding:
    """One segment as a new leader found it: its registration and what it stores."""

    registration: m.RegisterSegment
    objects: Sequence[HeldObject]


class HeldReplica(msgspec.Struct, frozen=True, gc=False):
    """One stored slot of a segment (never GC-tracked: module docstring)."""

    segment_id: str
    incarnation: int
    slot: int
    slot_generation: int
    size_bytes: int
    key: ObjectKey


class RebuiltMember(msgspec.Struct, frozen=True, gc=False):
    """One member of a group and its agreeing replicas, in slot order per segment (never
    GC-tracked: module docstring)."""

    tp_rank: int
    pp_stage: int
    layer_group: int
    size_bytes: int
    checksum: bytes
    replicas: tuple[HeldReplica, ...]


class RebuiltGroup(msgspec.Struct, frozen=True, gc=False):
    """One chunk group's identity (`GroupInfo`'s fields, flat: a `GroupInfo` is a tracked
    object) and its members by `member_code` (never GC-tracked: module docstring)."""

    group_id: GroupKey
    namespace: Namespace
    chunk_index: int
    expected_members: int
    members: dict[int, RebuiltMember]


def member_code(tp_rank: int, pp_stage: int, layer_group: int) -> int:
    """A member as one int, ordered as its (tp_rank, pp_stage, layer_group) tuple: each is below
    `GROUP_MEMBERS_MAX` (< 2**8; `parse_key` refuses larger groups), so no two members share a
    code. An int key, unlike a fresh tuple, never makes a dict tracked."""
    return (tp_rank << 16) | (pp_stage << 8) | layer_group


@dataclass(slots=True)
class RebuildPlan:
    # group key (domain digest + chain hash) -> the group, complete groups only
    groups: dict[GroupKey, RebuiltGroup]
    orphans: list[HeldReplica]


def plan_rebuild(holdings: Sequence[SegmentHolding]) -> RebuildPlan:
    """The plan of `holdings` in one call (`plan_rebuild_steps` run to its end)."""
    steps = plan_rebuild_steps(holdings, None)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            plan: RebuildPlan = done.value
            return plan


def plan_rebuild_steps(
    holdings: Sequence[SegmentHolding], objects_max: int | None
) -> Generator[None, object, RebuildPlan]:
    """`plan_rebuild` in steps of about `objects_max` objects each (None: one step), yielding
    between them, the plan returned at the end: the same plan whatever the step (each segment's
    objects are sorted a slice a step, then merged, stably, as one sort would order them). Only
    this generator holds what it builds, so nothing can change it between steps. A shard of
    1,000,000 objects is ~25 s of this and `DirectoryCore.adopt`: in one call it held the event
    loop past the leader lease (review, stop 71)."""
    step = objects_max or max(1, sum(len(h.objects) for h in holdings))
    candidates: dict[GroupKey, RebuiltGroup] = {}
    orphans: list[HeldReplica] = []
    disputed: set[GroupKey] = set()  # a member's replicas disagree: nothing of the group is trusted
    ordered = sorted(holdings, key=lambda h: h.registration.segment_id)
    seen = 0
    for holding in ordered:
        reg = holding.registration
        runs = []
        for start in range(0, len(holding.objects), step):
            runs.append(sorted(holding.objects[start : start + step], key=_slot))
            yield
        for obj in heapq.merge(*runs, key=_slot):
            seen += 1
            if seen % step == 0:
                yield
            replica = HeldReplica(
                reg.segment_id, reg.incarnation, obj.slot, obj.slot_generation, obj.size_bytes, obj.key
            )
            try:
                info = parse_key(obj.key)
            except BadRequest:
                orphans.append(replica)
                continue
            if obj.size_bytes <= 0 or len(obj.checksum) != CHECKSUM_BYTES:
                orphans.append(replica)
                continue
            group = info.group
            gid = group.group_id
            known = candidates.get(gid)
            if known is None:
                known = candidates[gid] = RebuiltGroup(
                    gid, group.namespace, group.chunk_index, group.expected_members, {}
                )
            elif (known.namespace, known.chunk_index, known.expected_members) != (
                group.namespace,
                group.chunk_index,
                group.expected_members,
            ):  # one group key, two identities: keep the first
                orphans.append(replica)
                continue
            code = member_code(*info.member)
            member = known.members.get(code)
            if member is None:
                known.members[code] = RebuiltMember(*info.member, obj.size_bytes, obj.checksum, (replica,))
                continue
            if (member.size_bytes, member.checksum) != (obj.size_bytes, obj.checksum):
                # Which one the writer committed is not known here (a segment's hash may be the
                # object's checksum: ObjectSpec.checksum), so neither is adopted.
                orphans.append(replica)
                disputed.add(gid)
                continue
            if len(member.replicas) >= MEMBER_REPLICAS_MAX:
                # a record holds at most this many: past it, adopted, packing the record raised
                # InvariantViolation and every instance adopting the shard stopped (review, stop
                # 67; the copies come from begin/PUT/abort loops); the rest are orphans
                orphans.append(replica)
                continue
            # a new tuple (at most MEMBER_REPLICAS_MAX long): a list would stay tracked
            known.members[code] = msgspec.structs.replace(member, replicas=(*member.replicas, replica))
    groups = {}
    weighed = 0  # a candidate, and each replica it orphans
    for gid, candidate in candidates.items():
        weighed += 1
        if len(candidate.members) == candidate.expected_members and gid not in disputed:
            groups[gid] = candidate
        else:  # incomplete (its writer never finished, or a member's only copy died) or disputed
            before = len(orphans)
            orphans.extend(r for mem in candidate.members.values() for r in mem.replicas)
            weighed += len(orphans) - before
        if weighed >= step:
            weighed = 0
            yield
    return RebuildPlan(groups, orphans)


def _slot(obj: HeldObject) -> int:
    return obj.slot
