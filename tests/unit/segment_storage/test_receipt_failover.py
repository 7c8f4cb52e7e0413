"""A receipted write published at epoch E survives a failover that comes before its segment's
background confirm (the reviewer's repro, stop 33): the new leader (E+1) adopts the slot from the
segment's report and publishes it; the lingering confirm still carries E and is answered
`StaleGeneration`, which the segment used to treat as final and free the slot E+1 hands out."""

from __future__ import annotations

import pytest

from kvfabric.core.directory import DirectoryCore
from kvfabric.core.directory.rebuild import SegmentHolding
from kvfabric.format.errors import KvfError, StaleGeneration
from kvfabric.proto import directory as m
from kvfabric.proto.segment import HeldObject
from kvfabric.segment_storage.shell_confirms import _CONFIRM_FINAL_ERRORS
from tests.unit.core.dirkit import groups, lookup
from tests.unit.core.test_directory_receipts import commit, receipt, setup


def test_a_published_receipted_slot_survives_a_failover_before_its_background_confirm() -> None:
    old, keys, tickets = setup(1)
    slot, gen = 7, 1
    assert commit(old, keys, [receipt(tickets[0], slot, gen)]) == ["published"]
    t = tickets[0]
    new = DirectoryCore(old.config, epoch=old.epoch + 1)  # the successor adopts what the segment holds
    registration = m.RegisterSegment(
        segment_id=t.segment_id,
        incarnation=t.incarnation,
        capacity_bytes=10_000,
        domain=m.FailureDomain(host=t.segment_id),
        data_addr="tcp://s1",
    )
    held = HeldObject(t.key, slot, gen, t.size_bytes, t.checksum)
    new.adopt([SegmentHolding(registration, [held])], now_ms=10)
    assert lookup(new, groups(1), now=10).hit_chunks == 1  # published at E+1, in that slot
    late = m.ConfirmReplicas(
        segment_id=t.segment_id,
        incarnation=t.incarnation,
        epoch=t.epoch,
        confirms=[
            m.ReplicaConfirm(
                ticket_id=t.ticket_id,
                key=t.key,
                slot=slot,
                slot_generation=gen,
                size_bytes=t.size_bytes,
                checksum=t.checksum,
            )
        ],
    )
    with pytest.raises(KvfError) as refused:
        new.handle(late, 20)
    assert isinstance(refused.value, StaleGeneration)
    assert not isinstance(refused.value, _CONFIRM_FINAL_ERRORS)  # the segment keeps the slot
