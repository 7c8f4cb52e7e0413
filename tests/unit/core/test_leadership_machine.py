"""Hypothesis state machine for the shard-leadership core: several instances over one simulated
JetStream KV bucket (`SimKV`) and a member registry. Faults: operations in flight land after a
random delay (the server stamps a write when it applies it, after the send); answers come late
or never (the shell times out: the outcome is indeterminate and the operation may still land);
one instance stalls while the others run (GC pause, partition); registry views are stale or
partial, so instances disagree on who should lead; instance clocks run slow (down to 0.9 of the
servers' rate) from arbitrary offsets; crashes (the dead's operations still land), restarts
with a fresh core under the same id, joins, graceful leaves and large time jumps.

Safety, checked after every step in real (simulated) time: for every shard at most one instance
has `epoch(shard, now_ms=its clock)`; that leader's key is live in KV with its id; successive
leaders of a shard have strictly increasing epochs; StartLeading epochs only grow; the effects a
shell sees (StartLeading / StopLeading, StopLeading first) match `leading()`; one operation in
flight per shard per instance; `check_invariants`. Liveness, in teardown: with no more faults
and prompt delivery, within `max(lease_ttl, members_ttl) + 3 renew periods` every shard has
exactly one leader, its rendezvous owner among the live instances, and keeps it.

Bugs this catches (mutants, checked by hand): no safety margin (a slow clock outlives its
lease), a term past the TTL, `epoch` ignoring the clock, a shell passing the answer time as
`sent_ms`, no retry after a failed create, renewals later than the deadline."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

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
    desired_owner,
    key_of,
)

from .test_leadership import SimKV

TTL_MS = 3_000
RENEW_MS = 1_000
MARGIN_MS = 500
MEMBERS_TTL_MS = 3_000
SLOTS = 4
# Clocks drift: an instance's clock may run slow against the KV servers'. The margin (500 of 3000)
# covers any rate above 1 - 500 / 3000 = 0.834.
CLOCK_RATES = (1.0, 0.95, 0.9)

OpKind = Literal["create", "update", "delete"]


@dataclass(slots=True)
class Op:
    slot: int
    incarnation: int
    kind: OpKind
    shard: int
    revision: int  # update/delete: the `last` revision
    sent_ms: int
    landed: bool = False
    result: int | None = None  # create/update: the new revision; delete: 1 when deleted
    abandoned: bool = False  # timed out or its instance died: no answer will be fed back


@dataclass(slots=True)
class Instance:
    instance_id: str
    status: Literal["down", "up", "leaving"] = "down"
    incarnation: int = 0
    core: ShardLeadership | None = None
    serving: dict[int, int] = field(default_factory=dict)  # what the shell serves: shard -> epoch
    rate: float = 1.0  # its monotonic clock runs this fast against real (KV server) time
    offset_ms: int = 0


class LeadershipMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.kv = SimKV(TTL_MS)
        self.registry: dict[str, int] = {}  # instance id -> written at
        self.ops: list[Op] = []
        self.instances: list[Instance] = []
        self.config = LeadershipConfig(shards=1)
        self.last_holder: dict[int, tuple[int, int, int]] = {}  # shard -> (slot, incarnation, epoch)
        self.max_started: dict[int, int] = {}  # shard -> highest epoch ever started

    # ---- the shells --------------------------------------------------------------------------

    @initialize(
        n=st.integers(3, SLOTS),
        shards=st.integers(4, 8),
        warm=st.booleans(),
        rates=st.lists(st.sampled_from(CLOCK_RATES), min_size=SLOTS, max_size=SLOTS),
    )
    def setup(self, n: int, shards: int, warm: bool, rates: list[float]) -> None:
        self.config = LeadershipConfig(
            shards=shards,
            lease_ttl_ms=TTL_MS,
            renew_every_ms=RENEW_MS,
            safety_margin_ms=MARGIN_MS,
            members_ttl_ms=MEMBERS_TTL_MS,
        )
        self.instances = [Instance(f"dir-{i}", rate=rates[i], offset_ms=1_000_003 * i) for i in range(n)]
        for slot in range(n):
            self._start(slot)
        if warm:  # start from a settled cluster, so that the faults hit leaders
            for _ in range(3):
                self.everyone_ticks()
                self._flush()
                self.now += 10

    def _start(self, slot: int) -> None:
        inst = self.instances[slot]
        inst.status = "up"
        inst.incarnation += 1
        inst.core = ShardLeadership(self.config, inst.instance_id)  # same id: a restarted pod
        inst.serving = {}

    def _t(self, slot: int) -> int:
        """The instance's own clock: what its shell passes as now_ms and sent_ms."""
        inst = self.instances[slot]
        return inst.offset_ms + int(self.now * inst.rate)

    def _live(self, slot: int) -> bool:
        return self.instances[slot].status != "down"

    def _core(self, slot: int) -> ShardLeadership:
        core = self.instances[slot].core
        assert core is not None
        return core

    def _members_view(self) -> set[str]:
        return {i for i, t in self.registry.items() if self.now - t < MEMBERS_TTL_MS}

    def _apply(self, slot: int, effects: list[Effect]) -> None:
        """What the shell does with a list of effects: stop first, serve, queue KV operations."""
        inst = self.instances[slot]
        core = self._core(slot)
        kinds = [isinstance(e, StopLeading) for e in effects]
        assert kinds == sorted(kinds, reverse=True), f"StopLeading after other effects: {effects}"
        for effect in effects:
            if isinstance(effect, StartLeading):
                assert effect.shard not in inst.serving
                assert effect.epoch > self.max_started.get(effect.shard, 0), "a new term's epoch must grow"
                self.max_started[effect.shard] = effect.epoch
                inst.serving[effect.shard] = effect.epoch
            elif isinstance(effect, StopLeading):
                assert inst.serving.pop(effect.shard, None) == effect.epoch
            elif isinstance(effect, AnnounceMember):
                # Lands at once: stale or partial registry views come from `see_members(hide=...)`.
                self.registry[inst.instance_id] = self.now
            elif isinstance(effect, Acquire):
                self.ops.append(Op(slot, inst.incarnation, "create", effect.shard, 0, self._t(slot)))
            elif isinstance(effect, Renew):
                self.ops.append(
                    Op(slot, inst.incarnation, "update", effect.shard, effect.revision, self._t(slot))
                )
            else:
                assert isinstance(effect, Release)
                self.ops.append(
                    Op(slot, inst.incarnation, "delete", effect.shard, effect.revision, self._t(slot))
                )
        assert inst.serving == core.leading()

    def _current(self, op: Op) -> bool:
        inst = self.instances[op.slot]
        return not op.abandoned and inst.status != "down" and inst.incarnation == op.incarnation

    def _land(self, op: Op) -> None:
        """The server applies the operation now, after it was sent: the write is stamped now."""
        assert not op.landed
        op.landed = True
        instance_id = self.instances[op.slot].instance_id
        key = key_of(op.shard)
        if op.kind == "create":
            op.result = self.kv.create(key, instance_id, self.now)
        elif op.kind == "update":
            op.result = self.kv.update(key, instance_id, op.revision, self.now)
        else:
            op.result = 1 if self.kv.delete(key, op.revision, self.now) else None
        if not self._current(op):
            self.ops.remove(op)  # nobody waits for an answer

    def _answer(self, op: Op, *, timed_out: bool = False) -> None:
        """Feed the outcome back to the instance that asked (a timeout reads as a failure)."""
        assert self._current(op)
        core = self._core(op.slot)
        result = op.result if op.landed and not timed_out else None
        if op.kind == "create":
            effects = (
                core.on_acquired(op.shard, result, op.sent_ms, now_ms=self._t(op.slot))
                if result is not None
                else core.on_acquire_failed(op.shard, self._t(op.slot))
            )
        elif op.kind == "update":
            if result is not None:
                effects = core.on_renewed(op.shard, result, op.sent_ms, now_ms=self._t(op.slot))
            elif timed_out:  # no answer: the term goes on to its deadline, the renewal is retried
                effects = core.on_renew_unanswered(op.shard, self._t(op.slot))
            else:  # refused: the key is not ours at that revision
                effects = core.on_renew_failed(op.shard, self._t(op.slot))
        else:
            effects = core.on_released(op.shard)
        if op.landed:
            self.ops.remove(op)
        else:
            op.abandoned = True  # indeterminate: it may still land
        self._apply(op.slot, effects)

    # ---- rules -------------------------------------------------------------------------------

    @rule(step=st.sampled_from([1, 50, 200, 499, 700, 1_000, 1_500, 2_500, 2_999, 4_000]))
    def advance(self, step: int) -> None:
        self.now += step

    @rule(slot=st.integers(0, SLOTS - 1))
    def tick(self, slot: int) -> None:
        slot %= len(self.instances)
        if self._live(slot):
            self._apply(slot, self._core(slot).tick(self._t(slot)))

    @rule(slot=st.integers(0, SLOTS - 1), hide=st.integers(0, (1 << SLOTS) - 1))
    def see_members(self, slot: int, hide: int) -> None:
        """The instance's registry watch delivers a view, maybe stale or partial (missing the
        members in the `hide` mask): views disagree, so several instances may want one shard."""
        slot %= len(self.instances)
        if self._live(slot):
            hidden = {inst.instance_id for i, inst in enumerate(self.instances) if hide >> i & 1}
            self._apply(slot, self._core(slot).on_members(self._members_view() - hidden, self._t(slot)))

    @rule()
    def everyone_ticks(self) -> None:
        for slot in range(len(self.instances)):
            if self._live(slot):
                self._apply(slot, self._core(slot).on_members(self._members_view(), self._t(slot)))

    @precondition(lambda self: any(not op.landed for op in self.ops))
    @rule(pick=st.integers(0, 1_000), answer=st.booleans())
    def land(self, pick: int, answer: bool) -> None:
        pending = [op for op in self.ops if not op.landed]
        op = pending[pick % len(pending)]
        self._land(op)
        if answer and op in self.ops:
            self._answer(op)

    @precondition(lambda self: bool(self.ops))
    @rule()
    def deliver_all(self) -> None:
        """A prompt moment: everything in flight lands and is answered."""
        self._flush()

    @precondition(lambda self: any(not op.landed and self._current(op) for op in self.ops))
    @rule(pick=st.integers(0, 1_000), delay=st.sampled_from([300, 501, 1_200, 2_600, 3_500]))
    def slow_answer(self, pick: int, delay: int) -> None:
        """The operation lands now; its answer comes back `delay` ms later (nothing else moves)."""
        pending = [op for op in self.ops if not op.landed and self._current(op)]
        op = pending[pick % len(pending)]
        self._land(op)
        self.now += delay
        self.safe()
        self._answer(op)

    @precondition(
        lambda self: any(op.kind == "update" and not op.landed and self._current(op) for op in self.ops)
    )
    @rule(pick=st.integers(0, 1_000), past_ms=st.sampled_from([0, 1, 400]))
    def renewal_read_past_its_deadline(self, pick: int, past_ms: int) -> None:
        """A renewal lands, and its answer is read at or past the term's deadline on the
        instance's own clock with no tick between: the term ends then, as a tick would have ended
        it (a resumed one could leave a shard led whose start the host had given up; review,
        stop 65), and the key is handed back."""
        renewals = [op for op in self.ops if op.kind == "update" and not op.landed and self._current(op)]
        op = renewals[pick % len(renewals)]
        self._land(op)
        if op not in self.ops:
            return
        core = self._core(op.slot)
        deadline = core.deadline_ms(op.shard)
        if deadline is None:  # (stopped already: draining, its answer still awaited)
            return
        while self._t(op.slot) < deadline + past_ms:
            self.now += 50
        self.safe()
        self._answer(op)
        assert core.epoch(op.shard) is None, "a term resumed by a renewal read past its deadline"

    @rule(slot=st.integers(0, SLOTS - 1), duration=st.sampled_from([1_000, 2_600, 3_500, 5_000]))
    def pause(self, slot: int, duration: int) -> None:
        """One instance stalls (GC pause, partition) while the others run normally, ticking every
        100 ms with prompt delivery; its own operations stay in flight."""
        slot %= len(self.instances)
        end = self.now + duration
        while self.now < end:
            self.now += 100
            for other in range(len(self.instances)):
                if other != slot and self._live(other):
                    self._apply(other, self._core(other).on_members(self._members_view(), self._t(other)))
            self._flush(lambda op: op.slot != slot)
            self.safe()

    @precondition(lambda self: any(op.landed for op in self.ops))
    @rule(pick=st.integers(0, 1_000))
    def answer(self, pick: int) -> None:
        landed = [op for op in self.ops if op.landed]
        self._answer(landed[pick % len(landed)])

    @precondition(lambda self: any(self._current(op) for op in self.ops))
    @rule(pick=st.integers(0, 1_000))
    def time_out(self, pick: int) -> None:
        waiting = [op for op in self.ops if self._current(op)]
        self._answer(waiting[pick % len(waiting)], timed_out=True)

    @rule(slot=st.integers(0, SLOTS - 1))
    def crash_or_restart(self, slot: int) -> None:
        slot %= len(self.instances)
        inst = self.instances[slot]
        if inst.status == "down":
            self._start(slot)
        else:
            inst.status = "down"
            inst.core = None
            inst.serving = {}
            for op in list(self.ops):
                if op.slot == slot:
                    op.abandoned = True  # in flight from the dead: may still land
                    if op.landed:
                        self.ops.remove(op)

    @rule(slot=st.integers(0, SLOTS - 1))
    def leave_or_exit(self, slot: int) -> None:
        """An instance leaves gracefully; once drained, its process exits."""
        slot %= len(self.instances)
        inst = self.instances[slot]
        if inst.status == "up":
            inst.status = "leaving"
            self._apply(slot, self._core(slot).leave(self._t(slot)))
            self.registry.pop(inst.instance_id, None)  # the shell deletes its member key
        else:
            self._exit_when_drained(slot)

    def _exit_when_drained(self, slot: int) -> None:
        inst = self.instances[slot]
        if inst.status == "leaving" and self._core(slot).drained():
            assert not any(op.slot == slot and self._current(op) for op in self.ops)
            inst.status = "down"
            inst.core = None

    # ---- checks ------------------------------------------------------------------------------

    @invariant()
    def safe(self) -> None:
        for slot, inst in enumerate(self.instances):
            if inst.status == "down":
                continue
            core = self._core(slot)
            core.check_invariants(self._t(slot))
            assert inst.serving == core.leading()
            in_flight = [op.shard for op in self.ops if op.slot == slot and self._current(op)]
            assert len(in_flight) == len(set(in_flight)), "two operations in flight for one shard"
            assert len(in_flight) == core.in_flight()
        for shard in range(self.config.shards):
            holders = [
                (slot, inst, epoch)
                for slot, inst in enumerate(self.instances)
                if inst.core is not None
                and (epoch := inst.core.epoch(shard, now_ms=self._t(slot))) is not None
            ]
            assert len(holders) <= 1, f"two leaders of shard {shard} at {self.now}: {holders}"
            if holders:
                slot, inst, epoch = holders[0]
                entry = self.kv.get(key_of(shard), self.now)
                assert entry is not None and entry.value == inst.instance_id, "leading without the key"
                assert entry.revision >= epoch
                holder = (slot, inst.incarnation, epoch)
                last = self.last_holder.get(shard)
                if holder != last:
                    assert last is None or epoch > last[2], "a later leader with an epoch not greater"
                    self.last_holder[shard] = holder

    def _flush(self, which: Callable[[Op], bool] = lambda op: True) -> None:
        """Prompt delivery: everything in flight (`which`) lands now and is answered, until quiet."""
        for _ in range(100):
            ops = [op for op in self.ops if which(op)]
            if not ops:
                return
            for op in [op for op in ops if not op.landed]:
                self._land(op)
            for op in [op for op in ops if op.landed]:
                if op in self.ops:
                    self._answer(op)
        raise AssertionError("operations kept coming without time passing")

    def teardown(self) -> None:
        if not self.instances:
            return
        # Fault-free phase: no crashes, timeouts or delays; every live instance ticks every 100 ms.
        self._flush()
        for slot in range(len(self.instances)):
            self._exit_when_drained(slot)
        if not any(inst.status == "up" for inst in self.instances):
            self._start(next(s for s, inst in enumerate(self.instances) if inst.status == "down"))
        settle_by = self.now + max(TTL_MS, MEMBERS_TTL_MS) + 3 * RENEW_MS
        settled: dict[int, tuple[str, int]] | None = None
        while self.now < settle_by + 2 * RENEW_MS:
            self.now += 100
            self.everyone_ticks()
            self._flush()
            for slot in range(len(self.instances)):
                self._exit_when_drained(slot)
            self.safe()
            if self.now < settle_by:
                continue
            up = {inst.instance_id for inst in self.instances if inst.status == "up"}
            assert all(inst.status != "leaving" for inst in self.instances), (
                "a leaving instance never drained"
            )
            leaders: dict[int, tuple[str, int]] = {}
            for shard in range(self.config.shards):
                holders = [
                    (inst.instance_id, epoch)
                    for slot, inst in enumerate(self.instances)
                    if inst.core is not None
                    and (epoch := inst.core.epoch(shard, now_ms=self._t(slot))) is not None
                ]
                assert len(holders) == 1, f"shard {shard} has no leader at {self.now}"
                assert holders[0][0] == desired_owner(shard, up), "the leader is not the desired owner"
                leaders[shard] = holders[0]
            assert settled is None or leaders == settled, "leadership kept moving without faults"
            settled = leaders


LeadershipMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestLeadershipMachine = LeadershipMachine.TestCase
