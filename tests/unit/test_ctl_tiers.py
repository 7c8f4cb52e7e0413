"""kvctl shows each replica's tier (the slot id says it: docs/segment.md, "Disk tier")."""

from __future__ import annotations

from kvfabric.ctl.render import group_doc
from kvfabric.format.ids import ChainHash, Namespace
from kvfabric.proto import directory as m
from kvfabric.proto.segment import SSD_SLOT_BASE, tier_of_slot


def test_tier_of_slot_and_kvctl_manifest_json() -> None:
    assert tier_of_slot(0) == tier_of_slot(SSD_SLOT_BASE - 1) == "dram"
    assert tier_of_slot(SSD_SLOT_BASE) == tier_of_slot(2**32 - 1) == "ssd"
    replicas = [
        m.Replica(segment_id="seg-1", incarnation=5, slot=3, slot_generation=1),
        m.Replica(segment_id="seg-1", incarnation=5, slot=SSD_SLOT_BASE + 3, slot_generation=2),
    ]
    summary = m.GroupSummary(
        group=ChainHash(b"\x01" * 32),
        namespace=Namespace(b"\x00" * 54),
        chunk_index=0,
        state="published",
        members=1,
        expected_members=1,
        objects=[
            m.ObjectLocation(
                chunk_index=0, member=m.Member(0, 0, 0), size_bytes=10, checksum=b"c" * 16, replicas=replicas
            )
        ],
    )
    (obj,) = group_doc(summary)["objects"]
    assert [r["tier"] for r in obj["replicas"]] == ["dram", "ssd"]
