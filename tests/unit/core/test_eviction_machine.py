"""Hypothesis state machine for the eviction core against a simple model: no leased or pinned
object is ever evicted (the directory refuses, the core cools it down), victims are leaves
(a prefix never keeps a tail whose head the policy evicted), watermarks and quotas hold once
pressure is resolved, accounting never drifts."""

from __future__ import annotations

from collections.abc import Iterator

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfabric.core.eviction import (
    ADMIT_REASONS,
    REFUSE_REASONS,
    REFUSED_BACKOFF_SHIFT_MAX,
    VICTIM_REASONS,
    AdmissionName,
    Admitted,
    EvictBatch,
    EvictionConfig,
    EvictionCore,
    PolicyName,
    Refused,
    TenantQuota,
)
from kvfabric.core.eviction_model import ObjectId

POOLS = ("p0", "p1")
CAPACITY = 16
TENANTS = ("t0", "t1", "t2")
QUOTAS = {"t1": TenantQuota(hard_bytes=25), "t2": TenantQuota(guaranteed_bytes=8)}


class EvictionMachine(RuleBasedStateMachine):
    policy: PolicyName = "gdsf"
    admission: AdmissionName = "always"
    inflow_horizon_ms = 0

    def __init__(self) -> None:
        super().__init__()
        self.config = EvictionConfig(
            policy=self.policy,
            admission=self.admission,
            high_watermark=0.9,
            low_watermark=0.7,
            batch_max=6,
            refused_cooldown_ms=50,
            reuse_horizon_ms=40,
            density_recompute_every=4,  # density: learned densities in play within a few steps
            inflow_horizon_ms=self.inflow_horizon_ms,
        )
        self.core = EvictionCore(self.config, QUOTAS)
        for pool in POOLS:
            self.core.set_capacity(pool, CAPACITY)
        self.now = 0
        self.next_id = 0
        # id -> (tenant, {pool: bytes}, parent)
        self.resident: dict[int, tuple[str, dict[str, int], int | None]] = {}
        self.chunks: dict[int, int] = {}  # id -> its chunk index (a parent's is lower)
        self.evicting: set[int] = set()
        self.leased: set[int] = set()
        self.cooldown: dict[int, int] = {}
        self.unpinned_evicting: set[int] = set()  # victims under way whose last pin ended
        self.refusals: dict[int, int] = {}  # refusals in a row (each doubles the next cooldown)
        self.batches = 0
        # a pool lost and dropped in steps (`drop_pool_steps`), other rules running between them
        self.dropping: Iterator[tuple[list[ObjectId], list[ObjectId]]] | None = None
        self.dropping_pool = ""

    def rank(self, object_id: int) -> dict[str, object]:
        """What ranks a resident object, which a tier move keeps (its place in a queue policy's
        order is checked by the order's own `check`)."""
        explained = self.core.explain(object_id)
        assert explained is not None
        kept = (
            "last_access_ms",
            "accesses",
            "chunk_index",
            "tenant",
            "turn",
            "prompt_chunks",
            "density_class",
        )
        rank = {k: v for k, v in explained.items() if k in kept}
        rank["cooldown_until_ms"] = self.core._objects[object_id].cooldown_until_ms
        return rank

    def arrived(self, object_id: int) -> None:
        """Children stored before it (`insert_before_parent`) stay its children only if after it
        in a prefix: else two could name each other, neither ever a leaf."""
        for child, (tenant, pools, named) in list(self.resident.items()):
            if named == object_id and self.chunks[child] <= self.chunks[object_id]:
                self.resident[child] = (tenant, pools, None)

    def children(self, object_id: int) -> list[int]:
        return [o for o, (_, _, parent) in self.resident.items() if parent == object_id]

    def check_batch(self, batch: EvictBatch) -> None:
        assert len(batch.victims) <= self.config.batch_max
        assert len(batch.victim_reasons) == len(batch.victims)
        assert set(batch.victim_reasons) <= set(VICTIM_REASONS)
        for victim in batch.victims:
            assert isinstance(victim, int)
            assert victim in self.resident and victim not in self.evicting, "chosen twice or not resident"
            tenant, pools, _ = self.resident[victim]
            assert batch.pool in pools if batch.reason == "watermark" else batch.pool is None
            assert set(self.children(victim)) <= self.evicting, "a head chosen while its tail stays"
            assert self.cooldown.get(victim, -1) <= self.now, "chosen during its refusal cooldown"
            self.evicting.add(victim)
            if batch.reason == "watermark" and tenant == "t2":
                left = sum(
                    sum(ps.values())
                    for o, (t, ps, _) in self.resident.items()
                    if t == "t2" and o not in self.evicting
                )
                assert left >= QUOTAS["t2"].guaranteed_bytes, "pressure took t2 below its guaranteed share"
        self.batches += 1

    @rule(
        tenant=st.sampled_from(TENANTS),
        pool=st.sampled_from(POOLS),
        size=st.integers(1, 5),
        extend=st.integers(0, 30),
        replica_bytes=st.integers(0, 4),
        older=st.integers(0, 40),
    )
    def insert(
        self, tenant: str, pool: str, size: int, extend: int, replica_bytes: int, older: int = 0
    ) -> None:
        """`older`: found stored, last used that long before now (0: used now)."""
        parents = [o for o, (t, ps, _) in self.resident.items() if t == tenant and pool in ps]
        parent = parents[extend % len(parents)] if parents and extend < 20 else None
        object_id = self.next_id
        self.next_id += 1
        pools = {pool: size}
        if replica_bytes:  # also held in the other pool (a second replica or another member)
            pools[POOLS[1 - POOLS.index(pool)]] = replica_bytes
        self.core.seen(object_id)
        # after its parent in a prefix (a link to one not before it is dropped by the core)
        chunk_index = self.chunks.get(parent, -1) + 1 if parent is not None else 0
        self.chunks[object_id] = chunk_index
        effects = self.core.insert(
            object_id,
            tenant=tenant,
            pools=pools,
            parent=parent,
            chunk_index=chunk_index,
            now_ms=self.now,
            last_access_ms=self.now - older if older else None,
        )
        assert effects == [Admitted(object_id)] or effects == [Refused(object_id)]
        (effect,) = effects
        if isinstance(effect, Admitted):
            assert effect.reason in ADMIT_REASONS
            # never a child without its parent under predicted admission
            assert (
                self.config.admission != "predicted"
                or parent is None
                or (parent in self.resident and parent not in self.evicting)
            )
            self.resident[object_id] = (tenant, pools, parent)
            self.arrived(object_id)
        else:
            assert isinstance(effect, Refused) and effect.reason in REFUSE_REASONS
            assert self.config.admission != "always"
            assert effect.reason != "parent_absent" or parent not in self.resident or parent in self.evicting

    @rule(
        tenant=st.sampled_from(TENANTS),
        pool=st.sampled_from(POOLS),
        size=st.integers(1, 5),
        ahead=st.integers(0, 3),
        chunk_index=st.integers(0, 4),
    )
    def insert_before_parent(self, tenant: str, pool: str, size: int, ahead: int, chunk_index: int) -> None:
        """A chunk stored before its parent (a sharded directory's events come in any order),
        at any chunk index, naming one of the next objects to come as its parent (`ahead`: 0,
        itself); when that one arrives, naming this one back or not (`insert`), the link holds
        only if this one is after it in a prefix."""
        object_id = self.next_id
        self.next_id += 1
        parent = object_id + ahead
        self.chunks[object_id] = chunk_index
        self.core.seen(object_id)
        effects = self.core.insert(
            object_id,
            tenant=tenant,
            pool=pool,
            size=size,
            parent=parent,
            chunk_index=chunk_index,
            now_ms=self.now,
        )
        (effect,) = effects
        if isinstance(effect, Admitted):
            self.resident[object_id] = (tenant, {pool: size}, parent if ahead else None)
            self.arrived(object_id)
        else:
            assert self.config.admission != "always"

    @rule(
        tenant=st.sampled_from(TENANTS),
        pool=st.sampled_from(POOLS),
        length=st.integers(2, 6),
        size=st.integers(1, 3),
        extend=st.integers(0, 30),
        read=st.booleans(),
    )
    def insert_prefix(self, tenant: str, pool: str, length: int, size: int, extend: int, read: bool) -> None:
        """A request's missed tail: a chain of chunks, each the parent of the next (enough bytes
        at once to press a pool, so victims, refusals and tails-before-heads are exercised);
        `read`: a reader leases its chunks as they are stored (until `toggle_lease`)."""
        for _ in range(length):
            self.insert(tenant, pool, size, extend, 0)
            if read and self.next_id - 1 in self.resident:
                self.leased.add(self.next_id - 1)
            extend = 0 if self.next_id - 1 in self.resident else 25  # extend the chunk just stored
            parents = [o for o, (t, ps, _) in self.resident.items() if t == tenant and pool in ps]
            if self.next_id - 1 in self.resident:
                extend = parents.index(self.next_id - 1)

    @rule(pick=st.integers(0, 1000))
    def access(self, pick: int) -> None:
        if self.resident:
            self.core.access(sorted(self.resident)[pick % len(self.resident)], self.now)

    @rule(pick=st.integers(0, 1000), pool=st.sampled_from(POOLS), nbytes=st.integers(1, 3))
    def copied_to_a_pool(self, pick: int, pool: str, nbytes: int) -> None:
        """A copy of a resident object's bytes lands in a pool, its other replicas kept (the
        disk copy of a demoted tail's head: `add_pool`), being evicted or not."""
        if self.resident:
            object_id = sorted(self.resident)[pick % len(self.resident)]
            assert self.core.add_pool(object_id, pool, nbytes)
            pools = self.resident[object_id][1]
            pools[pool] = pools.get(pool, 0) + nbytes
        assert not self.core.add_pool(self.next_id, pool, nbytes)  # not resident: nothing counted

    @rule(pick=st.integers(0, 1000), nbytes=st.integers(1, 4), keep_parent=st.booleans())
    def moved_to_another_tier(self, pick: int, nbytes: int, keep_parent: bool) -> None:
        """A resident object's bytes move to the other pool (a demotion to disk, answered for a
        victim or not): the same object, neither an eviction nor an insert counted; on disk
        only it may lose its parent in the core (`retiered`)."""
        if not self.resident:
            assert not self.core.retiered(self.next_id, pools={"p0": 1}, parent=None, now_ms=self.now)
            return
        object_id = sorted(self.resident)[pick % len(self.resident)]
        tenant, pools, parent = self.resident[object_id]
        moved_to = {POOLS[1 - POOLS.index(p)] for p in pools} if len(pools) == 1 else {POOLS[0]}
        new_pools = {pool: nbytes for pool in moved_to}
        new_parent = parent if keep_parent else None
        before = dict(self.core.counters)
        rank = self.rank(object_id)
        assert self.core.retiered(object_id, pools=new_pools, parent=new_parent, now_ms=self.now)
        assert before.get("evicted_total", 0) == self.core.counters.get("evicted_total", 0)
        assert before.get("inserts_total", 0) == self.core.counters.get("inserts_total", 0)
        assert self.core.counters["retiered_total"] == before.get("retiered_total", 0) + 1
        assert self.rank(object_id) == rank, "a tier move changed what ranks the object"
        self.resident[object_id] = (tenant, new_pools, new_parent)
        if object_id in self.evicting:  # answered by the move: the refusals in a row end
            self.refusals.pop(object_id, None)
        self.evicting.discard(object_id)
        assert not self.core.is_evicting(object_id)

    @rule(pick=st.integers(0, 1000))
    def toggle_lease(self, pick: int) -> None:
        if self.resident:
            object_id = sorted(self.resident)[pick % len(self.resident)]
            self.leased ^= {object_id}

    @rule(pool=st.sampled_from(POOLS))
    def lease_a_pool(self, pool: str) -> None:
        """A reader leases everything a pool holds now: its victims are all refused, so the pool
        stays pressed with nothing it may evict (its passes parked: `EvictionCore._park`) until
        a cooldown ends or something lands in it."""
        self.leased |= {o for o, (_, ps, _) in self.resident.items() if pool in ps}

    @rule(step=st.sampled_from([0, 1, 20, 60]))
    def tick(self, step: int) -> None:
        self.now += step
        for effect in self.core.tick(self.now):
            assert isinstance(effect, EvictBatch)
            self.check_batch(effect)

    @precondition(lambda self: bool(self.evicting))
    @rule(pick=st.integers(0, 1000), pinned=st.booleans())
    def directory_answers(self, pick: int, pinned: bool = True) -> None:
        object_id = sorted(self.evicting)[pick % len(self.evicting)]
        self.evicting.discard(object_id)
        if object_id in self.leased:  # the directory refuses: leased or pinned objects stay
            self.core.refused(object_id, self.now, pinned=pinned)
            # each pinned refusal in a row doubles the cooldown, up to 2**REFUSED_BACKOFF_SHIFT_MAX
            # times; a leased one ends the run (the base cooldown)
            refusals = (
                min(self.refusals.get(object_id, 0) + 1, REFUSED_BACKOFF_SHIFT_MAX + 1) if pinned else 0
            )
            self.refusals[object_id] = refusals
            self.cooldown[object_id] = self.now + self.config.refused_cooldown_ms * 2 ** max(refusals - 1, 0)
            if object_id in self.unpinned_evicting:  # its last pin ended after the answer
                self.refusals[object_id], self.cooldown[object_id] = 0, self.now
                self.leased.discard(object_id)
            assert self.core._objects[object_id].cooldown_until_ms == self.cooldown[object_id]
        else:
            self.core.removed(object_id)
            del self.resident[object_id]

    @rule(pick=st.integers(0, 1000))
    def last_pin_ends(self, pick: int) -> None:
        """The directory says an object's last pin ended (`GroupsUnpinned`): one cooling down
        after a refusal may go at once, its refusals in a row ended (parked passes look again:
        `check_invariants`); a victim under way is marked, its refusal (answered before the
        unpin) cools it down not at all."""
        if not self.resident:
            return
        object_id = sorted(self.resident)[pick % len(self.resident)]
        self.core.unpinned(object_id, self.now)
        if object_id in self.evicting:  # the directory's answer may be decided already: kept
            self.unpinned_evicting.add(object_id)
            return
        self.leased.discard(object_id)
        if self.cooldown.get(object_id, -1) > self.now:
            self.refusals[object_id] = 0
            self.cooldown[object_id] = self.now
        if object_id in self.cooldown:
            assert self.core._objects[object_id].cooldown_until_ms == self.cooldown[object_id]

    @precondition(lambda self: bool(self.evicting))
    @rule()
    def directory_answers_all(self) -> None:
        """A whole batch answered at once (leased ones refused: a pool whose victims are all
        leased is pressed again with nothing it may evict until their cooldowns end)."""
        while self.evicting:
            self.directory_answers(0)

    @rule(pick=st.integers(0, 1000))
    def freed_elsewhere(self, pick: int) -> None:
        candidates = sorted(set(self.resident) - self.evicting)
        if candidates:
            object_id = candidates[pick % len(candidates)]
            self.core.removed(object_id)
            del self.resident[object_id]
            self.leased.discard(object_id)

    @precondition(lambda self: self.dropping is None)
    @rule(pool=st.sampled_from(POOLS), back=st.booleans())
    def pool_lost(self, pool: str, back: bool) -> None:
        """A segment died: its bytes went; objects held only there are gone, those held
        elsewhere too are listed as kept. Back at once, or lost again first (a pool no object
        is in any more: nothing gone, nothing kept)."""
        kept: list[object] = []
        gone = self.core.drop_pool(pool, kept)
        expected = [o for o, (_, ps, _) in self.resident.items() if set(ps) == {pool}]
        assert sorted(int(str(g)) for g in gone) == sorted(expected)
        survivors = [o for o, (_, ps, _) in self.resident.items() if pool in ps and len(ps) > 1]
        assert sorted(int(str(k)) for k in kept) == sorted(survivors)
        if not back:
            again: list[object] = []
            assert self.core.drop_pool(pool, again) == [] and again == []
        for object_id in expected:
            del self.resident[object_id]
            self.evicting.discard(object_id)
            self.leased.discard(object_id)
        for _, ps, _ in self.resident.values():
            ps.pop(pool, None)
        self.core.set_capacity(pool, CAPACITY)  # it came back, empty

    @precondition(lambda self: self.dropping is None)
    @rule(pool=st.sampled_from(POOLS), step_cost=st.sampled_from([1, 20, 60]))
    def pool_lost_in_steps(self, pool: str, step_cost: int) -> None:
        """A segment died and the service drops its pool in steps (`drop_pool_steps`, a step
        of `step_cost`: an object looked at costs 1, one dropped `DROP_POOL_OBJECT_COST`);
        every other rule runs between the steps, adding to this pool too."""
        self.dropping = self.core.drop_pool_steps(pool, step_cost)
        self.dropping_pool = pool

    @precondition(lambda self: self.dropping is not None)
    @rule()
    def drop_step(self) -> None:
        """One step: what it removed held bytes in the pool only, what it kept elsewhere too
        (as the model stands now); once done, no object holds the pool and it is back, empty."""
        assert self.dropping is not None
        pool = self.dropping_pool
        step = next(self.dropping, None)
        if step is None:
            self.dropping = None
            assert not [o for o, (_, ps, _) in self.resident.items() if pool in ps]
            assert self.core.used_bytes(pool) == 0
            self.core.set_capacity(pool, CAPACITY)
            return
        gone, kept = step
        for object_id in (int(str(g)) for g in gone):
            assert set(self.resident[object_id][1]) == {pool}
            del self.resident[object_id]
            self.evicting.discard(object_id)
            self.leased.discard(object_id)
        for object_id in (int(str(k)) for k in kept):
            pools = self.resident[object_id][1]
            assert pool in pools and len(pools) > 1
            del pools[pool]

    @invariant()
    def consistent(self) -> None:
        self.core.check_invariants()
        for pool in POOLS:
            assert self.core.used_bytes(pool) == sum(ps.get(pool, 0) for _, ps, _ in self.resident.values())
        for tenant in TENANTS:
            assert self.core.tenant_bytes(tenant) == sum(
                sum(ps.values()) for t, ps, _ in self.resident.values() if t == tenant
            )
        assert set(self.resident) == {o for o in self.resident if o in self.core}
        assert len(self.core) == len(self.resident)
        for object_id in self.evicting:
            assert self.core.is_evicting(object_id)
        self.unpinned_evicting &= self.evicting  # (answered, moved or gone: forgotten)
        assert self.core._unpinned_evicting == self.unpinned_evicting

    def teardown(self) -> None:
        while self.dropping is not None:  # a stepped drop under way ends first
            self.drop_step()
        # Pressure resolves once leases go: watermarks and quotas hold.
        self.leased.clear()
        for _ in range(200):
            self.now += 100
            effects = self.core.tick(self.now)
            for effect in effects:
                assert isinstance(effect, EvictBatch)
                self.check_batch(effect)
            while self.evicting:
                self.directory_answers(0)
            if not effects and all(self.cooldown.get(o, -1) <= self.now for o in self.resident):
                break  # (refused ones cool down for up to 64 x the cooldown: waited for)
        for pool in POOLS:
            if self.core.used_bytes(pool) <= self.config.high_watermark * CAPACITY:
                continue
            # Still over: only if no object there could go (a tail stays, or t2's guaranteed share).
            t2_bytes = sum(sum(ps.values()) for t, ps, _ in self.resident.values() if t == "t2")
            for object_id, (tenant, pools, _) in self.resident.items():
                if pool in pools and not self.children(object_id):
                    assert (
                        tenant == "t2" and t2_bytes - sum(pools.values()) < QUOTAS["t2"].guaranteed_bytes
                    ), f"{pool} stays over its high watermark while {object_id} could go"
        assert self.core.tenant_bytes("t1") <= 25
        self.core.check_invariants()


EvictionMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestEvictionMachine = EvictionMachine.TestCase


# The same machine over every other policy: the rules (leases win, tails before heads, exact
# accounting, watermarks and quotas reached once leases go) do not depend on the victim order.
class Lru2Machine(EvictionMachine):
    policy = "lru2"


class SieveMachine(EvictionMachine):
    policy = "sieve"


class S3FifoMachine(EvictionMachine):
    policy = "s3fifo"


class WTinyLfuMachine(EvictionMachine):
    policy = "wtinylfu"


class SecondHitMachine(EvictionMachine):
    """LRU with second-hit admission (the `lru+admission` row): refusals of first sightings keep
    every rule; the sketch stays its fixed size (`check_invariants`)."""

    policy = "lru"
    admission = "second_hit"


class ReuseMachine(EvictionMachine):
    """The reuse predictor with its admission: refusals (parent absent, below the frontier)
    keep every rule; the predictor's ghost and classes stay bounded (`check_invariants`)."""

    policy = "reuse"
    admission = "predicted"


class DensityMachine(EvictionMachine):
    """Hit density with its admission: per-class heaps, age-dependent ranking and refusals
    keep every rule; the ghost, classes and class heaps stay bounded (`check_invariants`)."""

    policy = "density"
    admission = "predicted"


class InflowMachine(EvictionMachine):
    """Watermarks lowered for fast writers (the service's default): a margin that moves with
    every tick keeps every rule (leases win, tails before heads, exact accounting, watermarks
    reached once leases go) and stays within half the low watermark (`check_invariants`)."""

    policy = "density"
    inflow_horizon_ms = 5  # ticks 1-60 ms apart: margins from 0 to the cap (5) on a 16-byte pool


_OTHER_POLICIES = settings(max_examples=80, stateful_step_count=60, deadline=None)
Lru2Machine.TestCase.settings = _OTHER_POLICIES
SieveMachine.TestCase.settings = _OTHER_POLICIES
S3FifoMachine.TestCase.settings = _OTHER_POLICIES
WTinyLfuMachine.TestCase.settings = _OTHER_POLICIES
SecondHitMachine.TestCase.settings = _OTHER_POLICIES
ReuseMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=60, deadline=None)
DensityMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=60, deadline=None)
TestLru2Machine = Lru2Machine.TestCase
TestSieveMachine = SieveMachine.TestCase
TestS3FifoMachine = S3FifoMachine.TestCase
TestWTinyLfuMachine = WTinyLfuMachine.TestCase
TestSecondHitMachine = SecondHitMachine.TestCase
TestReuseMachine = ReuseMachine.TestCase
TestDensityMachine = DensityMachine.TestCase
InflowMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=60, deadline=None)
TestInflowMachine = InflowMachine.TestCase


def test_a_full_pool_evicts_tail_first_down_to_the_low_watermark() -> None:
    core = EvictionCore(EvictionConfig(policy="lru", high_watermark=0.9, low_watermark=0.5, batch_max=100))
    core.set_capacity("p", 10)
    for i in range(10):  # one prefix of 10 chunks
        core.insert(i, tenant="t", pool="p", size=1, parent=i - 1 if i else None, chunk_index=i, now_ms=i)
    (batch,) = core.tick(12)  # 10 > 90 % of 10
    assert isinstance(batch, EvictBatch)
    assert batch.victims == (9, 8, 7, 6, 5)  # tail first, down to the low watermark (5 of 10)
    for victim in batch.victims:
        core.removed(victim)
    assert core.used_bytes("p") == 5 and core.tick(13) == []
    core.check_invariants()


def test_refused_victims_are_replaced_until_the_low_watermark_is_reached() -> None:
    core = EvictionCore(
        EvictionConfig(
            policy="lru", high_watermark=0.9, low_watermark=0.5, batch_max=100, refused_cooldown_ms=10
        )
    )
    core.set_capacity("p", 10)
    for i in range(10):  # ten one-chunk prefixes, 0 the least recently used
        core.insert(i, tenant="t", pool="p", size=1, parent=None, chunk_index=0, now_ms=i)
    (batch,) = core.tick(10)
    assert isinstance(batch, EvictBatch) and batch.victims == (0, 1, 2, 3, 4)
    core.refused(0, 10)  # leased: it stays
    for victim in batch.victims[1:]:
        core.removed(victim)
    assert core.used_bytes("p") == 6  # below the high watermark, above the low one: still pressed
    (again,) = core.tick(11)
    assert isinstance(again, EvictBatch) and again.victims == (5,)  # 0 cools down; 5 goes instead
    core.removed(5)
    assert core.used_bytes("p") == 5 and core.tick(30) == []  # at the low watermark: done
    core.check_invariants()
