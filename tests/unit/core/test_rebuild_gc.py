"""A rebuild's plan adds no objects for CPython's cyclic GC to walk (issue 20,
`kvfabric.runtime.gcpolicy`): it is alive for the whole stepped adoption of a shard
(`DirectoryCore.adopt_steps`, the event loop yielding between steps), so a full collection landing
in one of those steps walked every record it held: as slotted dataclasses, lists and tuples they
were ~4.5 tracked objects per stored object, ~0.7 s at 500,000 objects on the shared 2-core VM,
on the loop that renews the shard's leader lease. Its records are msgspec Structs with
`gc=False`, its dicts hold nothing tracked, a member's replicas are a tuple of untracked records.

Measure (the figures in docs/directory.md, garbage collector):
`.venv/bin/python -m tests.unit.core.test_rebuild_gc 500000`."""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Generator, Iterable, Iterator
from typing import Any

from kvfabric.core.directory import DirectoryConfig, DirectoryCore
from kvfabric.core.directory.rebuild import (
    HeldReplica,
    RebuildPlan,
    SegmentHolding,
    plan_rebuild,
    plan_rebuild_steps,
)
from kvfabric.core.directory.records import unpack_group
from kvfabric.proto.segment import HeldObject
from tests.unit.core.dirkit import SECRET, checksum_of, groups, key
from tests.unit.core.test_adopt_steps import holdings_of, registration


def whole_groups(n_objects: int, segments: int = 4) -> list[SegmentHolding]:
    """`n_objects` stored objects of complete 2-member groups, one replica each, spread over
    `segments` segments."""
    objects: list[list[HeldObject]] = [[] for _ in range(segments)]
    i = 0
    for g in groups(n_objects // 2, tp_size=2):
        for rank in (0, 1):
            k = key(g, rank)
            objects[i % segments].append(HeldObject(k, i // segments + 1, 1, 4096, checksum_of(k)))
            i += 1
    return [SegmentHolding(registration(f"seg-{s}"), found) for s, found in enumerate(objects)]


def finish(steps: Generator[None, Any, RebuildPlan]) -> RebuildPlan:
    while True:
        try:
            next(steps)
        except StopIteration as done:
            plan: RebuildPlan = done.value
            return plan


def parts(obj: object) -> Iterator[object]:
    """`obj` and every container and record it reaches, whatever their shape (not str, bytes or
    int: those are never tracked)."""
    if obj is None or isinstance(obj, (str, bytes, int)):
        return
    yield obj
    if isinstance(obj, dict):
        children: Iterable[object] = [*obj.keys(), *obj.values()]
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = obj
    else:  # a msgspec Struct or a slotted dataclass
        names: tuple[str, ...] = getattr(obj, "__struct_fields__", ()) or getattr(obj, "__slots__", ())
        children = [getattr(obj, name) for name in names]
    for child in children:
        yield from parts(child)


def test_a_plans_records_are_never_tracked() -> None:
    holdings = holdings_of(4)  # whole, incomplete, disputed, replicated, unparsable: every path
    plan = plan_rebuild(holdings)
    assert len(plan.groups) > 50 and len(plan.orphans) > 50
    found = [p for root in (*plan.groups.values(), *plan.orphans) for p in parts(root)]
    # every stored slot is in the plan once: adopted in a member, or an orphan
    assert sum(isinstance(p, HeldReplica) for p in found) == sum(len(h.objects) for h in holdings)
    # records and dicts: never tracked (the dicts hold ints, bytes and untracked records)
    assert not [p for p in found if gc.is_tracked(p) and type(p) is not tuple]
    assert not gc.is_tracked(plan.groups)
    gc.collect()  # a tuple of untracked objects is untracked by the first collection it survives
    assert not [p for p in found if gc.is_tracked(p)]


def test_a_plan_adds_no_tracked_objects_while_it_is_built_or_kept() -> None:
    holdings = whole_groups(4_000)
    gc.collect()
    before = len(gc.get_objects())
    steps = plan_rebuild_steps(holdings, 64)
    for _ in range(60):  # half-way through: the candidates the generator holds
        next(steps)
    gc.collect()
    building = len(gc.get_objects()) - before
    plan = finish(steps)
    gc.collect()
    kept = len(gc.get_objects()) - before
    assert len(plan.groups) == 2_000
    # ~4.5 per object (18,000 here) before; now the plan object, the generator's few lists
    assert building < 400, building
    assert kept < 10, kept


def test_adopting_a_plan_publishes_what_it_found() -> None:
    """The plan's groups, members and replicas reach the published records (member order,
    replicas, namespace), as before the records changed shape."""
    holdings = whole_groups(200, segments=2)
    core = DirectoryCore(DirectoryConfig(ticket_secret=SECRET), epoch=4)
    core.adopt(holdings, 1_000)
    core.check_invariants()
    plan = plan_rebuild(holdings)
    assert set(core.published) == set(plan.groups) and len(plan.groups) == 100
    for gid, rebuilt in plan.groups.items():
        record = unpack_group(core.published[gid])
        assert core.published_table.namespace(record.namespace) == rebuilt.namespace
        assert record.chunk_index == rebuilt.chunk_index
        assert [
            (x.member, x.size_bytes, x.checksum, [r.slot for r in x.replicas]) for x in record.members
        ] == [
            ((m.tp_rank, m.pp_stage, m.layer_group), m.size_bytes, m.checksum, [r.slot for r in m.replicas])
            for _, m in sorted(rebuilt.members.items())
        ]
        assert [x.member for x in record.members] == [(0, 0, 0), (1, 0, 0)]


def measure(n_objects: int) -> None:
    """Tracked objects and full-collection time with a plan of `n_objects` alive (half-built and
    whole), printed."""
    holdings = whole_groups(n_objects)
    gc.collect()
    before = len(gc.get_objects())

    def collection() -> str:
        gc.collect()
        grown = len(gc.get_objects()) - before
        took = []
        for _ in range(3):
            start = time.perf_counter()
            gc.collect()
            took.append(f"{(time.perf_counter() - start) * 1000:.0f}")
        per_object = grown / n_objects
        tracked = f"{grown:,} tracked objects more ({per_object:.2f} per stored object)"
        return f"{tracked}, full collection {' / '.join(took)} ms"

    steps = plan_rebuild_steps(holdings, 512)
    start = time.perf_counter()
    for _ in range(3 * n_objects // 512 // 2):  # the slices sorted, half the objects merged
        next(steps)
    print(f"{n_objects:,} objects, plan half-built: {collection()}")
    plan = finish(steps)
    print(f"planned in {time.perf_counter() - start:.1f} s (and the collections above)")
    print(f"plan whole ({len(plan.groups):,} groups): {collection()}")
    del plan
    print(f"plan dropped: {collection()}")


if __name__ == "__main__":
    measure(int(sys.argv[1]) if len(sys.argv) > 1 else 500_000)
