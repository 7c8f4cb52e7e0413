"""The router's chunk index against a model of the directory, over random interleavings.

The model is the directory's published state: segments up (with incarnations) and groups with
their live replicas. Each directory operation appends its events to a log, numbered as
JetStream numbers a stream (publish; a commit's groups in one event; evict; invalidate; a
segment down, which strips it from every group and invalidates a group left without replicas,
as the directory's sweep does; a segment restart: down then up with a new incarnation,
announced once per shard; a shard's core replaced with an event it had queued never published,
then the new core's `shard_started`). The index is
fed from that log by a follower that may deliver the next event, redeliver old ones
(duplicates) or lose some (a gap). On a gap the shell's resync runs: S = the log's length, a few
more directory operations happen while the listing is taken, the listing is the model's state
at its end, and the follower resumes at S + 1 (replaying what the listing already shows). On a
`shard_started` the index stays synced (`resync_wanted`): its listing is built beside the view
served, in slices, while the follower goes on delivering (and the directory on changing), then
the events from S + 1 up to the view served replayed onto it and swapped in, the follower
reading on where it was (or dropped: a failed listing); a view behind is never swapped in.

Checked after every step: the index's own invariants; a lost event is always detected as a
gap; and whenever the index is synced and has applied the whole log, it holds exactly the
model's groups, replicas and segments, except while `resync_wanted`, when it differs only in
the groups whose event a handover dropped after the sequence of the last listing swapped in (a
listing covers only the drops whose marker is at or before its sequence; not at all once one
is swapped in with no marker after it).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfabric.core.routing_index import ListedGroup, ListedSegment, RoutingIndex, StaleResyncPacing
from kvfabric.format.ids import (
    ChainHash,
    DomainDigest,
    GroupKey,
    Namespace,
    chain_in_group_key,
    domain_in_group_key,
)
from kvfabric.proto import directory as m

SEGMENTS = ("s0", "s1", "s2")
DOMAINS = (DomainDigest(b"\x01" * 16), DomainDigest(b"\x02" * 16))
CHAINS = tuple(ChainHash(bytes([i]) * 32) for i in range(1, 6))
SHARDS = 2
CHAIN_KEYS = tuple(d + c for d in DOMAINS for c in CHAINS)  # every group key the machine uses


def namespace(domain: DomainDigest) -> Namespace:
    return Namespace(b"\x00" * 4 + domain + b"\x00" * 34)


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = RoutingIndex()
        # the router's own: one share domain's groups only, fed and resynced the same way
        # (it held every domain's, review, stop 67)
        self.mine = RoutingIndex(domain=DOMAINS[0])
        self.log: list[m.DirectoryEvent] = []
        self.segments: dict[str, int] = {}
        self.incarnation = dict.fromkeys(SEGMENTS, 0)
        self.groups: dict[bytes, set[str]] = {}
        self.next = 1  # the next sequence the follower delivers
        self.lost = False  # the follower skipped events since the last resync
        self.epoch = 1  # of the shard handed over (`handover`)
        # groups whose last event a handover dropped, not covered by a listing swapped in yet ->
        # the sequence of that handover's marker (a listing as of S covers a drop whose marker
        # is at or before S only: one dropped again after S stays unknown after its swap)
        self.unpublished: dict[bytes, int] = {}
        # a stale index's listing being built: (S, groups not added yet, the build tokens of
        # `index` and `mine`)
        self.stale: tuple[int, list[ListedGroup], tuple[int, int]] | None = None

    # ---- the directory ----------------------------------------------------------------------

    def emit(self, event: m.DirectoryEvent) -> None:
        self.log.append(event)

    def segment_lost(self, seg: str, reason: str) -> None:
        for _ in range(SHARDS):
            self.emit(m.SegmentDown(segment_id=seg, incarnation=self.incarnation[seg], reason=reason))
        del self.segments[seg]
        for key, replicas in list(self.groups.items()):
            replicas.discard(seg)
            if not replicas:
                del self.groups[key]
                self.emit(
                    m.GroupInvalidated(
                        group=chain_in_group_key(GroupKey(key)),
                        reason="replica_lost",
                        domain=domain_in_group_key(GroupKey(key)),
                    )
                )

    @rule(seg=st.sampled_from(SEGMENTS))
    def segment_start(self, seg: str) -> None:
        if seg in self.segments:
            self.segment_lost(seg, "restarted")
        self.incarnation[seg] += 1
        self.segments[seg] = self.incarnation[seg]
        for _ in range(SHARDS):  # every shard core announces the registration
            self.emit(m.SegmentUp(segment_id=seg, incarnation=self.incarnation[seg], capacity_bytes=1))

    @precondition(lambda self: self.segments)
    @rule(
        commit=st.lists(
            st.tuples(
                st.sampled_from(DOMAINS),
                st.sampled_from(CHAINS),
                st.sets(st.sampled_from(SEGMENTS), min_size=1, max_size=2),
            ),
            min_size=1,
            max_size=4,
        )
    )
    def publish_many(self, commit: list[tuple[DomainDigest, ChainHash, set[str]]]) -> None:
        """One put_commit's groups: one `GroupsPublished`, one sequence (issue 20)."""
        published = []
        for domain, chain, placed in commit:
            live = {s for s in placed if s in self.segments}
            if not live or domain + chain in self.groups:
                continue
            self.groups[domain + chain] = live
            published.append(
                m.GroupPublished(
                    group=chain,
                    chunk_index=CHAINS.index(chain),
                    members=1,
                    namespace=namespace(domain),
                    placements=[m.SegmentBytes(s, 100) for s in sorted(live)],
                )
            )
        if published:
            self.emit(m.GroupsPublished(groups=published))

    @precondition(lambda self: self.segments)
    @rule(seg=st.sampled_from(SEGMENTS))
    def segment_down(self, seg: str) -> None:
        if seg in self.segments:
            self.segment_lost(seg, "heartbeat_timeout")

    @precondition(lambda self: self.segments)
    @rule(
        domain=st.sampled_from(DOMAINS),
        chain=st.sampled_from(CHAINS),
        placed=st.sets(st.sampled_from(SEGMENTS), min_size=1, max_size=2),
    )
    def publish(self, domain: DomainDigest, chain: ChainHash, placed: set[str]) -> None:
        live = {s for s in placed if s in self.segments}
        key = domain + chain
        if not live or key in self.groups:
            return  # placement only on segments up; a published group is never rewritten
        self.groups[key] = live
        self.emit(
            m.GroupPublished(
                group=chain,
                chunk_index=CHAINS.index(chain),
                members=1,
                namespace=namespace(domain),
                placements=[m.SegmentBytes(s, 100) for s in sorted(live)],
            )
        )

    @rule(domain=st.sampled_from(DOMAINS), chain=st.sampled_from(CHAINS), evict=st.booleans())
    def remove(self, domain: DomainDigest, chain: ChainHash, evict: bool) -> None:
        if self.groups.pop(domain + chain, None) is None:
            return
        if evict:
            self.emit(m.GroupEvicted(group=chain, reason="pressure", domain=domain))
        else:
            self.emit(m.GroupInvalidated(group=chain, reason="corrupt", domain=domain))

    @rule(
        domain=st.sampled_from(DOMAINS),
        chain=st.sampled_from(CHAINS),
        placed=st.sets(st.sampled_from(SEGMENTS), min_size=1, max_size=2),
    )
    def handover(self, domain: DomainDigest, chain: ChainHash, placed: set[str]) -> None:
        """A shard's core stopped with its last event queued, not published (a handover's drain
        ended first): the group's eviction, or its publication, never got a sequence. The next
        core's first event is `shard_started`."""
        key = domain + chain
        live = {s for s in placed if s in self.segments}
        if key in self.groups:
            del self.groups[key]  # evicted: the `evicted` event dropped
            self.unpublished[key] = len(self.log) + 1  # (the marker's sequence, below)
        elif live:
            self.groups[key] = live  # published: the `published` event dropped
            self.unpublished[key] = len(self.log) + 1
        self.epoch += 1
        self.emit(m.ShardStarted(shard=0, epoch=self.epoch))

    @rule(groups=st.lists(st.tuples(st.sampled_from(CHAINS), st.integers(1, 9)), max_size=3))
    def accessed(self, groups: list[tuple[ChainHash, int]]) -> None:
        self.emit(m.GroupsAccessed(groups=[m.GroupHits(c, h, DOMAINS[0]) for c, h in groups]))

    # ---- the follower -----------------------------------------------------------------------

    @precondition(lambda self: self.next <= len(self.log))
    @rule()
    def deliver(self) -> None:
        result = self.index.apply(self.next, self.log[self.next - 1])
        assert self.mine.apply(self.next, self.log[self.next - 1]) == result
        if self.lost or (self.next > 1 and self.index.last_seq < self.next - 1):
            assert result == "gap"
            return
        assert result == "applied"
        self.next += 1

    @precondition(lambda self: self.next <= len(self.log) and not self.lost)
    @rule()
    def catch_up(self) -> None:
        """Everything pending delivered (checked caught up more often)."""
        while self.next <= len(self.log) and self.index.synced:
            self.deliver()

    @precondition(lambda self: self.index.last_seq >= 1)
    @rule(data=st.data())
    def redeliver(self, data: st.DataObject) -> None:
        seq = data.draw(st.integers(1, self.index.last_seq))
        before = (dict(self.index.groups), self.index.last_seq)
        assert self.index.apply(seq, self.log[seq - 1]) == "duplicate"
        assert self.mine.apply(seq, self.log[seq - 1]) == "duplicate"
        assert (dict(self.index.groups), self.index.last_seq) == before

    @precondition(lambda self: self.next <= len(self.log))
    @rule(data=st.data())
    def lose(self, data: st.DataObject) -> None:
        self.next = data.draw(st.integers(self.next + 1, len(self.log) + 1))
        self.lost = True

    def listing(self, ops: list[str], chain: ChainHash) -> tuple[int, list[ListedSegment], list[ListedGroup]]:
        """S, then the directory's state once a listing ends (it moves on while it is taken)."""
        at_seq = len(self.log)
        for seg in ops:
            self.segment_start(seg)
            self.publish(DOMAINS[1], chain, {seg})
        groups = [
            ListedGroup(key[:16], key[16:], CHAINS.index(key[16:]), 100, frozenset(replicas))
            for key, replicas in self.groups.items()
        ]
        return at_seq, [ListedSegment(s, inc, True) for s, inc in self.segments.items()], groups

    @precondition(lambda self: self.lost or not self.index.synced)
    @rule(ops=st.lists(st.sampled_from(SEGMENTS), max_size=2), chain=st.sampled_from(CHAINS))
    def resync(self, ops: list[str], chain: ChainHash) -> None:
        at_seq, segments, listing = self.listing(ops, chain)
        self.index.resync(segments, listing, at_seq=at_seq)  # (a stale listing's view replaced)
        self.mine.resync(segments, listing, at_seq=at_seq)
        self.next = at_seq + 1
        self.lost = False
        self.stale = None
        self.unpublished.clear()

    @precondition(lambda self: self.stale is None and self.index.synced and self.index.resync_wanted)
    @rule(
        ops=st.lists(st.sampled_from(SEGMENTS), max_size=2),
        chain=st.sampled_from(CHAINS),
        then=st.sampled_from(["", "evict", "handover"]),
    )
    def stale_listing_start(self, ops: list[str], chain: ChainHash, then: str) -> None:
        """A marker's listing: the follower keeps delivering (and the directory changing) while
        it is indexed beside the view served (`then`: an eviction or another handover at once,
        after its sequence)."""
        assert self.mine.resync_wanted and self.mine.synced
        at_seq, segments, listing = self.listing(ops, chain)
        tokens = (
            self.index.resync_start(segments, at_seq=at_seq),
            self.mine.resync_start(segments, at_seq=at_seq),
        )
        self.stale = (at_seq, listing, tokens)
        for key in list(self.groups)[:1] if then else []:
            domain, chain = DomainDigest(key[:16]), ChainHash(key[16:])
            if then == "evict":
                self.remove(domain, chain, evict=True)
            else:
                self.handover(domain, chain, set())

    @precondition(lambda self: self.stale is not None and self.stale[1])
    @rule(n=st.integers(1, 8))
    def stale_listing_add(self, n: int) -> None:
        assert self.stale is not None
        at_seq, listing, tokens = self.stale
        assert self.index.resync_add(tokens[0], listing[:n]) and self.mine.resync_add(tokens[1], listing[:n])
        self.stale = (at_seq, listing[n:], tokens)

    @precondition(lambda self: self.stale is not None and not self.stale[1] and self.index.synced)
    @rule()
    def stale_listing_done(self) -> None:
        """The events from S + 1 up to the view served replayed onto the new view, then swapped
        in; the follower reads on where it was. Swapped in as of S instead, the view served went
        back: it counted again, until the replay reached them, groups an eviction or a
        segment_down after S had already taken out (review, 2026-12-07). So a view behind is
        refused, and once the view served was caught up the new one is, and exact."""
        assert self.stale is not None
        at_seq, _, (token, mine_token) = self.stale
        served = self.index.last_seq
        assert self.mine.last_seq == served
        if at_seq < served:
            behind = self.index.counters["resyncs_behind"]
            assert not self.index.resync_done(token)  # behind the view served: refused
            assert self.index.counters["resyncs_behind"] == behind + 1 and self.index.last_seq == served
        # A marker replayed after a later one was applied to the view served is fenced (its
        # epoch below the shard's highest: `kvfabric.core.shard_fence`, the fence shared); the
        # later marker, replayed after it, asks for the listing again.
        highest = max((e.epoch for e in self.log[:served] if isinstance(e, m.ShardStarted)), default=0)
        for seq in range(at_seq + 1, served + 1):
            event = self.log[seq - 1]
            fenced = isinstance(event, m.ShardStarted) and event.epoch < highest
            expected = "fenced" if fenced else "applied"
            assert self.index.resync_replay(token, seq, event) == expected
            assert self.mine.resync_replay(mine_token, seq, event) == expected
        wanted_again = any(isinstance(e, m.ShardStarted) for e in self.log[at_seq:served])
        assert self.index.resync_done(token) and self.mine.resync_done(mine_token)
        assert self.index.synced and self.index.last_seq == max(at_seq, served)
        assert self.index.resync_wanted == wanted_again and self.index.resync_building is None
        assert not self.index.resync_add(token, [])  # that listing's token is spent
        if self.next <= self.index.last_seq + 1:  # what the follower skipped, the listing covers
            self.next = self.index.last_seq + 1
            self.lost = False
        self.stale = None
        # Covered: what a handover dropped before S. One dropped after S (again, maybe: a group
        # the listing shows) stays unknown, its marker after S keeping `resync_wanted` set.
        self.unpublished = {k: seq for k, seq in self.unpublished.items() if seq > at_seq}

    @precondition(lambda self: self.stale is not None and self.stale[1])
    @rule()
    def stale_listing_fails(self) -> None:
        assert self.stale is not None
        _, _, (token, mine_token) = self.stale
        assert self.index.resync_abort(token) and self.mine.resync_abort(mine_token)
        self.stale = None
        assert self.index.resync_building is None

    @rule(keys=st.integers(1, 3))
    def sweep_some(self, keys: int) -> None:
        """The shell sweeps a slice of a lost segment's groups between batches."""
        self.index.sweep(keys)
        self.mine.sweep(keys)

    # ---- checks -----------------------------------------------------------------------------

    def live_groups(self) -> dict[bytes, set[str]]:
        """The index's groups as a route reads them: dead replicas (not swept yet) left out."""
        got = {k: self.index.live_replicas(k) for k in self.index.groups}
        return {k: replicas for k, replicas in got.items() if replicas}

    @invariant()
    def consistent(self) -> None:
        self.index.check_invariants()
        self.mine.check_invariants()
        assert all(key[:16] == DOMAINS[0] for key in self.mine.groups)
        if self.index.synced and not self.lost and self.index.last_seq == len(self.log):
            # Stale (a marker applied, its listing not swapped in): it differs only where a
            # handover dropped the event. Otherwise exact.
            assert self.index.resync_wanted or not self.unpublished
            unknown = self.unpublished

            def known(groups: dict[bytes, set[str]]) -> dict[bytes, set[str]]:
                return {k: r for k, r in groups.items() if r and k not in unknown}

            mine = {k: self.mine.live_replicas(k) for k in self.mine.groups}
            assert known(mine) == known({k: r for k, r in self.groups.items() if k[:16] == DOMAINS[0]})
            assert known(self.live_groups()) == known(self.groups)
            assert self.index.segments == self.segments
            for key in CHAIN_KEYS:
                if key in unknown:
                    continue
                run = self.index.available_run([key], 0)
                assert [e.replicas for e in run] == ([self.groups[key]] if key in self.groups else [])

    def teardown(self) -> None:
        # A fault-free end: resync if events were lost, then deliver the rest (as the follower
        # does, listing again whenever the index is not synced or a `shard_started` asks).
        while True:
            if self.lost or not self.index.synced or self.index.resync_wanted:
                self.resync([], CHAINS[0])
            if self.next > len(self.log):
                break
            self.deliver()
        self.consistent()
        assert self.index.last_seq == len(self.log)
        while self.index.sweep(1):
            pass
        assert not self.index.dead_replicas  # swept: nothing but live replicas left
        assert {k: set(e.replicas) for k, e in self.index.groups.items()} == self.groups


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_fresh_index_counts_nothing_until_synced() -> None:
    index = RoutingIndex()
    key = DOMAINS[0] + CHAINS[0]
    assert index.available_run([key], 0) == []
    assert index.apply(5, m.SegmentUp(segment_id="s0", incarnation=1)) == "gap"
    index.resync(
        [ListedSegment("s0", 1, True)],
        [ListedGroup(DOMAINS[0], CHAINS[0], 0, 7, frozenset({"s0"}))],
        at_seq=9,
    )
    assert [e.copy_bytes for e in index.available_run([key], 0)] == [7]
    assert index.apply(10, m.SegmentDown(segment_id="s0", incarnation=1, reason="x")) == "applied"
    assert index.available_run([key], 0) == []


def test_run_stops_at_first_missing_chunk() -> None:
    index = RoutingIndex()
    keys = [DOMAINS[0] + c for c in CHAINS[:3]]
    index.resync(
        [ListedSegment("s0", 1, True)],
        [ListedGroup(k[:16], k[16:], i, 1, frozenset({"s0"})) for i, k in enumerate(keys) if i != 1],
        at_seq=0,
    )
    assert len(index.available_run(keys, 0)) == 1
    assert len(index.available_run(keys, 2)) == 1


def test_stale_incarnation_down_is_ignored() -> None:
    """Shards announce a restart in their own order: an old incarnation's down arriving after the
    new incarnation's up must not drop what the new one holds."""
    index = RoutingIndex()
    index.resync([ListedSegment("s0", 1, True)], [], at_seq=0)
    key = DOMAINS[0] + CHAINS[0]
    events: list[m.DirectoryEvent] = [
        m.SegmentDown(segment_id="s0", incarnation=1, reason="restarted"),  # shard A
        m.SegmentUp(segment_id="s0", incarnation=2),  # shard A
        m.GroupPublished(
            group=CHAINS[0],
            chunk_index=0,
            members=1,
            namespace=namespace(DOMAINS[0]),
            placements=[m.SegmentBytes("s0", 5)],
        ),
        m.SegmentDown(segment_id="s0", incarnation=1, reason="restarted"),  # shard B, late
        m.SegmentUp(segment_id="s0", incarnation=2),  # shard B
    ]
    for seq, event in enumerate(events, 1):
        assert index.apply(seq, event) == "applied"
    assert index.groups[key].replicas == {"s0"}


def test_a_shard_started_marker_keeps_the_index_answering_until_its_listing_swaps_in() -> None:
    """A shard's new core may follow one that stopped with events unpublished (no sequence, so
    no gap): its `shard_started` asks for a listing. It made the index answer nothing until
    that listing was done, at every shard start (seconds at 400k groups, once per shard of a
    failover): now the index keeps answering what it held and following events, the listing is
    built beside it, the events after its sequence up to the view served replayed onto it, and
    swapped in whole: the view served never goes back (swapped in as of the listing's sequence,
    it counted k1 again, evicted at 6 but listed before that, until the replay reached 6)."""
    index = RoutingIndex()
    k0, k1, k2 = (DOMAINS[0] + c for c in CHAINS[:3])

    def listed(key: bytes) -> ListedGroup:
        return ListedGroup(key[:16], key[16:], CHAINS.index(key[16:]), 7, frozenset({"s0"}))

    index.resync([ListedSegment("s0", 1, True)], [listed(k0), listed(k1)], at_seq=4)
    assert index.apply(5, m.ShardStarted(shard=1, epoch=3)) == "applied"
    assert index.synced and index.resync_wanted and index.last_seq == 5
    assert index.counters["shard_starts"] == 1
    assert [e.chunk_index for e in index.available_run([k0, k1], 0)] == [0, 1]  # still answers
    assert not index.check_stream(1, 5)  # no gap: the follower reads on meanwhile

    # The listing (after sequence 5): k0's eviction was never published, the rebuild adopted k2.
    token = index.resync_start([ListedSegment("s0", 1, True)], at_seq=5)
    assert index.resync_add(token, [listed(k1)])  # (k1's shard listed before its eviction)
    evicted = m.GroupEvicted(group=CHAINS[1], reason="pressure", domain=DOMAINS[0])
    assert index.apply(6, evicted) == "applied"  # followed on the view served
    assert index.resync_add(token, [listed(k2)])
    assert index.resync_building == 2
    assert [e.chunk_index for e in index.available_run([k0, k1, k2], 0)] == [0]  # the old view
    assert index.apply(7, m.ShardStarted(shard=2, epoch=3)) == "applied"  # after its sequence
    index.check_invariants()

    assert not index.resync_done(token)  # as of 5, behind the view served (7): refused
    assert index.counters["resyncs_behind"] == 1 and index.last_seq == 7 and index.resync_building == 2
    assert index.available_run([k1], 0) == []  # (k1 not counted again)
    assert index.resync_replay(token, 6, evicted) == "applied"  # replayed onto the new view
    assert index.resync_replay(token, 7, m.ShardStarted(shard=2, epoch=3)) == "applied"
    assert index.available_run([k0], 0) != []  # the view served until the swap
    assert index.resync_done(token)
    assert index.synced and index.last_seq == 7 and index.resync_building is None
    assert index.counters["resyncs"] == 2 and index.counters["shard_starts"] == 3  # (replays too)
    assert {k: e.replicas for k, e in index.groups.items()} == {k2: {"s0"}}  # the directory's
    assert index.resync_wanted  # the marker after the listing's sequence asks again
    assert index.apply(7, m.ShardStarted(shard=2, epoch=3)) == "duplicate"  # read on after 7
    assert not index.resync_done(token) and index.counters["resync_stale_writes"] == 1  # spent
    index.check_invariants()


def test_a_loss_after_the_listings_sequence_keeps_it_wanted_after_the_swap() -> None:
    """A listing as of S covers only the losses whose marker is at or before S. A handover that
    drops a group's eviction after S (a group the listing shows, its publication lost by an
    earlier handover) leaves the swapped-in view over-counting it, which its marker, replayed
    onto the new view, must keep `resync_wanted` for; a marker read only after the swap asks
    again then. Only a listing begun after that marker forgets the group. (The model test once
    forgot such a group at the first swap: its rule, not the index, was wrong.)"""
    index = RoutingIndex()
    key = DOMAINS[0] + CHAINS[0]
    up = [ListedSegment("s0", 1, True)]
    shows_key = [ListedGroup(key[:16], key[16:], 0, 7, frozenset({"s0"}))]
    index.resync(up, [], at_seq=1)
    assert index.apply(2, m.ShardStarted(shard=0, epoch=2)) == "applied"  # key's publication lost
    token = index.resync_start(up, at_seq=2)  # (the marker at 2: covered)
    assert index.resync_add(token, shows_key)
    assert index.apply(3, m.ShardStarted(shard=0, epoch=3)) == "applied"  # key's eviction lost
    assert not index.resync_done(token)  # behind: 3 replayed first
    assert index.resync_replay(token, 3, m.ShardStarted(shard=0, epoch=3)) == "applied"
    assert index.resync_done(token) and index.last_seq == 3
    assert set(index.groups) == {key} and index.resync_wanted  # over-counted, and wanted

    # A listing as of 3 (showing key: taken before the next loss), swapped in before the marker
    # of that loss (4) is read: the want clears, and the marker read after it sets it again.
    token = index.resync_start(up, at_seq=3)
    assert index.resync_add(token, shows_key) and index.resync_done(token)
    assert not index.resync_wanted
    assert index.apply(4, m.ShardStarted(shard=0, epoch=4)) == "applied"
    assert index.resync_wanted and set(index.groups) == {key}

    token = index.resync_start(up, at_seq=4)  # begun after the marker: the directory's state
    assert index.resync_done(token)
    assert not index.resync_wanted and not index.groups
    index.check_invariants()


def test_a_replayed_segment_down_leaves_the_new_view_swept_later() -> None:
    """A `segment_down` after the listing's sequence, replayed onto the new view before the
    swap: its replicas are dead there at once (not counted), swept after the swap."""
    index = RoutingIndex()
    k0, k1 = (DOMAINS[0] + c for c in CHAINS[:2])
    up = [ListedSegment("s0", 1, True), ListedSegment("s1", 1, True)]
    index.resync(up, [], at_seq=1)
    assert index.apply(2, m.ShardStarted(shard=0, epoch=2)) == "applied"
    token = index.resync_start(up, at_seq=2)
    index.resync_add(token, [ListedGroup(k[:16], k[16:], 0, 7, frozenset({"s0", "s1"})) for k in (k0, k1)])
    down = m.SegmentDown(segment_id="s1", incarnation=1, reason="heartbeat_timeout")
    assert index.apply(3, down) == "applied"
    assert index.resync_replay(token, 3, down) == "applied"
    index.check_invariants()  # (the view being built holds dead replicas now)
    assert index.resync_replay(token, 5, m.GroupsAccessed(groups=[])) == "gap"
    assert not index.resync_done(token)  # its replay met a gap: never swapped in
    assert index.resync_abort(token) and index.resync_building is None

    token = index.resync_start(up, at_seq=2)
    index.resync_add(token, [ListedGroup(k[:16], k[16:], 0, 7, frozenset({"s0", "s1"})) for k in (k0, k1)])
    assert index.resync_replay(token, 3, down) == "applied"
    assert index.resync_done(token) and index.dead_replicas == 2
    assert [e.replicas for e in index.available_run([k0, k1], 0)] == [{"s0"}, {"s0"}]
    while index.sweep(1):
        pass
    assert {k: e.replicas for k, e in index.groups.items()} == {k0: {"s0"}, k1: {"s0"}}
    index.check_invariants()


def test_a_listing_given_up_cannot_write_into_the_next_listings_view() -> None:
    """A stale listing's task left running after the follower gave it up (Python 3.11's
    `wait_for` can swallow its cancellation for a whole request timeout) went on calling
    `resync_add` on the same index: into the view of the gap listing that followed, and a view
    mixing the two was swapped in (review, 2026-12-07). Each listing writes through its own
    build token: a stale token's calls change nothing and are counted."""
    index = RoutingIndex()
    k0, k1, k2 = (DOMAINS[0] + c for c in CHAINS[:3])

    def listed(key: bytes) -> ListedGroup:
        return ListedGroup(key[:16], key[16:], CHAINS.index(key[16:]), 7, frozenset({"s0"}))

    index.resync([ListedSegment("s0", 1, True)], [listed(k0)], at_seq=1)
    assert index.apply(2, m.ShardStarted(shard=0, epoch=2)) == "applied"
    stale = index.resync_start([ListedSegment("s0", 1, True)], at_seq=2)  # the stale listing's
    assert index.resync_add(stale, [listed(k1)])
    assert index.apply(4, m.GroupsAccessed(groups=[])) == "gap"  # the follower lists again
    gap = index.resync_start([ListedSegment("s0", 1, True)], at_seq=4)  # the gap listing's
    assert gap != stale and index.resync_building == 0
    # The stale listing's task, still running, writes on: nothing of it lands.
    assert not index.resync_add(stale, [listed(k1)])
    assert index.resync_replay(stale, 3, m.GroupsAccessed(groups=[])) is None
    assert not index.resync_abort(stale) and index.resync_building == 0  # not the gap's view
    assert not index.resync_done(stale) and not index.synced
    assert index.counters["resync_stale_writes"] == 4
    assert index.resync_add(gap, [listed(k2)]) and index.resync_done(gap)
    assert index.synced and index.last_seq == 4 and set(index.groups) == {k2}  # the gap listing's
    assert not index.resync_add(stale, [listed(k1)]) and set(index.groups) == {k2}
    assert index.counters["resync_stale_writes"] == 5
    index.check_invariants()


def test_a_failed_stale_listing_leaves_the_view_served_and_a_gap_still_blanks() -> None:
    index = RoutingIndex()
    key = DOMAINS[0] + CHAINS[0]
    index.resync(
        [ListedSegment("s0", 1, True)],
        [ListedGroup(DOMAINS[0], CHAINS[0], 0, 7, frozenset({"s0"}))],
        at_seq=1,
    )
    index.leader_changed()  # the shard map's epochs: the same as a marker
    index.leader_changed()  # (asked once)
    assert index.synced and index.resync_wanted and index.counters["leader_changes"] == 1
    assert index.resync_abort(index.resync_start([], at_seq=1))
    assert index.resync_building is None and index.resync_wanted
    assert len(index.available_run([key], 0)) == 1
    index.unsync()  # its listing kept failing: no longer trusted
    assert not index.synced and index.available_run([key], 0) == [] and index.counters["stale_expired"] == 1
    index.resync([ListedSegment("s0", 1, True)], [], at_seq=2)
    assert index.synced and not index.resync_wanted
    assert index.apply(4, m.GroupsAccessed(groups=[])) == "gap"  # a gap hides anything: blank
    assert not index.synced and index.available_run([key], 0) == []


def test_stale_resync_pacing_coalesces_a_burst_and_bounds_the_wait() -> None:
    """Shards start one at a time (16+ after a failover or a cold start): their markers make one
    listing, not one each; a steady stream of markers cannot postpone it past `wait_max_ms`;
    listings start `interval_ms` after the last one ended; one that keeps failing is given up
    after `stale_max_ms`."""
    p = StaleResyncPacing(quiet_ms=1_000, wait_max_ms=5_000, interval_ms=3_000, stale_max_ms=60_000)
    assert not p.due(0, wanted=False)
    for t in range(0, 3_200, 200):  # 16 markers 200 ms apart
        p.marked(t)
        assert not p.due(t, wanted=True) and not p.due(t + 999, wanted=True)
    assert p.due(3_000 + 1_000, wanted=True)  # quiet for 1 s
    p.started(4_000)
    p.marked(4_500)  # during the listing (its shard may have been listed before it started)
    assert not p.due(9_000, wanted=True)  # one at a time
    p.listed(10_000)
    assert not p.due(12_999, wanted=True)  # the interval after the last listing's end
    assert p.due(13_000, wanted=True)
    p.started(13_000)
    p.listed(14_000)
    assert not p.due(20_000, wanted=False)  # nothing wanted any more
    for t in range(20_000, 40_000, 900):  # a marker every 900 ms: never quiet for 1 s
        p.marked(t)
        if p.due(t, wanted=True):
            break
    assert t == 20_000 + 6 * 900  # the first past 5 s after the first marker
    p.started(t)
    p.failed(t + 2_000)
    assert not p.overdue(t + 2_000) and not p.due(t + 4_999, wanted=True)
    assert p.due(t + 5_000, wanted=True)  # retried after the interval
    p.started(t + 5_000)
    assert not p.overdue(20_000 + 60_000)  # one under way is let finish
    p.failed(20_000 + 61_000)
    assert p.overdue(20_000 + 61_000)  # wanted since 20,000 with none succeeding: give up


def test_check_stream_sees_aged_out_and_recreated_streams() -> None:
    index = RoutingIndex()
    assert index.check_stream(1, 0)  # empty stream, fresh index: not synced yet (list first)
    index.resync([], [], at_seq=10)
    assert not index.check_stream(3, 12)  # our next event is still there
    assert index.check_stream(12, 20)  # 11 aged out before we read it
    index.resync([], [], at_seq=20)
    assert index.check_stream(1, 4)  # recreated: its sequences restarted below ours


def test_check_stream_sees_a_purge_and_a_stream_recreated_past_us() -> None:
    index = RoutingIndex()
    assert index.check_stream(1, 0, "t0")  # not synced: list first (the creation time is kept)
    index.resync([], [], at_seq=10)
    assert not index.check_stream(11, 10, "t0")  # purged right after our last event: nothing lost
    assert index.check_stream(31, 30, "t0")  # purged (empty now) with 11..30 unread
    index.resync([], [], at_seq=30)
    assert not index.check_stream(31, 30, "t1")  # the directory's repair: recreated at its end + 1
    assert index.check_stream(1, 50, "t2")  # recreated from 1 and already past us
    assert index.counters["gaps"] == 2


def test_a_groups_copy_bytes_come_from_the_event_not_a_placement() -> None:
    """One copy's bytes are the group's (`group_bytes`), not a segment's placement: a head copied
    to disk counts both its replicas there (200 for a 100-byte group), a group split across a
    segment's tiers (one member in the arena, one on disk) counts each member once (200 for a
    200-byte group: the placements alone cannot tell the two apart), and a group whose members
    were placed apart holds less than a copy on each segment. An older directory's event (no
    `group_bytes`) falls back to the largest placement."""
    index = RoutingIndex()
    index.resync([ListedSegment("s0", 1, True), ListedSegment("s1", 1, True)], [], at_seq=0)
    key = DOMAINS[0] + CHAINS[0]

    def event(placements: dict[str, int], disk: dict[str, int], group_bytes: int) -> m.GroupPublished:
        return m.GroupPublished(
            group=CHAINS[0],
            chunk_index=0,
            members=2,
            namespace=namespace(DOMAINS[0]),
            placements=[m.SegmentBytes(s, b) for s, b in placements.items()],
            disk_placements=[m.SegmentBytes(s, b) for s, b in disk.items()],
            group_bytes=group_bytes,
        )

    def copy_bytes() -> int:
        (entry,) = index.available_run([key], 0)
        return entry.copy_bytes

    index.apply(1, event({"s0": 100}, {}, 100))
    assert copy_bytes() == 100
    index.apply(2, event({"s0": 200}, {"s0": 100}, 100))  # in s0's arena and on its disk
    assert copy_bytes() == 100
    index.apply(3, event({"s0": 200}, {"s0": 100}, 200))  # one member in the arena, one on disk
    assert copy_bytes() == 200
    index.apply(4, event({"s0": 100, "s1": 100}, {}, 200))  # its two members on two segments
    assert copy_bytes() == 200
    index.apply(5, event({"s0": 300}, {}, 0))  # an older directory: the largest placement
    assert copy_bytes() == 300
    index.check_invariants()


def test_a_lost_segments_groups_leave_in_slices_and_count_for_nothing_meanwhile() -> None:
    """A `segment_down` costs O(1) at once (100,000 groups walked stalled the router 230-290 ms):
    its replicas are dead, swept in slices (`sweep`), counting for nothing meanwhile. The segment
    back under a new incarnation needs no sweep first: a group published there again is live."""
    index = RoutingIndex()
    index.resync(
        [ListedSegment("s0", 1, True), ListedSegment("s1", 1, True)],
        [
            ListedGroup(DOMAINS[0], c, i, 7, frozenset({"s0", "s1"} if i == 0 else {"s0"}))
            for i, c in enumerate(CHAINS)
        ],
        at_seq=1,
    )
    keys = [DOMAINS[0] + c for c in CHAINS]
    assert index.apply(2, m.SegmentDown(segment_id="s0", incarnation=1, reason="x")) == "applied"
    assert len(index.groups) == len(CHAINS) and index.dead_replicas == len(CHAINS)  # none walked
    assert [e.replicas for e in index.available_run(keys, 0)] == [{"s1"}]  # the rest: nothing
    index.check_invariants()
    assert index.sweep(2)  # more left
    index.check_invariants()
    assert index.apply(3, m.SegmentUp(segment_id="s0", incarnation=2)) == "applied"  # a restart
    assert index.dead_replicas == len(CHAINS) - 2  # not swept by it
    assert [e.replicas for e in index.available_run(keys, 0)] == [{"s1"}]
    published = m.GroupPublished(
        group=CHAINS[1],
        chunk_index=1,
        members=1,
        namespace=namespace(DOMAINS[0]),
        placements=[m.SegmentBytes("s0", 7)],
    )
    assert index.apply(4, published) == "applied"  # stored again on the new incarnation: live
    assert index.live_replicas(keys[1]) == {"s0"}
    assert [e.replicas for e in index.available_run(keys, 0)] == [{"s1"}, {"s0"}]
    index.check_invariants()
    while index.sweep(1):
        index.check_invariants()
    assert {k: e.replicas for k, e in index.groups.items()} == {keys[0]: {"s1"}, keys[1]: {"s0"}}
    index.check_invariants()


SEGMENT_IDS = ("s0", "s1", "s2")
KEYS = tuple(d + c for d in DOMAINS[:1] for c in CHAINS[:3])
directory_events = st.one_of(
    st.builds(
        lambda chain, placed: m.GroupPublished(
            group=chain,
            chunk_index=CHAINS.index(chain),
            members=1,
            namespace=namespace(DOMAINS[0]),
            placements=[m.SegmentBytes(s, 7) for s in sorted(placed)],
        ),
        st.sampled_from(CHAINS[:3]),
        st.sets(st.sampled_from(SEGMENT_IDS), max_size=3),
    ),
    st.builds(
        lambda chain, domain: m.GroupEvicted(group=chain, reason="pressure", domain=domain),
        st.sampled_from(CHAINS[:3]),
        st.sampled_from([DOMAINS[0], b""]),
    ),
    st.builds(
        lambda seg, inc: m.SegmentDown(segment_id=seg, incarnation=inc, reason="x"),
        st.sampled_from(SEGMENT_IDS),
        st.integers(1, 4),
    ),
    st.builds(
        lambda seg, inc: m.SegmentUp(segment_id=seg, incarnation=inc),
        st.sampled_from(SEGMENT_IDS),
        st.integers(1, 4),
    ),
)


@settings(max_examples=400, deadline=None)
@given(steps=st.lists(st.tuples(directory_events, st.integers(0, 3)), max_size=40))
def test_an_index_swept_in_slices_answers_as_one_swept_at_once(
    steps: list[tuple[m.DirectoryEvent, int]],
) -> None:
    """Any events at all (not only what a directory sends: publications naming segments down,
    stale and repeated incarnations, evictions with and without a domain), each followed by a
    slice of 0-3 dead replicas swept: every route reads the same as from an index that sweeps
    everything at once, and once swept the two hold the same."""
    eager, lazy = RoutingIndex(), RoutingIndex()
    for index in (eager, lazy):
        index.resync([], [], at_seq=0)
    for seq, (event, slice_keys) in enumerate(steps, start=1):
        assert eager.apply(seq, event) == lazy.apply(seq, event) == "applied"
        while eager.sweep():
            pass
        lazy.sweep(slice_keys)
        lazy.check_invariants()
        assert lazy.segments == eager.segments
        for start in range(len(KEYS)):
            got = [(e.copy_bytes, e.replicas) for e in lazy.available_run(KEYS, start)]
            assert got == [(e.copy_bytes, e.replicas) for e in eager.available_run(KEYS, start)]
        for key in KEYS:
            assert lazy.live_replicas(key) == eager.live_replicas(key)
    while lazy.sweep(1):
        pass
    assert {k: e.replicas for k, e in lazy.groups.items()} == {k: e.replicas for k, e in eager.groups.items()}
    lazy.check_invariants()
