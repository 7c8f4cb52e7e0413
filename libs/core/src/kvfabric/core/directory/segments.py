"""The segments table: which segment processes are up, what each holds reserved, and the
interned placements (segment id, incarnation) every record names.

## States of a segment (one entry per segment id: its latest incarnation)
    (absent) --register--> UP --heartbeat (draining flag)--> UP / UP draining
    UP --heartbeat_timeout passed / registered again with a newer incarnation--> DOWN
    DOWN --register with a newer incarnation--> UP (a new entry: it restarted empty)
A DOWN incarnation never comes back: a register or heartbeat naming it, or an older one, is
`StaleGeneration`. Placing skips DOWN and draining segments (`candidates`).

## Placements
A placement is an index into a list of (segment id, incarnation) pairs, interned once and never
removed (records store the index: 4 bytes, `records`). A placement is live while its
segment's entry is UP with that incarnation; everything stored on a dead one is gone with it.

## Invariants (`check_invariants`; the core checks the sums across tables)
1. The placement list and its index are one bijection.
2. A DOWN segment reserves nothing; an UP one reserves ≥ 0 bytes: exactly the sizes of the live
   placements in its arena that the write, published, free and replica tables hold (checked by
   the core through `check_reserved`: a disk-tier replica reserves no arena bytes).

## Bounds
One entry per segment id ever registered; placements grow by one per (id, incarnation).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from kvfabric.core.directory.base import Context, Effect, EmitEvent, Outcome
from kvfabric.core.directory.records import ReplicaRecord
from kvfabric.core.placement import Candidate
from kvfabric.core.quotas import Tenant
from kvfabric.format.errors import BadRequest, NotFound, StaleGeneration
from kvfabric.format.invariant import invariant
from kvfabric.proto import directory as m
from kvfabric.proto.segment import HeldObject, tier_of_slot
from kvfabric.proto.tickets import read_token

__all__ = ["Segment", "SegmentTable", "arena_bytes_of"]


def arena_bytes_of(objects: Iterable[HeldObject]) -> int:
    """The arena bytes these stored objects take (disk-tier ones take none: docs/segment.md)."""
    return sum(o.size_bytes for o in objects if tier_of_slot(o.slot) == "dram")


@dataclass(slots=True)
class Segment:
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


# What the core does when a segment incarnation is lost (its placements die in every table).
LostHandler = Callable[[Segment, str, list[Effect]], None]


class SegmentTable:
    def __init__(self, ctx: Context, lost: LostHandler) -> None:
        self.ctx = ctx
        self.segments: dict[str, Segment] = {}
        self._placements: list[tuple[str, int]] = []
        self._placement_index: dict[tuple[str, int], int] = {}
        self._lost = lost
        self._last_tick_ms: int | None = None  # `tick`'s, for the time a deaf directory missed
        # The longest segment id and data address ever registered (UTF-8 bytes): an upper bound
        # of what a ticket or replica names, for the reply bounds.
        self.segment_id_bytes_max = 0
        self.data_addr_bytes_max = 0

    # ---- verbs ---------------------------------------------------------------------------

    def register(self, req: m.RegisterSegment, now_ms: int) -> Outcome:
        self.ctx.check_epoch(req.epoch)
        if req.capacity_bytes <= 0 or not req.segment_id:
            raise BadRequest("segment needs an id and a positive capacity")
        effects: list[Effect] = []
        seg = self.segments.get(req.segment_id)
        if seg is not None:
            if req.incarnation < seg.incarnation or (req.incarnation == seg.incarnation and not seg.up):
                # An old process, or one declared down that must restart empty with a new incarnation.
                self.ctx.count("stale_incarnation_rejected_total")
                raise StaleGeneration("segment_incarnation", req.incarnation, seg.incarnation + 1)
            if req.incarnation == seg.incarnation:  # idempotent re-register
                seg.last_heartbeat_ms = now_ms
                return Outcome(self._registered())
            if seg.up:  # (one already declared down was lost then: no second loss, no second event)
                self._lost(seg, "restarted", effects)
        self._note_text(req.segment_id, req.data_addr)
        self.segments[req.segment_id] = Segment(
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

    def heartbeat(self, req: m.Heartbeat, now_ms: int) -> Outcome:
        self.ctx.check_epoch(req.epoch)
        seg = self.live_segment(req.segment_id, req.incarnation)
        seg.last_heartbeat_ms = now_ms
        seg.reported_used_bytes = req.used_bytes
        seg.draining = req.draining
        return Outcome(m.HeartbeatAck(epoch=self.ctx.epoch))

    def tick(self, now_ms: int, effects: list[Effect], *, deaf: bool = False) -> None:
        """Silent segments (no heartbeat for `heartbeat_timeout_ms`) are lost. Not while the
        directory is `deaf` (its NATS connection down: no heartbeat could arrive): then every up
        segment's silence is shifted by the time since the last tick. Review, 2026-12-05: on a
        NATS cluster a leader keeps acting for 12.5 s, longer than the 5 s heartbeat timeout, and
        a disconnect of that long declared every segment down, each then restarting empty (the
        whole cache lost). The shell ticks `deaf` too after its event loop stalled (a tick 1 s or
        more late: docs/directory-ha.md)."""
        last, self._last_tick_ms = self._last_tick_ms, now_ms
        if deaf:
            shift_ms = now_ms - last if last is not None else 0
            for seg in self.segments.values():
                if seg.up:
                    seg.last_heartbeat_ms = min(now_ms, seg.last_heartbeat_ms + shift_ms)
            self.ctx.count("segment_silence_excused_total")
            return
        for seg in self.segments.values():
            if seg.up and now_ms - seg.last_heartbeat_ms > self.ctx.config.heartbeat_timeout_ms:
                self.ctx.count("segments_down_total")
                self._lost(seg, "heartbeat_timeout", effects)

    def mark_down(self, seg: Segment, reason: str, effects: list[Effect]) -> None:
        """This incarnation is gone, and its reservations with it (the first step of a loss)."""
        seg.up = False
        seg.reserved_bytes = 0
        effects.append(
            EmitEvent(
                "segment_down",
                m.SegmentDown(segment_id=seg.segment_id, incarnation=seg.incarnation, reason=reason),
            )
        )

    def adopt(self, reg: m.RegisterSegment, arena_bytes: int, now_ms: int) -> None:
        """A segment as a new leader found it: up, reserving `arena_bytes`, what its arena holds
        (`arena_bytes_of` its objects, summed a slice at a time by `DirectoryCore.adopt_steps`;
        freed orphans give it back)."""
        seg = Segment(reg.segment_id, reg.incarnation, reg.domain, reg.capacity_bytes, reg.data_addr, now_ms)
        seg.reserved_bytes = arena_bytes
        self.segments[reg.segment_id] = seg
        self._note_text(reg.segment_id, reg.data_addr)

    def heard_at(self, now_ms: int) -> None:
        """Every segment counts as heard at `now_ms`: a stepped adoption ends (the new core heard
        nothing while it was built; its first tick must not take that silence for theirs)."""
        for seg in self.segments.values():
            seg.last_heartbeat_ms = max(seg.last_heartbeat_ms, now_ms)

    def _note_text(self, segment_id: str, data_addr: str) -> None:
        self.segment_id_bytes_max = max(self.segment_id_bytes_max, len(segment_id.encode()))
        self.data_addr_bytes_max = max(self.data_addr_bytes_max, len(data_addr.encode()))

    def _registered(self) -> m.SegmentRegistered:
        return m.SegmentRegistered(
            epoch=self.ctx.epoch,
            heartbeat_interval_ms=self.ctx.config.heartbeat_interval_ms,
            heartbeat_timeout_ms=self.ctx.config.heartbeat_timeout_ms,
        )

    def live_segment(self, segment_id: str, incarnation: int) -> Segment:
        """The segment a request comes from, if that incarnation is up (else the request is refused)."""
        seg = self.segments.get(segment_id)
        if seg is None or not seg.up:
            raise NotFound(f"segment {segment_id!r} is not registered: register again", segment_id=segment_id)
        if incarnation != seg.incarnation:
            self.ctx.count("stale_incarnation_rejected_total")
            raise StaleGeneration("segment_incarnation", incarnation, seg.incarnation)
        return seg

    # ---- placements ----------------------------------------------------------------------

    def intern(self, segment_id: str, incarnation: int) -> int:
        key = (segment_id, incarnation)
        idx = self._placement_index.get(key)
        if idx is None:
            idx = len(self._placements)
            self._placements.append(key)
            self._placement_index[key] = idx
        return idx

    def find(self, segment_id: str, incarnation: int) -> int | None:
        """The placement of this incarnation if it was ever interned."""
        return self._placement_index.get((segment_id, incarnation))

    def where(self, placement: int) -> tuple[str, int]:
        """(segment id, incarnation) of a placement."""
        return self._placements[placement]

    def any_draining(self) -> bool:
        """Some segment that is up drains (its replicas are readable but do not count)."""
        return any(seg.up and seg.draining for seg in self.segments.values())

    def live(self, placement: int) -> bool:
        return self.segment_of(placement) is not None

    def segment_of(self, placement: int) -> Segment | None:
        """The segment of a placement while that incarnation is up; its reservations live there."""
        segment_id, incarnation = self._placements[placement]
        seg = self.segments.get(segment_id)
        return seg if seg is not None and seg.up and seg.incarnation == incarnation else None

    def release(self, placement: int, size_bytes: int, tenant: Tenant) -> None:
        """A reservation that stored nothing goes back (and the tenant's bytes with it)."""
        self.ctx.quotas.add(tenant, -size_bytes)
        seg = self.segment_of(placement)
        if seg is not None:
            seg.reserved_bytes -= size_bytes
            invariant(seg.reserved_bytes >= 0, "negative reservation", segment=seg.segment_id)

    def release_freed(self, segment_id: str, incarnation: int, slot: int, size_bytes: int) -> None:
        """A slot the segment freed: its arena bytes go back (a disk-tier slot reserved none)."""
        seg = self.segments.get(segment_id)
        if seg is not None and seg.incarnation == incarnation and seg.up and tier_of_slot(slot) == "dram":
            seg.reserved_bytes -= size_bytes
            invariant(seg.reserved_bytes >= 0, "negative reservation", segment=seg.segment_id)

    def candidates(self) -> list[Candidate]:
        """The segments a new object may be placed on, with their free bytes as placement sees them."""
        shared = self.ctx.config.segments_shared
        granules = self.ctx.config.free_bytes_granules
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

    def capacity_up_bytes(self) -> int:
        return sum(s.capacity_bytes for s in self.segments.values() if s.up)

    def replica(self, r: ReplicaRecord, size_bytes: int = 0, read_expires_ms: int = 0) -> m.Replica:
        """Where a replica is; with `read_expires_ms`, also the token that lets its holder read it
        until then (segments refuse reads without one: no lease, no bytes)."""
        segment_id, incarnation = self._placements[r.placement]
        token = b""
        if read_expires_ms:
            token = read_token(
                self.ctx.config.ticket_secret,
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

    # ---- checks --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        invariant(len(self._placements) == len(self._placement_index), "placement index drift")
        for idx, key in enumerate(self._placements):
            invariant(self._placement_index[key] == idx, "placement index drift")
        for seg in self.segments.values():
            invariant(
                seg.up or seg.reserved_bytes == 0, "a down segment reserves bytes", segment=seg.segment_id
            )
            invariant(seg.reserved_bytes >= 0, "negative reservation", segment=seg.segment_id)

    def check_reserved(self, want: Mapping[str, int]) -> None:
        """Every up segment reserves exactly what the other tables hold on it (`want`)."""
        for seg in self.segments.values():
            if seg.up:
                invariant(
                    seg.reserved_bytes == want.get(seg.segment_id, 0),
                    "reservation drift",
                    segment=seg.segment_id,
                    have=seg.reserved_bytes,
                    want=want.get(seg.segment_id, 0),
                )
