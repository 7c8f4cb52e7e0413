"""The segment's gate (`kvfabric.segment_storage.gate`): epoch fences per directory shard and drain,
alone and as the backend applies it to write tickets."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvfabric.format.errors import Conflict, StaleGeneration
from kvfabric.segment_storage.gate import SegmentGate
from tests.unit.segment_storage.test_copy_scrub import make_segment, settled


def test_a_stale_epoch_is_refused_once_a_newer_leader_is_heard_of() -> None:
    gate = SegmentGate()
    gate.check(0, 1)  # nothing heard of yet: every epoch passes
    assert gate.saw(0, 5)
    with pytest.raises(StaleGeneration) as refused:
        gate.check(0, 4)
    assert refused.value.details == {"kind": "directory_epoch", "seen": 4, "current": 5}
    with pytest.raises(StaleGeneration):
        gate.admit(0, 4)  # a replaced leader's free or report
    assert gate.fence(0) == 5
    gate.check(0, 5)  # the leader heard of, and newer ones, pass
    gate.check(0, 6)
    gate.check(1, 1)  # another shard's fence is its own
    gate.check_invariants()


def test_admit_raises_the_fence_and_saw_never_lowers_it() -> None:
    gate = SegmentGate()
    assert gate.admit(2, 3)
    assert not gate.admit(2, 3)  # the same leader again: passes, nothing new
    assert not gate.saw(2, 1)
    assert not gate.saw(2, 0)  # a reply without an epoch
    assert gate.fences == {2: 3}
    gate.check_invariants()


def test_a_draining_gate_refuses_writes_only() -> None:
    gate = SegmentGate()
    gate.check_writes()
    gate.draining = True
    with pytest.raises(Conflict):
        gate.check_writes()
    gate.check(0, 0)  # fences are unaffected


def test_the_backend_refuses_a_ticket_of_a_fenced_epoch(tmp_path: Path) -> None:
    seg = make_segment(tmp_path, "gate", 7)
    assert seg.backend.admit_directory(0, 3)  # a report of the shard's new leader
    with pytest.raises(StaleGeneration):
        seg.backend.begin_put(seg.ticket(b"abc", epoch=2), conn=0)
    assert seg.backend.counters["stale_epoch_rejected_total"] == 1
    with pytest.raises(StaleGeneration):
        seg.backend.admit_directory(0, 2)  # the old leader's free
    put = seg.backend.begin_put(seg.ticket(b"abc", epoch=3), conn=0)
    put.view[:] = b"abc"
    seg.backend.finish_put(put, conn=0)
    seg.backend.draining = True
    with pytest.raises(Conflict):
        seg.backend.begin_put(seg.ticket(b"abc", key=b"k2", epoch=3), conn=0)
    seg.backend.close_connection(0)
    seg.backend.free_slots(seg.confirmed)
    settled(seg)


class GateMachine(RuleBasedStateMachine):
    """The gate against a model: per shard the newest epoch heard of; a request passes iff its
    epoch is at least that."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = SegmentGate()
        self.newest: dict[int, int] = {}

    @rule(shard=st.integers(0, 3), epoch=st.integers(0, 8))
    def saw(self, shard: int, epoch: int) -> None:
        rose = self.gate.saw(shard, epoch)
        assert rose == (epoch > self.newest.get(shard, 0))
        if rose:
            self.newest[shard] = epoch

    @rule(shard=st.integers(0, 3), epoch=st.integers(0, 8))
    def admit(self, shard: int, epoch: int) -> None:
        before = self.newest.get(shard, 0)
        try:
            self.gate.admit(shard, epoch)
        except StaleGeneration:
            assert epoch < before, "a current epoch was refused"
            return
        assert epoch >= before, "a stale epoch passed"
        if epoch > before:
            self.newest[shard] = epoch

    @rule(shard=st.integers(0, 3), epoch=st.integers(0, 8))
    def check(self, shard: int, epoch: int) -> None:
        try:
            self.gate.check(shard, epoch)
        except StaleGeneration:
            assert epoch < self.newest.get(shard, 0), "a current epoch was refused"
        else:
            assert epoch >= self.newest.get(shard, 0), "a stale epoch passed"

    @invariant()
    def matches_the_model(self) -> None:
        self.gate.check_invariants()
        assert self.gate.fences == self.newest


GateMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestGateMachine = GateMachine.TestCase
