"""The disk-tier chaos checkers (issue 23 drills segment-kill-during-demotion, ssd-full,
cluster-power-cycle): each passes what its drill must show and fails a system that breaks it."""

from __future__ import annotations

from typing import Any

from tests.unit.tools.toolkit import load_tool


def segment(**figures: Any) -> dict[str, Any]:
    seg = {
        "segment_id": "s-1",
        "listed_objects": 5,
        "listed_bytes": 5 << 16,
        "ssd_objects": 5.0,
        "ssd_bytes": float(5 << 16),
        "demotions": 0.0,
        "demote_no_capacity": 0.0,
        "ssd_read_corrupt": 0.0,
        "ssd_recovered_objects": 5.0,
    }
    seg.update(figures)
    return seg


def test_disk_tier_holds_exactly_what_the_directory_lists() -> None:
    c = load_tool("chaos_checks")
    assert (
        c.check_disk_tier(
            [
                segment(),
                segment(segment_id="s-2", listed_objects=0, listed_bytes=0, ssd_objects=0.0, ssd_bytes=0.0),
            ]
        )
        == []
    )
    assert c.check_disk_tier([]) == []
    # orphans not freed (recovered after a kill, never adopted): leaked space
    leaked = c.check_disk_tier([segment(ssd_objects=7.0, ssd_bytes=float(7 << 16))])
    assert len(leaked) == 1 and "7 objects" in leaked[0] and "lists 5" in leaked[0]
    # same count, other bytes (a torn size) is caught too
    assert c.check_disk_tier([segment(ssd_bytes=float(5 << 16) + 4096)])
    # a disk read that failed its checksum
    assert "corrupt" in c.check_disk_tier([segment(ssd_read_corrupt=1.0)])[0]


def test_demotion_counts_against_the_drill_s_minimums() -> None:
    c = load_tool("chaos_checks")
    counts = {"demoted": 3, "demotion_stopped": 2}
    disk = [segment(demote_no_capacity=1.0), segment(segment_id="s-2", demote_no_capacity=2.0)]
    expect = {"min_demoted": 1, "min_demotion_stopped": 1, "min_demote_no_capacity": 3}
    assert c.check_demotion(disk, counts, expect) == []
    assert c.check_demotion([], {}, {}) == []  # a drill without these bounds
    # KVF_EVICTION_DEMOTE=0: nothing demoted, nothing stopped, nothing counted
    broken = c.check_demotion([segment()], {"demoted": 0, "demotion_stopped": 0}, expect)
    assert broken == ["demoted: 0 < 1", "demotion_stopped: 0 < 1", "demote_no_capacity: 0 < 3"]


def test_power_cycle_share_of_what_was_findable_on_disk() -> None:
    c = load_tool("chaos_checks")
    assert c.check_power_cycle({}, None) == []  # not a power-cycle drill
    assert c.check_power_cycle({"findable_before": 100, "hit_after": 99}, 0.99, 40) == []
    short = c.check_power_cycle({"findable_before": 100, "hit_after": 98}, 0.99, 40)
    assert len(short) == 1 and "98 of 100" in short[0]
    # adoption lost: nothing hit from disk after the cycle
    assert c.check_power_cycle({"findable_before": 120, "hit_after": 0}, 0.99, 40)
    # nothing on disk before the cycle (demotion off), or the cycle never ran: proves nothing
    assert "0 chunk(s) findable" in c.check_power_cycle({"findable_before": 0, "hit_after": 0}, 0.99, 40)[0]
    assert c.check_power_cycle({}, 0.99, 40)
    assert c.check_power_cycle({"findable_before": 39, "hit_after": 39}, 0.99, 40)


def test_findable_and_adopted_chunks_count_from_chunk_0() -> None:
    s = load_tool("chaos_ssd")
    a, b, c = ("s-1", 1 << 40, 1), ("s-1", (1 << 40) + 1, 1), ("s-2", 1 << 40, 3)
    assert s.findable_on_disk([{a}, {b}, set(), {c}]) == 2  # a lookup folds from chunk 0
    assert s.findable_on_disk([set(), {a}]) == 0
    before = [{a}, {b}, {c}]
    assert s.adopted_on_disk(before, [{a}, {b}, {c}], identical=3) == 3
    assert s.adopted_on_disk(before, [{a}, {b}, {c}], identical=1) == 1  # bytes differ from chunk 1
    # chunk 1 saved again and demoted anew (another slot or generation): not adopted, nor what follows
    assert s.adopted_on_disk(before, [{a}, {("s-1", (1 << 40) + 1, 2)}, {c}], identical=3) == 1
    assert s.adopted_on_disk(before, [{a}, set(), {c}], identical=3) == 1  # only an arena copy now
    assert s.adopted_on_disk(before, [{a}], identical=1) == 1  # found shorter after the cycle
