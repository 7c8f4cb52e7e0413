"""`DirectoryCore.adopt_steps`: a rebuild's adoption in bounded steps (the host yields its event
loop between them: one call for a shard of 100,000 objects outlasted the leader lease, review,
stop 71) ends in exactly the state one `adopt` call builds, whatever the step; the segments
count as heard at the last step's time (an adoption longer than the heartbeat timeout must not
have them all declared down by the first tick)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Generator, Iterator
from typing import Any

import pytest

from kvfabric.core.directory import DirectoryConfig, DirectoryCore
from kvfabric.core.directory.rebuild import SegmentHolding, plan_rebuild, plan_rebuild_steps
from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from kvfabric.proto.segment import SSD_SLOT_BASE, HeldObject
from tests.unit.core.dirkit import SECRET, checksum_of, groups, key

EPOCH = 4


def registration(segment_id: str) -> m.RegisterSegment:
    return m.RegisterSegment(
        segment_id=segment_id,
        incarnation=3,
        capacity_bytes=1 << 30,
        domain=m.FailureDomain(host=segment_id, rack="r", zone="z"),
        data_addr=f"tcp://{segment_id}",
    )


def holdings_of(seed: int) -> list[SegmentHolding]:
    """Three segments' reports, slots out of order: whole groups (some on two segments, some
    on disk), groups missing a member, a member whose replicas disagree, unparsable keys."""
    rng = random.Random(seed)
    objects: dict[str, list[HeldObject]] = {"seg-c": [], "seg-a": [], "seg-b": []}
    slots = {name: iter(rng.sample(range(1, 100_000), 5_000)) for name in objects}
    names = sorted(objects)

    def store(name: str, k: bytes, size: int = 100, checksum: bytes | None = None) -> None:
        slot = next(slots[name]) + (SSD_SLOT_BASE if rng.random() < 0.2 else 0)
        objects[name].append(
            HeldObject(ObjectKey(k), slot, rng.randint(1, 3), size, checksum or checksum_of(k))
        )

    for i, group in enumerate(groups(150, seed=seed, tp_size=2)):
        members = [key(group, rank) for rank in (0, 1)]
        shape = i % 6
        for rank, k in enumerate(members):
            if shape == 1 and rank == 1:
                continue  # incomplete: an orphan
            for name in rng.sample(names, 2 if shape in (2, 3) else 1):
                store(name, k)
            if shape == 4 and rank == 0:
                store(rng.choice(names), k, checksum=b"x" * 16)  # replicas disagree: disputed
    for j in range(7):
        store(rng.choice(names), b"not a key %d" % j)
    for found in objects.values():
        rng.shuffle(found)
    return [SegmentHolding(registration(name), found) for name, found in objects.items()]


def state_of(core: DirectoryCore) -> dict[str, Any]:
    return {
        "published": dict(core.published),
        "segments": {s: (g.reserved_bytes, g.up, g.last_heartbeat_ms) for s, g in core.segments.items()},
        "freeing": dict(core._freeing),
        "quotas": sorted((str(t), u.bytes, u.objects) for t, u in core.quotas.usage.items()),
        "counters": dict(core.counters),
        "grace_until_ms": core.grace_until_ms,
    }


def run(steps: Generator[None, Any, Any], times: Iterator[int] | None = None) -> tuple[int, Any]:
    """`steps` run to their end, sent the next of `times` at each step after the first if
    given: (how many steps yielded, what they returned)."""
    taken = 0
    sent = None
    while True:
        try:
            steps.send(sent)
        except StopIteration as done:
            return taken, done.value
        taken += 1
        sent = next(times) if times is not None else None


def adopted(holdings: list[SegmentHolding], objects_max: int | None) -> tuple[DirectoryCore, list[Any]]:
    core = DirectoryCore(DirectoryConfig(ticket_secret=SECRET), epoch=EPOCH)
    _, effects = run(core.adopt_steps(holdings, 1_000, objects_max))
    core.check_invariants()
    return core, effects


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("objects_max", [1, 7, 64, 1_000])
def test_adoption_in_steps_builds_what_one_call_builds(seed: int, objects_max: int) -> None:
    holdings = holdings_of(seed)
    whole = DirectoryCore(DirectoryConfig(ticket_secret=SECRET), epoch=EPOCH)
    effects = whole.adopt(holdings, 1_000)
    whole.check_invariants()
    assert len(whole.published) > 50 and whole.counters["adopted_orphans_total"] > 50
    stepped, stepped_effects = adopted(holdings, objects_max)
    assert state_of(stepped) == state_of(whole)
    assert stepped_effects == effects


def test_plan_in_steps_is_the_plan_of_one_call() -> None:
    holdings = holdings_of(9)
    taken, plan = run(plan_rebuild_steps(holdings, 5))
    assert plan == plan_rebuild(holdings)
    assert taken > sum(len(h.objects) for h in holdings) // 5


def test_no_step_weighs_more_than_its_bound() -> None:
    """Each step adopts about `objects_max` objects: the count of steps grows with the shard."""
    holdings = holdings_of(5)
    objects = sum(len(h.objects) for h in holdings)
    core = DirectoryCore(DirectoryConfig(ticket_secret=SECRET), epoch=EPOCH)
    taken, _ = run(core.adopt_steps(holdings, 1_000, 10))
    assert taken >= 3 * objects // 10  # the slots, the plan, then what is published or freed


def test_segments_count_as_heard_at_the_last_steps_time() -> None:
    """A long adoption (the time sent with each step moves on) leaves the segments heard at its
    end: the first tick after it, within the heartbeat timeout of that, declares none down."""
    holdings = holdings_of(7)
    core = DirectoryCore(DirectoryConfig(ticket_secret=SECRET), epoch=EPOCH)
    timeout_ms = core.config.heartbeat_timeout_ms
    times = itertools.count(2_000, 1_000)  # a second a step: far past the heartbeat timeout in all
    taken, _ = run(core.adopt_steps(holdings, 1_000, 50), times)
    last = 1_000 + taken * 1_000
    assert last - 1_000 > 2 * timeout_ms
    assert {seg.last_heartbeat_ms for seg in core.segments.values()} == {last}
    core.tick(last + timeout_ms - 1)
    assert all(seg.up for seg in core.segments.values())
    assert core.grace_until_ms == 1_000 + core.config.lease_ttl_ms_max  # from the start: the old leases
