"""`ShardLeadership.step(event, now_ms)`, the one entry (issue 26: one shape for every core), is
the method of the same meaning: two cores, one driven through `step`, one through the methods,
given the same random run (ticks, member changes, answers to every operation in flight: won,
lost, landed, refused, unanswered, released; a leave), emit the same effects and end in the
same state."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.core.leadership import (
    Acquire,
    Acquired,
    AcquireFailed,
    Effect,
    LeadershipConfig,
    LeadershipEvent,
    Leave,
    MembersSeen,
    Release,
    Released,
    Renew,
    Renewed,
    RenewFailed,
    RenewUnanswered,
    ShardLeadership,
    Tick,
)

CONFIG = LeadershipConfig(
    shards=4, lease_ttl_ms=3_000, renew_every_ms=1_000, safety_margin_ms=500, members_ttl_ms=3_000
)


def by_method(core: ShardLeadership, event: LeadershipEvent, now_ms: int) -> list[Effect]:
    if isinstance(event, Tick):
        return core.tick(now_ms)
    if isinstance(event, MembersSeen):
        return core.on_members(set(event.members), now_ms)
    if isinstance(event, Leave):
        return core.leave(now_ms)
    if isinstance(event, Acquired):
        return core.on_acquired(event.shard, event.revision, event.sent_ms, now_ms=now_ms)
    if isinstance(event, AcquireFailed):
        return core.on_acquire_failed(event.shard, now_ms)
    if isinstance(event, Renewed):
        return core.on_renewed(event.shard, event.revision, event.sent_ms, now_ms=now_ms)
    if isinstance(event, RenewUnanswered):
        return core.on_renew_unanswered(event.shard, now_ms)
    if isinstance(event, RenewFailed):
        return core.on_renew_failed(event.shard, now_ms)
    assert isinstance(event, Released)
    return core.on_released(event.shard)


def state(core: ShardLeadership, now_ms: int) -> tuple[object, ...]:
    return (
        core.leading(now_ms),
        core.held(now_ms),
        core.desired(),
        core.members(),
        core.next_wakeup_ms(),
        core.in_flight(),
        dict(core.counters),
    )


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_step_is_the_method_of_the_same_meaning(data: st.DataObject) -> None:
    stepped, called = ShardLeadership(CONFIG, "a"), ShardLeadership(CONFIG, "a")
    now, revision = 0, 0
    in_flight: dict[int, tuple[Effect, int]] = {}  # shard -> (operation, when it was asked)
    for _ in range(data.draw(st.integers(min_value=1, max_value=60))):
        choice = data.draw(st.sampled_from(["tick", "members", "answer", "answer", "leave"]))
        now += data.draw(st.sampled_from([0, 10, 300, 900, 2_600]))
        event: LeadershipEvent
        if choice == "answer" and in_flight:
            shard = data.draw(st.sampled_from(sorted(in_flight)))
            op, asked_ms = in_flight.pop(shard)
            if isinstance(op, Acquire):
                revision += 1
                answers: list[LeadershipEvent] = [Acquired(shard, revision, asked_ms), AcquireFailed(shard)]
                event = data.draw(st.sampled_from(answers))
            elif isinstance(op, Renew):
                revision += 1
                answers = [Renewed(shard, revision, asked_ms), RenewUnanswered(shard), RenewFailed(shard)]
                event = data.draw(st.sampled_from(answers))
            else:
                event = Released(shard)
        elif choice == "members":
            event = MembersSeen(frozenset(data.draw(st.sets(st.sampled_from(["a", "b", "c"])))))
        elif choice == "leave" and data.draw(st.integers(min_value=0, max_value=9)) == 0:
            event = Leave()
        else:
            event = Tick()
        effects = stepped.step(event, now)
        assert effects == by_method(called, event, now)
        for effect in effects:
            if isinstance(effect, Acquire | Renew | Release):
                in_flight[effect.shard] = (effect, now)
        assert state(stepped, now) == state(called, now)
        stepped.check_invariants(now)
