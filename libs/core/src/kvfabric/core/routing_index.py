"""Where prefix chunks can be had in kvfabric: the router's index, fed by the directory's events.

Synchronous and I/O-free. The router's shell reads the directory's JetStream event stream
(`KVF_DIRECTORY_EVENTS`, every subject of it, so stream sequences arrive contiguous) and calls
`apply(seq, event)`; on a gap it lists the directory and calls `resync`. One entry stands for
them all: `step(event, now_ms)` (`kvfabric.core.step`; the events in
`kvfabric.core.routing_index_events`).

## What it holds
Only the groups of its share domain (`domain`: the one the router keys prompts in), when given.
- `groups`: group key (16-byte share domain digest + 32-byte chain hash, as the events name a
  group) -> `GroupEntry` (chunk index, bytes of one copy, the segments holding a replica).
- `segments`: segment id -> incarnation of the segments known to be up.
- A reverse index segment -> group keys of its live replicas, so a `segment_down` costs
  O(its groups), and that is spent in slices: the segment leaves `segments` at once and its
  keys move to `_dead[segment]` (its *dead* replicas); `sweep` takes them out of their groups
  `SWEEP_KEYS_PER_CALL` at a time, called by the shell between event batches until none is
  left (100,000 groups walked at once stalled the router's loop 230-290 ms). Meanwhile a dead
  replica counts for nothing (`live_replicas`, `available_run`: a group with no live one is
  not available). A segment back up under the same id (a restart: a new incarnation, its
  `segment_down` and `segment_up` one after the other) needs no sweep first: a dead replica is
  (segment, key), so a group published again on the new incarnation is live there.

A chunk is *available* when its group is published and one of its replicas is on a segment
that is up. Replicas added later by repair or prefetch have no event: the index learns them at
the next resync only (it under-counts, never over-counts, a replica that exists). One exception,
while `resync_wanted` (below): between a `shard_started` marker (or `leader_changed`) and the
swap of the listing it asks for, the index may also over-count, by exactly what it cannot know:
a group whose eviction (or a replica whose loss) the shard's previous core never published, and
what the new core's rebuild lost (a segment that missed its report) without an event. Every
event published meanwhile is applied as usual.

## Events (`apply`)
    published(domain, chain, placements) --> the group, replicas = the segments of `placements`
                                              on segments up (set, not union: the latest wins)
    published_many(groups)                --> each as a `published`, in order (one commit's
                                              groups: one event, one sequence)
    evicted / invalidated(domain, chain)  --> the group is gone (an empty domain: every domain's
                                              group with that chain hash)
    segment_down(segment, incarnation)    --> the segment leaves `segments` and every group; a
                                              group left without replicas is gone (ignored for
                                              an incarnation older than the one known up; the
                                              groups in slices, `sweep`: above)
    segment_up(segment, incarnation)      --> known up; a newer incarnation holds nothing until
                                              events say so (a segment comes back empty,
                                              docs/directory.md); the same one again (every
                                              shard announces a registration) changes nothing
    accessed / under_replicated           --> nothing (no change of where chunks are)
    shard_started(shard, epoch)           --> `resync_wanted`: list again, still answering. A
                                              shard's new core (a new leader's, or a rebuild's
                                              at the same epoch) may follow one that stopped
                                              with events unpublished (no sequence: no gap shows
                                              them), and its rebuild emits nothing for what it
                                              adopted or lost

## Late events of a replaced core: fenced
`apply(seq, event, origin)`: `origin` is the (shard, epoch) the event's NATS header names
(`kvfabric.proto.directory.shard_epoch_of`; a `shard_started`'s own fields when it has none). An
old core's events can land after its successor's `shard_started` (a handover drains them while
its lease is released; nats-py may flush a cancelled publish on reconnect): applied after the
listing the marker asked for, they left the index holding a group the directory no longer has,
or missing one it has, with no marker after them. `fence` (`kvfabric.core.shard_fence`: per
shard, the highest epoch seen, never lowered) answers "fenced" for an event naming a lower epoch
than its shard's highest: in sequence (`last_seq` moves on), not applied, counted
`events_fenced`; a stale marker too (it asks for no listing). An event without the header (an
older directory) is applied as before. A view being built shares the served view's fence, so an
event replayed onto it (`resync_replay`) is fenced as the fence stands then (one that preceded
its successor's marker may be dropped in the replay: the marker, replayed after it, asks for a
listing again). The follower raises the fence to a gap
listing's shard-map epochs (`fence.raise_to`): markers among the events lost are not seen.

## Sequences: resume, duplicates, gaps
`last_seq` is the stream sequence of the last event applied (0: none).
    seq <= last_seq        --> "duplicate": ignored (a redelivery after a consumer restart)
    seq == last_seq + 1    --> "applied"; or "fenced" (above): `last_seq` = seq, nothing applied
    seq >  last_seq + 1    --> "gap": nothing applied, `synced` becomes False; the shell lists
                               the directory and calls `resync(listing, at_seq=S)` where S is
                               the stream's last sequence read *before* the listing started,
                               then resumes the stream at S + 1.
Replaying S+1.. over a listing taken at or after S converges to the directory's state: every
event sets (published), removes (evicted, invalidated, segment_down) or marks (segment_up),
so applying one whose effect the listing already shows changes nothing once the later events
for the same group or segment are applied too (tested against a model: `test_routing_index`).
`check_stream(first_seq, last_seq, created)` catches what no delivery shows: events aged out or
purged before the follower read them, and a recreated stream (sequences restarted: new events
would look like duplicates, or name another stream's events; `kvfabric.core.stream_bounds`).
Until the first `resync` (or an `apply` of seq 1 on a fresh index) `synced` is False and the
router counts no kvfabric tokens at all (`available_run` answers 0): an index that may miss
evictions never promises a load. So after a gap: events of any kind are missing.

## Stale, not blank: `resync_wanted`
A `shard_started` marker (and `leader_changed`: the shard map's epochs, for a directory that
sends no marker) says only that one shard's unpublished events and its rebuild's changes are
unknown; the rest of the index is as good as before. Blanking it (not `synced`, as until
2026-12-07) cost every router its kvfabric counts for a whole listing (seconds at 400k groups)
at every shard start: each of 16+ shards starting one at a time after a failover or a cold
start, and every same-epoch rebuild for a missing segment. Now the index stays `synced`,
answers and follows events, and sets `resync_wanted` (the over-count above is the price). The
shell lists while it keeps following and paces those listings (`StaleResyncPacing`: a burst
of markers, one listing). `resync_done` sets `resync_wanted` to the new view's own: a marker
after `at_seq` replayed on it asks again (its shard may have been listed before it started).
A gap, a lost stream, or a stale index whose listing kept failing for `STALE_MAX_MS` (`unsync`)
still blanks: those may hide anything.

## Building a view beside the served one (`resync_start` .. `resync_done`)
    token = resync_start(segments, at_seq)   a new view, the listing's, as of stream sequence
                                             `at_seq` (read before the listing started); an
                                             index not `synced` drops its served view at once
    resync_add(token, groups)                some of the listing's groups into it (in slices)
    resync_replay(token, seq, event)         an event after `at_seq` applied to it (`apply`'s
                                             answer), not to the view served
    resync_done(token)                       swapped in: `last_seq` is the new view's own
    resync_abort(token)                      dropped (its listing failed or is moot)
Each listing has its own *build token*. A `resync_start` replaces a view still being built (a
gap during a stale listing: the shell lists again), and every call naming an older token is
ignored and counted (`resync_stale_writes`): a listing's task left running after the shell gave
it up (Python 3.11's `wait_for` can swallow its cancellation for a whole request timeout) can
never write into, swap in or drop another listing's view (review, 2026-12-07: it could, and a
view mixing two listings was swapped in).

A synced index is never swapped *back*: `resync_done` refuses (False, counted `resyncs_behind`)
a view whose `last_seq` is below the served one's. The events between the listing's `at_seq`
and the served view's `last_seq` were applied to the served view, but the listing need not show
them (each shard is listed at its own moment, maybe before an eviction or a `segment_down`
among them): swapped in as of `at_seq` (as until 2026-12-07) the new view counted those groups
again, trusted (synced, heard from) until the replay reached them. The shell replays them onto
the new view first (`resync_replay`, from the stream), so the view served never goes back. The
alternative, swapping at once and reporting the index not current until the replay passed the
old view's sequence, would blank routing: a router's only "not current" counts no kvfabric
tokens at all (`RoutingCore.index_usable`). `resync` (one call: a listing replacing everything,
the gap path) drops the served view first, as not `synced`, and so may set `last_seq` anywhere.

## Invariants (`check_invariants`)
- every group has >= 1 replica; a replica is dead (its key in `_dead[segment]`) or on a
  segment in `segments` and in the reverse index, never both;
- the reverse index holds exactly the live (segment, group) pairs of `groups`; every dead key
  names a group holding that replica;
- a view being built (`resync_start` .. `resync_done`) holds the same of its own (its dead
  replicas only from a `segment_down` replayed on it: a listing names live ones);
- while `synced`, `last_seq` never decreases (`resync_done` swaps in no view behind it;
  `resync` first drops the view served, as not `synced`);
- caught up (every event applied) with no gap, it holds exactly the directory's groups, and
  while `resync_wanted` differs from them only in the groups the exception above names (the
  model test, `tests/unit/core/test_routing_index.py`: a handover that drops an eviction or a
  publication).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from kvfabric.core import routing_index_events
from kvfabric.core.routing_index_events import RoutingIndexEvent, RoutingIndexOutput
from kvfabric.core.shard_fence import ShardEpochFence
from kvfabric.core.step import not_before
from kvfabric.core.stream_bounds import StreamBounds
from kvfabric.format.ids import (
    CHAIN_HASH_BYTES,
    DOMAIN_DIGEST_BYTES,
    NAMESPACE_BYTES,
    ChainHash,
    DomainDigest,
    GroupKey,
    chain_in_group_key,
    domain_in_id,
    pack_group_key,
)
from kvfabric.format.invariant import invariant
from kvfabric.proto import directory as m

__all__ = [
    "DOMAIN_BYTES",
    "GroupEntry",
    "ListedGroup",
    "ListedSegment",
    "RoutingIndex",
    "StaleResyncPacing",
    "group_key",
]

DOMAIN_BYTES: Final = DOMAIN_DIGEST_BYTES
CHAIN_BYTES: Final = CHAIN_HASH_BYTES

ApplyResult = Literal["applied", "duplicate", "gap", "fenced"]
# Dead replicas taken out per `sweep` call (the shell's slice between turns of its loop): ~2.5 us
# each.
SWEEP_KEYS_PER_CALL: Final = 1_024
# The pacing of a stale index's listings (`StaleResyncPacing`). Shards start one at a time
# (a failover or cold start of 16+, each rebuild ~1 s): a listing waits for the markers to stop
# for STALE_QUIET_MS, but never past STALE_WAIT_MAX_MS after the first (a steady stream would
# postpone it for good), and starts at least STALE_INTERVAL_MS after the end of the one before
# (a listing of 400k groups takes seconds of every shard's time and of the router's loop).
STALE_QUIET_MS: Final = 1_000
STALE_WAIT_MAX_MS: Final = 5_000
STALE_INTERVAL_MS: Final = 3_000
# A stale index whose listing has not succeeded this long after it was first wanted (the
# directory failing to list) is no longer trusted: not `synced` (the over-count is bounded).
STALE_MAX_MS: Final = 60_000


def group_key(domain: bytes, chain: bytes) -> GroupKey:
    """The 48-byte name of a group in the events: share domain digest + chain hash."""
    invariant(len(domain) == DOMAIN_BYTES and len(chain) == CHAIN_BYTES, "group key parts", d=len(domain))
    return pack_group_key(DomainDigest(domain), ChainHash(chain))


@dataclass(slots=True)
class GroupEntry:
    chunk_index: int
    copy_bytes: int  # bytes of one copy of the group (its members' sizes summed)
    replicas: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class ListedSegment:
    segment_id: str
    incarnation: int
    up: bool


@dataclass(frozen=True, slots=True)
class ListedGroup:
    """One published group of a directory listing (`list_groups` with objects)."""

    domain: bytes
    chain: bytes
    chunk_index: int
    copy_bytes: int
    segments: frozenset[str]


class RoutingIndex:
    def __init__(self, domain: bytes | None = None) -> None:
        # The share domain the router keys prompts in (None: every domain, tests): other
        # domains' groups are never looked up, and held they cost memory and sweeps with other
        # tenants' traffic (review, stop 67); the listing the shell resyncs from is of it only.
        invariant(domain is None or len(domain) == DOMAIN_BYTES, "a share domain digest", d=domain)
        self.domain = domain
        self.groups: dict[bytes, GroupEntry] = {}  # by group key (looked up with plain bytes too)
        self.segments: dict[str, int] = {}
        self._by_segment: dict[str, set[GroupKey]] = {}
        self._by_chain: dict[bytes, set[GroupKey]] = {}  # chain hash -> group keys (every domain held)
        # dead replicas not swept yet: segment (down, or up again under a new incarnation) ->
        # keys of groups still naming it from before
        self._dead: dict[str, set[GroupKey]] = {}
        self.last_seq = 0
        self.synced = False
        # A shard's marker (or a newer leader) since the last listing: list again, still serving
        self.resync_wanted = False
        self._building: RoutingIndex | None = None  # the listing's view, `resync_start`..`resync_done`
        self._build_token = 0  # the token of the latest `resync_start` (that of `_building`)
        self.bounds = StreamBounds()  # the stream's creation time as last seen
        # Per shard, the highest epoch an event named: an older core's late event is fenced
        # (`apply`). One for the index: a view being built shares the served one's.
        self.fence = ShardEpochFence()
        self.counters: dict[str, int] = {
            "events_applied": 0,
            "events_duplicate": 0,
            "gaps": 0,
            "resyncs": 0,
            "events_foreign": 0,  # published groups without a namespace (old directories)
            "events_other_domain": 0,  # published groups of another share domain: not held
            "leader_changes": 0,  # resyncs asked because a shard's leader changed (`leader_changed`)
            "shard_starts": 0,  # resyncs asked by a shard's `shard_started` event (replays too)
            "stale_expired": 0,  # stale indexes no longer trusted, their listing failing (`unsync`)
            "events_fenced": 0,  # a replaced shard core's late events, not applied (replays too)
            "resync_stale_writes": 0,  # calls naming a listing's view no longer built: ignored
            "resyncs_behind": 0,  # views refused, behind a synced index (`resync_done`)
        }
        self._step_ms = 0  # the latest time given to `step`

    def step(self, event: RoutingIndexEvent, now_ms: int) -> list[RoutingIndexOutput]:
        """The one entry (`kvfabric.core.step`): `event` as the method of the same meaning
        (`Apply` and `CheckStream` answer one `Reply`). Nothing here depends on the time, but
        time going backwards is refused as by every core."""
        self._step_ms = not_before(self._step_ms, now_ms)
        return routing_index_events.dispatch(self, event)

    # ---- events --------------------------------------------------------------------------

    def apply(self, seq: int, event: m.DirectoryEvent, origin: tuple[int, int] | None = None) -> ApplyResult:
        """The event at stream sequence `seq`; `origin` the (shard, epoch) its header names
        (`kvfabric.proto.directory.shard_epoch_of`; None: none, or a `ShardStarted`'s own)."""
        invariant(seq >= 1, "stream sequences start at 1", seq=seq)
        if seq <= self.last_seq:
            self.counters["events_duplicate"] += 1
            return "duplicate"
        if seq != self.last_seq + 1:
            self.counters["gaps"] += 1
            self.synced = False
            return "gap"
        if seq == 1:
            self.synced = True  # the whole history from the stream's first event
        self.last_seq = seq
        if origin is None and isinstance(event, m.ShardStarted):
            origin = (event.shard, event.epoch)
        if not self.fence.admit(origin):  # a replaced core's late event: in sequence, not applied
            self.counters["events_fenced"] += 1
            return "fenced"
        self.counters["events_applied"] += 1
        self._apply(event)
        return "applied"

    def _apply(self, event: m.DirectoryEvent) -> None:
        if isinstance(event, m.GroupPublished):
            self._published(event)
        elif isinstance(event, m.GroupsPublished):  # one commit's groups, under one sequence
            for published in event.groups:
                self._published(published)
        elif isinstance(event, m.GroupEvicted | m.GroupInvalidated):
            if len(event.domain) == DOMAIN_BYTES:
                self._remove(pack_group_key(event.domain, event.group))
            else:
                for known_key in list(self._by_chain.get(event.group, ())):
                    self._remove(known_key)
        elif isinstance(event, m.SegmentDown):
            known = self.segments.get(event.segment_id)
            if known is not None and event.incarnation >= known:
                self._segment_down(event.segment_id)
        elif isinstance(event, m.SegmentUp):
            known = self.segments.get(event.segment_id)
            if known is not None and event.incarnation <= known:
                return  # every shard announces a registration: the same incarnation again
            if known is not None:
                self._segment_down(event.segment_id)  # a new incarnation holds nothing yet
            self.segments[event.segment_id] = event.incarnation
        elif isinstance(event, m.ShardStarted):
            # What the shard's core before it left unpublished is gone without a gap, but only
            # that shard's (and what its rebuild changed): list again, answering meanwhile.
            self.counters["shard_starts"] += 1
            self.resync_wanted = True

    def _published(self, event: m.GroupPublished) -> None:
        if len(event.namespace) != NAMESPACE_BYTES or len(event.group) != CHAIN_BYTES:
            self.counters["events_foreign"] += 1
            return
        domain = domain_in_id(event.namespace)
        if self.domain is not None and domain != self.domain:
            self.counters["events_other_domain"] += 1
            return
        key = group_key(domain, event.group)
        # One copy's bytes (an older directory sends none: the largest placement, which a
        # segment holding a member twice, arena and disk, overstates)
        copy_bytes = event.group_bytes or max((p.bytes for p in event.placements), default=0)
        self._set(key, event.chunk_index, copy_bytes, {p.segment_id for p in event.placements})

    def _set(self, key: GroupKey, chunk_index: int, copy_bytes: int, segments: set[str]) -> None:
        self._remove(key)
        live = {s for s in segments if s in self.segments}
        if not live:
            return
        self.groups[key] = GroupEntry(chunk_index, copy_bytes, live)
        self._by_chain.setdefault(chain_in_group_key(key), set()).add(key)
        for seg in live:
            self._by_segment.setdefault(seg, set()).add(key)

    def _remove(self, key: GroupKey) -> None:
        entry = self.groups.pop(key, None)
        if entry is None:
            return
        chain = chain_in_group_key(key)
        keys = self._by_chain[chain]
        keys.discard(key)
        if not keys:
            del self._by_chain[chain]
        for seg in entry.replicas:
            dead = self._dead.get(seg)
            if dead is not None and key in dead:  # a dead replica: not in the reverse index
                dead.discard(key)
                if not dead:
                    del self._dead[seg]
                continue
            held = self._by_segment[seg]
            held.discard(key)
            if not held:
                del self._by_segment[seg]

    def _segment_down(self, segment_id: str) -> None:
        """The segment leaves `segments` now; its replicas are dead, swept later (`sweep`)."""
        self.segments.pop(segment_id, None)
        keys = self._by_segment.pop(segment_id, None)
        if keys:
            self._dead.setdefault(segment_id, set()).update(keys)

    def live_replicas(self, key: bytes) -> set[str]:
        """The segments holding a live replica of group `key` (none: not available)."""
        entry = self.groups.get(key)
        if entry is None:
            return set()
        if not self._dead:
            return set(entry.replicas)
        return {s for s in entry.replicas if key not in self._dead.get(s, ())}

    @property
    def dead_replicas(self) -> int:
        """Replicas on lost segments still to sweep."""
        return sum(len(keys) for keys in self._dead.values())

    def sweep(self, keys_max: int = SWEEP_KEYS_PER_CALL) -> bool:
        """Up to `keys_max` dead replicas leave their groups (a group left with none is gone).
        True while any is left."""
        budget = keys_max
        for seg in list(self._dead):
            dead = self._dead.get(seg)
            if dead is None:
                continue
            while dead and budget > 0:
                key = dead.pop()
                budget -= 1
                entry = self.groups[key]  # (a dead key always names a group holding that replica)
                entry.replicas.discard(seg)
                if not entry.replicas:
                    self._remove(key)
            if not dead:
                self._dead.pop(seg, None)
            if budget <= 0:
                break
        return bool(self._dead)

    def leader_changed(self) -> None:
        """A directory shard has a new leader since the listing: its rebuild emitted no event for
        what it adopted or lost (a segment that missed its report never goes `segment_down`;
        an event the old leader had not published is gone, with no gap in the sequences), so
        the index may hold what the directory no longer does: list again (review, stop 67),
        answering meanwhile, as on the new core's `shard_started` event (this, from the shard
        map's epochs, covers a directory that sends none). Until 2026-12-07 it made the index
        not `synced`: every failover blanked the routers' counts for a listing, the marker's
        resync aside. A resync already wanted is not asked again."""
        if self.synced and not self.resync_wanted:
            self.counters["leader_changes"] += 1
            self.resync_wanted = True

    def unsync(self) -> None:
        """Not `synced` (answers nothing until a listing): a stale index whose listing kept
        failing (`StaleResyncPacing.overdue`) is no longer trusted."""
        if self.synced:
            self.counters["stale_expired"] += 1
            self.synced = False

    def check_stream(self, first_seq: int, last_seq: int, created: object = None) -> bool:
        """The stream's bounds and creation time (read whenever the shell (re)subscribes, so a
        recreation is seen): True, and not `synced`, when events after ours are gone (aged out,
        purged, or the stream recreated with its sequences restarted: `kvfabric.core.
        stream_bounds`), or when not synced yet (list first)."""
        if self.bounds.lost(self.last_seq, first_seq, last_seq, created) and self.synced:
            self.counters["gaps"] += 1
            self.synced = False
        return not self.synced

    # ---- resync --------------------------------------------------------------------------

    def resync(
        self, segments: Iterable[ListedSegment], groups: Iterable[ListedGroup], *, at_seq: int
    ) -> None:
        """Replace everything by a listing taken after stream sequence `at_seq` (the shell then
        resumes the stream at `at_seq + 1`): the view served is dropped first (as not `synced`),
        so `last_seq` may go back. In steps, built beside the view served: `resync_start`,
        `resync_add` (any number of times), `resync_replay`, `resync_done`."""
        self.synced = False
        token = self.resync_start(segments, at_seq=at_seq)
        self.resync_add(token, groups)
        self.resync_done(token)

    def resync_start(self, segments: Iterable[ListedSegment], *, at_seq: int) -> int:
        """A new view as of stream sequence `at_seq`, `segments` the live ones now, built beside
        the one served: that keeps answering (and `apply` keeps changing it) until `resync_done`
        swaps the new one in. Its build token, for the calls that follow. An index not `synced`
        answers nothing: its view is dropped at once (one view in memory; a stale one's listing
        holds two until the swap). A view already being built is replaced, its token stale (a
        gap during a stale listing: the shell lists again)."""
        invariant(at_seq >= 0, "a stream sequence", at_seq=at_seq)
        if not self.synced:
            self.groups.clear()
            self._by_segment.clear()
            self._by_chain.clear()
            self._dead.clear()
        building = RoutingIndex(self.domain)
        building.fence = self.fence  # (replayed events are fenced as the served view's were)
        building.segments = {s.segment_id: s.incarnation for s in segments if s.up}
        building.last_seq = at_seq
        building.synced = True
        self._building = building
        self._build_token += 1
        return self._build_token

    def _built(self, token: int) -> RoutingIndex | None:
        """The view being built under `token`; None, counted, when that is not the current one
        (dropped, swapped in, or replaced by a later `resync_start`)."""
        if self._building is None or token != self._build_token:
            self.counters["resync_stale_writes"] += 1
            return None
        return self._building

    def resync_add(self, token: int, groups: Iterable[ListedGroup]) -> bool:
        """Some of the listing's groups, into the view built under `token` (the shell yields the
        loop between slices: 400k groups at once held the router's loop 3 s; review,
        2026-12-06). False, nothing written, for a stale token."""
        building = self._built(token)
        if building is None:
            return False
        for g in groups:
            if self.domain is None or g.domain == self.domain:
                building._set(group_key(g.domain, g.chain), g.chunk_index, g.copy_bytes, set(g.segments))
        return True

    def resync_replay(
        self, token: int, seq: int, event: m.DirectoryEvent, origin: tuple[int, int] | None = None
    ) -> ApplyResult | None:
        """The event at stream sequence `seq` applied to the view built under `token` (as
        `apply`: "gap" when it is not the next after the view's `last_seq`; the shell gives that
        listing up). None, nothing applied, for a stale token."""
        building = self._built(token)
        if building is None:
            return None
        return building.apply(seq, event, origin)

    def resync_done(self, token: int) -> bool:
        """The view built under `token` swapped in, `last_seq` its own (the listing's `at_seq`,
        or the last event replayed on it). `resync_wanted` is the new view's: cleared, unless a
        marker replayed on it set it again. False, nothing changed, for a stale token, or a
        view behind a synced index's `last_seq` or whose replay met a gap (counted
        `resyncs_behind`, still built: the shell replays onto it, or drops it)."""
        building = self._built(token)
        if building is None:
            return False
        if not building.synced or (self.synced and building.last_seq < self.last_seq):
            self.counters["resyncs_behind"] += 1
            return False
        self.groups = building.groups
        self.segments = building.segments
        self._by_segment = building._by_segment
        self._by_chain = building._by_chain
        self._dead = building._dead
        self._building = None
        self.last_seq = building.last_seq
        self.synced = True
        self.resync_wanted = building.resync_wanted
        for name, count in building.counters.items():  # what was replayed on it (`shard_starts`...)
            self.counters[name] += count
        self.counters["resyncs"] += 1
        return True

    def resync_abort(self, token: int) -> bool:
        """The view built under `token` dropped (its listing failed, or a gap made it moot).
        False, nothing dropped, for a stale token: another listing's view is never dropped."""
        if self._built(token) is None:
            return False
        self._building = None
        return True

    @property
    def resync_building(self) -> int | None:
        """Groups in the view being built (None: no listing under way)."""
        return None if self._building is None else len(self._building.groups)

    # ---- queries -------------------------------------------------------------------------

    def available_run(self, keys: Sequence[bytes], start: int) -> list[GroupEntry]:
        """The entries of `keys[start:]` available in kvfabric, up to the first that is not
        (readers never skip a gap). Empty while not `synced`."""
        if not self.synced:
            return []
        out: list[GroupEntry] = []
        for key in keys[start:]:
            entry = self.groups.get(key)
            if entry is None:
                break
            if self._dead and any(key in self._dead.get(seg, ()) for seg in entry.replicas):
                live = self.live_replicas(key)
                if not live:
                    break
                entry = GroupEntry(entry.chunk_index, entry.copy_bytes, live)
            out.append(entry)
        return out

    def check_invariants(self) -> None:
        if self._building is not None:
            self._building.check_invariants()
        pairs = set()
        for key, entry in self.groups.items():
            invariant(bool(entry.replicas), "a group without replicas is gone", key=key.hex())
            for seg in entry.replicas:
                if key in self._dead.get(seg, ()):
                    continue  # dead, not yet swept
                invariant(seg in self.segments, "a live replica on a segment not up", segment=seg)
                pairs.add((seg, key))
        for seg, dead in self._dead.items():
            invariant(bool(dead), "no empty dead set", segment=seg)
            for key in dead:
                named = self.groups.get(key)
                invariant(named is not None and seg in named.replicas, "a dead key names its group")
        reverse = {(seg, key) for seg, keys in self._by_segment.items() for key in keys}
        invariant(pairs == reverse, "reverse index matches", missing=len(pairs ^ reverse))
        chains = {(key[DOMAIN_BYTES:], key) for key in self.groups}
        by_chain = {(chain, key) for chain, keys in self._by_chain.items() for key in keys}
        invariant(chains == by_chain, "chain index matches")


@dataclass(slots=True)
class StaleResyncPacing:
    """When the shell lists the directory for a stale index (`RoutingIndex.resync_wanted`): a
    burst of markers, one listing. Pure: every time is the shell's monotonic clock in ms.

        marked(now)        a marker applied (or a newer leader seen)
        due(now, wanted)   list now? `wanted` (the index's `resync_wanted`), no listing under
                           way, `interval_ms` since the last one ended, and no marker for
                           `quiet_ms` or `wait_max_ms` since the first not covered
        started(now)       a listing begins: the markers applied so far are covered by it
        failed(now)        it failed (tried again once due: the interval and no quiet wait)
        listed(now)        a listing swapped in (a stale one's or the shell's gap resync)
        overdue(now)       wanted for `stale_max_ms` with no listing succeeding, none under way
                           (the shell gives up the stale view: `RoutingIndex.unsync`)
    """

    quiet_ms: int = STALE_QUIET_MS
    wait_max_ms: int = STALE_WAIT_MAX_MS
    interval_ms: int = STALE_INTERVAL_MS
    stale_max_ms: int = STALE_MAX_MS
    running: bool = False
    _first_ms: int | None = None  # the first marker no listing started since covers
    _last_ms: int | None = None  # the latest such marker
    _since_ms: int | None = None  # wanted since (across failed listings; None: not wanted)
    _ended_ms: int | None = None  # the last listing's end (swapped in or failed)

    def marked(self, now_ms: int) -> None:
        if self._first_ms is None:
            self._first_ms = now_ms
        self._last_ms = now_ms
        if self._since_ms is None:
            self._since_ms = now_ms

    def due(self, now_ms: int, wanted: bool) -> bool:
        if not wanted:
            self._first_ms = self._last_ms = self._since_ms = None
            return False
        if self._since_ms is None:
            self._since_ms = now_ms  # wanted without a mark seen (the shell's own bookkeeping)
        if self.running:
            return False
        if self._ended_ms is not None and now_ms - self._ended_ms < self.interval_ms:
            return False
        if self._first_ms is None or self._last_ms is None:
            return True  # wanted since a failed listing, nothing newer to wait for
        return now_ms - self._last_ms >= self.quiet_ms or now_ms - self._first_ms >= self.wait_max_ms

    def started(self, now_ms: int) -> None:
        invariant(not self.running, "one stale listing at a time")
        self.running = True
        self._first_ms = self._last_ms = None
        if self._since_ms is None:
            self._since_ms = now_ms

    def failed(self, now_ms: int) -> None:
        self.running = False
        self._ended_ms = now_ms

    def listed(self, now_ms: int) -> None:
        self.running = False
        self._ended_ms = now_ms
        # markers applied while it ran (`_first_ms`) stay: one after its sequence asks again
        self._since_ms = self._first_ms

    def overdue(self, now_ms: int) -> bool:
        return (
            not self.running and self._since_ms is not None and now_ms - self._since_ms >= self.stale_max_ms
        )
