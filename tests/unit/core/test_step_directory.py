"""`step(event, now_ms)` (issue 26: one shape for every core) of the directory core, the shard
leadership and the shard lifecycle.

The directory: a core driven through `step` and one driven through its methods (`handle`,
`lookup_more`, `tick`, `adopt`, `charge_domains`, `set_admission_filter`), given the same random
run (the constants of `test_directory_machine`: segments, writers, readers, keys; segments
registered, heartbeats, put_begin, confirms from the tickets handed out, commits, aborts, lookups
whole or in slices, lease releases and renewals, evictions, frees acknowledged from the `FreeSlots`
that came out, tenant charges, admission filters, an adoption into an empty core, ticks), answer
alike (a handle's effects then its reply as the `Reply`; the same error when one refuses) and end
every step in the same state (`stepkit`); time going backwards is refused before anything changes.

Leadership and lifecycle: both are a `Core[their events, their effects]` (mypy checks the
assignments in `make lint`) with the shared `Tick`, and `check_invariants()` without a time is the
check as of the latest time each was given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.core.directory import DirectoryCore, FreeSlots
from kvfabric.core.directory import events as de
from kvfabric.core.directory.rebuild import SegmentHolding
from kvfabric.core.leadership import (
    Effect,
    LeadershipConfig,
    LeadershipEvent,
    MembersSeen,
    ShardLeadership,
)
from kvfabric.core.shard_lifecycle import Event, Led, LifecycleEffect, ShardLifecycle
from kvfabric.core.step import Core, Reply, Tick, reply_of
from kvfabric.format.invariant import InvariantViolation
from kvfabric.proto import directory as m
from kvfabric.proto.eviction import ADMISSION_LENGTH_CLASSES
from kvfabric.proto.segment import HeldObject
from tests.unit.core import test_directory_machine as dm
from tests.unit.core.dirkit import checksum_of, key, put, register, spec
from tests.unit.core.stepkit import backwards_refused, run_both
from tests.unit.core.test_admission_filter_core import view

EXAMPLES = settings(max_examples=60, deadline=None)
SEGMENT_IDS = sorted(dm.SEGMENTS)
HOLDERS = (*dm.READERS, "stranger")
# group key -> the ids of its prefix's groups from it on (a lookup that may hit from its start)
RUN_FROM = {
    dm.GROUP_IDS[g.group_id()]: [h.group_id() for h in prefix[i:]]
    for prefix in dm.PREFIXES
    for i, g in enumerate(prefix)
}
PREFIX_KEYS = [[key(g, rank=r) for g in p for r in range(g.tp_size)] for p in dm.PREFIXES]


def registration(data: st.DataObject, seg: str, core: DirectoryCore) -> m.RegisterSegment:
    """Mostly the same or the next incarnation (a restart); now and then a stale one."""
    zone, rack = dm.SEGMENTS[seg]
    known = core.segments.get(seg)
    again = 1 if known is not None and not known.up else 0  # a segment declared down restarts
    incarnation = (
        1
        if known is None
        else known.incarnation + data.draw(st.sampled_from([again, again, again, again, 1, -1]))
    )
    return m.RegisterSegment(
        segment_id=seg,
        incarnation=max(1, incarnation),
        domain=m.FailureDomain(host=seg, rack=rack, zone=zone),
        capacity_bytes=data.draw(st.sampled_from(dm.CAPACITIES)),
        data_addr=f"tcp://{seg}",
    )


def replies(out: list[object], kind: type[Any]) -> list[Any]:
    return [r.value for r in out if isinstance(r, Reply) and isinstance(r.value, kind)]


def a_lookup(data: st.DataObject, core: DirectoryCore) -> m.Lookup:
    """A prefix's first groups, or groups published now (so that some lookups hit)."""
    groups = [g.group_id() for g in data.draw(st.sampled_from(dm.PREFIXES))]
    if core.published and data.draw(st.sampled_from([True, True, False])):
        groups = RUN_FROM[data.draw(st.sampled_from(sorted(core.published)))]
    return m.Lookup(
        holder_id=data.draw(st.sampled_from(dm.READERS)),
        groups=groups[: data.draw(st.integers(1, 3))],
        lease_ttl_ms=data.draw(st.sampled_from(dm.LEASE_TTLS_MS)),
    )


def directory_event(data: st.DataObject, out: list[object], core: DirectoryCore) -> de.DirectoryCoreEvent:
    kind = data.draw(st.sampled_from(["register", "register", "heartbeat", "heartbeat", "heartbeat", "begin",
                                      "begin", "begin", "confirm", "confirm", "confirm", "commit", "commit",
                                      "abort", "lookup", "lookup", "slices", "more", "release", "renew",
                                      "evict", "freed", "charge", "filter", "adopt", "tick",
                                      "tick"]))  # fmt: skip
    seg = data.draw(st.sampled_from(SEGMENT_IDS))
    keys = data.draw(st.sampled_from(PREFIX_KEYS))[: data.draw(st.integers(1, 3))]  # from chunk 0 on
    if data.draw(st.booleans()):
        keys = data.draw(st.lists(st.sampled_from(dm.KEYS), min_size=1, max_size=3, unique=True))
    writer = data.draw(st.sampled_from(dm.WRITERS))
    tickets = [t for r in replies(out, m.PutBeginReply) for res in r.results for t in res.tickets]
    if data.draw(st.sampled_from([True, True, True, False])):
        tickets = tickets[-4:]  # mostly the latest: older ones have mostly ended
    leases = [r.lease_id for r in replies(out, m.LookupReply) if r.lease_id] + [999]
    held = [(i, lease) for i, lease in core.lease_table.leases.items() if not lease.is_pin]
    request: Any
    live = core.segments.get(seg)
    if kind == "register" or live is None or not live.up:  # mostly every segment up
        request = registration(data, seg, core)
    elif kind == "heartbeat":
        request = m.Heartbeat(
            segment_id=seg,
            incarnation=live.incarnation if data.draw(st.sampled_from([True, True, False])) else 1,
            used_bytes=data.draw(st.sampled_from([0, 200])),
            draining=data.draw(st.booleans()),
        )
    elif kind == "begin":
        request = m.PutBegin(
            writer_id=writer,
            request_id=f"q{data.draw(st.sampled_from([len(out)] * 4 + [0]))}",  # now and then a retry
            objects=[spec(k, data.draw(st.sampled_from(dm.SIZES))) for k in keys],
            replicas=data.draw(st.integers(0, 2)),
            write_ttl_ms=data.draw(st.sampled_from([*dm.WRITE_TTLS_MS, 10_000, 10_000])),
        )
    elif kind == "confirm" and len(tickets) > 0:
        t = data.draw(st.sampled_from(tickets))
        good = data.draw(st.sampled_from([True, True, True, False]))
        request = m.ConfirmReplicas(
            segment_id=t.segment_id,
            incarnation=t.incarnation,
            confirms=[  # a slot of its own (a segment never holds two live objects in one slot)
                m.ReplicaConfirm(
                    ticket_id=t.ticket_id,
                    key=t.key,
                    slot=t.ticket_id,
                    slot_generation=1,
                    size_bytes=t.size_bytes,
                    checksum=t.checksum if good else dm.corrupt(t.checksum),
                )
            ],
        )
    elif kind in ("commit", "abort"):
        ok = {c.ticket_id for r in replies(out, m.ConfirmReply) for c in r.results if c.status == "ok"}
        mine = [t for t in tickets if t.ticket_id in ok] or tickets
        if mine and data.draw(st.sampled_from([True, True, True, False])):  # a writer's own keys
            writer = data.draw(st.sampled_from(mine)).writer_id
            keys = sorted({t.key for t in mine if t.writer_id == writer})[: data.draw(st.integers(1, 3))]
        ask = m.PutCommit if kind == "commit" else m.PutAbort
        request = ask(writer_id=writer, request_id=f"c{data.draw(st.integers(0, 5))}", keys=keys)
    elif kind == "lookup":
        request = a_lookup(data, core)
    elif kind == "slices":  # the first slice of a lookup the shell runs in slices
        return de.Request(a_lookup(data, core), reply_bytes_max=m.REPLY_BYTES_MAX, groups_max=1)
    elif kind == "more":  # mostly a live lease's next slice (its holder, then groups published now)
        lookup, lease_id = a_lookup(data, core), data.draw(st.sampled_from(leases))
        if len(held) > 0 and data.draw(st.sampled_from([True, True, False])):
            lease_id, lease = data.draw(st.sampled_from(held))
            lookup = m.Lookup(holder_id=lease.holder_id, groups=RUN_FROM[lease.groups[0]])
        return de.LookupMore(lookup, lease_id, first=1, reply_bytes_max=m.REPLY_BYTES_MAX,
                             groups_max=data.draw(st.integers(1, 2)))  # fmt: skip
    elif kind in ("release", "renew"):
        holder, lease_id = data.draw(st.sampled_from(HOLDERS)), data.draw(st.sampled_from(leases))
        if len(held) > 0 and data.draw(st.booleans()):
            lease_id, lease = data.draw(st.sampled_from(held))
            holder = lease.holder_id
        if kind == "release":
            request = m.LeaseRelease(holder_id=holder, lease_id=lease_id)
        else:
            request = m.LeaseRenew(holder_id=holder, lease_id=lease_id, lease_ttl_ms=500)
    elif kind == "evict":
        request = m.Evict(groups=[g.group_id() for g in data.draw(st.sampled_from(dm.PREFIXES))[:2]])
    elif kind == "freed" and any(isinstance(e, FreeSlots) for e in out):
        free = data.draw(st.sampled_from([e for e in out if isinstance(e, FreeSlots)]))
        request = m.SlotsFreed(
            segment_id=free.segment_id, incarnation=free.incarnation, freed=list(free.slots)
        )
    elif kind == "charge":
        return de.ChargeDomains(tuple(data.draw(st.lists(st.sampled_from(dm.DIGESTS), max_size=2))))
    elif kind == "filter":
        limit = data.draw(st.sampled_from([0, 150, 10_000, 10_000]))
        return de.SetAdmissionFilter(
            view(
                {s: [limit] * ADMISSION_LENGTH_CLASSES for s in SEGMENT_IDS}, at=data.draw(st.integers(0, 3))
            )
        )
    elif kind == "adopt" and not core.segments:  # a new leader: only into an empty core
        reg = registration(data, seg, core)
        k = data.draw(st.sampled_from(dm.KEYS))
        stored = [HeldObject(k, slot=1, slot_generation=1, size_bytes=100, checksum=checksum_of(k))]
        return de.Adopt((SegmentHolding(reg, stored if data.draw(st.booleans()) else []),))
    else:
        return Tick()
    return de.Request(request)


def directory_by_method(core: DirectoryCore, event: de.DirectoryCoreEvent, now_ms: int) -> Sequence[object]:
    if isinstance(event, de.Request):
        outcome = core.handle(
            event.request, now_ms, reply_bytes_max=event.reply_bytes_max, groups_max=event.groups_max
        )
        return [*outcome.effects, Reply(outcome.reply)]
    if isinstance(event, Tick):
        return core.tick(now_ms)
    if isinstance(event, de.LookupMore):
        more = core.lookup_more(
            event.request,
            event.lease_id,
            event.first,
            now_ms,
            reply_bytes_max=event.reply_bytes_max,
            groups_max=event.groups_max,
        )
        return [*more.effects, Reply(more.reply)]
    if isinstance(event, de.SetAdmissionFilter):
        return [Reply(core.set_admission_filter(event.view, now_ms))]
    if isinstance(event, de.Adopt):
        return core.adopt(event.holdings, now_ms)
    assert isinstance(event, de.ChargeDomains)
    core.charge_domains(event.domain_digests, now_ms)
    return []


# The machine's constants, with room for a tenant's writes (its 0.2 of the capacity refuses most),
# and segments and writes that last longer (the run's steps are up to 900 ms apart): most writes
# are then published, and read.
CONFIG = dataclasses.replace(
    dm.CONFIG,
    tenant_pending_capacity_fraction=1.0,
    heartbeat_interval_ms=2_500,
    heartbeat_timeout_ms=10_000,
    write_ttl_ms_max=10_000,
)


@EXAMPLES
@given(data=st.data())
def test_directory_step_is_the_method_of_the_same_meaning(data: st.DataObject) -> None:
    run_both(
        data, lambda: DirectoryCore(CONFIG), directory_event, directory_by_method, steps_max=80, steps_min=30
    )


def test_directory_step_answers_a_request_after_its_effects() -> None:
    """A handle's `Outcome` comes back as its effects, in order, then one `Reply` (its reply)."""
    core = DirectoryCore(dm.CONFIG)
    domain = m.FailureDomain(host="h", rack="r", zone="z")
    reg = m.RegisterSegment(segment_id="s0", incarnation=1, domain=domain, capacity_bytes=1_000)
    out = core.step(de.Request(reg), 5)
    assert isinstance(out[-1], Reply)
    assert out[-1].value == DirectoryCore(dm.CONFIG).handle(reg, 5).reply
    assert all(not isinstance(e, Reply) for e in out[:-1])


def test_directory_step_passes_a_lookups_slice_bounds() -> None:
    """A lookup's first slice (`groups_max`) and the next (`LookupMore`) through `step` fold what
    the methods fold: a 2-group hit in slices of 1 is a hit of 1, then 1 more on the same lease."""
    core = DirectoryCore(dm.CONFIG)
    for seg in ("s0", "s1"):
        register(core, seg, now=1)
    prefix = dm.PREFIXES[0][:2]
    put(core, [key(g) for g in prefix], writer="w", now=2)
    lookup = m.Lookup(holder_id="r", groups=[g.group_id() for g in prefix], lease_ttl_ms=500)
    first = reply_of(core.step(de.Request(lookup, reply_bytes_max=m.REPLY_BYTES_MAX, groups_max=1), 3))
    assert isinstance(first, m.LookupReply) and first.hit_chunks == 1
    more = de.LookupMore(lookup, first.lease_id, 1, reply_bytes_max=m.REPLY_BYTES_MAX, groups_max=1)
    second = reply_of(core.step(more, 4))
    assert isinstance(second, m.LookupReply) and second.hit_chunks == 1
    core.check_invariants()


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (Tick(), de.ChargeDomains(())),
        (de.ChargeDomains(()), de.Request(m.Lookup(holder_id="r", groups=[]))),
        (de.SetAdmissionFilter(view({})), Tick()),
    ],
)
def test_directory_time_going_backwards_is_refused(first: object, second: object) -> None:
    backwards_refused(DirectoryCore(dm.CONFIG), first, second)


# ---- leadership and lifecycle: the one shape ------------------------------------------------

LEADERSHIP = LeadershipConfig(shards=4)


def test_leadership_and_lifecycle_have_the_one_shape() -> None:
    """Each is a `Core[its events, its effects]` (mypy checks these assignments in `make lint`),
    steps the shared `Tick`, and checks its invariants without a time (as of the latest one)."""
    leadership = ShardLeadership(LEADERSHIP, "i0")
    lifecycle = ShardLifecycle(leadership)
    leader_core: Core[LeadershipEvent, Effect] = leadership
    lifecycle_core: Core[Event, LifecycleEffect] = lifecycle
    out = leader_core.step(MembersSeen(frozenset({"i0"})), 10)
    assert isinstance(out, list) and out
    assert isinstance(leader_core.step(Tick(), 20), list)
    leader_core.check_invariants()
    assert lifecycle_core.step(Led(0, 1), 20) == []  # not led: nothing to start
    lifecycle_core.check_invariants()
    leadership.check_invariants(20)  # the timed check is unchanged
    with pytest.raises(InvariantViolation, match="checked at a time before"):
        lifecycle.check_invariants(19)


@pytest.mark.parametrize(
    ("first", "second"),
    [(Tick(), MembersSeen(frozenset({"i0"}))), (MembersSeen(frozenset({"i0", "i1"})), Tick())],
)
def test_leadership_time_going_backwards_is_refused_before_anything_changes(
    first: object, second: object
) -> None:
    backwards_refused(ShardLeadership(LEADERSHIP, "i0"), first, second)
