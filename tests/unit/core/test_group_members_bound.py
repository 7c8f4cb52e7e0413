"""A chunk group has at most `GROUP_MEMBERS_MAX` (255) members: tp_size x pp_size x
layer_group_count, counted in one byte of the published record. Review, 2026-12-06: a tenant
that committed a group of 256 members (tp 8 x 32 layer groups, or a real tp 8 x pp 4 x 8 layer
groups) broke the record's invariant: the instance stopped, and every instance that adopted the
shard from the segments afterwards stopped too. Such keys are now refused where they are named,
and a segment's objects of such a group are orphans when a leader adopts them."""

from __future__ import annotations

import pytest

from kvfabric.core.directory import FreeSlots
from kvfabric.core.directory.keys import GROUP_MEMBERS_MAX, parse_group, parse_key
from kvfabric.core.directory.rebuild import SegmentHolding
from kvfabric.format.errors import BadRequest
from kvfabric.proto import directory as m
from kvfabric.proto.segment import HeldObject

from .dirkit import groups, key, lookup, new_core, put, register, spec


def test_a_key_of_a_group_too_large_to_record_is_refused() -> None:
    (big,) = groups(1, seed=1, tp_size=8, layer_group_count=32)  # 256 members
    with pytest.raises(BadRequest, match="at most 255 members"):
        parse_key(key(big))
    with pytest.raises(BadRequest, match="at most 255 members"):
        parse_group(big.group_id())
    core = new_core()
    register(core, "s1")
    with pytest.raises(BadRequest, match="at most 255 members"):
        core.handle(m.PutBegin(writer_id="w", request_id="r", objects=[spec(key(big))]), 0)
    with pytest.raises(BadRequest):
        lookup(core, [big])
    core.check_invariants()


def test_a_group_of_the_largest_size_publishes_and_hits() -> None:
    (full,) = groups(1, seed=2, tp_size=5, layer_group_count=51)
    assert GROUP_MEMBERS_MAX == 5 * 51
    core = new_core()
    register(core, "s1", capacity=1 << 30)
    keys = [key(full, rank=r, lgroup=lg) for r in range(5) for lg in range(51)]
    assert put(core, keys).results[-1].status == "published"  # the last member completes it
    assert lookup(core, [full]).hit_chunks == 1
    core.check_invariants()


def test_a_segments_objects_of_a_too_large_group_are_orphans_when_adopted() -> None:
    (big,) = groups(1, seed=3, tp_size=8, layer_group_count=32)
    core = new_core(heartbeat_timeout_ms=10**9)  # only the orphans' grace passes
    registration = m.RegisterSegment(
        segment_id="s1",
        incarnation=2,
        capacity_bytes=1 << 30,
        domain=m.FailureDomain(host="s1"),
        data_addr="tcp://s1",
    )
    held = [
        HeldObject(key(big, rank=r, lgroup=lg), r * 32 + lg, 1, 10, b"c" * 16)
        for r in range(8)
        for lg in range(32)
    ]
    assert core.adopt([SegmentHolding(registration, held)], now_ms=1_000) == []
    assert core.counters["adopted_orphans_total"] == 256
    frees = [e for e in core.tick(10**9) if isinstance(e, FreeSlots)]
    assert sum(len(f.slots) for f in frees) == 256
    core.check_invariants()
