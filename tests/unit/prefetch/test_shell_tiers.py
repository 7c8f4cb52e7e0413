"""The prefetch shell with disk replicas (issue 23): a disk replica is the source `<segment>#ssd`,
never the segment's own copy, so reads from disk can make a hot extra in that segment's arena;
a cold extra is dropped by its arena replica, never by the segment's disk replica."""

from __future__ import annotations

import asyncio
from typing import Any

from kvfabric.format.ids import namespace_in_id
from kvfabric.proto import directory as m
from kvfabric.proto.segment import SSD_SLOT_BASE
from tests.unit.core.dirkit import groups, key
from tests.unit.prefetch.test_shell_shards import FakeRouter, make_shell


def test_a_cold_extra_is_dropped_by_its_arena_replica_not_the_disk_one() -> None:
    (g,) = groups(1)
    k = key(g)
    disk = m.Replica(segment_id="s1", incarnation=1, slot=SSD_SLOT_BASE + 3, slot_generation=1)
    arena = m.Replica(segment_id="s1", incarnation=1, slot=7, slot_generation=2)
    summary = m.GroupSummary(
        group=g.chain_hash,
        namespace=namespace_in_id(g.group_id()),
        chunk_index=0,
        state="published",
        members=1,
        expected_members=1,
        objects=[
            m.ObjectLocation(
                chunk_index=0,
                member=m.Member(0, 0, 0),
                size_bytes=10,
                checksum=b"c" * 16,
                replicas=[disk, arena],
            )
        ],
    )

    def answer(shard: int, verb: str, message: Any) -> Any:
        if verb == "show_group":
            return m.GroupList(epoch=1, groups=[summary])
        assert verb == "replica_corrupt"
        return m.ReplicaCorruptReply(epoch=1, dropped=True)

    router = FakeRouter(answer)
    shell = make_shell(router)
    asyncio.run(shell._drop_extra(k, "s1"))
    (dropped,) = [msg for _, verb, msg in router.asked if verb == "replica_corrupt"]
    assert isinstance(dropped, m.ReplicaCorrupt)
    assert (dropped.slot, dropped.slot_generation, dropped.reason) == (7, 2, "cold_extra")
