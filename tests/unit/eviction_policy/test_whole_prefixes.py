"""Whole prefixes on disk (issue 23, a power cycle): before the policy demotes a tail, the
ancestors of it that are on no disk are copied to disk with `keep_arena` (their arena replicas
stay), so the disk tier never holds a tail without its head and a power cycle, which loses the
arena, leaves every disk object findable. The shared hot head case: a head (system prompt) that
stays in DRAM while its tails are demoted. No NATS: a directory and a segment with state."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec
import pytest

from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.core.eviction import EvictBatch, EvictionConfig, EvictionCore
from kvfabric.eviction_policy import shell, tiers
from kvfabric.eviction_policy.shell import EvictionShell
from kvfabric.format.key import ChunkGroupId
from kvfabric.proto import directory as m
from kvfabric.proto.segment import SSD_SLOT_BASE, DemoteReply, DemoteRequest, DemoteResult, DemoteStatus
from tests.unit.eviction_policy.test_demote_batch import NAMESPACE
from tests.unit.eviction_policy.test_shell import A, chain, published

SIZE = 10  # bytes of each group (one object) in the core and in the directory


@dataclass
class Cluster:
    """One shard, one segment s1 with a disk tier: per group id its replicas' tiers."""

    tiers: dict[bytes, set[str]] = field(default_factory=dict)
    parent: dict[bytes, bytes] = field(default_factory=dict)
    requests: list[DemoteRequest] = field(default_factory=list)
    evicted: list[bytes] = field(default_factory=list)
    evict_tiers: dict[bytes, str] = field(default_factory=dict)  # group id -> the evict's tier
    evict_asks: list[list[bytes]] = field(default_factory=list)  # each evict request's groups
    leased: set[bytes] = field(default_factory=set)  # group ids `evict` answers "leased"
    answer: dict[bytes, DemoteStatus] = field(default_factory=dict)  # group id -> forced status

    def on_disk_without_its_head(self) -> list[bytes]:
        """Groups with a disk replica whose parent has none: unfindable after a power cycle."""
        return [g for g, t in self.tiers.items() if "ssd" in t and g in self.parent
                and "ssd" not in self.tiers.get(self.parent[g], set())]  # fmt: skip


class FakeDirectory(DirectoryRouter):
    def __init__(self, cluster: Cluster) -> None:
        super().__init__(cast(Any, None))
        self.shards = 1
        self.cluster = cluster

    async def refresh(self) -> None:
        raise AssertionError("the map is known")

    async def ask(self, shard: int, verb: str, message: msgspec.Struct, timeout_s: float, **_: Any) -> Any:
        if verb == "evict":  # tier "ssd": a group in the arena too loses only its disk replica
            assert isinstance(message, m.Evict)
            results = []
            self.cluster.evict_asks.append(list(message.groups))
            for i, g in enumerate(message.groups):
                self.cluster.evict_tiers[g] = message.tier
                if g in self.cluster.leased:
                    results.append(m.EvictResult(group=g, status="leased"))
                    continue
                if message.tails and any(results[j].status in m.EVICT_STAYS for j in message.tails[i]):
                    results.append(m.EvictResult(group=g, status="tail_stays"))  # as the directory
                    continue
                tiers = self.cluster.tiers.get(g, set())
                if message.tier == "ssd" and tiers == {"dram", "ssd"}:
                    tiers.discard("ssd")
                    results.append(m.EvictResult(group=g, status="disk_dropped"))
                    continue
                self.cluster.evicted.append(g)
                self.cluster.tiers.pop(g, None)
                results.append(m.EvictResult(group=g, status="evicting"))
            return m.EvictReply(epoch=1, results=results)
        assert verb == "show_group" and isinstance(message, m.ShowGroup)
        group = ChunkGroupId.from_bytes(message.group)
        tiers = self.cluster.tiers[message.group]
        replicas = [
            m.Replica(segment_id="s1", incarnation=1, slot=(SSD_SLOT_BASE if t == "ssd" else 0) + 1,
                      slot_generation=1)
            for t in sorted(tiers)
        ]  # fmt: skip
        obj = m.ObjectLocation(
            chunk_index=group.chunk_index, member=m.Member(0, 0, 0), size_bytes=SIZE, checksum=b"",
            replicas=replicas,
        )  # fmt: skip
        summary = m.GroupSummary(
            group=group.chain_hash, namespace=NAMESPACE, chunk_index=group.chunk_index, state="published",
            members=1, expected_members=1, objects=[obj],
        )  # fmt: skip
        return m.GroupList(epoch=1, groups=[summary])


def segment(cluster: Cluster) -> Any:
    """`demote.s1`: a keep_arena object gains a disk replica (copied), another moves there."""

    async def demote(nc: Any, subject: str, message: Any, decoder: Any, timeout_s: float) -> Any:
        assert subject.endswith("demote.s1") and isinstance(message, DemoteRequest)
        cluster.requests.append(message)
        results = []
        for o in message.objects:
            gid = bytes(o.key[:90])
            status = cluster.answer.get(gid)
            if status is None:
                tiers = cluster.tiers[gid]
                assert "dram" in tiers, "only an arena replica is demoted or copied"
                tiers.add("ssd")
                if not o.keep_arena:
                    tiers.discard("dram")
                status = "copied" if o.keep_arena else "demoted"
            results.append(DemoteResult(status))
        return DemoteReply(results=results, ssd_capacity_bytes=1 << 40, ssd_used_bytes=0)

    return demote


def setup(monkeypatch: pytest.MonkeyPatch, tails: int = 5) -> tuple[EvictionShell, Cluster]:
    """A head (chain 1) with `tails` tails (chains 2..) under it, all in s1's arena."""
    core = EvictionCore(EvictionConfig(policy="lru", high_watermark=0.5, low_watermark=0.25))
    sh = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0)
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=100), 0)
    cluster = Cluster()
    sh.apply(published(1, NAMESPACE, s1=SIZE), 1)
    for i in range(2, tails + 2):
        sh.apply(published(i, NAMESPACE, parent=1, s1=SIZE), i)
    for i in range(1, tails + 2):
        cluster.tiers[sh._group_ids[A + chain(i)]] = {"dram"}
        if i > 1:
            cluster.parent[sh._group_ids[A + chain(i)]] = sh._group_ids[A + chain(1)]
    sh._router = FakeDirectory(cluster)
    sh._nc = cast(Any, object())
    monkeypatch.setattr(shell, "nats_request", segment(cluster))
    return sh, cluster


def watermark_batch(sh: EvictionShell, at: int) -> EvictBatch:
    (batch,) = sh.core.tick(at)
    assert isinstance(batch, EvictBatch) and batch.pool == "s1" and batch.reason == "watermark"
    return batch


def test_a_head_that_stays_in_dram_is_copied_to_disk_before_its_tails_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sh, cluster = setup(monkeypatch)
    head = A + chain(1)
    batch = watermark_batch(sh, 10)  # 60 of 100 > 50 %: down to 25 %, four tails, not the head
    assert head not in batch.victims and len(batch.victims) == 4
    asyncio.run(sh._evict(batch))
    copy, move = cluster.requests
    assert [(bytes(o.key[:90]), o.keep_arena) for o in copy.objects] == [(sh._group_ids[head], True)]
    assert len(move.objects) == 4 and not any(o.keep_arena for o in move.objects)
    assert cluster.on_disk_without_its_head() == []  # every disk object findable after a cycle
    assert cluster.tiers[sh._group_ids[head]] == {"dram", "ssd"}
    # exact accounting: the head counts in both pools, like a replica; its tenant pays both
    assert sh.core.used_bytes("s1") == 2 * SIZE and sh.core.used_bytes("s1#ssd") == 5 * SIZE
    assert sh.core.tenant_bytes(A) == 7 * SIZE
    assert sh.demotions == {"head_copied": 1, "demoted": 4}
    sh.core.check_invariants()
    # the head keeps its place: no leaf while its last tail is in DRAM, so no disk-pool victim
    sh.core.set_capacity("s1#ssd", 40)
    now = sh._driver.now_ms()  # the shell's clock: the core's time never goes back
    (disk_batch,) = sh.core.tick(now)
    assert isinstance(disk_batch, EvictBatch) and disk_batch.pool == "s1#ssd"
    assert head not in disk_batch.victims
    for v in disk_batch.victims:
        sh.core.refused(v, now)
    # later the last tail and the head are demoted: the head's disk copy is already there
    sh.core.set_capacity("s1#ssd", 1 << 40)
    sh.core.set_capacity("s1", 30)
    batch = watermark_batch(sh, sh._driver.now_ms())
    assert batch.victims == (A + chain(6), head)
    asyncio.run(sh._evict(batch))
    assert len(cluster.requests) == 3 and not any(o.keep_arena for o in cluster.requests[2].objects)
    assert sh.core.used_bytes("s1") == 0 and sh.core.used_bytes("s1#ssd") == 6 * SIZE  # not 7
    assert cluster.on_disk_without_its_head() == []
    sh.core.check_invariants()


def test_a_copied_head_chosen_by_its_disk_pool_keeps_its_arena_replica(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once every tail of a copied head is on disk the head is a leaf of the disk pool too, and
    may be its victim: its disk tails go (evicted) and so does its disk copy, but its arena
    replica stays (`evict` tier "ssd" -> `disk_dropped`): the head is resident in its arena pool
    as before (it was evicted from both tiers)."""
    sh, cluster = setup(monkeypatch)
    head = A + chain(1)
    sh.core.set_capacity("s1", 40)  # 60 > 20: down to 10, all five tails
    batch = watermark_batch(sh, 10)
    assert head not in batch.victims and len(batch.victims) == 5
    asyncio.run(sh._evict(batch))
    assert cluster.tiers[sh._group_ids[head]] == {"dram", "ssd"}
    sh.core.set_capacity("s1#ssd", 40)  # 60 > 20: the disk pool's own victims
    now = sh._driver.now_ms()
    (disk_batch,) = sh.core.tick(now)
    assert isinstance(disk_batch, EvictBatch) and disk_batch.pool == "s1#ssd" and head in disk_batch.victims
    asyncio.run(sh._evict(disk_batch))
    assert cluster.tiers == {sh._group_ids[head]: {"dram"}}  # the tails evicted, the head in DRAM
    # only the head, which the records know in an arena, is asked to keep it; its tails go whole
    assert {g: t for g, t in cluster.evict_tiers.items() if t == "ssd"} == {sh._group_ids[head]: "ssd"}
    assert len(cluster.evict_tiers) == 6
    assert cluster.evicted[-1] != sh._group_ids[head]
    assert head in sh.core and not sh.core.is_evicting(head)
    assert sh._held[head][2] == {"s1": SIZE}
    for i in range(2, 7):  # the directory's events for the tails (one the core had not chosen)
        sh.apply(m.GroupEvicted(group=chain(i), reason="watermark", domain=A), now)
    assert sh.core.used_bytes("s1") == SIZE and sh.core.used_bytes("s1#ssd") == 0
    assert sh.demotions["disk_dropped"] == 1
    sh.core.check_invariants()


def test_a_disk_batch_naming_a_head_first_asks_its_tails_first_and_a_leased_tail_keeps_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A disk tail has no parent in the core, so a disk pool's batch may name a head before its
    tails: they are asked first all the same, and a tail that stays (leased) keeps its head
    from being asked (the head would lose its disk copy, leaving the tail on disk without its
    head after a power cycle). Review of fe59409."""
    sh, cluster = setup(monkeypatch)
    head = A + chain(1)
    sh.core.set_capacity("s1", 40)
    asyncio.run(sh._evict(watermark_batch(sh, 10)))  # all five tails to disk, the head copied
    cluster.leased = {sh._group_ids[A + chain(2)]}
    sh.core.set_capacity("s1#ssd", 40)
    (disk_batch,) = sh.core.tick(sh._driver.now_ms())
    assert isinstance(disk_batch, EvictBatch) and disk_batch.victims[0] == head  # the head first
    asyncio.run(sh._evict(disk_batch))
    asked = [g for request in cluster.evict_asks for g in request]
    assert sh._group_ids[head] not in asked  # a tail of it stayed
    assert cluster.on_disk_without_its_head() == []
    assert cluster.tiers[sh._group_ids[head]] == {"dram", "ssd"}
    assert head in sh.core and not sh.core.is_evicting(head)  # cooled down, tried again later
    sh.core.check_invariants()


def test_a_copied_head_whose_own_head_goes_whole_goes_whole_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk pool's batch of a chain H <- M <- T where H and T are on disk only and M, a head
    copied to disk, is in the arena too: H goes whole, so M keeping its arena replica
    (`disk_dropped`) would leave it in DRAM where no lookup reaches it (its head gone) until
    the arena evicted it. It goes whole as well (review of stop 39)."""
    core = EvictionCore(EvictionConfig(policy="lru", high_watermark=0.5, low_watermark=0.25))
    sh = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0)
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=100), 0)
    cluster = Cluster()
    disk = [m.SegmentBytes("s1", SIZE)]
    for i, (parent, placed) in enumerate([(None, SIZE), (1, 2 * SIZE), (2, SIZE)], start=1):
        event = msgspec.structs.replace(
            published(i, NAMESPACE, parent=parent, s1=placed), disk_placements=disk
        )
        sh.apply(event, i)
    head, middle, tail = (A + chain(i) for i in (1, 2, 3))
    assert sh._held[head][2] == {"s1#ssd": SIZE} and sh._held[middle][2] == {"s1": SIZE, "s1#ssd": SIZE}
    ids = {k: sh._group_ids[k] for k in (head, middle, tail)}
    cluster.tiers = {ids[head]: {"ssd"}, ids[middle]: {"dram", "ssd"}, ids[tail]: {"ssd"}}
    cluster.parent = {ids[middle]: ids[head], ids[tail]: ids[middle]}
    sh._router = FakeDirectory(cluster)
    sh._nc = cast(Any, object())
    monkeypatch.setattr(shell, "nats_request", segment(cluster))
    sh.core.set_capacity("s1#ssd", 20)  # 30 > 50 % of 20: down to 5, all three
    (batch,) = sh.core.tick(10)
    assert (
        isinstance(batch, EvictBatch)
        and batch.pool == "s1#ssd"
        and set(batch.victims) == {head, middle, tail}
    )
    asyncio.run(sh._evict(batch))
    assert cluster.tiers == {}  # before: {M: {"dram"}}, M in DRAM without its head
    assert cluster.evict_tiers[ids[middle]] == "all"
    assert not {head, middle, tail} & set(sh._held)
    sh.core.check_invariants()


def test_a_copied_head_under_a_disk_tail_the_batch_takes_goes_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """B <- A <- C <- D: A was demoted (its head B copied), C written under A later and copied
    when its tail D was demoted. The core knows A and D without a parent (on disk only), so the
    disk pool's batch is B and C, both in an arena too; A and D come in as disk tails of B and
    C and go whole, so C, under A, must go whole too (review of fec783e: the check ran on the
    batch before its disk tails were added, and C stayed in DRAM without its parent)."""
    core = EvictionCore(EvictionConfig(policy="lru", high_watermark=0.9, low_watermark=0.6))
    sh = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0)
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=1000), 0)
    b, a, c, d = (A + chain(i) for i in (1, 2, 3, 4))
    sh.apply(published(1, NAMESPACE, s1=SIZE), 1)
    sh.apply(published(2, NAMESPACE, parent=1, s1=SIZE), 2)
    sh._copied(b, "s1", SIZE)  # the demotion flow's own record updates
    sh._moved(a, "s1", 3)
    sh.apply(published(3, NAMESPACE, parent=2, s1=SIZE), 4)
    sh.apply(published(4, NAMESPACE, parent=3, s1=SIZE), 5)
    sh._copied(c, "s1", SIZE)
    sh._moved(d, "s1", 6)
    ids = {k: sh._group_ids[k] for k in (b, a, c, d)}
    cluster = Cluster(
        tiers={ids[b]: {"dram", "ssd"}, ids[a]: {"ssd"}, ids[c]: {"dram", "ssd"}, ids[d]: {"ssd"}},
        parent={ids[a]: ids[b], ids[c]: ids[a], ids[d]: ids[c]},
    )
    sh._router = FakeDirectory(cluster)
    sh._nc = cast(Any, object())
    monkeypatch.setattr(shell, "nats_request", segment(cluster))
    sh.core.set_capacity("s1#ssd", 40)
    batch = next(x for x in sh.core.tick(10) if isinstance(x, EvictBatch) and x.pool == "s1#ssd")
    assert set(batch.victims) == {b, c}
    asyncio.run(sh._evict(batch))
    assert cluster.evict_tiers[ids[c]] == "all" and cluster.evict_tiers[ids[b]] == "ssd"
    assert cluster.tiers == {ids[b]: {"dram"}}  # before: C in DRAM too, A (its parent) gone
    sh.core.check_invariants()


def test_a_leased_tail_keeps_its_head_in_the_same_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tail and its head of one shard go in one `evict` request; the request names the head's
    tails (`Evict.tails`), so the head stays when its tail does (review of 0097ecb: the
    directory judged each group alone and evicted the head)."""
    sh, cluster = setup(monkeypatch, tails=1)
    sh.demote = False
    head, tail = A + chain(1), A + chain(2)
    cluster.leased = {sh._group_ids[tail]}
    sh.core.set_capacity("s1", 20)  # 20 > 50 % of 20: down to 5, both
    batch = watermark_batch(sh, 100)
    assert batch.victims == (tail, head)
    asyncio.run(sh._evict(batch))
    assert cluster.evict_asks == [[sh._group_ids[tail], sh._group_ids[head]]]  # one request
    assert set(cluster.tiers) == {sh._group_ids[tail], sh._group_ids[head]}  # both still there
    assert head in sh.core and tail in sh.core and not sh.core.is_evicting(head)
    sh.core.check_invariants()


def test_a_head_whose_copy_failed_keeps_its_tails_in_dram(monkeypatch: pytest.MonkeyPatch) -> None:
    sh, cluster = setup(monkeypatch)
    cluster.answer[sh._group_ids[A + chain(1)]] = "failed"
    batch = watermark_batch(sh, 10)
    asyncio.run(sh._evict(batch))
    assert len(cluster.requests) == 1  # the copy only: no tail is demoted without its head
    assert cluster.on_disk_without_its_head() == [] and cluster.evicted == []
    for v in batch.victims:  # cooled down, tried again later
        assert v in sh.core and not sh.core.is_evicting(v)
    assert sh.demotions == {"head_failed": 1, "waits_for_head": 4}
    assert sh.core.used_bytes("s1#ssd") == 0
    sh.core.check_invariants()


def test_a_full_disk_refusing_the_head_stops_demotion(monkeypatch: pytest.MonkeyPatch) -> None:
    sh, cluster = setup(monkeypatch)
    cluster.answer[sh._group_ids[A + chain(1)]] = "no_capacity"
    batch = watermark_batch(sh, 10)
    ids = [sh._group_ids[v] for v in batch.victims if isinstance(v, bytes)]
    asyncio.run(sh._evict(batch))
    assert len(cluster.requests) == 1
    assert cluster.evicted == ids  # dropped: the arena gets its room
    assert cluster.on_disk_without_its_head() == []
    assert sh.core.used_bytes("s1") == 2 * SIZE
    sh.core.check_invariants()


def test_a_copy_the_records_missed_is_learned_not_made_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A policy that replayed the stream does not know a head's disk copy (no event says it):
    the directory's listing shows it, the disk pool counts it, nothing is copied again."""
    sh, cluster = setup(monkeypatch)
    cluster.tiers[sh._group_ids[A + chain(1)]] = {"dram", "ssd"}
    batch = watermark_batch(sh, 10)
    asyncio.run(sh._evict(batch))
    (move,) = cluster.requests
    assert not any(o.keep_arena for o in move.objects)
    assert sh.core.used_bytes("s1#ssd") == 5 * SIZE and sh.core.used_bytes("s1") == 2 * SIZE
    assert sh.demotions == {"head_on_disk": 1, "demoted": 4}
    sh.core.check_invariants()


def test_a_head_no_one_segment_holds_whole_lets_its_tails_go_as_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A head whose members the directory placed on different segments (TP > 1, several layer
    groups) has no one segment to copy it from: its tails are demoted as before this copy
    existed (counted `head_not_copied`), not cooled down for good, which kept them in DRAM over
    the high watermark (review of 434d328)."""
    sh, cluster = setup(monkeypatch)
    head = sh._group_ids[A + chain(1)]
    directory = cast(FakeDirectory, sh._router)
    ask = directory.ask

    async def spread_head(shard: int, verb: str, message: msgspec.Struct, timeout_s: float, **kw: Any) -> Any:
        if verb != "show_group" or not isinstance(message, m.ShowGroup) or message.group != head:
            return await ask(shard, verb, message, timeout_s, **kw)
        group = ChunkGroupId.from_bytes(head)
        objects = [
            m.ObjectLocation(
                chunk_index=group.chunk_index, member=m.Member(0, 0, 0), size_bytes=SIZE // 2, checksum=b"",
                replicas=[m.Replica(segment_id=seg, incarnation=1, slot=1, slot_generation=1)],
            )
            # two members on two segments (this fake layout has one member: the same fields twice)
            for seg in ("s1", "s2")
        ]  # fmt: skip
        summary = m.GroupSummary(
            group=group.chain_hash, namespace=NAMESPACE, chunk_index=group.chunk_index, state="published",
            members=2, expected_members=2, objects=objects,
        )  # fmt: skip
        return m.GroupList(epoch=1, groups=[summary])

    directory.ask = spread_head  # type: ignore[method-assign]
    batch = watermark_batch(sh, 10)
    asyncio.run(sh._evict(batch))
    (move,) = cluster.requests  # no copy: the tails' demotion only
    assert len(move.objects) == 4 and not any(o.keep_arena for o in move.objects)
    assert sh.demotions == {"head_spread": 1, "head_not_copied": 4, "demoted": 4}
    assert sh.core.used_bytes("s1#ssd") == 4 * SIZE
    sh.core.check_invariants()


def test_a_tail_demoted_from_one_of_its_arenas_keeps_its_head_from_being_a_leaf() -> None:
    """A tail held in two arenas, demoted from one of them, still has DRAM bytes: re-inserted
    into the core it keeps its parent, so its head (in DRAM) is no leaf and cannot be chosen
    before it (heads never before tails). Without its parent the head became a leaf."""
    core = EvictionCore(EvictionConfig(policy="lru", high_watermark=0.5, low_watermark=0.25))
    sh = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0)
    for seg in ("s1", "s2"):
        sh.apply(m.SegmentUp(segment_id=seg, incarnation=1, capacity_bytes=100), 0)
    sh.apply(published(1, NAMESPACE, s2=SIZE), 1)
    sh.apply(published(2, NAMESPACE, parent=1, s1=SIZE, s2=SIZE), 2)
    head = A + chain(1)
    assert core._objects[head].children == 1
    sh._moved(A + chain(2), "s1", 3)
    assert core.used_bytes("s1#ssd") == SIZE and core.used_bytes("s2") == 2 * SIZE
    assert core._objects[head].children == 1
    core.check_invariants()


def test_a_lost_segment_leaves_the_records_of_the_groups_it_shared() -> None:
    """A head in two arenas, copied to s1's disk; s1 goes down: the records no longer say the
    head is on a disk (its next tail's demotion copies it again), and a later move of its s2
    replica counts its bytes once (the stale pools came back into the core: 3x its bytes)."""
    core = EvictionCore(EvictionConfig(policy="lru", high_watermark=0.5, low_watermark=0.25))
    sh = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0)
    for seg in ("s1", "s2"):
        sh.apply(m.SegmentUp(segment_id=seg, incarnation=1, capacity_bytes=100), 0)
    sh.apply(published(1, NAMESPACE, s1=SIZE, s2=SIZE), 1)
    sh.apply(published(2, NAMESPACE, parent=1, s2=SIZE), 2)
    head = A + chain(1)
    sh._copied(head, "s1", SIZE)
    assert sh._held[head][2] == {"s1": SIZE, "s2": SIZE, "s1#ssd": SIZE}
    sh.apply(m.SegmentDown(segment_id="s1", incarnation=1, reason="heartbeat_timeout"), 3)
    assert sh._held[head][2] == {"s2": SIZE}
    sh._moved(head, "s2", 4)
    assert core.used_bytes("s2#ssd") == SIZE and core.tenant_bytes(A) == 2 * SIZE
    core.check_invariants()


def test_head_copies_are_cut_into_requests_within_the_demote_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two heads to copy, a request bound of one head's bytes: two copy requests, as the
    victims' own requests are cut (`demote_request_fits`); one request of every copy could run
    past the demote timeout (review of 434d328)."""
    sh, cluster = setup(monkeypatch)
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=200), 20)
    sh.apply(published(7, NAMESPACE, s1=SIZE), 21)
    for i in range(8, 13):
        sh.apply(published(i, NAMESPACE, parent=7, s1=SIZE), 14 + i)
    for i in range(7, 13):
        cluster.tiers[sh._group_ids[A + chain(i)]] = {"dram"}
        if i > 7:
            cluster.parent[sh._group_ids[A + chain(i)]] = sh._group_ids[A + chain(7)]
    sh.apply(m.GroupsAccessed(groups=[m.GroupHits(chain(1), 1, A), m.GroupHits(chain(7), 1, A)]), 30)
    monkeypatch.setattr(tiers, "DEMOTE_REQUEST_BYTES_MAX", SIZE + SIZE // 2)
    (batch,) = sh.core.tick(40)
    assert isinstance(batch, EvictBatch)
    assert {A + chain(1), A + chain(7)}.isdisjoint(batch.victims)
    assert {sh._parent.get(v) for v in batch.victims if isinstance(v, bytes)} == {A + chain(1), A + chain(7)}
    asyncio.run(sh._evict(batch))
    copies = [r for r in cluster.requests if any(o.keep_arena for o in r.objects)]
    assert [len(r.objects) for r in copies] == [1, 1]
    assert cluster.on_disk_without_its_head() == []
    sh.core.check_invariants()


def one_group_a_request(monkeypatch: pytest.MonkeyPatch) -> tuple[EvictionShell, Cluster, bytes, bytes]:
    """A head and its one tail, both victims of one batch, each in a demote request of its own."""
    monkeypatch.setattr(tiers, "DEMOTE_REQUEST_GROUPS_MAX", 1)
    sh, cluster = setup(monkeypatch, tails=1)
    head, tail = A + chain(1), A + chain(2)
    sh.core.set_capacity("s1", 20)  # 20 > 50 % of 20: down to 5, both
    return sh, cluster, head, tail


def test_a_batchs_head_is_demoted_before_its_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    sh, cluster, head, tail = one_group_a_request(monkeypatch)
    batch = watermark_batch(sh, 100)
    assert batch.victims == (tail, head)  # the core's order: tails first
    asyncio.run(sh._evict(batch))
    asked = [bytes(o.key[:90]) for r in cluster.requests for o in r.objects]
    assert asked == [sh._group_ids[head], sh._group_ids[tail]]
    assert cluster.tiers == {sh._group_ids[head]: {"ssd"}, sh._group_ids[tail]: {"ssd"}}
    assert sh.core.used_bytes("s1") == 0 and sh.core.used_bytes("s1#ssd") == 2 * SIZE
    sh.core.check_invariants()


def test_a_tail_whose_head_failed_in_an_earlier_request_waits_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tails first, the tail reached the disk in one request and its head failed in the next:
    the tail on disk without its head (unfindable after a power cycle)."""
    sh, cluster, head, tail = one_group_a_request(monkeypatch)
    cluster.answer[sh._group_ids[head]] = "failed"
    batch = watermark_batch(sh, 100)
    asyncio.run(sh._evict(batch))
    assert len(cluster.requests) == 1  # the head's only
    assert cluster.on_disk_without_its_head() == []
    assert cluster.tiers == {sh._group_ids[head]: {"dram"}, sh._group_ids[tail]: {"dram"}}
    for v in (head, tail):  # cooled down, tried again later
        assert v in sh.core and not sh.core.is_evicting(v)
    assert sh.demotions == {"failed": 1, "waits_for_head": 1}
    sh.core.check_invariants()


def test_a_full_disk_refusing_a_batchs_head_leaves_no_tail_on_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tails first, the tail was written to disk, then the head, refused by the full disk, was
    dropped and took the tail with it: a disk write for nothing. Heads first, the tail is never
    written; both are dropped, the tail first."""
    sh, cluster, head, tail = one_group_a_request(monkeypatch)
    ids = [sh._group_ids[tail], sh._group_ids[head]]
    cluster.answer[ids[1]] = "no_capacity"
    batch = watermark_batch(sh, 100)
    asyncio.run(sh._evict(batch))
    assert len(cluster.requests) == 1
    assert cluster.on_disk_without_its_head() == []
    assert cluster.evicted == ids  # the tail first, as always
    sh.core.check_invariants()


def test_a_failed_head_holds_back_its_whole_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    """1 <- 2 <- 3, all victims of one batch, a request each: 1 fails, so 2 waits, so 3 waits."""
    monkeypatch.setattr(tiers, "DEMOTE_REQUEST_GROUPS_MAX", 1)
    core = EvictionCore(EvictionConfig(policy="lru", high_watermark=0.5, low_watermark=0.25))
    sh = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0)
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=20), 0)
    cluster = Cluster()
    for i in (1, 2, 3):
        sh.apply(published(i, NAMESPACE, parent=i - 1 or None, s1=SIZE), i)
        cluster.tiers[sh._group_ids[A + chain(i)]] = {"dram"}
        if i > 1:
            cluster.parent[sh._group_ids[A + chain(i)]] = sh._group_ids[A + chain(i - 1)]
    sh._router = FakeDirectory(cluster)
    sh._nc = cast(Any, object())
    monkeypatch.setattr(shell, "nats_request", segment(cluster))
    cluster.answer[sh._group_ids[A + chain(1)]] = "failed"
    batch = watermark_batch(sh, 100)
    assert batch.victims == (A + chain(3), A + chain(2), A + chain(1))
    asyncio.run(sh._evict(batch))
    assert len(cluster.requests) == 1 and all(t == {"dram"} for t in cluster.tiers.values())
    assert sh.demotions == {"failed": 1, "waits_for_head": 2}
    sh.core.check_invariants()
