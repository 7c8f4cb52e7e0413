"""`step(event, now_ms)` (issue 26: one shape for every core) of the repair, prefetch, eviction and
routing cores and the routing index is the method of the same meaning: a core driven through
`step` and one driven through the methods, given the same random run (the constants of each
core's Hypothesis machine, its events drawn at random, results answering what came out), answer
alike and end every step in the same state (`stepkit`); and every core refuses time going
backwards, through any event, before changing anything."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.core import eviction_events as ev
from kvfabric.core import prefetch_events as pf
from kvfabric.core import repair_events as rp
from kvfabric.core import routing_events as ro
from kvfabric.core import routing_index_events as ri
from kvfabric.core.eviction import POLICY_NAMES, EvictionConfig, EvictionCore
from kvfabric.core.prefetch import Hint, HintObject, PrefetchCore, StartCopy
from kvfabric.core.repair import RepairCore
from kvfabric.core.repair import StartCopy as RepairCopy
from kvfabric.core.routing import RoutingCore, prompt_keys
from kvfabric.core.routing_index import ListedGroup, ListedSegment, RoutingIndex
from kvfabric.core.step import Reply, Tick
from kvfabric.format.ids import DomainDigest
from kvfabric.proto import directory as m
from tests.unit.core import test_eviction_machine as evm
from tests.unit.core import test_prefetch_machine as pfm
from tests.unit.core import test_repair_machine as rpm
from tests.unit.core import test_routing as rom
from tests.unit.core import test_routing_index as rim
from tests.unit.core.stepkit import backwards_refused, run_both

EXAMPLES = settings(max_examples=60, deadline=None)


def copy_ids(out: list[object], kind: type[StartCopy] | type[RepairCopy]) -> list[int]:
    return [e.copy_id for e in out if isinstance(e, kind)] + [999]  # an unknown one too


# ---- repair ----------------------------------------------------------------------------------


def repair_event(data: st.DataObject, out: list[object], core: object) -> rp.RepairEvent:
    kind = data.draw(st.sampled_from(["up", "up", "drain", "down", "known", "known", "lost", "removed", "ok",
                                      "failed", "tick", "tick"]))  # fmt: skip
    seg = data.draw(st.sampled_from(rpm.SEGMENTS))
    obj = data.draw(st.sampled_from(rpm.OBJECTS))
    if kind == "up":
        zone, rack, host = rpm.DOMAINS[seg]
        return rp.SegmentUp(
            seg,
            incarnation=data.draw(st.integers(1, 3)),
            zone=zone,
            rack=rack,
            host=host,
            free_bytes=data.draw(st.sampled_from([0, 15, 60, rpm.ROOMY])),
            draining=data.draw(st.sampled_from([None, None, True, False])),
        )
    if kind == "drain":
        return rp.SegmentDraining(seg, data.draw(st.booleans()))
    if kind == "down":
        return rp.SegmentDown(seg)
    if kind == "known":
        segments = data.draw(st.lists(st.sampled_from(rpm.SEGMENTS), max_size=3, unique=True))
        return rp.ObjectKnown(
            obj,
            size_bytes=data.draw(st.integers(1, rpm.CONFIG.burst_bytes)),
            replica_target=data.draw(st.integers(1, 3)),
            segments=tuple(segments),
            hot=data.draw(st.integers(0, 2)),
        )
    if kind == "lost":
        return rp.ReplicaLost(obj, seg, corrupt=data.draw(st.booleans()))
    if kind == "removed":
        return rp.ObjectRemoved(obj)
    if kind in ("ok", "failed"):
        copy_id = data.draw(st.sampled_from(copy_ids(out, RepairCopy)))
        if kind == "ok":
            return rp.CopyOk(copy_id)
        return rp.CopyFailed(copy_id, source_failed=data.draw(st.booleans()))
    return Tick()


def repair_by_method(core: RepairCore, event: rp.RepairEvent, now_ms: int) -> Sequence[object]:
    if isinstance(event, Tick):
        return core.tick(now_ms)
    if isinstance(event, rp.SegmentUp):
        core.segment_up(
            event.segment_id,
            incarnation=event.incarnation,
            zone=event.zone,
            rack=event.rack,
            host=event.host,
            free_bytes=event.free_bytes,
            draining=event.draining,
        )
    elif isinstance(event, rp.SegmentDraining):
        core.segment_draining(event.segment_id, event.draining)
    elif isinstance(event, rp.SegmentDown):
        core.segment_down(event.segment_id)
    elif isinstance(event, rp.ObjectKnown):
        core.object_known(
            event.object_id,
            size_bytes=event.size_bytes,
            replica_target=event.replica_target,
            segments=event.segments,
            hot=event.hot,
        )
    elif isinstance(event, rp.ReplicaLost):
        core.replica_lost(event.object_id, event.segment_id, corrupt=event.corrupt)
    elif isinstance(event, rp.ObjectRemoved):
        core.object_removed(event.object_id)
    elif isinstance(event, rp.CopyOk):
        return [Reply(core.copy_ok(event.copy_id))]
    else:
        assert isinstance(event, rp.CopyFailed)
        core.copy_failed(event.copy_id, now_ms, source_failed=event.source_failed)
    return []


@EXAMPLES
@given(data=st.data())
def test_repair_step_is_the_method_of_the_same_meaning(data: st.DataObject) -> None:
    run_both(data, lambda: RepairCore(rpm.CONFIG), repair_event, repair_by_method)


# ---- prefetch --------------------------------------------------------------------------------

PF_SEGMENTS = sorted(pfm.SEGMENTS_FREE)


def prefetch_event(data: st.DataObject, out: list[object], core: object) -> pf.PrefetchEvent:
    kind = data.draw(st.sampled_from(["hint", "hint", "cancel", "tick", "tick", "finished", "finished",
                                      "read", "segments", "added", "removed", "cold"]))  # fmt: skip
    obj = data.draw(st.sampled_from(sorted(pfm.SIZE)))
    seg = data.draw(st.sampled_from(PF_SEGMENTS))
    if kind == "hint":
        tenant, target, objects, _ = data.draw(pfm.hint_specs)
        places = st.lists(st.sampled_from(PF_SEGMENTS), max_size=2, unique=True)
        parts = tuple(HintObject(o, pfm.SIZE[o], tuple(data.draw(places))) for o in objects)
        hint_id = f"h{data.draw(st.integers(0, 6))}"
        return pf.AddHint(Hint(hint_id, tenant, target, parts, data.draw(st.integers(0, 3_000))))
    if kind == "cancel":  # hint ids are per tenant; no tenant: the one live hint with that id
        return pf.CancelHint(f"h{data.draw(st.integers(0, 6))}", data.draw(st.sampled_from((None, "a", "b"))))
    if kind == "finished":
        return pf.CopyFinished(data.draw(st.sampled_from(copy_ids(out, StartCopy))), data.draw(st.booleans()))
    if kind == "read":
        holders = tuple(
            data.draw(st.lists(st.sampled_from(PF_SEGMENTS), min_size=1, max_size=3, unique=True))
        )
        return pf.Read(obj, size_bytes=pfm.SIZE[obj], served_from=holders[0], replicas=holders,
                       reads=data.draw(st.integers(1, 4)))  # fmt: skip
    if kind == "segments":
        free = data.draw(st.lists(st.integers(0, 60), min_size=len(PF_SEGMENTS), max_size=len(PF_SEGMENTS)))
        return pf.SetSegments(dict(zip(PF_SEGMENTS, free, strict=True)))
    if kind == "added":
        return pf.ReplicaAdded(obj, seg)
    if kind == "removed":
        return pf.ReplicaRemoved(obj, seg)
    if kind == "cold":
        return pf.ColdExtraReplicas()
    return Tick()


def prefetch_by_method(core: PrefetchCore, event: pf.PrefetchEvent, now_ms: int) -> Sequence[object]:
    if isinstance(event, Tick):
        return core.tick(now_ms)
    if isinstance(event, pf.CopyFinished):
        return core.copy_finished(event.copy_id, event.ok, now_ms)
    if isinstance(event, pf.AddHint):
        return [Reply(core.add_hint(event.hint, now_ms))]
    if isinstance(event, pf.CancelHint):
        return [Reply(core.cancel_hint(event.hint_id, event.tenant))]
    if isinstance(event, pf.ColdExtraReplicas):
        return [Reply(core.cold_extra_replicas(now_ms))]
    if isinstance(event, pf.Read):
        core.read(event.object_id, size_bytes=event.size_bytes, served_from=event.served_from,
                  replicas=event.replicas, now_ms=now_ms, reads=event.reads)  # fmt: skip
    elif isinstance(event, pf.SetSegments):
        core.set_segments(event.segments_free)
    elif isinstance(event, pf.ReplicaAdded):
        core.replica_added(event.object_id, event.segment)
    else:
        assert isinstance(event, pf.ReplicaRemoved)
        core.replica_removed(event.object_id, event.segment)
    return []


@EXAMPLES
@given(data=st.data())
def test_prefetch_step_is_the_method_of_the_same_meaning(data: st.DataObject) -> None:
    run_both(data, lambda: PrefetchCore(pfm.CONFIG, pfm.SEGMENTS_FREE), prefetch_event, prefetch_by_method)


# ---- eviction --------------------------------------------------------------------------------


def eviction_event(data: st.DataObject, out: list[object], core: object) -> ev.EvictionEvent:
    kind = data.draw(st.sampled_from(["insert", "insert", "insert", "access", "removed", "refused", "seen",
                                      "tick", "tick", "capacity", "drop", "add_pool",
                                      "retiered", "unpinned"]))  # fmt: skip
    obj = data.draw(st.integers(0, 9))
    pool = data.draw(st.sampled_from(evm.POOLS))
    if kind == "insert":
        spans = data.draw(st.booleans())
        pools = {p: data.draw(st.integers(1, 6)) for p in evm.POOLS} if spans else None
        return ev.Insert(
            obj,
            tenant=data.draw(st.sampled_from(evm.TENANTS)),
            parent=data.draw(st.sampled_from([None, *range(obj)])),
            chunk_index=obj,
            pool=None if spans else pool,
            size=0 if spans else data.draw(st.integers(1, 6)),
            pools=pools,
            prompt_chunks=data.draw(st.sampled_from([None, 12])),
        )
    if kind == "access":
        return ev.Access(obj)
    if kind == "removed":
        return ev.Removed(obj)
    if kind == "refused":
        return ev.EvictRefused(obj)
    if kind == "seen":
        return ev.Seen(obj)
    if kind == "capacity":
        return ev.SetCapacity(pool, data.draw(st.sampled_from([0, 8, evm.CAPACITY, 40])))
    if kind == "drop":
        return ev.DropPool(pool)
    if kind == "add_pool":
        return ev.AddPool(obj, pool, data.draw(st.integers(1, 6)))
    if kind == "unpinned":
        return ev.Unpinned(obj)
    if kind == "retiered":
        return ev.Retiered(
            obj, {pool: data.draw(st.integers(1, 6))}, data.draw(st.sampled_from([None, *range(obj)]))
        )
    return Tick()


def eviction_by_method(core: EvictionCore, event: ev.EvictionEvent, now_ms: int) -> Sequence[object]:
    if isinstance(event, Tick):
        return core.tick(now_ms)
    if isinstance(event, ev.Insert):
        return core.insert(event.object_id, tenant=event.tenant, pool=event.pool, size=event.size,
                           pools=event.pools, parent=event.parent, chunk_index=event.chunk_index,
                           now_ms=now_ms, prompt_chunks=event.prompt_chunks)  # fmt: skip
    if isinstance(event, ev.DropPool):
        return [Reply(core.drop_pool(event.pool))]
    if isinstance(event, ev.SetCapacity):
        core.set_capacity(event.pool, event.capacity_bytes)
    elif isinstance(event, ev.Seen):
        core.seen(event.object_id)
    elif isinstance(event, ev.Access):
        core.access(event.object_id, now_ms)
    elif isinstance(event, ev.Removed):
        core.removed(event.object_id)
    elif isinstance(event, ev.AddPool):
        core.add_pool(event.object_id, event.pool, event.nbytes)
    elif isinstance(event, ev.Retiered):
        core.retiered(event.object_id, pools=event.pools, parent=event.parent, now_ms=now_ms)
    elif isinstance(event, ev.Unpinned):
        core.unpinned(event.object_id, now_ms)
    else:
        assert isinstance(event, ev.EvictRefused)
        core.refused(event.object_id, now_ms)
    return []


def eviction_core(policy: Any, admission: Any) -> EvictionCore:
    config = EvictionConfig(policy=policy, admission=admission, high_watermark=0.9, low_watermark=0.7,
                            batch_max=6, refused_cooldown_ms=50, reuse_horizon_ms=40,
                            density_recompute_every=4)  # fmt: skip
    core = EvictionCore(config, evm.QUOTAS)
    for pool in evm.POOLS:
        core.set_capacity(pool, evm.CAPACITY)
    return core


@settings(max_examples=25, deadline=None)  # fewer: a state with a sketch takes ~10 ms to compare
@given(
    data=st.data(), policy=st.sampled_from(POLICY_NAMES), admission=st.sampled_from(["always", "second_hit"])
)
def test_eviction_step_is_the_method_of_the_same_meaning(
    data: st.DataObject, policy: Any, admission: Any
) -> None:
    run_both(data, lambda: eviction_core(policy, admission), eviction_event, eviction_by_method)


# ---- routing ---------------------------------------------------------------------------------


def routing_core() -> RoutingCore:
    core = rom.core(admitted_max=6, tenant_inflight_max=4, health_stale_ms=50)
    rom.publish(core, rom.KEYS[:8], "seg-a")
    return core


def routing_event(data: st.DataObject, out: list[object], core: Any) -> ro.RoutingEvent:
    kind = data.draw(st.sampled_from(["route", "route", "health", "heard", "first", "finished", "failed"]))
    if kind == "route":
        prefix, length = data.draw(st.integers(0, 3)), data.draw(st.integers(1, 700))
        keys = prompt_keys(rom.DOMAIN, rom.MODEL, rom.LAYOUT, [prefix] * length)
        rid = f"r{data.draw(st.integers(0, 9))}"
        exclude = tuple(data.draw(st.lists(st.sampled_from(["a", "b"]), max_size=1)))
        return ro.Route(rid, data.draw(st.sampled_from(["t1", "t2"])), keys, length, exclude=exclude,
                        admit=data.draw(st.booleans()))  # fmt: skip
    if kind == "health":
        return ro.Health(data.draw(st.sampled_from(["a", "b"])), data.draw(st.booleans()))
    if kind == "heard":
        return ro.IndexHeard()
    rid = f"r{data.draw(st.integers(0, 9))}"
    return (
        ro.FirstToken(rid) if kind == "first" else ro.Finished(rid) if kind == "finished" else ro.Failed(rid)
    )


def routing_by_method(core: RoutingCore, event: ro.RoutingEvent, now_ms: int) -> Sequence[object]:
    if isinstance(event, ro.Route):
        return [Reply(core.route(event.request_id, event.tenant, event.keys, event.prompt_tokens, now_ms,
                                 exclude=event.exclude, admit=event.admit))]  # fmt: skip
    if isinstance(event, ro.Failed):
        return [Reply(core.failed(event.request_id))]
    if isinstance(event, ro.Health):
        core.health(event.instance_id, event.ok, now_ms)
    elif isinstance(event, ro.IndexHeard):
        core.index_heard(now_ms)
    elif isinstance(event, ro.FirstToken):
        core.first_token(event.request_id)
    else:
        assert isinstance(event, ro.Finished)
        core.finished(event.request_id)
    return []


@EXAMPLES
@given(data=st.data())
def test_routing_step_is_the_method_of_the_same_meaning(data: st.DataObject) -> None:
    run_both(data, routing_core, routing_event, routing_by_method)


# ---- routing index ---------------------------------------------------------------------------


def directory_event(data: st.DataObject) -> m.DirectoryEvent:
    seg = data.draw(st.sampled_from(rim.SEGMENTS))
    domain, chain = data.draw(st.sampled_from(rim.DOMAINS)), data.draw(st.sampled_from(rim.CHAINS))
    kind = data.draw(
        st.sampled_from(["up", "down", "published", "published", "evicted", "invalidated", "hits"])
    )
    incarnation = data.draw(st.integers(1, 3))
    if kind == "up":
        return m.SegmentUp(segment_id=seg, incarnation=incarnation, capacity_bytes=1)
    if kind == "down":
        return m.SegmentDown(segment_id=seg, incarnation=incarnation, reason="restarted")
    if kind == "published":
        placed = data.draw(st.sets(st.sampled_from(rim.SEGMENTS), min_size=1, max_size=2))
        return m.GroupPublished(group=chain, chunk_index=rim.CHAINS.index(chain), members=1,
                                namespace=rim.namespace(domain),
                                placements=[m.SegmentBytes(s, 100) for s in sorted(placed)])  # fmt: skip
    if kind == "evicted":
        return m.GroupEvicted(group=chain, reason="pressure", domain=domain)
    if kind == "invalidated":
        return m.GroupInvalidated(
            group=chain, reason="corrupt", domain=data.draw(st.sampled_from([domain, DomainDigest(b"")]))
        )
    return m.GroupsAccessed(groups=[m.GroupHits(chain, 2, domain)])


def index_event(data: st.DataObject, out: list[object], index: RoutingIndex) -> ri.RoutingIndexEvent:
    kind = data.draw(st.sampled_from(["apply", "apply", "apply", "apply", "check", "resync"]))
    if kind == "apply":
        seq = data.draw(
            st.sampled_from([index.last_seq + 1] * 3 + [max(1, index.last_seq), index.last_seq + 2])
        )
        return ri.Apply(seq, directory_event(data))
    if kind == "check":
        first = data.draw(st.integers(0, index.last_seq + 3))
        created = data.draw(st.none() | st.sampled_from(["t0", "t1"]))  # the stream's creation time
        return ri.CheckStream(first, data.draw(st.integers(0, index.last_seq + 3)), created)
    segments = [
        ListedSegment(s, data.draw(st.integers(1, 3)), data.draw(st.booleans())) for s in rim.SEGMENTS
    ]
    up = [s.segment_id for s in segments if s.up]
    groups = [
        ListedGroup(d, c, rim.CHAINS.index(c), 100, frozenset(up[:1]))
        for d in rim.DOMAINS
        for c in rim.CHAINS[: data.draw(st.integers(0, 2))]
        if up
    ]
    return ri.Resync(segments, groups, at_seq=data.draw(st.integers(0, index.last_seq + 2)))


def index_by_method(index: RoutingIndex, event: ri.RoutingIndexEvent, now_ms: int) -> Sequence[object]:
    if isinstance(event, ri.Apply):
        return [Reply(index.apply(event.seq, event.event))]
    if isinstance(event, ri.CheckStream):
        return [Reply(index.check_stream(event.first_seq, event.last_seq, event.created))]
    index.resync(event.segments, event.groups, at_seq=event.at_seq)
    return []


@EXAMPLES
@given(data=st.data())
def test_routing_index_step_is_the_method_of_the_same_meaning(data: st.DataObject) -> None:
    run_both(data, RoutingIndex, index_event, index_by_method)


# ---- time never goes backwards ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "first", "second"),
    [
        (lambda: RepairCore(rpm.CONFIG), Tick(), rp.SegmentDown("s0")),  # an event without a time
        (lambda: RepairCore(rpm.CONFIG), rp.ObjectRemoved(1), rp.CopyFailed(1)),
        (lambda: PrefetchCore(pfm.CONFIG, pfm.SEGMENTS_FREE), Tick(), pf.CancelHint("h")),
        (lambda: PrefetchCore(pfm.CONFIG, pfm.SEGMENTS_FREE), pf.ReplicaAdded("o0", "s0"), Tick()),
        (lambda: eviction_core("lru", "always"), Tick(), ev.Removed(1)),
        (lambda: eviction_core("lru", "always"), ev.Seen(1), ev.Access(1)),
        (routing_core, ro.Health("a", True), ro.Finished("r0")),
        (routing_core, ro.IndexHeard(), ro.Route("r1", "t1", rom.KEYS[:2], 300)),
        (
            RoutingIndex,
            ri.CheckStream(1, 0),
            ri.Apply(1, m.SegmentUp(segment_id="s0", incarnation=1, capacity_bytes=1)),
        ),
    ],
)
def test_time_going_backwards_is_refused(make: Any, first: object, second: object) -> None:
    backwards_refused(make(), first, second)


def test_a_method_call_moves_the_time_step_checks() -> None:
    """Callers may mix the methods and `step`: the core's own time counts too."""
    core = RepairCore(rpm.CONFIG)
    core.tick(5_000)
    with pytest.raises(AssertionError, match="time went backwards"):
        core.step(rp.SegmentDown("s0"), 4_999)


def test_every_core_has_the_one_shape() -> None:
    """Each core is a `Core[its events, its outputs]` (mypy checks these assignments in `make
    lint`), so the one shell driver runs any of them; each steps an event of its own."""
    from kvfabric.core import disk_slots_events as dk
    from kvfabric.core.client_loads import Effect as LoadEffect
    from kvfabric.core.client_loads import LoadTable
    from kvfabric.core.client_loads_events import LoadEvent
    from kvfabric.core.disk_slots import DiskSlotTable
    from kvfabric.core.segment_slots import SlotTable
    from kvfabric.core.segment_slots_events import SlotEvent, SlotOutput
    from kvfabric.core.step import Core

    repair: Core[rp.RepairEvent, rp.RepairOutput] = RepairCore(rpm.CONFIG)
    prefetch: Core[pf.PrefetchEvent, pf.PrefetchOutput] = PrefetchCore(pfm.CONFIG, pfm.SEGMENTS_FREE)
    eviction: Core[ev.EvictionEvent, ev.EvictionOutput] = eviction_core("lru", "always")
    routing: Core[ro.RoutingEvent, ro.RoutingOutput] = routing_core()
    index: Core[ri.RoutingIndexEvent, ri.RoutingIndexOutput] = RoutingIndex()
    loads: Core[LoadEvent, LoadEffect] = LoadTable(transfers_max=2)
    slots: Core[SlotEvent, SlotOutput] = SlotTable(128)
    disk: Core[dk.DiskSlotEvent, dk.DiskSlotOutput] = DiskSlotTable(48, 4, block_bytes=1)
    stepped: list[tuple[Core[Any, Any], object]] = [
        (repair, Tick()),
        (prefetch, Tick()),
        (eviction, Tick()),
        (routing, ro.IndexHeard()),
        (index, ri.CheckStream(1, 0)),
        (loads, Tick()),
        (slots, Tick()),
        (disk, dk.AllocSlot(4, b"k")),
    ]
    for core, event in stepped:
        assert isinstance(core.step(event, 10), list)
        core.check_invariants()
