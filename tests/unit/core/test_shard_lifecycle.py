"""The directory instance's shard lifecycle core (`kvfabric.core.shard_lifecycle`): examples, and a
Hypothesis state machine over a real `ShardLeadership` whose leases are won, renewed, handed over,
refused and let lapse while shard starts succeed, fail, are retried and asked again.

The machine checks, after every step, what the shell would see against a small model:
- every StartShard names the epoch `ShardLeadership` gives at that moment (never None, never an
  older term), at most one start is in flight or waiting per shard, and none comes once the
  instance stopped;
- a handover or a leave gives exactly StopShard(drain) and never stops the instance; a lapsed or
  refused lease, the election's end, or a shard whose start failed `start_attempts_max` times
  stops it, with one StopInstance, its first reason;
- a failed start is retried `start_retry_ms x attempt` after its failure, with the epoch led
  then;
- `may_act` is exactly "not stopped and the term is ours now";
- `check_invariants` holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvfabric.core.leadership import (
    Acquire,
    AnnounceMember,
    Effect,
    LeadershipConfig,
    Release,
    Renew,
    ShardLeadership,
    StartLeading,
    StopLeading,
)
from kvfabric.core.shard_lifecycle import (
    ElectionEnded,
    Led,
    LifecycleConfig,
    LifecycleEffect,
    RestartAsked,
    RetryDue,
    RetryStartAt,
    ShardLifecycle,
    StartDone,
    StartFailed,
    StartShard,
    StopInstance,
    StopShard,
    Unled,
)
from kvfabric.format.invariant import InvariantViolation

LEADERSHIP = LeadershipConfig(
    shards=4, lease_ttl_ms=3_000, renew_every_ms=1_000, safety_margin_ms=500, members_ttl_ms=3_000
)
LIFECYCLE = LifecycleConfig(start_attempts_max=3, start_retry_ms=500, handover_drain_ms=1_000)


@dataclass
class Kv:
    """A leader-lease bucket that answers at once: creates win, renewals land (unless refused)."""

    leadership: ShardLeadership
    revision: int = 0
    renewing: bool = True  # False: renewals go unanswered (the lease then lapses at its deadline)
    refuse: set[int] = field(default_factory=set)  # shards whose next renewal is refused

    def perform(self, effects: list[Effect], now_ms: int) -> list[StartLeading | StopLeading]:
        """Performs the KV effects at `now_ms`; returns StartLeading/StopLeading, in order."""
        out: list[StartLeading | StopLeading] = []
        queue = list(effects)
        while queue:
            effect = queue.pop(0)
            more: list[Effect] = []
            if isinstance(effect, StartLeading | StopLeading):
                out.append(effect)
            elif isinstance(effect, Acquire):
                self.revision += 1
                more = self.leadership.on_acquired(effect.shard, self.revision, now_ms, now_ms=now_ms)
            elif isinstance(effect, Renew):
                if effect.shard in self.refuse:
                    self.refuse.discard(effect.shard)
                    more = self.leadership.on_renew_failed(effect.shard, now_ms)
                elif self.renewing:
                    self.revision += 1
                    more = self.leadership.on_renewed(effect.shard, self.revision, now_ms, now_ms=now_ms)
                else:
                    more = self.leadership.on_renew_unanswered(effect.shard, now_ms)
            elif isinstance(effect, Release):
                more = self.leadership.on_released(effect.shard)
            else:
                assert isinstance(effect, AnnounceMember)
            queue.extend(more)
        return out


def leading(instance: str = "a", members: frozenset[str] = frozenset({"a"})) -> tuple[ShardLeadership, Kv]:
    """A leadership core that has won every shard it desires among `members`, at time 0."""
    core = ShardLeadership(LEADERSHIP, instance)
    kv = Kv(core)
    kv.perform(core.on_members(set(members), 0), 0)
    return core, kv


def test_a_won_shard_is_started_under_its_epoch_and_served() -> None:
    leadership, _kv = leading()
    life = ShardLifecycle(leadership, LIFECYCLE)
    epoch = leadership.epoch(0, now_ms=10)
    assert epoch is not None
    assert life.step(Led(0, epoch), 10) == [StartShard(0, epoch, 1)]
    assert life.state(0) == "starting"
    assert life.step(StartDone(0), 20) == []
    assert life.serving() == {0: epoch}
    assert life.may_act(0, epoch, 20) and not life.may_act(0, epoch + 1, 20)
    life.check_invariants(20)


def test_a_failed_start_is_retried_later_each_time_then_the_instance_gives_up() -> None:
    """Tries 1..3, waits 500, 1000, 1500 ms after each failure (as the closures in __main__ did),
    and after the third try's wait stops the instance: a led shard is never left unserved."""
    leadership, kv = leading()
    life = ShardLifecycle(leadership, LIFECYCLE)
    epoch = leadership.epoch(1, now_ms=0)
    assert epoch is not None
    assert life.step(Led(1, epoch), 0) == [StartShard(1, epoch, 1)]
    now = 0
    for attempt in (1, 2, 3):
        now += 100
        assert life.step(StartFailed(1, "boom"), now) == [RetryStartAt(1, now + 500 * attempt)]
        life.check_invariants(now)
        assert life.step(RetryDue(1), now + 1) == [RetryStartAt(1, now + 500 * attempt)]  # early
        now += 500 * attempt
        kv.perform(leadership.tick(now), now)  # renewals keep the lease
        effects = life.step(RetryDue(1), now)
        if attempt < 3:
            assert effects == [StartShard(1, epoch, attempt + 1)]
        else:
            assert effects == [StopInstance("shard_start_failed")]
        life.check_invariants(now)
    assert life.lost and not life.may_act(1, epoch, now)
    assert life.step(Led(2, leadership.epoch(2, now_ms=now) or 0), now) == []  # no start once lost


def test_a_retry_of_a_shard_no_longer_led_starts_nothing() -> None:
    leadership, kv = leading()
    life = ShardLifecycle(leadership, LIFECYCLE)
    epoch = leadership.epoch(0, now_ms=0) or 0
    life.step(Led(0, epoch), 0)
    assert life.step(StartFailed(0, "boom"), 10) == [RetryStartAt(0, 510)]
    stops = kv.perform(leadership.leave(20), 20)  # handed over meanwhile
    assert [s.reason for s in stops if isinstance(s, StopLeading)] == ["leaving"] * 4
    assert life.step(RetryDue(0), 510) == []
    assert life.state(0) == "idle" and not life.lost
    life.check_invariants(510)


def test_a_shard_handed_over_after_its_last_failed_start_does_not_stop_the_instance() -> None:
    """Its attempts were spent, then it was handed over (a member joined): the retry that came due
    stopped the instance anyway, and every other shard it led failed over, each with a rebuild
    and a grace period (review, stop 65). A shard another leads now is left to it."""
    leadership, kv = leading()
    life = ShardLifecycle(leadership, LIFECYCLE)
    epoch = leadership.epoch(0, now_ms=0) or 0
    assert life.step(Led(0, epoch), 0) == [StartShard(0, epoch, 1)]
    now = 0
    for attempt in (1, 2):
        now += 10
        life.step(StartFailed(0, "boom"), now)
        now += 500 * attempt
        kv.perform(leadership.tick(now), now)
        assert life.step(RetryDue(0), now) == [StartShard(0, epoch, attempt + 1)]
    now += 10
    assert life.step(StartFailed(0, "boom"), now) == [RetryStartAt(0, now + 1_500)]  # the third
    kv.perform(leadership.leave(now + 20), now + 20)  # handed over meanwhile
    assert life.step(RetryDue(0), now + 1_500) == []
    assert life.state(0) == "idle" and not life.lost
    life.check_invariants(now + 1_500)


def test_a_handover_stops_serving_the_shard_and_a_lapse_stops_the_instance_once() -> None:
    leadership, _kv = leading()
    life = ShardLifecycle(leadership, LIFECYCLE)
    assert life.step(Unled(2, 5, "handover"), 10) == [StopShard(2, 1_000)]
    assert life.step(Unled(3, 6, "leaving"), 10) == [StopShard(3, 1_000)]
    assert not life.lost
    assert life.step(Unled(0, 3, "lease_expired"), 20) == [StopInstance("leadership_lost:lease_expired")]
    assert life.step(Unled(1, 4, "renew_failed"), 30) == []  # stopping already: one StopInstance
    assert life.step(ElectionEnded("gone"), 40) == []
    assert life.lost_reason == "leadership_lost:lease_expired"
    life.check_invariants(40)


def test_the_election_ending_stops_the_instance_and_nothing_may_act() -> None:
    leadership, _kv = leading()
    life = ShardLifecycle(leadership, LIFECYCLE)
    epoch = leadership.epoch(0, now_ms=0) or 0
    assert life.may_act(0, epoch, 0)
    assert life.step(ElectionEnded("RuntimeError()"), 1) == [StopInstance("election_loop_failed")]
    assert not life.may_act(0, epoch, 1)


def test_a_start_asked_during_a_start_runs_once_more_after_it_with_the_epoch_led_then() -> None:
    leadership, _kv = leading()
    life = ShardLifecycle(leadership, LIFECYCLE)
    epoch = leadership.epoch(0, now_ms=0) or 0
    assert life.step(Led(0, epoch), 0) == [StartShard(0, epoch, 1)]
    assert life.step(RestartAsked(0, epoch), 5) == []  # one start in flight per shard
    assert life.step(StartDone(0), 10) == [StartShard(0, epoch, 1)]
    assert life.step(StartDone(0), 20) == []
    assert life.counters["starts_total"] == 2
    life.check_invariants(20)


def test_a_start_done_after_the_term_ended_leaves_the_shard_idle() -> None:
    leadership, _kv = leading()
    life = ShardLifecycle(leadership, LIFECYCLE)
    epoch = leadership.epoch(0, now_ms=0) or 0
    life.step(Led(0, epoch), 0)
    # No renewal answered: the term's deadline (0 + 3000 - 500) passes while the start runs.
    assert life.step(StartDone(0), 2_600) == []
    assert life.state(0) == "idle" and life.counters["starts_abandoned_total"] == 1


def test_a_result_for_no_start_in_flight_is_a_shell_bug() -> None:
    leadership, _kv = leading()
    life = ShardLifecycle(leadership, LIFECYCLE)
    with pytest.raises(InvariantViolation):
        life.step(StartDone(0), 1)
    with pytest.raises(InvariantViolation):
        life.step(StartFailed(0, "x"), 1)


def test_time_never_goes_backwards() -> None:
    leadership, _kv = leading()
    life = ShardLifecycle(leadership, LIFECYCLE)
    life.step(Unled(0, 1, "handover"), 100)
    with pytest.raises(InvariantViolation):
        life.step(Unled(0, 1, "handover"), 99)


# ---- the state machine ---------------------------------------------------------------------


class ShardLifecycleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.leadership = ShardLeadership(LEADERSHIP, "a")
        self.kv = Kv(self.leadership)
        self.life = ShardLifecycle(self.leadership, LIFECYCLE)
        self.members = {"a"}
        # the model
        self.in_flight: dict[int, StartShard] = {}  # shard -> its start, not answered yet
        self.waiting: dict[int, tuple[int, int]] = {}  # shard -> (retry at, failures so far)
        self.failures: dict[int, int] = {}  # shard -> failed tries of its current start
        self.again: set[int] = set()  # shards asked to start while a start was in flight
        self.stopped: str | None = None
        self.expect_stop: str | None = None  # the first reason the instance must stop for

    @initialize()
    def join(self) -> None:
        self._leadership(self.leadership.on_members(set(self.members), self.now))

    # ---- leadership moves ------------------------------------------------------------------

    def _leadership(self, effects: list[Effect]) -> None:
        for change in self.kv.perform(effects, self.now):
            if isinstance(change, StartLeading):
                self._step(Led(change.shard, change.epoch))
            else:
                if change.reason in ("lease_expired", "renew_failed"):
                    self.expect_stop = self.expect_stop or f"leadership_lost:{change.reason}"
                out = self._step(Unled(change.shard, change.epoch, change.reason))
                if change.reason in ("handover", "leaving"):
                    assert out == [StopShard(change.shard, LIFECYCLE.handover_drain_ms)]

    @rule(ms=st.integers(min_value=1, max_value=1_200))
    def time_passes(self, ms: int) -> None:
        self.now += ms
        self._leadership(self.leadership.tick(self.now))

    @rule(answered=st.booleans())
    def renewals_answered(self, answered: bool) -> None:
        self.kv.renewing = answered

    @rule(shard=st.integers(min_value=0, max_value=LEADERSHIP.shards - 1))
    def next_renewal_refused(self, shard: int) -> None:
        self.kv.refuse.add(shard)

    @rule(other=st.sampled_from(["b", "c"]), join=st.booleans())
    def member_moves(self, other: str, join: bool) -> None:
        if join:
            self.members.add(other)
        else:
            self.members.discard(other)
        self._leadership(self.leadership.on_members(set(self.members), self.now))

    @rule(roll=st.integers(min_value=0, max_value=99))
    def election_ends(self, roll: int) -> None:
        if roll < 97:  # rare: it ends the run
            return
        self.expect_stop = self.expect_stop or "election_loop_failed"
        self._step(ElectionEnded("RuntimeError()"))

    # ---- the host's answers ----------------------------------------------------------------

    @precondition(lambda self: bool(self.in_flight))
    @rule(data=st.data(), ok=st.sampled_from([True, False, False]))
    def start_answered(self, data: st.DataObject, ok: bool) -> None:
        shard = data.draw(st.sampled_from(sorted(self.in_flight)))
        start = self.in_flight.pop(shard)
        if ok:
            self._step(StartDone(shard))
        else:
            failures = self.failures.get(shard, 0) + 1
            self.failures[shard] = failures
            out = self._step(StartFailed(shard, "boom"))
            if self.stopped is None:
                assert out == [RetryStartAt(shard, self.now + LIFECYCLE.start_retry_ms * start.attempt)]
                self.waiting[shard] = (self.now + LIFECYCLE.start_retry_ms * start.attempt, failures)
            else:
                assert out == []

    @precondition(lambda self: bool(self.waiting))
    @rule(data=st.data(), early=st.booleans())
    def retry_due(self, data: st.DataObject, early: bool) -> None:
        shard = data.draw(st.sampled_from(sorted(self.waiting)))
        at, failures = self.waiting[shard]
        if early and self.now < at:
            assert self._step(RetryDue(shard)) == [RetryStartAt(shard, at)]
            return
        self.now = max(self.now, at)
        self._leadership(self.leadership.tick(self.now))  # the loop ticked meanwhile
        if shard not in self.waiting:
            return  # the instance stopped meanwhile: the retry was dropped
        del self.waiting[shard]
        led = self.leadership.epoch(shard, now_ms=self.now) is not None
        if failures >= LIFECYCLE.start_attempts_max and led:  # (not over a shard handed over)
            self.expect_stop = self.expect_stop or "shard_start_failed"
        out = self._step(RetryDue(shard))
        retried = failures < LIFECYCLE.start_attempts_max and led and self.stopped is None
        assert any(isinstance(e, StartShard) for e in out) == retried

    @precondition(lambda self: bool(self.life.serving()))
    @rule(data=st.data())
    def restart_asked(self, data: st.DataObject) -> None:
        shard = data.draw(st.sampled_from(sorted(self.life.serving())))
        self._step(RestartAsked(shard, self.life.serving()[shard]))

    # ---- the shell's view --------------------------------------------------------------------

    def _step(self, event: object) -> list[LifecycleEffect]:
        before_in_flight = set(self.in_flight)
        out = self.life.step(event, self.now)  # type: ignore[arg-type]
        starts = [e for e in out if isinstance(e, StartShard)]
        for effect in out:
            if isinstance(effect, StartShard):
                assert self.stopped is None, "a start after the instance stopped"
                assert effect.shard not in self.in_flight and effect.shard not in self.waiting
                assert effect.epoch == self.leadership.epoch(effect.shard, now_ms=self.now)
                if isinstance(event, RetryDue):  # the next try of the same start
                    assert effect.attempt == self.failures.get(effect.shard, 0) + 1 >= 2
                else:  # a new start
                    assert effect.attempt == 1
                    self.failures[effect.shard] = 0
                self.in_flight[effect.shard] = effect
            elif isinstance(effect, StopInstance):
                assert self.stopped is None, "StopInstance twice"
                assert effect.reason == self.expect_stop
                self.stopped = effect.reason
                self.waiting.clear()
            elif isinstance(effect, StopShard):
                assert isinstance(event, Unled) and event.reason in ("handover", "leaving")
        led_now = self.stopped is None and self.leadership.epoch(getattr(event, "shard", 0), now_ms=self.now)
        if isinstance(event, Led | RestartAsked):
            if event.shard in before_in_flight:
                assert out == [] and self.life.state(event.shard) == "starting"
                self.again.add(event.shard)
            elif event.shard in self.waiting:
                assert out == []  # its retry starts the epoch led then
            else:
                assert len(starts) == (1 if led_now else 0)
        elif isinstance(event, StartDone):
            assert len(starts) == (1 if event.shard in self.again and led_now else 0)
            self.again.discard(event.shard)
        elif isinstance(event, StartFailed):
            self.again.discard(event.shard)  # the retry starts the epoch led then
        self.life.check_invariants(self.now)
        return out

    @invariant()
    def agrees_with_the_model(self) -> None:
        assert self.life.lost == (self.stopped is not None)
        if self.expect_stop is not None:
            assert self.stopped == self.expect_stop  # stopped at once, for its first reason
        for shard in range(LEADERSHIP.shards):
            epoch = self.leadership.epoch(shard, now_ms=self.now)
            for guess in {epoch, 1, 2, 3} - {None}:
                assert guess is not None
                expected = self.stopped is None and epoch == guess
                assert self.life.may_act(shard, guess, self.now) == expected
            state = self.life.state(shard)
            assert (state == "starting") == (shard in self.in_flight)
            assert (state == "backoff") == (shard in self.waiting)


ShardLifecycleMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=80, deadline=None)
TestShardLifecycleMachine = ShardLifecycleMachine.TestCase
