"""A victim the directory refuses as pinned cools down longer after each pinned refusal in a row.
Review, 2026-12-06: the cooldown was a fixed `refused_cooldown_ms`, and a pinned group keeps its
rank, so it was the first victim again each time its cooldown ended: asked every 5 s for as
long as the pin lasted (with a disk tier, each attempt also republished it). Now each refusal
in a row doubles the next cooldown, up to 16 times (5 s: 5, 10, 20, 40, 80 s); the count ends
with the object, a leased refusal, or an attempt answered by a tier move; a hit does not end
it."""

from __future__ import annotations

from kvfabric.core.eviction import REFUSED_BACKOFF_SHIFT_MAX, EvictBatch, EvictionConfig, EvictionCore

BASE_MS = 5_000


def victims(core: EvictionCore, now: int) -> list[object]:
    out: list[object] = []
    for effect in core.tick(now):
        assert isinstance(effect, EvictBatch)
        out.extend(effect.victims)
    core.check_invariants()
    return out


def pinned_core() -> EvictionCore:
    """One group filling its pool: the victim of every tick it may go in."""
    core = EvictionCore(EvictionConfig(policy="lru", refused_cooldown_ms=BASE_MS))
    core.set_capacity("p", 10)
    core.insert("pinned", tenant="t", pool="p", size=10, parent=None, chunk_index=0, now_ms=0)
    return core


def refused_for(core: EvictionCore, now: int, expected_ms: int) -> int:
    """The victim chosen at `now` is refused: it is not chosen again for exactly `expected_ms`
    (checked to the ms); returns when it is chosen again."""
    core.refused("pinned", now, pinned=True)
    assert victims(core, now + expected_ms - 1) == []
    assert victims(core, now + expected_ms) == ["pinned"]
    return now + expected_ms


def test_each_pinned_refusal_in_a_row_doubles_the_cooldown_up_to_16_times() -> None:
    core = pinned_core()
    now = 1_000
    assert victims(core, now) == ["pinned"]
    for expected in (5_000, 10_000, 20_000):  # before: 5 s each time
        now = refused_for(core, now, expected)
    for shift in range(3, REFUSED_BACKOFF_SHIFT_MAX + 3):
        now = refused_for(core, now, BASE_MS << min(shift, REFUSED_BACKOFF_SHIFT_MAX))
    assert (BASE_MS << REFUSED_BACKOFF_SHIFT_MAX) == 80_000  # capped: 16 x 5 s


def test_a_hit_keeps_the_count_and_an_attempt_answered_by_a_tier_move_ends_it() -> None:
    core = pinned_core()
    now = 1_000
    assert victims(core, now) == ["pinned"]
    now = refused_for(core, now, 5_000)
    core.access("pinned", now)  # a pinned prefix is often a hot one: still backing off
    now = refused_for(core, now, 10_000)
    core.retiered("pinned", pools={"p": 10}, parent=None, now_ms=now)  # the attempt: moved
    assert victims(core, now + 1) == ["pinned"]
    now = refused_for(core, now + 1, 5_000)  # from the start again
    core.removed("pinned")  # evicted: a record inserted again starts with no refusals
    core.insert("pinned", tenant="t", pool="p", size=10, parent=None, chunk_index=0, now_ms=now)
    assert victims(core, now) == ["pinned"]
    refused_for(core, now, 5_000)


def test_a_leased_refusal_waits_the_base_cooldown_and_ends_a_pins_run() -> None:
    """Leases end in seconds: a hot prefix leased at each attempt must not wait minutes once its
    leases end (only pinned refusals back off)."""
    core = pinned_core()
    now = 1_000
    assert victims(core, now) == ["pinned"]
    now = refused_for(core, now, 5_000)
    now = refused_for(core, now, 10_000)  # two pinned refusals in a row
    for _ in range(3):  # then leased ones: the base cooldown each time
        core.refused("pinned", now)
        assert victims(core, now + BASE_MS - 1) == []
        assert victims(core, now + BASE_MS) == ["pinned"]
        now += BASE_MS
    refused_for(core, now, 5_000)  # a pin again: its run starts over


def test_the_directorys_word_that_its_last_pin_ended_lets_it_go_at_once() -> None:
    """`GroupsUnpinned` (stop 65): before, a released pin's group went up to 80 s late (its
    pass parked until the cooldown's end); now it is a victim again on the next tick."""
    core = pinned_core()
    now = 1_000
    assert victims(core, now) == ["pinned"]
    for expected in (5_000, 10_000, 20_000, 40_000):
        now = refused_for(core, now, expected)
    core.refused("pinned", now, pinned=True)  # cooling down 80 s, its pool's pass parked
    assert victims(core, now + 1_000) == []
    core.unpinned("pinned", now + 1_000)
    assert core.counters["unpinned_woken_total"] == 1
    assert victims(core, now + 1_000) == ["pinned"]
    refused_for(core, now + 1_000, 5_000)  # pinned again: its run starts over


def test_the_word_wakes_any_refusal_and_one_under_way_is_not_cooled_by_its_answer() -> None:
    """A head named with its pinned tail is refused `tail_stays`, not `pinned`: the word wakes
    whatever refusal it cools down after (a lease that still holds it refuses it again). One
    under way may have been answered before the unpin (review): that refusal cools it down not
    at all."""
    core = pinned_core()
    assert victims(core, 1_000) == ["pinned"]
    core.refused("pinned", 1_000)  # not as pinned (leased, or its tail stays)
    assert victims(core, 2_000) == []
    core.unpinned("pinned", 2_000)
    assert victims(core, 2_000) == ["pinned"]
    now = refused_for(core, 2_000, 5_000)  # pinned refusals in a row: 5, 10 s
    now = refused_for(core, now, 10_000)
    core.unpinned("pinned", now)  # under way: the answer may be decided already
    core.refused("pinned", now + 100, pinned=True)
    assert victims(core, now + 100) == ["pinned"]  # before (review): 20 s later
    core.unpinned("absent", now + 200)  # evicted meanwhile, or never stored here
    assert core.counters["unpinned_woken_total"] == 2
