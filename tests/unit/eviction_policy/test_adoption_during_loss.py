"""An adoption that begins while a lost segment's pools are still being dropped (in steps,
`GroupRecords.apply_in_steps`) takes no listed replica on that segment. Review, 2026-12-06: the
segments gone down were counted only from the adoption's start, so a segment whose arena pool
was already dropped (its disk pool next) had its listed replicas put back in the core: bytes
on a dead segment, in a pool no step dropped again (no NATS here)."""

from __future__ import annotations

import asyncio

import msgspec

from kvfabric.core.eviction import EvictionConfig, EvictionCore
from kvfabric.eviction_policy.shell import EvictionShell, now_ms
from kvfabric.proto import directory as m
from tests.unit.eviction_policy.test_adoption import Listing, summary
from tests.unit.eviction_policy.test_shell import published


def test_an_adoption_begun_while_a_lost_segment_is_dropped_puts_no_bytes_back_on_it() -> None:
    core = EvictionCore(EvictionConfig(policy="lru", high_watermark=0.9, low_watermark=0.1))
    sh = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0, demote=False)
    t = now_ms()
    sh._started_ms = t - 900
    for s in ("s1", "s2"):
        sh.apply(m.SegmentUp(segment_id=s, incarnation=1, capacity_bytes=1_000), t - 800)
    sh.apply(published(1, s2=10), t - 700)  # on the segment lost below only
    disk = msgspec.structs.replace(published(2, s2=10), disk_placements=[m.SegmentBytes("s2", 10)])
    sh.apply(disk, t - 700)  # its disk pool too: two pools to drop
    sh.apply(published(3, s1=10, s2=10), t - 700)
    steps = sh.apply_in_steps(
        m.SegmentDown(segment_id="s2", incarnation=1, reason="heartbeat_timeout"), t - 600
    )
    next(steps)
    next(steps)  # s2's arena pool dropped; its disk pool next
    assert core.used_bytes("s2") == 0
    # The directory's sweep has not reached them: its listing still names their s2 replicas.
    sh._router = Listing([summary(1, ("s2", 1)), summary(3, ("s1", 3), ("s2", 3))])
    asyncio.run(sh.adopt_listed())
    list(steps)  # the rest of the loss applied
    core.check_invariants()
    assert core.used_bytes("s2") == 0  # before: 10, a listed replica on the dead segment, for good
    assert core.used_bytes("s1") == 10  # group 3's other replica is still there
