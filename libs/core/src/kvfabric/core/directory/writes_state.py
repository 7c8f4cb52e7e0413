"""The write table's state (`kvfabric.core.directory.writes`, where its states, invariants and
bounds are told): the building groups and their members' placements, the ticket index, the
deadline heap and the per-tenant pending counts, with the two helpers every phase uses to keep
the counts and the heap within their bounds. `WriteBegin`, `WriteConfirm` and `WriteTable` extend it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Final

from kvfabric.core.directory.base import HEAP_SLACK_MIN, Context, Member, scope_of
from kvfabric.core.directory.frees import FreeTable
from kvfabric.core.directory.keys import GroupInfo
from kvfabric.core.directory.published import PublishedTable
from kvfabric.core.directory.replicas import ReplicaTable
from kvfabric.core.directory.replies import ReplyCache
from kvfabric.core.directory.segments import SegmentTable
from kvfabric.format.ids import ChainHash, GroupKey, ObjectKey
from kvfabric.format.invariant import invariant

__all__ = ["BuildingGroup", "PendingMember", "Placement", "WriteState"]


@dataclass(slots=True)
class Placement:
    ticket_id: int
    placement: int  # interned (segment id, incarnation)
    slot: int = -1
    slot_generation: int = -1

    @property
    def confirmed(self) -> bool:
        return self.slot >= 0


@dataclass(slots=True)
class PendingMember:
    key: ObjectKey
    writer_id: str
    size_bytes: int
    checksum: bytes
    deadline_ms: int
    replicas_target: int
    placements: list[Placement]
    # the put_begin that placed it: another request of the same writer (a second save of the
    # same chunk while this one is written) gets `in_flight`, never these tickets (two slots
    # written for one placement, one of them then tracked by nothing)
    request_id: str = ""
    committed: bool = False


NO_PARENT: Final = ChainHash(b"")  # the first chunk of a prefix has no parent


@dataclass(slots=True)
class BuildingGroup:
    info: GroupInfo
    members: dict[Member, PendingMember] = field(default_factory=dict)
    parent: ChainHash = NO_PARENT  # the previous chunk's chain hash, as the first writer told it
    # Segments the admission filter refused this group on (its first member's put_begin): its
    # later members (other TP ranks) are placed without them too.
    refused_on: frozenset[str] = frozenset()


class WriteState:
    """What every phase of a put reads and writes (see `WriteTable`)."""

    def __init__(
        self,
        ctx: Context,
        segments: SegmentTable,
        published: PublishedTable,
        frees: FreeTable,
        replicas: ReplicaTable,
    ) -> None:
        self.ctx = ctx
        self.segments = segments
        self.published = published
        self.frees = frees
        self.replicas = replicas
        self.building: dict[GroupKey, BuildingGroup] = {}
        self._tickets: dict[int, tuple[GroupKey, Member]] = {}
        self._deadlines: list[tuple[int, GroupKey]] = []  # (deadline_ms, group key), one per member begun
        self.pending_objects = 0
        # tenant scope of the writer id -> its building members / the bytes they hold reserved
        self.scope_pending_objects: dict[str, int] = {}
        self.scope_pending_bytes: dict[str, int] = {}
        # Admitted by a put_begin running in steps (its bounds checked for the whole request at its
        # start) but not placed yet: every later request's bound checks count them too, so two
        # requests stepping at once cannot both pass a bound only one fits in. Zero between calls
        # of a whole request.
        self.reserved_objects = 0
        self.begins_in_steps = 0  # put_begins in steps holding a reservation (suspended between steps)
        self.scope_reserved_objects: dict[str, int] = {}
        self.scope_reserved_bytes: dict[str, int] = {}
        self.replies = ReplyCache(ctx.config.reply_cache_objects_max, ctx.count)

    def identity_of(self, gid: GroupKey) -> GroupInfo | None:
        """The identity of a group being written, if one is."""
        group = self.building.get(gid)
        return None if group is None else group.info

    def _exists(self, gid: GroupKey) -> bool:
        return gid in self.published.records or gid in self.frees.evicting

    def _bound_heap(self) -> None:
        if len(self._deadlines) > 2 * self.pending_objects + HEAP_SLACK_MIN:  # drop the stale entries
            self._deadlines = [
                (pm.deadline_ms, gid) for gid, g in self.building.items() for pm in g.members.values()
            ]
            heapq.heapify(self._deadlines)

    def _reserve_add(self, scope: str | None, objects: int, scope_objects: int, nbytes: int) -> None:
        """Adjust what put_begins in steps hold admitted but not placed (negative: placed or ended)."""
        self.reserved_objects += objects
        invariant(self.reserved_objects >= 0, "negative reserved objects")
        if scope is None:
            return
        for table, n in ((self.scope_reserved_objects, scope_objects), (self.scope_reserved_bytes, nbytes)):
            left = table.get(scope, 0) + n
            invariant(left >= 0, "negative tenant reserved count", scope=scope)
            if left:
                table[scope] = left
            else:
                table.pop(scope, None)

    def _pending_add(self, writer_id: str, objects: int, nbytes: int) -> None:
        """Adjust what a tenant's writer holds in building members (negative: given back)."""
        scope = scope_of(writer_id)
        if scope is None:
            return
        for table, n in ((self.scope_pending_objects, objects), (self.scope_pending_bytes, nbytes)):
            left = table.get(scope, 0) + n
            invariant(left >= 0, "negative tenant pending count", scope=scope)
            if left:
                table[scope] = left
            else:
                table.pop(scope, None)
