"""The eviction policy's record of the directory's chunk groups, kept from its events.

What the shell knows of each group besides what its `EvictionCore` holds, all synchronous (no
I/O, no awaits; each call atomic on the event loop, but for a `segment_down` through
`apply_in_steps`: its steps are), and what the directory's events do to both:

- `apply`: one directory event into the core and these records: `published` inserts the group
  (or, published again, moves it to its new pools: `_republished`), a `GroupsPublished` (one
  put_commit's groups) does so for each of its groups in order, `accessed` counts hits,
  `evicted`/`invalidated` forget it (`_forget`), `segment_down` drops the segment's pools and
  their groups, `segment_up` sets a pool's capacity (`_set_capacity`).
- the records, per group key (share domain + chain hash): its 90-byte group id (`_group_ids`,
  what `evict` and `show_group` take), its tenant, chunk index, bytes per pool and its members'
  bytes (`_held`; the directory's `group_bytes`, 0 from a directory too old to say), its
  hits since published (`_hits`, for `demote_or_drop`), its parent and children (`_parent`,
  `_children`: a group moved to a disk pool loses its parent in the core
  (`EvictionCore.retiered`), so the prefix order across tiers is kept here); per pool its
  capacity (`_capacity`) and the disk pools seen (`_disk_pools`).
- the links of groups lost with their segment (`_lost_until`, `_lost_links`): a lost group may
  be adopted again from a disk tier — this segment's, or another's that the records no longer
  showed (lost before it, or a copy made as the segment died) — and the directory publishes it
  again with no parent, when a head adopted again must still take its disk tail with it. So
  its `_parent` entry and its place among its parent's `_children` stay `LOST_LINKS_KEEP_MS`
  after its latest loss (the directory's `invalidated` of it, `replica_lost`, sent in the same
  tick, does not forget them: `_forget`), then go unless it is back; at most
  `LOST_LINKS_EXPIRED_PER_EVENT` go per event (no stall of the loop when a big segment's hour
  ends). A lost group's own
  `_children` stay while a child names it (a child's `_forget` or unlink shrinks them). So a
  group lost for good costs nothing past the hour but what its live children name.
- what a victim batch needs from them: a demoted group moved to its segment's disk pool
  (`_moved`), a demoted tail's ancestor copied to disk counted there too (`_copied`), and the
  resident disk tails dropped before their head (`_with_disk_tails`).
- a republish of a victim while its batch is performed (`_held_back`): its batch's answer
  decides first, so the latest such event is held back, and applied when the victim stays
  (`_stays`: refused, not demoted, no answer); a victim demoted (`_moved`), whose disk copy
  was dropped (`_disk_dropped`) or that is gone drops it. Ignored instead, a partial
  demotion's republish (the members moved before another failed) left their bytes counted in
  the arena and not on disk until the group was demoted or evicted again (review, 2026-12-06).

- what a listing adopted after lost events says of the groups tracked already (the resync,
  `EvictionShell.adopt_listed`): one it names with other pools moves to them (`_relisted`: a
  dead segment's replica swept, a drop whose republish was lost); one that a whole listing
  did not name, nor any `published` event since, is missed (`_missed`, with the time the first
  such listing began, on the shell's monotonic clock: `EvictionShell._missed_clock_ms`, so a
  wall clock stepped forward ages no miss), and goes once a whole listing that began
  `MISSED_FORGET_MS` after that misses it too (`_missed_twice_gone`: evicted, invalidated or
  lost in the gap). Neither one listing nor two in a row are enough: a new directory leader
  whose rebuild missed a segment lists none of its groups until that segment's own rebuild,
  which backs off up to 5 minutes (docs/directory-ha.md), while every shard's `shard_started`
  of a failover asks for another adoption within seconds; a hot group forgotten then came
  back from a later listing ranked coldest (review, 2026-12-07, twice). A listed replica of a
  segment incarnation seen down here (`_down_incarnation`: the listing may predate the
  directory's sweep) is not counted, for a group adopted as for one relisted
  (`published_of_summary`'s `down`; review, 2026-12-07: a group adopted after its segment's
  `segment_down` had its bytes counted on the dead segment for good); one of that incarnation
  heard up again (`segment_up`) counts. A segment the directory no longer has up, holding no
  bytes here any more, goes with its pools (`_dead_segment_dropped`), as its lost
  `segment_down` would have (its incarnation recorded down only when the listing names it
  down, not when it lacks it). Which adoption last named
  each tracked group is kept in four sets that partition the tracked groups (`_named`,
  `_unnamed`, and the dicts `_missed`, `_doomed`; `check_named`): an adoption swaps and pops
  them, never copies them (a copy of 3,000,000 keys held the loop 0.2-0.4 s; review,
  2026-12-07), and one it empties is bound anew (a set or dict emptied by pops keeps its
  table: 134 MB at 3,000,000 groups).
- a demotion that finds no arena replica of its victim on the segment and none on that disk,
  and no republish held back to say where it is (`_listed_where`): the group moves to the
  pools its fresh `show_group` listing names (a segment not heard of yet counted, as the
  adoption counts it), or goes when that names no replica at all (the directory's republish
  may have been among lost events: it was chosen and answered `not_found` again every
  cooldown, its phantom bytes keeping the pool full; review, 2026-12-07). Replicas on a
  segment seen down here (`_down_incarnation`) or being dropped are left out, and a group
  listed on such segments only stays as it is (their loss, or the sweep the listing
  predates, decides; review, 2026-12-07: it was forgotten, links and all, and so was a live
  group listed on a segment whose `segment_up` the policy had not had yet).

`GroupRecords` is a mixin of `EvictionShell` (`kvfabric.eviction_policy.shell`), which
creates these attributes and owns the tasks that call in (the follower, the ticker's batches,
demotion); it reads the shell's `_no_disk` and counts into its `demotions`.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Collection, Iterator, Mapping
from typing import Final

import msgspec

from kvfabric.core.eviction import Admitted, EvictionCore
from kvfabric.eviction_policy.decisions import DecisionLog
from kvfabric.eviction_policy.tiers import SSD_POOL_SUFFIX, is_ssd_pool, ssd_pool, tiered_pools
from kvfabric.format.ids import (
    NAMESPACE_BYTES,
    ChainHash,
    GroupId,
    Namespace,
    domain_in_id,
    pack_group_id,
    pack_group_key,
)
from kvfabric.format.invariant import invariant
from kvfabric.proto import directory as m
from kvfabric.proto.segment import tier_of_slot

__all__ = [
    "ACCESS_PER_EVENT_MAX",
    "MISSED_FORGET_MS",
    "GroupRecords",
    "group_id_of",
    "pools_text",
    "published_of_summary",
]

ACCESS_PER_EVENT_MAX: Final = 16  # hits of one group in one event counted at most this often
# How long the links of a group lost with its segment are kept for its adoption: a segment back
# within it with its disk tier (a restart takes seconds to minutes) has its groups' order across
# tiers as before; one back later has them adopted unlinked (a disk tail then goes as a leaf of its
# own, not with its head: bytes unreachable until then, never wrong ones).
LOST_LINKS_KEEP_MS: Final = 3_600_000
# Links of lost groups forgotten at most per event applied (300,000 at once took 0.18 s in review).
LOST_LINKS_EXPIRED_PER_EVENT: Final = 5_000
# A tracked group that whole listings miss is forgotten only by one that began at least this long
# after the first of them (`_missed_twice_gone`): a directory shard's rebuild of a segment its new
# leader missed backs off 10 s doubling to 5 min (docs/directory-ha.md), and until then every
# listing misses that segment's groups, however many `shard_started` markers ask for one.
MISSED_FORGET_MS: Final = 360_000


def pools_text(pools: dict[str, int]) -> str:
    """The pools a group's bytes are on, as one (interned) string for its decisions."""
    return sys.intern(",".join(sorted(pools)))


def published_of_summary(
    summary: m.GroupSummary,
    *,
    without: Collection[str] = (),
    down: Mapping[str, int] | None = None,
) -> m.GroupPublished | None:
    """A listed group (`list_groups` with objects) as the `published` event that would have told
    the policy of it: bytes per segment (all replicas there but on the segments `without`: gone
    since the listing, and those of an incarnation `down` says went down: segment -> the newest
    incarnation seen down, `GroupRecords._down_incarnation`; the listing may predate the
    directory's sweep of them) and of those in its disk tier (a replica's slot says its tier),
    one copy's bytes; no parent (a listing does not say it). None for one not published, or
    with no live replica of a positive size."""
    if summary.state != "published" or len(summary.namespace) != NAMESPACE_BYTES:
        return None
    placements: dict[str, int] = {}
    on_disk: dict[str, int] = {}
    for obj in summary.objects:
        if obj.size_bytes <= 0:  # (a directory never lists one; the core refuses empty bytes)
            continue
        for replica in obj.replicas:
            sid = replica.segment_id
            if sid in without or (down is not None and replica.incarnation <= down.get(sid, -1)):
                continue
            placements[sid] = placements.get(sid, 0) + obj.size_bytes
            if tier_of_slot(replica.slot) == "ssd":
                on_disk[sid] = on_disk.get(sid, 0) + obj.size_bytes
    if not placements:
        return None
    return m.GroupPublished(
        group=summary.group,
        chunk_index=summary.chunk_index,
        members=summary.members,
        degraded=summary.degraded,
        namespace=summary.namespace,
        placements=[m.SegmentBytes(sid, n) for sid, n in sorted(placements.items())],
        disk_placements=[m.SegmentBytes(sid, n) for sid, n in sorted(on_disk.items())],
        group_bytes=sum(obj.size_bytes for obj in summary.objects if obj.size_bytes > 0),
    )


def group_id_of(namespace: Namespace, chunk_index: int, chain_hash: ChainHash) -> GroupId:
    """The 90-byte chunk group id the directory's `evict` takes, from a published event."""
    return pack_group_id(namespace, chunk_index, chain_hash)


class GroupRecords:
    """The shell's per-group records and what directory events do to them and to the core."""

    core: EvictionCore
    events_applied: int
    demotions: dict[str, int]  # outcome -> groups (status, metrics)
    # group key -> (tenant, chunk index, pool -> bytes, group bytes (0: not known)): to move a
    # demoted group's bytes, and to tell a group whole on a disk from a partly demoted one
    _held: dict[bytes, tuple[bytes, int, dict[str, int], int]]
    _hits: dict[bytes, int]  # group key -> hits since published (demote_or_drop)
    _children: dict[bytes, set[bytes]]  # group key -> the keys naming it as parent
    # victim -> (pools, group bytes) of the latest republish of it applied while it was evicting
    _held_back: dict[bytes, tuple[dict[str, int], int]]
    _parent: dict[bytes, bytes]
    _disk_pools: set[str]  # `<segment>#ssd` pools holding or having held groups
    _no_disk: set[str]  # segments that answered "no disk tier"
    _group_ids: dict[bytes, GroupId]  # domain + chain hash -> 90-byte group id (tracked)
    _capacity: dict[str, int]
    # segment -> the newest incarnation heard up: a down of an older one is no news (each
    # directory shard sends the down of the old incarnation, and one may come after the new
    # incarnation's groups were published; review, 2026-12-05: it dropped them from the policy)
    _up_incarnation: dict[str, int]
    # the event being applied was stored moments ago (the follower sets it; a backlog is not a
    # writer's rate: `EvictionShell._fresh`)
    _events_fresh: bool
    _dropping: set[str]  # the pools of a lost segment while they are dropped in steps
    # segment -> the newest incarnation seen down here, as of its `segment_down` (bounded by
    # the segments): a replica of it, or of an older one, that a listing still shows predates
    # the directory's sweep (`_listed_where`, `published_of_summary`). A `segment_up` of that
    # very incarnation takes it back to the one before (the directory has it up again: a core
    # that never saw the segment registers it from the registry under the same incarnation,
    # `shard_host._introduce`); a segment's drop only inferred from its absence in a segment
    # listing records nothing (`_dead_segment_dropped`).
    _down_incarnation: dict[str, int]
    # group key -> when its links go (`LOST_LINKS_KEEP_MS` after its latest loss), and per segment
    # loss (that time, its lost groups not yet looked at), oldest first
    _lost_until: dict[bytes, int]
    _lost_links: deque[tuple[int, list[bytes]]]
    _decisions: DecisionLog  # the latest decisions per group (`kvctl eviction explain`)
    # groups adopted from a listing whose `published` event the follower may still reach
    # (`_published`); emptied once it has read past the listing (`EvictionShell.adopt_listed`,
    # `_forget_adopted`), a forgotten one at once. (One the policy demoted meanwhile is taken
    # again into its old event's arena pools: stale until the directory's republish after the
    # demotion, later in the stream, is applied, as for any group the follower is behind on.)
    _adopted: set[bytes]
    # while a listing is adopted: the groups forgotten and the segments gone down since it began
    # (a page may be older than the events applied meanwhile: `EvictionShell.adopt_listed`)
    _gone_while_adopting: set[bytes] | None
    _down_while_adopting: set[str] | None
    # while a listing is adopted: the segments heard up since it began (a segment listing older
    # than that up is no news)
    _up_while_adopting: set[str] | None
    # Every tracked group (`_group_ids`) is in exactly one of these (`check_named`): named by a
    # `published` event or a listing page since the latest adoption began (`_named`: a group
    # tracked since is too); not named since it began (`_unnamed`: while its listing is read,
    # or after a listing cut short or failed); not named by a whole listing nor by an event
    # since (`_missed`: -> when the first such listing began; a whole listing that misses it
    # too and began `MISSED_FORGET_MS` after that forgets it); missed by the whole listing just
    # read, being judged (`_doomed`, the same times: forgotten, or back to `_missed`). These
    # times, and `_missed_oldest_ms`, are the shell's monotonic ms (`_missed_clock_ms`). Bounded
    # by the groups tracked: one entry each (~45 bytes in a set, ~56 in a dict with its time,
    # the time object shared by the groups one listing missed). Containers, not a stamp per
    # record: an adoption finds the groups it did not name by swapping them and judges them by
    # popping, a thousand a turn of the loop, with events applied in between (a dict cannot be
    # walked across turns of the loop while events add and remove groups, and a copy of
    # 3,000,000 keys held the loop 0.2-0.4 s; review, 2026-12-07). One emptied by pops is bound
    # anew at once (`EvictionShell._pop_steps`): a set or dict never shrinks as it is emptied,
    # and an emptied `_unnamed` kept its 134 MB table at 3,000,000 groups for good (review,
    # 2026-12-07).
    _named: set[bytes]
    _unnamed: set[bytes]
    _missed: dict[bytes, int]
    _doomed: dict[bytes, int]
    # no more than this old (the oldest first-miss time in `_missed` when it was last filled;
    # events only take groups out): when the confirming adoption is due (`EvictionShell`)
    _missed_oldest_ms: int

    def apply(self, event: msgspec.Struct, at_ms: int) -> None:
        """One directory event into the core, whole (pure bookkeeping; public for tests)."""
        for _ in self.apply_in_steps(event, at_ms):
            pass

    def apply_in_steps(self, event: msgspec.Struct, at_ms: int) -> Iterator[None]:
        """`apply`, yielding between the steps of a `segment_down` (its pools dropped in steps,
        `EvictionCore.drop_pool_steps`), so that the shell's loop runs meanwhile; every other
        event is applied before the first `next` returns. The caller applies no other event
        until this one is done."""
        core = self.core
        if self._lost_links and self._lost_links[0][0] <= at_ms:
            self._expire_lost_links(at_ms)
        # A group is (share domain, chain hash): two domains may hold the same chain hash (one
        # of them forged it), and the directory keeps them apart, so the policy must too.
        if isinstance(event, m.GroupPublished):
            if not self._published(event, at_ms):
                return  # from a directory too old to say where the bytes are: not ours to evict
        elif isinstance(event, m.GroupsPublished):  # one put_commit's groups, in order (issue 20)
            for published in event.groups:  # a writer's bytes, unless read from a backlog
                self._published(published, at_ms, writer=self._events_fresh)
        elif isinstance(event, m.GroupsAccessed):
            for hit in event.groups:
                key = pack_group_key(hit.domain, hit.group)
                if key in self._held:
                    self._hits[key] = self._hits.get(key, 0) + hit.hits
                for _ in range(min(hit.hits, ACCESS_PER_EVENT_MAX)):
                    core.seen(key)
                    core.access(key, at_ms)
        elif isinstance(event, m.GroupsUnpinned):  # a victim refused as pinned: ask again now
            for ref in event.groups:
                key = pack_group_key(ref.domain, ref.group)
                if core.unpinned(key, at_ms):  # `kvctl eviction explain` says why it went early
                    self._decisions.record(key, at_ms, "unpinned", "its_last_pin_ended")
        elif isinstance(event, m.GroupEvicted | m.GroupInvalidated):
            key = pack_group_key(event.domain, event.group)
            self._record_gone(key, event, at_ms)
            self._forget(key)
        elif isinstance(event, m.SegmentDown):
            if event.incarnation >= self._up_incarnation.get(event.segment_id, 0):
                yield from self._segment_down(event, at_ms)
        elif isinstance(event, m.SegmentUp):
            if self._up_while_adopting is not None:
                self._up_while_adopting.add(event.segment_id)
            if event.incarnation > self._up_incarnation.get(event.segment_id, 0):
                self._up_incarnation[event.segment_id] = event.incarnation
            if self._down_incarnation.get(event.segment_id) == event.incarnation:
                # That incarnation up again (review, 2026-12-07: the listings' replicas of it
                # were left out for good, its groups missed and forgotten, its bytes counted
                # nowhere); the older ones stay down. (One below the incarnation seen down is
                # an older process's: no news.)
                self._down_incarnation[event.segment_id] = event.incarnation - 1
            if event.capacity_bytes:
                self._set_capacity(event.segment_id, event.capacity_bytes)
        self.events_applied += 1

    def _segment_down(self, event: m.SegmentDown, at_ms: int) -> Iterator[None]:
        """Its arena and disk pools dropped from the core and these records, a step at a time
        (yields between steps). What is lost may be adopted again: linked a while longer."""
        if self._down_while_adopting is not None:
            self._down_while_adopting.add(event.segment_id)
        gone: list[bytes] = []
        until = at_ms + LOST_LINKS_KEEP_MS
        pools = (event.segment_id, ssd_pool(event.segment_id))
        self._dropping.update(pools)
        try:
            for pool in pools:  # both at capacity 0 from the first step: no watermark victims there
                if pool in self._capacity:
                    self.core.set_capacity(pool, 0)
            self._down_incarnation[event.segment_id] = max(
                event.incarnation, self._down_incarnation.get(event.segment_id, 0)
            )
            for pool in pools:
                for step_gone, step_kept in self.core.drop_pool_steps(pool):
                    self._lost_step(step_gone, step_kept, pool, until, event.reason, at_ms)
                    gone += (gid for gid in step_gone if isinstance(gid, bytes))
                    yield
                self._capacity.pop(pool, None)
        finally:  # (also when the follower stops mid-way: the event is applied again on restart)
            self._dropping.difference_update(pools)
        if gone:
            self._lost_links.append((until, gone))
        # A held-back republish may name the lost pools for a victim the core never had there
        # (a repair copy the event reported first): applied later, it brought the pool back
        # (review, 2026-12-06). Only current victims have entries: a short walk.
        for gid in list(self._held_back):
            back = self._held_back[gid][0]
            for pool in pools:
                back.pop(pool, None)
            if not back:
                del self._held_back[gid]
        self._disk_pools.discard(ssd_pool(event.segment_id))
        self._no_disk.discard(event.segment_id)

    def _lost_step(
        self, step_gone: list[object], step_kept: list[object], pool: str, until: int, reason: str, at_ms: int
    ) -> None:
        """One step of a lost pool in these records: the groups it removed from the core are
        forgotten but for their links (kept `until`); those it kept lose the pool."""
        for gid in step_gone:
            if isinstance(gid, bytes):
                self._adopted.discard(gid)
                self._unname(gid)
                self._group_ids.pop(gid, None)
                self._held.pop(gid, None)
                self._hits.pop(gid, None)
                self._held_back.pop(gid, None)
                self._lost_until[gid] = until
                if gid in self._decisions:  # (not every lost group: a big segment's loss would
                    # churn the whole log)
                    self._decisions.record(gid, at_ms, "lost", reason, str(pool))
        # The groups it shared with other segments lose that pool in the records too (as in the
        # core, whose pools these mirror): a stale pool said a head was on a disk that is gone,
        # and a later move (`_moved`) put its bytes back into the core.
        for gid in step_kept:
            if not isinstance(gid, bytes):
                continue
            held = self._held.get(gid)
            if held is not None:
                held[2].pop(pool, None)
            back = self._held_back.get(gid)
            if back is not None:
                back[0].pop(pool, None)
                if not back[0]:
                    del self._held_back[gid]  # (what stays is the core's, without that pool)

    def _record_gone(self, key: bytes, event: m.GroupEvicted | m.GroupInvalidated, at_ms: int) -> None:
        """The decision a directory `evicted` / `invalidated` event records. One of the policy's
        own victims (still evicting: the directory publishes a slice's events before it answers)
        reads as the answer would (`evicted evicting`, its batch's reason as the cause); once
        the answer came, it is forgotten here and not recorded twice. A group lost with its
        segment is recorded only if the log knows it already (as its `lost`): a big segment's
        invalidations would otherwise push every other group out of the log."""
        if isinstance(event, m.GroupEvicted) and self.core.is_evicting(key):
            self._decisions.record(key, at_ms, "evicted", "evicting", cause=event.reason)
        elif key in self.core or (key in self._lost_until and key in self._decisions):
            what = "evicted" if isinstance(event, m.GroupEvicted) else "invalidated"
            self._decisions.record(key, at_ms, what, event.reason)

    def _published(
        self, event: m.GroupPublished, at_ms: int, *, listed_ms: int | None = None, writer: bool = False
    ) -> bool:
        """One published group into the core and the records (published again: `_republished`).
        False for one without placements or namespace (a directory too old to say them).
        `listed_ms`: adopted from the directory's listing (`published_of_summary`), ranked as
        last used then; an adopted group's own `published` event, when the follower reaches it,
        takes it again from the event (its parent, its time). `writer`: a put_commit's fresh
        bytes, the core's inflow (`EvictionCore.tick`): not a republish, nor an adopted group's
        own event (its bytes were there already)."""
        core = self.core
        if not event.placements or len(event.namespace) != NAMESPACE_BYTES:
            return False
        domain = domain_in_id(event.namespace)
        key = pack_group_key(domain, event.group)
        if listed_ms is None and key in self._adopted:
            writer = False
            self._adopted.discard(key)
            if key in core and not core.is_evicting(key):
                self._untrack(key)  # its links stay: children published since name it
        # a parent of the same domain
        parent = pack_group_key(domain, event.parent) if event.parent else None
        pools = tiered_pools(
            {p.segment_id: p.bytes for p in event.placements},
            {p.segment_id: p.bytes for p in event.disk_placements},
        )
        if key in core:  # published again: its bytes changed tier (a demotion, an adoption)
            self._name(key)  # (since an adoption began: what the event says stands)
            self._republished(key, pools, at_ms, event.group_bytes)
            return True
        verdicts = core.insert(
            key,
            tenant=domain,
            pools=pools,
            parent=parent,
            chunk_index=event.chunk_index,
            now_ms=at_ms,
            last_access_ms=listed_ms,
            counts_as_inflow=writer,
        )
        if key in core:
            reason = next((v.reason for v in verdicts if isinstance(v, Admitted)), "")
            if listed_ms is not None:
                reason = "listed"
                self._adopted.add(key)
            self._decisions.record(key, at_ms, "tracked", reason, pools_text(pools))
            self._group_ids[key] = group_id_of(event.namespace, event.chunk_index, event.group)
            self._name(key)
            self._held[key] = (domain, event.chunk_index, pools, event.group_bytes)
            self._disk_pools.update(p for p in pools if is_ssd_pool(p))
            if parent is not None:
                self._parent[key] = parent
                self._children.setdefault(parent, set()).add(key)
        return True

    def _republished(
        self,
        key: bytes,
        pools: dict[str, int],
        at_ms: int,
        event_group_bytes: int = 0,
        reason: str = "published",
    ) -> None:
        """A known group with new pools moves there (no access: a republish is not a read; its
        rank kept, `EvictionCore.retiered`). One being evicted or demoted right now is left to
        its batch's answer: the event is held back (`_held_back`; its `group_bytes` are kept at
        once), and applied if the victim stays (`_stays`). One that only gained pools,
        its others unchanged — a head copied to disk, its arena replica kept (the directory
        publishes it again once the copy is whole), and maybe an arena copy the policy was not
        told of (a prefetch's) — is counted in them as `_copied` does: the same group, its rank
        kept. A disk pool is such only when it holds the whole of that segment's arena bytes."""
        held = self._held.get(key)
        if held is not None and event_group_bytes and held[3] != event_group_bytes:
            held = self._held[key] = (*held[:3], event_group_bytes)  # before any early return
        if held is None or not pools:
            return
        if self.core.is_evicting(key):
            self._held_back[key] = (pools, event_group_bytes)  # the latest: applied if it stays
            return
        self._held_back.pop(key, None)  # (this event is newer than one held back)
        if held[2] == pools:
            return
        tenant, chunk_index, before, group_bytes = held
        added = {p: n for p, n in pools.items() if p not in before}
        whole_copies = all(
            not is_ssd_pool(p) or pools.get(p.removesuffix(SSD_POOL_SUFFIX)) == n for p, n in added.items()
        )
        # An arena pool added to a group on disk only would give it back its parent in the core
        # (`_core_parent`): that is a move, not an addition.
        in_arena = any(not is_ssd_pool(p) for p in before)
        additions = all(is_ssd_pool(p) or in_arena for p in added)
        if added and whole_copies and additions and all(pools.get(p) == n for p, n in before.items()):
            for pool, nbytes in added.items():
                if is_ssd_pool(pool):
                    self._copied(key, pool.removesuffix(SSD_POOL_SUFFIX), nbytes)
                elif self.core.add_pool(key, pool, nbytes):
                    before[pool] = nbytes
            return
        self.core.retiered(key, pools=pools, parent=self._core_parent(key, pools), now_ms=at_ms)
        self._decisions.record(key, at_ms, "moved", reason, pools_text(pools))
        self._held[key] = (tenant, chunk_index, pools, group_bytes)
        self._disk_pools.update(p for p in pools if is_ssd_pool(p))

    def _relisted(self, key: bytes, event: m.GroupPublished, at_ms: int) -> bool:
        """A tracked group a listing page names (`event`: `published_of_summary` of it), that no
        event applied since the adoption began named (not in `_named`): the page is newer than
        what the records hold of it, so it moves to the pools listed, as a republish would move
        it (`_republished`): a replica on a segment lost in the gap is no longer counted, nor one
        dropped whose republish was lost. Named now (missed no more). One being evicted or
        demoted is left to its batch's answer. True when its pools changed."""
        if self._gone_while_adopting is None or key in self._named or key not in self._group_ids:
            return False
        self._name(key)
        held = self._held.get(key)
        if held is None or key not in self.core or self.core.is_evicting(key):
            return False
        pools = tiered_pools(
            {p.segment_id: p.bytes for p in event.placements},
            {p.segment_id: p.bytes for p in event.disk_placements},
        )
        if held[2] == pools:
            return False
        self._republished(key, pools, at_ms, event.group_bytes, reason="listed")
        return True

    def _missed_twice_gone(self, key: bytes, first_ms: int, began_ms: int, at_ms: int) -> bool:
        """A group (popped from `_doomed`) that the whole listing that began at `began_ms` did not
        name, nor any event since, and that whole listings have missed since `first_ms`: when
        that is at least `MISSED_FORGET_MS` before `began_ms`, the directory holds it no more
        (evicted, invalidated, lost with its segment, in events the stream lost), so it goes,
        links and all, as an `evicted` event would take it. Back in `_missed` with its first
        miss instead: one missed for less (a new leader's listing without a segment it has not
        rebuilt yet, which takes it up to 5 minutes), one being evicted or demoted (its batch's
        answer decides: `not_found` forgets it), and one whose every pool is being dropped right
        now (its segment's loss, in steps, takes it and keeps its links for its adoption from a
        disk tier). `first_ms` and `began_ms` are on the shell's monotonic clock
        (`EvictionShell._missed_clock_ms`: a wall clock stepped forward would age them), `at_ms`
        the decision's time (the driver's). True when it went."""
        if key not in self._group_ids:  # (forgotten: not in the sets any more)
            return False
        held = self._held.get(key)
        if (
            began_ms - first_ms < MISSED_FORGET_MS
            or self.core.is_evicting(key)
            or (held is not None and held[2] and all(p in self._dropping for p in held[2]))
        ):
            self._missed[key] = first_ms
            self._missed_oldest_ms = min(self._missed_oldest_ms, first_ms)
            return False
        self._decisions.record(key, at_ms, "evicted", "not_listed")
        self._forget(key)
        return True

    def _listed_where(self, key: bytes, listing: Collection[m.ObjectLocation], at_ms: int) -> str:
        """A victim that stays after its demotion found no replica of it to demote on the segment
        nor on that disk, and no republish of it held back (`EvictionShell._demote_groups`): its
        records still name a replica that went (drained, scrubbed, dropped), and the directory's
        republish that would say so may have been among events the stream lost: nothing else
        would fix the records (it was chosen, answered `not_found` and cooled down again and
        again, its bytes counted where they are not). So the fresh `show_group` listing is the
        directory's word: the group moves to the pools its replicas are in (as `_republished`
        with reason `listed`; a segment not heard of yet counts, its pool taken as the adoption
        takes it: its `segment_up` may be among the lost events, or not refreshed yet) and goes
        when it has none (decision `evicted`, reason `not_listed`). A replica on a segment seen
        down here (`_down_incarnation`: the listing may predate the directory's sweep) or being
        dropped is left out, and a group listed on such segments only stays as it is: its
        replicas' loss decides (a sweep's `invalidated`, a segment's drop, or the adoption's
        misses; review, 2026-12-07: such a group, and a live one listed on a segment not known
        here yet, were forgotten, links and all). A republish still to come applies after it.
        Returns "moved", "gone" or "" (nothing changed)."""
        held = self._held.get(key)
        if held is None or key not in self.core or self.core.is_evicting(key):
            return ""
        placements: dict[str, int] = {}
        on_disk: dict[str, int] = {}
        left_out = False
        for obj in listing:
            if obj.size_bytes <= 0:
                continue
            for replica in obj.replicas:
                sid = replica.segment_id
                if sid in self._dropping or replica.incarnation <= self._down_incarnation.get(sid, -1):
                    left_out = True  # a segment gone down here (being dropped, or dropped)
                    continue
                placements[sid] = placements.get(sid, 0) + obj.size_bytes
                if tier_of_slot(replica.slot) == "ssd":
                    on_disk[sid] = on_disk.get(sid, 0) + obj.size_bytes
        if not placements and left_out:
            return ""
        if not placements:
            self._decisions.record(key, at_ms, "evicted", "not_listed")
            self._forget(key)
            return "gone"
        pools = tiered_pools(placements, on_disk)
        if pools == held[2]:
            return ""
        group_bytes = sum(obj.size_bytes for obj in listing if obj.size_bytes > 0)
        self._republished(key, pools, at_ms, group_bytes, reason="listed")
        return "moved"

    def _dead_segment_dropped(self, segment_id: str, incarnation: int, at_ms: int, *, listed: bool) -> bool:
        """A segment the directory's segment listing, taken after its groups were listed, does
        not have up (`incarnation`: the newest it lists, else the newest heard up here): its
        arena and disk pools go as its `segment_down` would take them (`_segment_down`), once
        they hold no bytes here any more (the group listing moved or forgot what they held);
        not one heard up since the adoption began (`_up_while_adopting`: the listing is older),
        nor one whose incarnation heard up is newer than the one listed, nor one being dropped
        already. A pool still holding bytes (groups events named since the adoption began) is
        left to the segment's own `segment_down`. Only a segment the listing names down
        (`listed`) has that incarnation recorded down (`_down_incarnation`): one the listing
        lacks may be back under the same incarnation with no event (a new leader's rebuild
        that missed it, then one that adopts it again; review, 2026-12-07: its replicas were
        left out of every later listing, its groups forgotten, its bytes counted nowhere), and
        while no shard lists it, none lists a replica of it either. True when its pools
        went."""
        pools = (segment_id, ssd_pool(segment_id))
        if (
            (self._up_while_adopting is not None and segment_id in self._up_while_adopting)
            or incarnation < self._up_incarnation.get(segment_id, 0)
            or any(p in self._dropping for p in pools)
            or any(self.core.used_bytes(p) or self.core.evicting_bytes(p) for p in pools)
        ):
            return False
        # as its lost `segment_down` event would have been applied (empty pools: no step)
        down_before = self._down_incarnation.get(segment_id)
        self.apply(m.SegmentDown(segment_id=segment_id, incarnation=incarnation, reason="not_listed"), at_ms)
        if not listed:  # inferred only: recorded nothing (see above)
            if down_before is None:
                del self._down_incarnation[segment_id]
            else:
                self._down_incarnation[segment_id] = down_before
        return True

    def _name(self, key: bytes) -> None:
        """A tracked group named by a `published` event or a listing page: heard of since the
        latest adoption began (`_named`), missed no more."""
        self._named.add(key)
        self._unnamed.discard(key)
        self._missed.pop(key, None)
        self._doomed.pop(key, None)

    def _unname(self, key: bytes) -> None:
        """A group no longer tracked: in none of the naming sets."""
        self._named.discard(key)
        self._unnamed.discard(key)
        self._missed.pop(key, None)
        self._doomed.pop(key, None)

    def check_named(self) -> None:
        """Every tracked group is in exactly one of `_named`, `_unnamed`, `_missed`, `_doomed`,
        and nothing else is (O(groups): for tests)."""
        sets: tuple[Collection[bytes], ...] = (self._named, self._unnamed, self._missed, self._doomed)
        invariant(sum(len(s) for s in sets) == len(self._group_ids), "a group named twice or not at all")
        invariant(all(key in self._group_ids for s in sets for key in s), "an untracked group named")
        invariant(all(any(key in s for s in sets) for key in self._group_ids), "a tracked group unnamed")

    def _forget(self, gid: bytes) -> None:
        if self._gone_while_adopting is not None:
            self._gone_while_adopting.add(gid)
        if gid not in self.core and gid in self._lost_until:
            # Lost with its segment: the directory invalidates it (`replica_lost`) in the same
            # tick, but its links wait for its adoption from a disk tier like any lost group's.
            return
        self._untrack(gid)
        self._children.pop(gid, None)
        self._unlink(gid)

    def _untrack(self, gid: bytes) -> None:
        """Out of the core and the per-group records but its links (`_parent`, `_children`)."""
        if self._gone_while_adopting is not None:
            self._gone_while_adopting.add(gid)
        if gid in self.core:
            self.core.removed(gid)
        self._adopted.discard(gid)
        self._unname(gid)
        self._group_ids.pop(gid, None)
        self._held.pop(gid, None)
        self._hits.pop(gid, None)
        self._held_back.pop(gid, None)

    def _stays(self, key: bytes, at_ms: int, *, pinned: bool = False) -> None:
        """A victim that stays (the directory refused it, its demotion failed or kept its arena
        replicas, no answer, or held back above a tail that stays): resident again, cooled down
        (`EvictionCore.refused`), then moved by the latest republish of it held back meanwhile
        (`_held_back`: a partial demotion's members on disk, a replica dropped, a disk copy
        kept under a lease)."""
        self.core.refused(key, at_ms, pinned=pinned)  # (a pin's refusals back off: `refused`)
        back = self._held_back.pop(key, None)
        if back is not None:
            self._republished(key, back[0], at_ms, back[1])

    def _expire_lost_links(self, at_ms: int) -> None:
        """Unlink the lost groups whose keep time ended by `at_ms` and that are not back, at most
        `LOST_LINKS_EXPIRED_PER_EVENT` (the rest at the next events). A group lost again since
        has a later time of its own, and its later loss's entry looks at it then."""
        budget = LOST_LINKS_EXPIRED_PER_EVENT
        while self._lost_links and self._lost_links[0][0] <= at_ms and budget > 0:
            keys = self._lost_links[0][1]
            while keys and budget > 0:
                key = keys.pop()
                budget -= 1
                until = self._lost_until.get(key)
                if until is not None and until <= at_ms:
                    del self._lost_until[key]
                    if key not in self.core:  # not adopted (nor saved) again since
                        self._unlink(key)
            if not keys:
                self._lost_links.popleft()

    def _unlink(self, gid: bytes) -> None:
        """Forget `gid`'s parent and its place among that parent's children (its own children
        stay: they name it still)."""
        parent = self._parent.pop(gid, None)
        if parent is not None:
            siblings = self._children.get(parent)
            if siblings is not None:
                siblings.discard(gid)
                if not siblings:
                    del self._children[parent]

    def _set_capacity(self, pool: str, capacity_bytes: int) -> None:
        """A pool's capacity as a `segment_up`, the segment listing or a demotion's reply says;
        not for a pool being dropped (its capacity stays 0 until it is gone: no watermark victims
        among groups about to be dropped; the next listing or reply sets it again)."""
        if pool in self._dropping:
            return
        if self._capacity.get(pool) != capacity_bytes:
            self._capacity[pool] = capacity_bytes
            self.core.set_capacity(pool, capacity_bytes)

    def _with_disk_tails(self, chains: list[bytes]) -> list[bytes]:
        """The groups to drop, each preceded by its resident descendants: only tails moved to a
        disk pool can be there (the core picks leaves), and without their head no lookup finds
        them again, so they go first (tails before heads). Tails the batch names itself move up
        before their head too: a disk tail has no parent in the core, so a disk pool's batch may
        name a head before its tails."""
        out: list[bytes] = []
        batch = set(chains)
        placed: set[bytes] = set()
        for chain in chains:
            if chain in placed:
                continue
            tails: list[bytes] = []
            frontier = [chain]
            while frontier:
                for child in sorted(self._children.get(frontier.pop(), ())):
                    if child not in placed and child in self.core and child in self._group_ids:
                        placed.add(child)
                        tails.append(child)
                        frontier.append(child)
            added = sum(1 for t in tails if t not in batch)
            if added:
                self.demotions["tails_dropped"] = self.demotions.get("tails_dropped", 0) + added
            out += reversed(tails)  # the deepest first
            out.append(chain)
            placed.add(chain)
        return out

    def _copied(self, chain: bytes, segment_id: str, nbytes: int) -> None:
        """The group has `nbytes` on `segment_id`'s disk now (a copy, its arena replica kept: the
        ancestor of a demoted tail): the disk pool holds them, the same group (`add_pool`: its
        rank, parent and children unchanged). Known already with as many: nothing changes; with
        fewer (a partial demotion's members, completed by this copy): the difference is added."""
        held = self._held.get(chain)
        pool = ssd_pool(segment_id)
        known = held[2].get(pool, 0) if held is not None else 0
        if held is None or nbytes <= known or not self.core.add_pool(chain, pool, nbytes - known):
            return
        held[2][pool] = nbytes
        self._disk_pools.add(pool)

    def _moved(self, chain: bytes, segment_id: str, at_ms: int) -> None:
        """The group's bytes on `segment_id` are in its disk tier now: the same group, another pool
        (`EvictionCore.retiered`: its rank kept, no eviction counted)."""
        # A republish held back meanwhile that already shows this move (no arena replica on that
        # segment, its disk copy there) is the directory's newer word, other drops included (a
        # replica scrubbed elsewhere meanwhile): applied after the move. One from before it is not.
        back = self._held_back.pop(chain, None)
        newer = (
            back
            if back is not None and segment_id not in back[0] and ssd_pool(segment_id) in back[0]
            else None
        )
        held = self._held.get(chain)
        if held is None or chain not in self.core:
            return
        pools, group_bytes = held[2], held[3]
        moved = pools.pop(segment_id, 0)
        if not moved:  # not in that arena (any more: its segment lost meanwhile): nothing moved
            if back is not None:  # the directory's word, for `_stays` to apply
                self._held_back[chain] = back
            if self.core.is_evicting(chain):  # a victim answered by nothing else: it stays
                self._stays(chain, at_ms)  # (review, stop 65: it was EVICTING for good)
            return
        # A disk copy it had already (`_copied`) is the same replica, not more bytes; members
        # a partial demotion moved before are other bytes (one segment holds each member once).
        disk = pools.get(ssd_pool(segment_id), 0)
        pools[ssd_pool(segment_id)] = min(disk + moved, group_bytes) if group_bytes else max(disk, moved)
        self._disk_pools.add(ssd_pool(segment_id))
        self.core.retiered(chain, pools=pools, parent=self._core_parent(chain, pools), now_ms=at_ms)
        if newer is not None:
            self._republished(chain, newer[0], at_ms, newer[1])

    def _disk_dropped(self, chain: bytes, at_ms: int) -> None:
        """A disk pool's victim that kept its arena replicas (a head copied to disk, evicted with
        tier "ssd": the directory freed only its disk replicas): the same group, in its arena
        pools only, resident again (`EvictionCore.retiered`: its rank kept, no eviction counted)."""
        # A republish held back meanwhile that already shows the drop (no disk pool) is the
        # directory's newer word (as in `_moved`): applied after it.
        back = self._held_back.pop(chain, None)
        newer = back if back is not None and not any(is_ssd_pool(p) for p in back[0]) else None
        held = self._held.get(chain)
        if held is None or chain not in self.core:
            return
        pools = held[2]
        for pool in [p for p in pools if is_ssd_pool(p)]:
            del pools[pool]
        self.demotions["disk_dropped"] = self.demotions.get("disk_dropped", 0) + 1
        self._decisions.record(chain, at_ms, "disk_dropped", "evicting", pools_text(pools))
        if pools:  # (the shell asks tier "ssd" only for a group its records know in an arena)
            self.core.retiered(chain, pools=pools, parent=self._core_parent(chain, pools), now_ms=at_ms)
            if newer is not None:
                self._republished(chain, newer[0], at_ms, newer[1])
        else:  # nothing left anywhere: gone from the policy
            self._untrack(chain)

    def _core_parent(self, key: bytes, pools: dict[str, int]) -> bytes | None:
        """The parent a group moved to `pools` has in the core: its own while it keeps
        an arena replica (a head in DRAM is no leaf while its tail is in DRAM too); none when it
        is on disk only (the core's leaves are per object, not per pool: a disk tail naming its
        head would keep the head in the arena; `_with_disk_tails` keeps that order instead)."""
        return self._parent.get(key) if any(not is_ssd_pool(p) for p in pools) else None
