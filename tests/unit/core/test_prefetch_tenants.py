"""Prefetch core: tenants share its queues and copy slots, hint ids are per tenant, a hot object's
failing extra replica backs off, and a hint keeps only what it still has to copy (review,
2026-12-06)."""

from __future__ import annotations

import gc
from typing import Any

from kvfabric.core.prefetch import (
    Accepted,
    Busy,
    Hint,
    HintObject,
    PrefetchConfig,
    PrefetchCore,
    Refused,
    StartCopy,
)

T0 = 1_000
DEADLINE = T0 + 5_000


def objs(*names: str, on_target: tuple[str, ...] = ()) -> tuple[HintObject, ...]:
    return tuple(HintObject(n, 10, ("s1", "t") if n in on_target else ("s1",)) for n in names)


def hint(hint_id: str, tenant: str, objects: tuple[HintObject, ...], deadline_ms: int = DEADLINE) -> Hint:
    return Hint(hint_id, tenant, "t", objects, deadline_ms)


def core(**config: Any) -> PrefetchCore:
    return PrefetchCore(PrefetchConfig(**config))


def test_a_tenant_at_its_share_of_hints_is_busy_and_another_tenants_hint_is_accepted() -> None:
    """Four hints of tenant A made B's hint Busy('hints_full')."""
    c = core(hints_queued_max=4)  # A may hold three: one is left to the others
    for i, o in enumerate("xyz"):
        assert c.add_hint(hint(f"a{i}", "A", objs(o)), T0) == Accepted(f"a{i}", 1)
    assert c.add_hint(hint("a3", "A", objs("w")), T0) == Busy("a3", "tenant_hints_full")
    assert c.add_hint(hint("a4", "A", objs("x")), T0) == Busy("a4", "tenant_hints_full")  # even a duplicate
    assert c.add_hint(hint("b1", "B", objs("y")), T0) == Accepted("b1", 1)
    assert c.cancel_hint("a0", "A")  # A's share comes back
    assert c.add_hint(hint("a3", "A", objs("w")), T0) == Accepted("a3", 1)
    c.check_invariants()


def test_a_tenant_at_its_share_of_objects_is_busy_and_another_tenants_hint_is_accepted() -> None:
    """One hint of 16 objects took all of `objects_queued_max`."""
    c = core(objects_queued_max=16)  # A may queue 12: 4 are left to the others
    many = objs(*(f"o{i}" for i in range(16)))
    assert c.add_hint(hint("a0", "A", many), T0) == Refused("a0", "too_many_objects")  # never fits A's share
    # what is on the target already does not count
    partly = objs(*(f"o{i}" for i in range(16)), on_target=tuple(f"o{i}" for i in range(13)))
    assert c.add_hint(hint("a2", "A", partly), T0) == Accepted("a2", 3)
    assert c.add_hint(hint("a3", "A", objs(*(f"p{i}" for i in range(10)))), T0) == Busy(
        "a3", "tenant_objects_full"
    )
    assert c.add_hint(hint("b1", "B", objs("p", "q", "r", "s")), T0) == Accepted("b1", 4)
    assert c.objects_queued == 7
    c.check_invariants()


def test_a_lone_tenant_keeps_most_of_the_queues() -> None:
    """With a quarter *at most*, a lone tenant (tenants off) was refused an 8,192-object hint
    (1,024 chunks x TP 8) under a 16,384-object queue, and busy at 257 hints of 1,024."""
    c = core()
    big = objs(*(f"o{i}" for i in range(8_192)))
    assert c.add_hint(hint("big", "A", big), T0) == Accepted("big", 8_192)
    for i in range(300):
        assert isinstance(c.add_hint(hint(f"h{i}", "A", objs(f"s{i}")), T0), Accepted)
    c.check_invariants()


def test_copy_slots_are_shared_between_tenants_in_turn() -> None:
    """A tenant whose hints have the earliest deadlines took every copy slot."""
    c = core(copies_in_flight_max=4, hints_queued_max=16, objects_queued_max=64)
    assert c.add_hint(hint("a1", "A", objs(*(f"a{i}" for i in range(8))), T0 + 100), T0) == Accepted("a1", 8)
    assert c.add_hint(hint("b1", "B", objs("b0", "b1"), DEADLINE), T0) == Accepted("b1", 2)
    effects = c.tick(T0)
    assert [e.object_id for e in effects if isinstance(e, StartCopy)] == ["a0", "b0", "a1", "b1"]
    c.check_invariants()
    for e in effects:  # B's copies end: its slots go to A, the only one waiting
        assert isinstance(e, StartCopy)
        if str(e.object_id).startswith("b"):
            c.copy_finished(e.copy_id, True, T0 + 1)
    assert [e.object_id for e in c.tick(T0 + 2) if isinstance(e, StartCopy)] == ["a2", "a3"]
    c.check_invariants()


def test_the_same_hint_id_of_two_tenants_is_two_hints() -> None:
    """A's `req-1` and B's `req-1` were deduplicated into one, and one cancel ended both."""
    c = core()
    assert c.add_hint(hint("req-1", "A", objs("x")), T0) == Accepted("req-1", 1)
    assert c.add_hint(hint("req-1", "B", objs("y")), T0) == Accepted("req-1", 1)
    assert c.hint_ids_live == 2 and c.objects_queued == 2
    assert c.cancel_hint("req-1") is False  # no tenant named and two hold it: neither is cancelled
    assert c.has_hint("req-1", "A") and c.has_hint("req-1", "B")
    assert c.cancel_hint("req-1", "A")
    assert not c.has_hint("req-1", "A") and c.has_hint("req-1", "B")
    assert c.cancel_hint("req-1", "A") is False  # already gone
    assert [e.object_id for e in c.tick(T0) if isinstance(e, StartCopy)] == ["y"]
    assert c.cancel_hint("req-1")  # one tenant holds it now: a cancel without a tenant names it
    assert c.hint_ids_live == 0
    c.check_invariants()


def test_a_hot_objects_failing_extra_copy_backs_off() -> None:
    """The extra replica of a hot object whose copies always fail was queued again on the next
    read with fresh attempts: 180 copies started in 30 s."""
    c = core()  # hot at 50 reads/s over 10 s; 3 attempts 100 ms apart
    c.set_segments({"s2": 1 << 30, "s3": 1 << 30})
    started = 0
    in_flight: list[StartCopy] = []
    for now in range(T0, T0 + 30_000, 20):  # the shell's tick
        for copy in in_flight:
            c.copy_finished(copy.copy_id, False, now)  # the target refuses every copy
        if now % 100 == 0:  # an engine reads it 160 times a second
            c.read("hot", size_bytes=10, served_from="s1", now_ms=now, reads=16)
        in_flight = [e for e in c.tick(now) if isinstance(e, StartCopy)]
        started += len(in_flight)
        c.check_invariants()
    assert 3 <= started <= 12, started  # one try (3 attempts), then 10 s, 20 s, ... between tries
    assert c.extra_replicas() == {}


def test_a_hint_keeps_only_the_objects_still_to_copy() -> None:
    """Each hint kept its whole prefix: 1,024 hints of 8,192 objects with one to copy each held
    1.7 GiB and a tick walked every object."""
    c = core(objects_queued_max=1024)
    for i in range(16):
        prefix = [f"p{i}-{j}" for j in range(1024)]
        result = c.add_hint(hint(f"h{i}", "A", objs(*prefix, on_target=tuple(prefix[:-1]))), T0)
        assert result == Accepted(f"h{i}", 1)
    assert c.objects_queued == 16
    kept = reachable(c)
    assert sum(isinstance(o, HintObject) for o in kept) <= 1024  # was 16,384: all 16 prefixes
    assert sum(isinstance(o, str) and o.startswith("p") for o in kept) <= 1024  # their object ids
    assert len(c.tick(T0)) == 16
    c.check_invariants()


def reachable(root: object) -> list[object]:
    """Every object reachable from `root` (its referents, theirs, ...)."""
    seen = {id(root)}
    todo, found = [root], []
    while todo:
        for ref in gc.get_referents(todo.pop()):
            if id(ref) not in seen and not isinstance(ref, type):
                seen.add(id(ref))
                found.append(ref)
                todo.append(ref)
    return found
