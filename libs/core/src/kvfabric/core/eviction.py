"""The eviction-policy core: which chunk groups go when a pool (segment) or a tenant fills.

Synchronous and I/O-free: the service (or the trace simulator, `tools/evict_sim.py`) feeds
events in and performs the returned effects, through the methods below or the one entry
`step(event, now_ms) -> effects` (`kvfabric.core.step`; the events in
`kvfabric.core.eviction_events`). Time is passed in (`now_ms`). Sizes are bytes (the
simulator uses 1 per block).

## Model
An *object* is one chunk group: (id, tenant, pools, parent id or None, chunk index), where
`pools` maps each pool (segment) holding a replica or member of it to the bytes it holds there;
its *size* is the sum (what it costs its tenant); a copy of its bytes in another pool adds to
them (`add_pool`: a disk copy beside its arena replica). Evicting an object frees it in every pool. Its
parent is the previous chunk of the same prefix: a chunk is useless without its parent, so the
policy only ever picks **leaves** (objects no resident object names as parent). Eviction walks a
prefix from its tail to its head, and a head never goes while its tail stays.

## States of an object
    (absent) --insert, admitted--> RESIDENT
    (absent) --insert, refused by admission--> (absent) (counted; the writer does not write)
    RESIDENT --chosen as a victim (EvictBatch)--> EVICTING
    EVICTING --removed--> (absent)
    EVICTING --refused (leased/pinned)--> RESIDENT, skipped until `now + refused_cooldown_ms`,
        pinned: x 2**(its pinned refusals in a row - 1), at most x 16 (`refused`: 5 ... 80 s)
    RESIDENT, cooling down after a refusal --unpinned (its last pin ended)--> RESIDENT, a
        victim again at once, its count of refusals ended (`unpinned`)
    RESIDENT --removed (freed elsewhere: segment down, repair, ...)--> (absent)
    RESIDENT or EVICTING --retiered (its bytes moved to other pools: a demotion)--> RESIDENT
        (the same object: its rank's features kept, neither an eviction nor an insert counted)
    any --its last pool dropped (`drop_pool`, or a step of `drop_pool_steps`: segment down)--> (absent)
Removing an object whose children are resident is allowed (the directory decided); the children
then have no parent and are ordinary leaves-to-be. A child inserted before its parent (a sharded
directory's events come from several shards in any order) is counted as the parent's child when
the parent is inserted, if it is after it in a prefix (a higher chunk index): else its link is
cut (two groups naming each other across such a link were each other's parent, neither ever a
leaf). A parent inserted again while the children it had stay takes at most the chunk index it
had then. So every stored link points at a lower chunk index: no cycle.

## When to evict (`tick`)
- A pool whose used bytes exceed `high_watermark` x capacity is *pressed*: it evicts leaves of
  that pool until its used bytes minus the bytes already EVICTING reach `low_watermark` x
  capacity (both watermarks lowered by the pool's margin, below); a victim the directory
  refuses re-arms the pool, so it is replaced by another on a later tick until the pool is
  really at its low watermark.
- A tenant over its hard quota evicts its own leaves first (any pool) down to the quota.
- Pool pressure never takes a tenant below its guaranteed share (`guaranteed_bytes`, counting
  bytes already being evicted); its own hard quota may.
- At most `batch_max` victims per EvictBatch; one batch per pool (and per over-quota tenant)
  per tick.
- **A tick's cost.** The leaves are ranked in one order for every pool, so a pool's pass looks
  at the leaves ranked before its victims, other pools' included: up to every leaf when it
  finds fewer than it needs. Such a pass of a heap policy (one that ran out of leaves; a queue
  policy's scan also stops at its step bound, so its pools are never parked) is *parked* (`_park`):
  that pool (tenant) is not passed over again before the earliest cooldown it passed over
  ends, or before a leaf it may evict can have appeared (inserted, moved or copied into it,
  a tail gone, a refused victim back, a protecting tenant's bytes grown). A pressed pool with
  nothing it may evict costs a walk over every leaf once per such change, not every tick.
- **Writers faster than the ticks** (`inflow_horizon_ms` > 0; the service's default): victims
  go some time after a pool crosses its high watermark (the next tick, the events' way to the
  policy, the evict request), and a writer can fill what lies above it before then: the
  directory then refuses its saves (`no_capacity`). So each tick measures every pool's
  *inflow*, the bytes of new objects since the tick before (an object found stored,
  `last_access_ms` given, or inserted with `counts_as_inflow=False`, is not inflow), per
  second, taken at once when higher than the estimate and followed with a half-life of
  `INFLOW_HALF_LIFE_MS` when lower; both watermarks of the pool are lowered by its *margin*,
  what that inflow stores in `inflow_horizon_ms` or in twice the time between the last two
  ticks, whichever is longer (a service performs a tick's victims before it ticks again: a
  slow batch, a demotion, delays the next), at most half the low watermark's bytes. The first
  tick only starts the count (a service ticks once it has replayed its history: what it
  replayed is not a writer's rate). With no writer the margin decays to nothing and the
  watermarks are the configured ones.

## Policies
Each policy's ranking of leaves (`lru`, `gdsf`, `lru2`, `reuse`, `density` by priority or hit
density; `sieve`, `s3fifo`, `wtinylfu` by a victim queue) is `kvfabric.core.eviction_ranking`,
with its papers and adaptations; this module keeps every rule below whatever the policy ranks.
- Admission (`admission="second_hit"`): a new object is admitted only when a frequency sketch
  has seen its id before (or the pool has room below its low watermark), so one-off prefixes do
  not flush hot ones.
- Admission (`admission="predicted"`, policies `reuse` and `density`): a chunk whose parent is
  not resident (or is being evicted) is refused; above the low watermark, a chunk that would
  rank below the lowest evictable leaf is refused (bypass).
- Every decision carries a reason code (`ADMIT_REASONS`, `REFUSE_REASONS`, `VICTIM_REASONS`)
  and `explain(id)` shows a resident object's features and priority.

## Invariants (`check_invariants()`, after every step in tests)
1. Never chosen: a victim is a resident object whose resident children were all chosen before
   it (a leaf, or the head of a tail that goes in the same or an earlier batch) and whose
   refusal cooldown has passed; no object is in two batches. (A child inserted later under an
   EVICTING parent is allowed: the directory evicts the parent and the child is an orphan leaf.)
2. Accounting: per pool, used bytes = sum of resident objects' bytes in it; per tenant, the sum
   of their sizes.
3. Prefix order: a victim never has a resident child.
4. Margin: a pool's margin is between 0 and half its low watermark's bytes, its inflow and
   the bytes counted toward it are not negative.
5. Links: every stored parent link points at a lower chunk index (no cycle: no object is kept
   from being a leaf for good); a child waiting for an absent parent is after its floor, or
   listed to be checked when it arrives.
6. Parked: no leaf of a parked pool (tenant) may go before its time but one its tenant's
   guaranteed share keeps (a parked pass misses no victim).
7. Bounded: each batch has at most `batch_max` victims; the frequency sketch is fixed-size;
   lru2's history holds at most max(`LRU2_HISTORY_FLOOR`, resident objects) ids; a queue
   policy's state is checked by its own `check` (its ghost and scan bounds in its module);
   the reuse predictor's ghost and classes by its `check`; the density predictor's likewise, and
   its class heaps stay within a multiple of the objects (compacted like the heap); the heap is
   compacted at each push past `HEAP_ENTRIES_PER_OBJECT` entries an object plus
   `HEAP_ENTRIES_SLACK` (a hit pushes an entry), so it stays within that of the most objects held.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator, Mapping
from typing import Any, Final

from kvfabric.core import eviction_events
from kvfabric.core.eviction_density import DensityClass, DensityPredictor
from kvfabric.core.eviction_events import EvictionEvent, EvictionOutput
from kvfabric.core.eviction_model import (
    ADMIT_REASONS,
    POLICY_NAMES,
    REFUSE_REASONS,
    VICTIM_REASONS,
    AdmissionName,
    Admitted,
    Effect,
    EvictBatch,
    EvictionConfig,
    ObjectId,
    PolicyName,
    PoolUsage,
    Refused,
    TenantQuota,
    Tracked,
)
from kvfabric.core.eviction_ranking import LRU2_HISTORY_FLOOR, HeapEntry, LeafRanking
from kvfabric.core.eviction_reuse import ReusePredictor, reuse_class
from kvfabric.core.eviction_s3fifo import S3Fifo
from kvfabric.core.eviction_sieve import Sieve
from kvfabric.core.eviction_sketch import SKETCH_DEPTH, SKETCH_WIDTH, FrequencySketch
from kvfabric.core.eviction_wtinylfu import WTinyLfu
from kvfabric.core.step import not_before
from kvfabric.format.invariant import invariant

__all__ = [
    "ADMIT_REASONS",
    "POLICY_NAMES",
    "REFUSE_REASONS",
    "VICTIM_REASONS",
    "AdmissionName",
    "Admitted",
    "EvictBatch",
    "EvictionConfig",
    "EvictionCore",
    "PolicyName",
    "Refused",
    "TenantQuota",
]

# A stepped `drop_pool_steps`: what one step may cost, an object looked at costing 1 and one of
# the pool's objects dropped `DROP_POOL_OBJECT_COST` (~0.1 us against ~1.3-2.4 us): a step is
# at most ~1,000 removals or ~16,000 objects looked at (docs/eviction-policy.md).
DROP_POOL_STEP_COST: Final = 16_384
DROP_POOL_OBJECT_COST: Final = 15
# How fast a pool's inflow estimate follows a rate lower than it (a higher one is taken at once).
INFLOW_HALF_LIFE_MS: Final = 1_000
# A writer that stored nothing this long has stopped (`writing_for_ms`); shorter gaps (its saves
# refused while the pool was full, so no new object) do not end it.
WRITER_GAP_MS: Final = 1_000
# A victim refused as pinned cools down twice as long with each pinned refusal in a row, up to
# 2**4 = 16 x `refused_cooldown_ms` (5 s: 5, 10, 20, 40, 80 s). The directory tells the policy
# when a group's last pin ends (`unpinned`); without that word (an event lost, a directory older
# than it) the cap is how late a released pin's group may go (review).
REFUSED_BACKOFF_SHIFT_MAX: Final = 4
# `_park`: a pass under way (parked only if nothing lands in its pool meanwhile), and a pass
# parked with no cooldown to wait for (only a change in its pool or tenant ends it).
PARK_PASSING: Final = -1
PARK_UNTIL_CHANGE: Final = 1 << 62
QUEUE_POLICIES: Final[dict[str, type[Sieve] | type[S3Fifo] | type[WTinyLfu]]] = {
    "sieve": Sieve,
    "s3fifo": S3Fifo,
    "wtinylfu": WTinyLfu,
}


class EvictionCore(LeafRanking):
    """See the module docstring (the ranking of leaves: `LeafRanking`)."""

    def __init__(self, config: EvictionConfig, quotas: Mapping[Any, TenantQuota] | None = None) -> None:
        self.config = config
        self.quotas: dict[Hashable, TenantQuota] = dict(quotas or {})
        self._objects = {}
        # Children inserted before their parent (a sharded directory publishes a prefix's chunks
        # from different shards, so their events may come in any order): counted under the absent
        # parent's id and handed to it when it is inserted. Entries exist only while such children
        # are resident (bounded by the objects).
        self._early_children: dict[ObjectId, int] = {}
        self._early_children_evicting: dict[ObjectId, int] = {}
        # Of those, the ones linked while their parent was absent, so never compared with its
        # chunk index (one id, or a set of two or more): the parent's arrival cuts the links of
        # those not after it (`_attach`). The others were its children when it was removed
        # (`_detach`): all after the chunk index it had then, its `_early_floor`, which it
        # takes again if it comes back claiming a higher one (`_arrival_chunk`).
        self._early_unchecked: dict[ObjectId, ObjectId | set[ObjectId]] = {}
        self._early_floor: dict[ObjectId, int] = {}
        # Passes that found nothing more they may evict, skipped until their time or a change
        # (`_park`): pools (their `PoolUsage.parked_until_ms`) and over-quota tenants.
        self._parked: set[Hashable] = set()
        self._tenant_parked: dict[Hashable, int] = {}
        self._pass_wake = PARK_UNTIL_CHANGE  # the pass under way: its earliest cooldown end
        self._pass_protected: dict[Hashable, int] = {}  # and the tenants' shares that held it
        self._pools: dict[Hashable, PoolUsage] = {}
        self._tenants: dict[Hashable, int] = {}  # tenant -> resident bytes
        self._tenant_evicting: dict[Hashable, int] = {}  # tenant -> bytes chosen, not yet removed
        # victims whose last pin ended while the directory was asked about them (`unpinned`):
        # a refusal decided before the unpin does not cool them down (`refused`)
        self._unpinned_evicting: set[ObjectId] = set()
        self._heap = []  # (priority, seq, version, id): leaves
        self._seq = 0
        self._clock = 0.0  # GDSF inflation
        self._now_ms = 0
        self._step_ms = 0  # the latest time given to `step` (events without a time included)
        self._inflow_ms: int | None = None  # the tick that last measured the pools' inflow
        self._tick_interval_ms = 0  # between the last two ticks that measured it
        self._sketch = FrequencySketch() if config.admission == "second_hit" else None
        self._order = QUEUE_POLICIES[config.policy]() if config.policy in QUEUE_POLICIES else None
        self._history: OrderedDict[ObjectId, int] = OrderedDict()  # lru2: removed id -> last access
        self._predictor = ReusePredictor() if config.policy == "reuse" else None
        self._density = (
            DensityPredictor(config.density_recompute_every) if config.policy == "density" else None
        )
        # density: per class, a heap of (last access, seq, version, id) of leaves, stale skipped
        self._class_heaps = {}
        self._class_entries = 0  # entries pushed since the last compaction, plus those it kept
        self.counters: dict[str, int] = {}

    def step(self, event: EvictionEvent, now_ms: int) -> list[EvictionOutput]:
        """The one entry (`kvfabric.core.step`): `event` at `now_ms` as the method of the same
        meaning (`kvfabric.core.eviction_events`). Time going backwards is refused first."""
        self._step_ms = not_before(max(self._step_ms, self._now_ms), now_ms)
        return eviction_events.dispatch(self, event, now_ms)

    # ---- queries ---------------------------------------------------------------------------

    def __contains__(self, object_id: ObjectId) -> bool:
        return object_id in self._objects

    def __len__(self) -> int:
        return len(self._objects)

    def used_bytes(self, pool: Hashable) -> int:
        usage = self._pools.get(pool)
        return usage.used if usage else 0

    def evicting_bytes(self, pool: Hashable) -> int:
        usage = self._pools.get(pool)
        return usage.evicting if usage else 0

    def inflow(self, pool: Hashable) -> float:
        """Bytes a second new objects bring to `pool`, as the last tick measured it."""
        usage = self._pools.get(pool)
        return usage.inflow if usage else 0.0

    def writing_for_ms(self, pool: Hashable, now_ms: int) -> int:
        """How long new objects have come to `pool` with no gap of `WRITER_GAP_MS` (0: none)."""
        usage = self._pools.get(pool)
        since = usage.writing_since_ms if usage else None
        return 0 if since is None else max(0, now_ms - since)

    def margin_bytes(self, pool: Hashable) -> int:
        """How far below the configured ones `pool`'s watermarks are (its writers' headroom)."""
        usage = self._pools.get(pool)
        return self._margin(usage) if usage else 0

    def tenants(self) -> list[Hashable]:
        # Read by the metrics thread while the event loop adds tenants: `dict()` copies in C with
        # no allocation mid-walk (`list(d.items())` makes tuples, which can start the cyclic GC,
        # whose finalizers run Python code and let the loop's thread in; docs/metrics.md).
        return [t for t, used in dict(self._tenants).items() if used]

    def tenant_bytes(self, tenant: Hashable) -> int:
        return self._tenants.get(tenant, 0)

    def is_evicting(self, object_id: ObjectId) -> bool:
        obj = self._objects.get(object_id)
        return obj is not None and obj.evicting

    # ---- events ----------------------------------------------------------------------------

    def set_capacity(self, pool: Hashable, capacity_bytes: int) -> None:
        invariant(capacity_bytes >= 0, "negative capacity")
        self._pools.setdefault(pool, PoolUsage()).capacity = capacity_bytes

    def seen(self, object_id: ObjectId) -> None:
        """A request asked for `object_id` (hit or miss): feeds the admission sketch and the
        reuse predictor (a naming it remembers was a reuse)."""
        if self._sketch is not None:
            self._sketch.add(object_id, self.config.sketch_halve_every)
        if self._predictor is not None:
            self._predictor.named(object_id)

    def insert(
        self,
        object_id: ObjectId,
        *,
        tenant: Hashable,
        pool: Hashable | None = None,
        size: int = 0,
        pools: Mapping[Any, int] | None = None,  # Any: keys are pools (Hashable); Mapping is invariant
        parent: ObjectId | None,
        chunk_index: int,
        now_ms: int,
        prompt_chunks: int | None = None,
        last_access_ms: int | None = None,
        counts_as_inflow: bool = True,
    ) -> list[Effect]:
        """A new object is (about to be) stored: `size` bytes in `pool`, or `pools` (pool ->
        bytes) when it spans several; `prompt_chunks`: chunks of the prompt writing it (a reuse
        feature; default its position + 1); `last_access_ms`: when it was last used, if before
        now (an object found stored, its history unknown: it ranks as used then; the queue
        policies, which rank by arrival, take it as new). Returns Admitted or Refused with a
        reason code (admission, judged on each of its pools). `counts_as_inflow`: False for
        bytes no writer just brought (a shell replaying a backlog, a republish), which are not
        a writer's rate (`tick`); neither is an object with `last_access_ms`."""
        self._advance(now_ms)
        invariant(last_access_ms is None or last_access_ms <= now_ms, "last access after now")
        held = dict(pools) if pools is not None else {pool: size}
        invariant(bool(held) and all(b > 0 for b in held.values()), "object bytes must be positive")
        if object_id in self._objects:
            self.access(object_id, now_ms)
            return [Admitted(object_id, "resident")]
        claimed, chunk_index = chunk_index, self._arrival_chunk(object_id, chunk_index)
        prompt = prompt_chunks if prompt_chunks is not None else chunk_index + 1
        parent_obj = self._objects.get(parent) if parent is not None else None
        # A chunk written after a parent that had been hit before starts the prefix's next turn.
        turn = 1 if parent_obj is None else parent_obj.turn + int(parent_obj.frequency > 1)
        priority = float(now_ms)
        if self._predictor is not None:
            cls = reuse_class(1, turn, prompt, chunk_index == prompt - 1)
            self._predictor.named(object_id)
            self._predictor.track(object_id, cls, len(self._objects))
            priority += self.config.reuse_horizon_ms * self._predictor.log_probability(cls)
        density_cls: DensityClass = (1, 1)
        if self._density is not None:
            density_cls = self._density.name(object_id, now_ms, prompt)
            self._density.trim(len(self._objects))
            priority = self._density.density(density_cls, 0) / sum(held.values())
        usages = {p: self._pools.setdefault(p, PoolUsage()) for p in held}
        reason = "always"
        for p, b in held.items():
            verdict, why = self._admit(object_id, usages[p], b, parent, priority)
            if not verdict:
                self._count("admission_refused_total")
                self._count(f"admission_refused_{why}_total")
                return [Refused(object_id, why)]
            reason = why if reason in ("always", "room") else reason
        accessed = now_ms if last_access_ms is None else last_access_ms
        if chunk_index < claimed:
            self._count("chunk_index_lowered_total")
        parent = self._sane_parent(object_id, parent, chunk_index)
        obj = Tracked(tenant, held, sum(held.values()), parent, chunk_index, accessed)
        obj.turn, obj.prompt_chunks, obj.density_class = turn, prompt, density_cls
        if self.config.policy == "lru2":
            obj.previous_access_ms = self._history.pop(object_id, None)
        self._attach(object_id, obj)
        if last_access_ms is None and counts_as_inflow:  # a writer's new bytes
            for p, b in held.items():
                usages[p].inserted += b
        if self._order is not None:
            self._order.inserted(object_id, obj.size)
        self._count("inserts_total")
        return [Admitted(object_id, reason)]

    def retiered(
        self, object_id: ObjectId, *, pools: Mapping[Any, int], parent: ObjectId | None, now_ms: int
    ) -> bool:
        """The same object, its bytes in other pools now (a tier move: a chunk group demoted to its
        segment's disk, or a disk copy of it dropped while its arena replica stays), under
        `parent` (a group on disk only has none in the core: `GroupRecords._core_parent`).
        Neither an eviction nor an insert: no counter of either moves, no admission, no history
        or ghost entry, and what ranks it (last access, frequency, turn, prompt length, density
        class, cooldown, a queue policy's place) is kept. Resident afterwards, also when it was
        EVICTING (the move was the answer for it: a queue policy takes it back as a refused
        victim, and a pool it stays in is pressed again if it is still above its low watermark,
        as after a refusal). False when it is not resident."""
        self._advance(now_ms)
        held = dict(pools)
        invariant(bool(held) and all(b > 0 for b in held.values()), "object bytes must be positive")
        old = self._objects.get(object_id)
        if old is None:
            return False
        self._detach(object_id, old)
        parent = self._sane_parent(object_id, parent, old.chunk_index)
        obj = Tracked(old.tenant, held, sum(held.values()), parent, old.chunk_index, old.last_access_ms)
        obj.previous_access_ms, obj.frequency = old.previous_access_ms, old.frequency
        obj.turn, obj.prompt_chunks, obj.density_class = old.turn, old.prompt_chunks, old.density_class
        obj.cooldown_until_ms = old.cooldown_until_ms
        # A victim answered by this move: that attempt did not fail, the refusals in a row end.
        obj.refusals = 0 if old.evicting else old.refusals
        for p in held:
            self._pools.setdefault(p, PoolUsage())
        self._attach(object_id, obj)
        if self._order is not None:
            if old.evicting:
                self._order.returned(object_id, obj.size)
            else:
                self._order.resized(object_id, obj.size)
        if old.evicting:
            for p in held:
                self._press_if_above_low(self._pools[p])
        self._count("retiered_total")
        return True

    def access(self, object_id: ObjectId, now_ms: int) -> None:
        """A hit: bump recency and frequency."""
        self._advance(now_ms)
        obj = self._objects.get(object_id)
        if obj is None:
            return
        obj.previous_access_ms = obj.last_access_ms
        obj.last_access_ms = now_ms
        obj.frequency += 1
        if self._predictor is not None:
            self._predictor.named(object_id)
            self._predictor.track(object_id, self._reuse_class(obj), len(self._objects))
        if self._density is not None:
            density_cls = self._density.name(object_id, now_ms, obj.prompt_chunks, obj.frequency)
            if density_cls != obj.density_class:
                obj.density_class = density_cls
                obj.version = 0  # its entry is in the old class's heap: `_push` queues a new one
            self._density.trim(len(self._objects))
        if self._order is not None and not obj.evicting:
            self._order.accessed(object_id)
        self._push(object_id, obj)

    def removed(self, object_id: ObjectId, *, lost: bool = False) -> None:
        """The object is gone (evicted as asked, or freed for another reason; `lost`: with its
        last pool, `drop_pool`, not by the directory's answer)."""
        obj = self._objects.get(object_id)
        if obj is None:
            self._count("removed_unknown_total")
            return
        self._detach(object_id, obj)
        if self._order is not None and not obj.evicting:
            self._order.forgotten(object_id)  # a chosen one left the order when it was taken
        if self._predictor is not None:
            self._predictor.trim(len(self._objects))
        if self._density is not None:
            self._density.trim(len(self._objects))
        if self.config.policy == "lru2":
            self._history[object_id] = obj.last_access_ms
            self._history.move_to_end(object_id)
            while len(self._history) > max(LRU2_HISTORY_FLOOR, len(self._objects)):
                self._history.popitem(last=False)
        if obj.evicting and lost:  # a victim under way lost with its segment: not evicted (it
            self._count("evicting_lost_total")  # counted as one, and raised gdsf's clock; review, stop 67)
        elif obj.evicting:
            self._count("evicted_total")
            if self.config.policy == "gdsf":
                # L rises to the victim's H as ranked (recomputed from the clock now, every
                # eviction raised it by a whole term, past every resident's: review, stop 67)
                self._clock = max(self._clock, obj.priority)

    def _press_if_above_low(self, usage: PoolUsage) -> None:
        """A victim's bytes stay in this pool after all (refused, or moved to another tier while
        kept here): pressed again if it is still above its low watermark, so others are chosen."""
        if usage.capacity and usage.used - usage.evicting > self._low_target(usage):
            usage.pressed = True

    def _margin(self, usage: PoolUsage) -> int:
        """What the pool's writers store in `inflow_horizon_ms` at their measured rate, at most
        half the low watermark's bytes: how much earlier and further the pool evicts."""
        if not self.config.inflow_horizon_ms:
            return 0
        most = int(self.config.low_watermark * usage.capacity) // 2
        # A tick whose victims took long (a demotion) delays the next: the horizon stretches.
        horizon_ms = max(self.config.inflow_horizon_ms, 2 * self._tick_interval_ms)
        return min(int(usage.inflow * horizon_ms / 1000), most)

    def _low_target(self, usage: PoolUsage) -> int:
        return int(self.config.low_watermark * usage.capacity) - self._margin(usage)

    def _measure_inflow(self, now_ms: int) -> None:
        """Each pool's inflow since the last tick that measured it (none before the first)."""
        since = self._inflow_ms
        if since is not None and now_ms <= since:
            return  # no time passed: the bytes count toward the next tick
        self._inflow_ms = now_ms
        self._tick_interval_ms = 0 if since is None else now_ms - since
        for usage in self._pools.values():
            if since is not None:
                measured = usage.inserted * 1000 / (now_ms - since)
                kept = 0.5 ** ((now_ms - since) / INFLOW_HALF_LIFE_MS)
                usage.inflow = max(measured, usage.inflow * kept + measured * (1 - kept))
                if usage.inflow < 1.0:  # a byte a second: what is left of a writer gone long ago
                    usage.inflow = 0.0
                if usage.inserted:
                    usage.inflow_seen_ms = now_ms
                    if usage.writing_since_ms is None:
                        usage.writing_since_ms = since
                elif usage.inflow_seen_ms is None or now_ms - usage.inflow_seen_ms >= WRITER_GAP_MS:
                    usage.writing_since_ms = None
            usage.inserted = 0

    def _sane_parent(self, object_id: ObjectId, parent: ObjectId | None, chunk_index: int) -> ObjectId | None:
        """`parent`, unless it cannot be one: the object itself, or a resident object not before
        it in a prefix (chunk index not lower). A writer names its parent, and a parent link keeps
        an object from being a leaf while its child lives: a group naming itself, or two naming
        each other, were never victims, whatever the pool's pressure or the tenant's quota
        (review, 2026-12-05). A link to an absent parent is kept, and checked when the parent
        arrives (`_attach`): every stored link then points at a lower chunk index, so no cycle."""
        if parent is None or parent == object_id:
            return None
        resident = self._objects.get(parent)
        if resident is not None and resident.chunk_index >= chunk_index:
            self._count("parent_refused_total")
            return None
        return parent

    def _arrival_chunk(self, object_id: ObjectId, chunk_index: int) -> int:
        """The chunk index an arriving object is tracked at: the one claimed, but not above the
        one it had when it was removed while children stayed (`_early_floor`): they were linked
        as after that one, and no id of them is kept to cut their links (a group published
        again with another chunk index: a writer's word, as its parent is)."""
        floor = self._early_floor.get(object_id)
        return chunk_index if floor is None else min(chunk_index, floor)

    def _attach(self, object_id: ObjectId, obj: Tracked) -> None:
        """`obj` resident: counted in its pools and tenant, linked to its parent and children."""
        self._objects[object_id] = obj
        for p, b in obj.pools.items():
            self._pools[p].used += b
        self._tenants[obj.tenant] = self._tenants.get(obj.tenant, 0) + obj.size
        children = self._early_children.pop(object_id, 0)
        children_evicting = self._early_children_evicting.pop(object_id, 0)
        floor = self._early_floor.pop(object_id, None)
        invariant(floor is None or obj.chunk_index <= floor, "arrived after its waiting children")
        unchecked = self._early_unchecked.pop(object_id, None)
        if unchecked is not None:
            # Linked while it was absent: a child not after it in a prefix is no child of it
            # (review, 2026-12-06: a at chunk 0 naming b, absent, then b at chunk 1 naming a,
            # resident and before it, made each the other's parent, neither ever a leaf).
            for child_id in unchecked if isinstance(unchecked, set) else (unchecked,):
                child = self._objects[child_id]
                if child.chunk_index > obj.chunk_index:
                    continue
                child.parent = None  # a leaf-to-be of its own, as an orphan
                children -= 1
                children_evicting -= int(child.evicting)
                self._count("parent_refused_total")
        obj.children, obj.children_evicting = children, children_evicting
        parent_obj = self._objects.get(obj.parent) if obj.parent is not None else None
        if parent_obj is not None:
            parent_obj.children += 1  # no longer a leaf: its heap entry is ignored while children live
        elif obj.parent is not None:
            _bump(self._early_children, obj.parent, 1)
            self._pend(obj.parent, object_id)
        self._push(object_id, obj)
        self._unpark(obj)  # a new leaf, or one back: its pools' and tenant's passes look again
        self._tenant_grew(obj.tenant)

    def _detach(self, object_id: ObjectId, obj: Tracked) -> None:
        """`obj` no longer resident: `_attach` undone (its children wait for it like early ones)."""
        del self._objects[object_id]
        self._unpinned_evicting.discard(object_id)
        for p, b in obj.pools.items():
            usage = self._pools[p]
            usage.used -= b
            if obj.evicting:
                usage.evicting -= b
        if obj.evicting:
            self._tenant_evicting[obj.tenant] -= obj.size
        self._tenants[obj.tenant] -= obj.size
        if obj.children:  # its resident children now wait for it like early ones
            _bump(self._early_children, object_id, obj.children)
            if obj.children_evicting:
                _bump(self._early_children_evicting, object_id, obj.children_evicting)
            self._early_floor[object_id] = obj.chunk_index  # (none while it was resident)
        if obj.parent is not None:
            parent = self._objects.get(obj.parent)
            if parent is not None:
                parent.children -= 1
                if obj.evicting:
                    parent.children_evicting -= 1
                if parent.children == parent.children_evicting:
                    self._push(obj.parent, parent)  # a leaf again
                    self._unpark(parent)
            else:
                _bump(self._early_children, obj.parent, -1)
                if obj.evicting:
                    _bump(self._early_children_evicting, obj.parent, -1)
                if not self._unpend(obj.parent, object_id) and self._early_children.get(
                    obj.parent, 0
                ) == self._unchecked(obj.parent):
                    self._early_floor.pop(obj.parent, None)  # the last child it had left

    def _pend(self, parent: ObjectId, child_id: ObjectId) -> None:
        """`child_id` linked to `parent` while `parent` is absent (`_early_unchecked`)."""
        ids = self._early_unchecked.get(parent)
        if ids is None:
            self._early_unchecked[parent] = child_id  # the usual one: no set
        elif isinstance(ids, set):
            ids.add(child_id)
        else:
            self._early_unchecked[parent] = {ids, child_id}

    def _unpend(self, parent: ObjectId, child_id: ObjectId) -> bool:
        """`_pend` undone (the child gone or moved); False if it was not pending unchecked."""
        ids = self._early_unchecked.get(parent)
        if isinstance(ids, set):
            if child_id not in ids:
                return False
            ids.discard(child_id)
            if len(ids) == 1:
                self._early_unchecked[parent] = next(iter(ids))
            return True
        if ids is None or ids != child_id:
            return False
        del self._early_unchecked[parent]
        return True

    def _unchecked(self, parent: ObjectId) -> int:
        ids = self._early_unchecked.get(parent)
        return 0 if ids is None else len(ids) if isinstance(ids, set) else 1

    def add_pool(self, object_id: ObjectId, pool: Hashable, nbytes: int) -> bool:
        """`nbytes` more of the object in `pool`: a copy of its bytes in another tier (the disk
        copy of a demoted tail's head, whose arena replica stays), counted in that pool and in its
        tenant's bytes like a replica. Its rank, history, parent and children are unchanged (not
        an access, not a new object). False when it is not resident."""
        invariant(nbytes > 0, "object bytes must be positive")
        obj = self._objects.get(object_id)
        if obj is None:
            return False
        obj.pools[pool] = obj.pools.get(pool, 0) + nbytes
        obj.size += nbytes
        usage = self._pools.setdefault(pool, PoolUsage())
        usage.used += nbytes
        self._tenants[obj.tenant] += nbytes
        if obj.evicting:  # chosen in a batch still being performed: its bytes go with it
            usage.evicting += nbytes
            self._tenant_evicting[obj.tenant] += nbytes
        else:
            if self._order is not None:
                self._order.resized(object_id, obj.size)
            self._push(object_id, obj)  # a size-aware rank (gdsf) changes
            self._unpark(obj)  # a leaf of one more pool
            self._tenant_grew(obj.tenant)
        return True

    def keeps_children(self, object_id: ObjectId) -> bool:
        """Whether a resident object has a child that stays (resident, not being evicted): one
        chosen as a leaf while its tail was chosen too, whose tail was then refused (in another
        pool's batch of the same tick, say), is no leaf any more and must not go."""
        obj = self._objects.get(object_id)
        return obj is not None and obj.children > obj.children_evicting

    def refused(self, object_id: ObjectId, now_ms: int, *, pinned: bool = False) -> None:
        """The directory would not evict it (leased or pinned): resident again, cooled down for
        `refused_cooldown_ms`; refused as `pinned`, doubled for each pinned refusal before it
        in a row (at most 2**`REFUSED_BACKOFF_SHIFT_MAX` times): a pin outlasting a few
        attempts is asked again less and less often (each attempt costs an `evict` request, a
        demotion's republish). Any other refusal (a lease, which ends in seconds; no answer; a
        failed demotion) ends the count and cools it down for the base time only: a hot prefix
        leased at each attempt must not wait minutes once its leases end. The count also ends
        with the object (evicted, removed) or an attempt answered by a tier move (`retiered`);
        a hit does not end it (a pinned prefix is often a hot one)."""
        self._advance(now_ms)
        obj = self._objects.get(object_id)
        if obj is None or not obj.evicting:
            self._count("refused_unknown_total")
            return
        obj.evicting = False
        for p, b in obj.pools.items():
            usage = self._pools[p]
            usage.evicting -= b
            self._press_if_above_low(usage)
        self._tenant_evicting[obj.tenant] -= obj.size
        parent = self._objects.get(obj.parent) if obj.parent is not None else None
        if parent is not None:
            parent.children_evicting -= 1  # its tail stays: it is no leaf any more
        elif obj.parent is not None:
            _bump(self._early_children_evicting, obj.parent, -1)
        obj.refusals = min(obj.refusals + 1, REFUSED_BACKOFF_SHIFT_MAX + 1) if pinned else 0
        obj.cooldown_until_ms = now_ms + (self.config.refused_cooldown_ms << max(obj.refusals - 1, 0))
        if object_id in self._unpinned_evicting:  # its last pin ended after the directory answered
            self._unpinned_evicting.discard(object_id)
            obj.refusals, obj.cooldown_until_ms = 0, now_ms
            self._count("unpinned_woken_total")
        if self._order is not None:
            self._order.returned(object_id, obj.size)
        self._push(object_id, obj)
        self._wake(obj, obj.cooldown_until_ms)  # a leaf again once it has cooled down
        self._tenant_grew(obj.tenant)  # its bytes no longer on their way out
        self._count("evict_refused_total")

    def unpinned(self, object_id: ObjectId, now_ms: int) -> bool:
        """Its last pin ended (the directory's word): an object cooling down after a refusal may
        be a victim again at once, its count of refusals in a row ended, and parked passes over
        its pools and tenant look again. Whatever the refusal said: a head named with its
        pinned tail is answered `tail_stays` (and a head pinned with its tail too), not
        `pinned`; one a lease still holds is refused again, at the base cooldown; a cooldown
        the service set for another cause (a demotion that failed, a head not on disk yet) ends
        too: one attempt more per unpin. A victim under way is marked: the directory may have
        answered before the unpin, so its refusal, when it comes, cools it down not at all
        (review). One not cooling down, or unknown (evicted, never stored here), is left as it
        is. True when it was woken or marked."""
        self._advance(now_ms)
        obj = self._objects.get(object_id)
        if obj is not None and obj.evicting:
            self._unpinned_evicting.add(object_id)
            return True
        if obj is None or obj.cooldown_until_ms <= now_ms:
            return False
        obj.refusals = 0
        obj.cooldown_until_ms = now_ms
        self._wake(obj, now_ms)
        self._count("unpinned_woken_total")
        return True

    def drop_pool(self, pool: Hashable, kept: list[ObjectId] | None = None) -> list[ObjectId]:
        """The pool is gone (segment down or restarted): its bytes went with it. Objects left
        with no pool are removed (returned); the others keep their other pools (appended to
        `kept`, when given). O(objects), in one call: `drop_pool_steps` for the same in steps."""
        gone: list[ObjectId] = []
        for step_gone, step_kept in self.drop_pool_steps(pool):
            gone += step_gone
            if kept is not None:
                kept += step_kept
        return gone

    def drop_pool_steps(
        self, pool: Hashable, step_cost: int = DROP_POOL_STEP_COST
    ) -> Iterator[tuple[list[ObjectId], list[ObjectId]]]:
        """`drop_pool` in steps of about `step_cost` (an object looked at costs 1, one of the
        pool's objects removed or kept `DROP_POOL_OBJECT_COST`): yields each step's removed
        and kept objects, so that a caller on an event loop lets it run between steps (a third
        of 1,000,000 objects took 0.4-0.6 s in one call). Between steps the core is consistent:
        the pool holds what is not yet dropped, its capacity is 0 (no watermark victim is
        chosen in it; a victim chosen before stays EVICTING until answered or dropped), and an
        object moved into it meanwhile is dropped too (looked for again until the pool is
        empty). The caller adds nothing to the pool until the last step. Nothing for a pool no
        object was ever in (every pool an object holds has its usage in `_pools`: a disk pool
        of a segment without disk groups)."""
        usage = self._pools.get(pool)
        if usage is None:
            self._count("pools_dropped_total")
            return
        usage.capacity, usage.pressed = 0, False
        objects = self._objects
        found = True
        while usage.used or usage.evicting:
            # A pass that found nothing may have missed objects moved in behind it; none at all
            # would be accounting drift (checked at once: no endless passes over it).
            invariant(found or any(pool in o.pools for o in objects.values()), "pool used by no object")
            # The ids listed, not (id, object) pairs: a million new tuples set off the cyclic GC
            # over every object several times (docs/eviction-policy.md, "Garbage collector").
            listed = list(objects)
            found = False
            gone: list[ObjectId] = []
            kept: list[ObjectId] = []
            cost = 0
            for object_id in listed:
                cost += 1
                obj = objects.get(object_id)  # (gone meanwhile: removed between steps)
                if obj is not None and pool in obj.pools:
                    cost += DROP_POOL_OBJECT_COST
                    found = True
                    self._drop_from(object_id, obj, pool, gone, kept)
                if cost >= step_cost:
                    yield gone, kept
                    gone, kept, cost = [], [], 0
            if gone or kept:
                yield gone, kept
        dropped = self._pools.pop(pool, None)
        invariant(dropped is None or (dropped.used, dropped.evicting) == (0, 0), "dropped pool still used")
        self._parked.discard(pool)
        self._count("pools_dropped_total")

    def _drop_from(
        self, object_id: ObjectId, obj: Tracked, pool: Hashable, gone: list[ObjectId], kept: list[ObjectId]
    ) -> None:
        """One object's bytes in `pool` are gone: removed if that was its last pool."""
        held = obj.pools[pool]
        if len(obj.pools) == 1:
            self.removed(object_id, lost=True)
            gone.append(object_id)
            return
        del obj.pools[pool]
        kept.append(object_id)
        obj.size -= held
        if self._order is not None and not obj.evicting:
            self._order.resized(object_id, obj.size)
        if not obj.evicting:  # a pass parked on its tenant's share measured it at its old size
            self._unpark(obj)
        self._tenants[obj.tenant] -= held
        usage = self._pools[pool]
        usage.used -= held
        if obj.evicting:
            usage.evicting -= held
            self._tenant_evicting[obj.tenant] -= held

    def tick(self, now_ms: int) -> list[Effect]:
        """Batches of victims for every pool over its high watermark and every tenant over quota."""
        self._advance(now_ms)
        self._measure_inflow(now_ms)
        effects: list[Effect] = []
        for tenant, quota in self.quotas.items():
            if quota.hard_bytes is not None:
                pending = self._tenant_evicting.get(tenant, 0)
                excess = self._tenants.get(tenant, 0) - pending - quota.hard_bytes
                if excess <= 0:
                    self._tenant_parked.pop(tenant, None)
                elif now_ms < self._tenant_parked.get(tenant, PARK_PASSING):
                    self._count("passes_parked_total")  # nothing it may evict until then (`_park`)
                else:
                    effects += self._evict(excess, now_ms, reason="tenant_quota", tenant=tenant)
        for pool, usage in self._pools.items():
            if not usage.capacity:
                continue
            if usage.used > self.config.high_watermark * usage.capacity - self._margin(usage):
                usage.pressed = True
            if not usage.pressed:
                continue
            target = self._low_target(usage)
            excess = usage.used - usage.evicting - target
            if excess > 0:
                if usage.parked_until_ms is not None and now_ms < usage.parked_until_ms:
                    self._count("passes_parked_total")
                else:
                    effects += self._evict(excess, now_ms, reason="watermark", pool=pool)
            # Done once enough is chosen; a refusal (`refused`) re-arms it, so refused victims
            # are replaced on a later tick until the pool is really at its low watermark.
            usage.pressed = usage.used - usage.evicting > target
            if not usage.pressed and usage.parked_until_ms is not None:
                self._unpark_pool(pool, usage)
        return effects

    # ---- internals -------------------------------------------------------------------------

    def _admit(
        self, object_id: ObjectId, usage: PoolUsage, size: int, parent: ObjectId | None, priority: float
    ) -> tuple[bool, str]:
        """(admit?, reason code) for `size` more bytes in `usage`'s pool."""
        admission = self.config.admission
        if admission == "always":
            return True, "always"
        if admission == "predicted" and parent is not None:
            parent_obj = self._objects.get(parent)
            if parent_obj is None or parent_obj.evicting:
                return False, "parent_absent"  # absent or on its way out: no hit can reach it
        if usage.capacity == 0 or usage.used + size <= self.config.low_watermark * usage.capacity:
            return True, "room"  # room to spare: no reason to refuse
        if admission == "second_hit":
            assert self._sketch is not None
            seen = self._sketch.estimate(object_id) >= 2  # seen before this request
            return (True, "seen_before") if seen else (False, "first_sighting")
        frontier = self._frontier() if self._density is None else self._density_frontier(self._now_ms)
        if frontier is not None and priority < frontier:
            return False, "below_frontier"  # it would be the next victim: do not write it
        return True, "predicted_reuse"

    def _evict(
        self,
        excess: int,
        now_ms: int,
        *,
        reason: str,
        pool: Hashable | None = None,
        tenant: Hashable | None = None,
    ) -> list[Effect]:
        """Choose leaves in the policy's order (`LeafRanking._offer`), skipping other
        pools/tenants, protected tenants and cooled-down objects, until `excess` bytes are chosen.
        A heap policy's pass that ran out of leaves first is parked (`_park`)."""
        victims: list[ObjectId] = []
        self._pass_wake = PARK_UNTIL_CHANGE
        self._pass_protected.clear()
        self._park(pool, tenant, PARK_PASSING)
        freed, examined = self._offer(
            excess,
            now_ms,
            victims,
            skipped=lambda obj: self._skipped(obj, now_ms, pool, tenant),
            take=lambda object_id, obj: self._take(object_id, obj, pool, victims),
        )
        # Only a heap policy's pass offers every leaf (it also looks at the parents its victims
        # made leaves: pushed onto the heaps it walked). A queue policy's `choose` stops at its
        # scan bound as well (3n / 5n steps, other pools' objects counted as refused): parked,
        # such a pool held leaves it could evict and nothing woke it (review, 2026-12-06).
        exhausted = self._order is None and freed < excess and len(victims) < self.config.batch_max
        self._park(pool, tenant, self._pass_wake if exhausted else None, taken_in=self._order is None)
        self._count("victims_total", len(victims))
        self._count("candidates_examined_total", examined)
        # One batch per call, tail before head: a service that applies it in order never leaves
        # a tail without its head, even when they live in different pools.
        if not victims:
            return []
        why = tuple(self._victim_reason(self._objects[v]) for v in victims)
        return [EvictBatch(pool, tuple(victims), reason, why)]

    def _skipped(self, obj: Tracked, now_ms: int, pool: Hashable | None, tenant: Hashable | None) -> bool:
        """Not a victim for this batch: another pool's or tenant's, cooling down, or protected
        (what may end the last two is noted for `_park`)."""
        if (pool is not None and pool not in obj.pools) or (tenant is not None and obj.tenant != tenant):
            return True
        if obj.cooldown_until_ms > now_ms:
            self._pass_wake = min(self._pass_wake, obj.cooldown_until_ms)
            return True
        if tenant is None and self._protected(obj.tenant, obj.size):
            quota = self.quotas[obj.tenant]
            need = quota.guaranteed_bytes + obj.size  # its tenant's bytes that would let it go
            self._pass_protected[obj.tenant] = min(need, self._pass_protected.get(obj.tenant, need))
            return True
        return False

    def _take(
        self, object_id: ObjectId, obj: Tracked, pool: Hashable | None, victims: list[ObjectId]
    ) -> tuple[int, ObjectId | None]:
        """Make `obj` EVICTING; returns the bytes it frees (in `pool`, or all) and its parent if
        that just became a leaf (its whole tail is going: it may go in this batch)."""
        obj.evicting = True
        for p, b in obj.pools.items():
            self._pools[p].evicting += b
        self._tenant_evicting[obj.tenant] = self._tenant_evicting.get(obj.tenant, 0) + obj.size
        victims.append(object_id)
        leaf_parent: ObjectId | None = None
        parent = self._objects.get(obj.parent) if obj.parent is not None else None
        if parent is not None:
            parent.children_evicting += 1
            if parent.children == parent.children_evicting:
                leaf_parent = obj.parent
                self._push(obj.parent, parent)
                self._unpark(parent)
        elif obj.parent is not None:
            _bump(self._early_children_evicting, obj.parent, 1)
        return (obj.pools[pool] if pool is not None else obj.size), leaf_parent

    def _protected(self, tenant: Hashable, size: int) -> bool:
        """Would evicting `size` more bytes take `tenant` below its guaranteed share?"""
        quota = self.quotas.get(tenant)
        if quota is None or quota.guaranteed_bytes == 0:
            return False
        left = self._tenants.get(tenant, 0) - self._tenant_evicting.get(tenant, 0) - size
        return left < quota.guaranteed_bytes

    def _park(
        self, pool: Hashable | None, tenant: Hashable | None, until: int | None, *, taken_in: bool = False
    ) -> None:
        """Each tick walked every leaf (every pool's: the ranking is one) while a pressed pool
        had none it might evict, its own all cooling down or protected (review, 2026-12-06:
        200,100 leaves, 266-500 ms every 200 ms tick). So a heap policy's pass (`_evict`) that
        ran out of leaves before it freed what it needed is parked: its pool (or over-quota tenant) is
        not passed over again before `until`, the earliest end of a cooldown it passed over
        (`PARK_UNTIL_CHANGE`: none), unless something that may go lands in it first: a leaf
        inserted, moved or copied into the pool, one that becomes a leaf (its tail gone or
        chosen), a refused victim's cooldown (`_wake`), or a protecting tenant's bytes
        growing past what lets one of its leaves go (`_tenant_grew`). Called with
        `PARK_PASSING` as the pass begins, and with None (not parked) or `until` as it ends:
        a change during the pass (`_unpark`: a victim's parent became a leaf) leaves it not
        parked, unless the pass looked at those parents too (`taken_in`)."""
        if pool is None:
            if until == PARK_PASSING:
                self._tenant_parked[tenant] = PARK_PASSING
            elif taken_in or self._tenant_parked.get(tenant) == PARK_PASSING:
                if until is None:
                    self._tenant_parked.pop(tenant, None)
                else:
                    self._tenant_parked[tenant] = until
            return
        usage = self._pools[pool]
        if until == PARK_PASSING:
            usage.parked_until_ms, usage.parked_by = PARK_PASSING, None
            self._parked.add(pool)
        elif taken_in or usage.parked_until_ms == PARK_PASSING:
            if until is None:
                self._unpark_pool(pool, usage)
            else:
                usage.parked_until_ms = until
                usage.parked_by = dict(self._pass_protected) or None
                self._parked.add(pool)

    def _unpark_pool(self, pool: Hashable, usage: PoolUsage) -> None:
        usage.parked_until_ms = usage.parked_by = None
        self._parked.discard(pool)

    def _unpark(self, obj: Tracked) -> None:
        """`obj` may be a victim now: the passes over its pools and its tenant look again."""
        if self._parked:
            for p in obj.pools:
                if p in self._parked:
                    self._unpark_pool(p, self._pools[p])
        if self._tenant_parked:
            self._tenant_parked.pop(obj.tenant, None)

    def _wake(self, obj: Tracked, at_ms: int) -> None:
        """`obj` may be a victim from `at_ms` (its cooldown's end): parked passes over its pools
        and tenant wait no longer."""
        if self._parked:
            for p in obj.pools:
                usage = self._pools[p]
                if usage.parked_until_ms is not None and usage.parked_until_ms > at_ms:
                    usage.parked_until_ms = at_ms
        until = self._tenant_parked.get(obj.tenant) if self._tenant_parked else None
        if until is not None and until > at_ms:
            self._tenant_parked[obj.tenant] = at_ms

    def _tenant_grew(self, tenant: Hashable) -> None:
        """`tenant`'s bytes not on their way out grew: a parked pool whose leaves its guaranteed
        share kept looks again once one of them may go."""
        quota = self.quotas.get(tenant) if self._parked else None
        if quota is None or not quota.guaranteed_bytes:
            return  # (no share: no pool waits for its bytes)
        held = self._tenants.get(tenant, 0) - self._tenant_evicting.get(tenant, 0)
        for pool in list(self._parked):
            usage = self._pools[pool]
            need = usage.parked_by.get(tenant) if usage.parked_by else None
            if need is not None and held >= need:
                self._unpark_pool(pool, usage)

    def _advance(self, now_ms: int) -> None:
        invariant(now_ms >= self._now_ms, "time went backwards", now_ms=now_ms, last_ms=self._now_ms)
        self._now_ms = now_ms

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def check_invariants(self) -> None:
        pools: dict[Hashable, tuple[int, int]] = {}
        tenants: dict[Hashable, int] = {}
        children: dict[ObjectId, int] = {}
        for obj in self._objects.values():
            invariant(obj.size == sum(obj.pools.values()), "object size drifted")
            for p, b in obj.pools.items():
                used, evicting = pools.get(p, (0, 0))
                pools[p] = (used + b, evicting + (b if obj.evicting else 0))
            tenants[obj.tenant] = tenants.get(obj.tenant, 0) + obj.size
            if obj.parent is not None and obj.parent in self._objects:
                children[obj.parent] = children.get(obj.parent, 0) + 1
        for pool, usage in self._pools.items():
            invariant(
                (usage.used, usage.evicting) == pools.get(pool, (0, 0)), "pool accounting drifted", pool=pool
            )
            margin = self._margin(usage)
            invariant(
                0 <= margin <= int(self.config.low_watermark * usage.capacity) // 2
                and usage.inflow >= 0
                and usage.inserted >= 0,
                "inflow margin out of bounds",
                pool=pool,
            )
        for tenant, used in self._tenants.items():
            invariant(used == tenants.get(tenant, 0), "tenant accounting drifted", tenant=tenant)
        for tenant, pending in self._tenant_evicting.items():
            actual = sum(o.size for o in self._objects.values() if o.tenant == tenant and o.evicting)
            invariant(pending == actual, "tenant evicting bytes drifted", tenant=tenant)
        invariant(
            all(o in self._objects and self._objects[o].evicting for o in self._unpinned_evicting),
            "an unpin is remembered only for a victim under way",
        )
        early: dict[ObjectId, int] = {}
        early_evicting: dict[ObjectId, int] = {}
        for obj in self._objects.values():
            if obj.parent is not None and obj.parent not in self._objects:
                early[obj.parent] = early.get(obj.parent, 0) + 1
                if obj.evicting:
                    early_evicting[obj.parent] = early_evicting.get(obj.parent, 0) + 1
        invariant(early == self._early_children, "early children drifted")
        invariant(early_evicting == self._early_children_evicting, "early evicting children drifted")
        self._check_links(early)
        self._check_parked()
        evicting_children: dict[ObjectId, int] = {}
        for obj in self._objects.values():
            if obj.evicting and obj.parent is not None and obj.parent in self._objects:
                evicting_children[obj.parent] = evicting_children.get(obj.parent, 0) + 1
        if self._order is not None:
            self._order.check({i: o.size for i, o in self._objects.items() if not o.evicting})
        invariant(
            len(self._history) <= max(LRU2_HISTORY_FLOOR, len(self._objects) + 1), "lru2 history unbounded"
        )
        if self._sketch is not None:  # second_hit admission: fixed memory, whatever it was fed
            rows = self._sketch.rows
            invariant(
                len(rows) == SKETCH_DEPTH and all(len(row) == SKETCH_WIDTH for row in rows),
                "admission sketch resized",
            )
        if self._predictor is not None:
            self._predictor.check(len(self._objects))
        if self._density is not None:
            self._density.check(len(self._objects))
            entries = sum(map(len, self._class_heaps.values()))
            invariant(entries <= self._class_entries, "class heap entries miscounted")
        if self._order is None:
            self._check_entries()
        for object_id, obj in self._objects.items():
            invariant(obj.children == children.get(object_id, 0), "child count drifted", object_id=object_id)
            invariant(
                obj.children_evicting == evicting_children.get(object_id, 0),
                "evicting child count drifted",
                object_id=object_id,
            )

    def _check_entries(self) -> None:
        """Heap policies: an object's current entry is in its heap once, at or below its key (so a
        settled head is the least key), and every object that may go now has one."""
        heaps: list[tuple[DensityClass | None, list[HeapEntry]]] = (
            [(None, self._heap)] if self._density is None else list(self._class_heaps.items())
        )
        current: dict[int, tuple[DensityClass | None, HeapEntry]] = {}
        for where, heap in heaps:
            for entry in heap:
                obj = self._objects.get(entry[3])
                if obj is not None and obj.version == entry[2]:
                    invariant(entry[2] not in current, "two current entries", object_id=entry[3])
                    current[entry[2]] = (where, entry)
        for object_id, obj in self._objects.items():
            if obj.version == 0:
                invariant(
                    not self._evictable(obj), "a leaf that may go has no heap entry", object_id=object_id
                )
                continue
            found = current.get(obj.version)
            invariant(found is not None, "an object's current entry is not in a heap", object_id=object_id)
            assert found is not None
            where, entry = found
            invariant(
                where == (None if self._density is None else obj.density_class),
                "an entry in another class's heap",
                object_id=object_id,
            )
            invariant(
                entry[:2] <= (obj.priority, obj.rank_seq), "an entry above its key", object_id=object_id
            )

    def _check_links(self, early: dict[ObjectId, int]) -> None:
        """Every stored parent link points at a lower chunk index (so no cycle of links: no
        object kept from being a leaf for good); the children waiting for an absent parent are
        its unchecked ones (by id) and the checked ones (after its floor)."""
        unchecked: set[ObjectId] = set()
        for parent_id, ids in self._early_unchecked.items():
            invariant(not isinstance(ids, set) or len(ids) >= 2, "unchecked children: a set of one")
            members = ids if isinstance(ids, set) else {ids}
            for child_id in members:
                child = self._objects.get(child_id)
                invariant(child is not None and child.parent == parent_id, "unchecked child not waiting")
            unchecked |= members
            invariant(parent_id not in self._objects, "unchecked children of a resident parent")
        for parent_id, count in early.items():
            invariant(
                (count > self._unchecked(parent_id)) == (parent_id in self._early_floor),
                "early floor drifted",
                parent_id=parent_id,
            )
        invariant(self._early_floor.keys() <= early.keys(), "early floor of no child")
        for object_id, obj in self._objects.items():
            if obj.parent is None:
                continue
            parent = self._objects.get(obj.parent)
            if parent is not None:
                invariant(
                    parent.chunk_index < obj.chunk_index, "parent not before its child", object_id=object_id
                )
            else:
                floor = self._early_floor.get(obj.parent)
                invariant(
                    object_id in unchecked or (floor is not None and floor < obj.chunk_index),
                    "waiting child not after its parent's floor",
                    object_id=object_id,
                )

    def _check_parked(self) -> None:
        """A parked pass is right to wait: no leaf of its pool (tenant) may go before its time,
        but one protected by its tenant's guaranteed share (pools only)."""
        parked = {p for p, u in self._pools.items() if u.parked_until_ms is not None}
        invariant(parked == self._parked, "parked pools drifted")
        invariant(
            all(self._pools[p].parked_until_ms != PARK_PASSING for p in parked)
            and PARK_PASSING not in self._tenant_parked.values(),
            "a pass left under way",
        )
        if not (parked or self._tenant_parked):
            return
        for object_id, obj in self._objects.items():
            if not self._evictable(obj):
                continue
            for p in obj.pools:
                until = self._pools[p].parked_until_ms
                invariant(
                    until is None or obj.cooldown_until_ms >= until or self._protected(obj.tenant, obj.size),
                    "a parked pool has a leaf that may go",
                    pool=p,
                    object_id=object_id,
                )
            until = self._tenant_parked.get(obj.tenant)
            invariant(
                until is None or obj.cooldown_until_ms >= until,
                "a parked tenant has a leaf that may go",
                object_id=object_id,
            )


def _bump(counts: dict[ObjectId, int], key: ObjectId, delta: int) -> None:
    """Add `delta` to a count kept only while positive."""
    value = counts.get(key, 0) + delta
    invariant(value >= 0, "early child count below zero")
    if value:
        counts[key] = value
    else:
        counts.pop(key, None)
