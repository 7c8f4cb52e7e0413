"""Scripted scenarios for the shard-leadership core, against a simulated JetStream KV bucket
(`SimKV`, shared with the state-machine test): acquire, renew, expire, fail over, hand over."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest

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
    member_key,
    shard_of,
)
from kvfabric.format.invariant import InvariantViolation

CONFIG = LeadershipConfig(shards=8)  # ttl 3000, renew 1000, margin 500, members ttl 3000


@dataclass(slots=True)
class Entry:
    value: str
    revision: int
    written_ms: int


@dataclass(slots=True)
class SimKV:
    """A JetStream KV bucket with `max_age = ttl_ms`: one revision counter for the bucket
    (the stream sequence); a key not rewritten for `ttl_ms` is gone; an operation takes effect
    (and stamps its write) when the server applies it, which is after the client sent it."""

    ttl_ms: int
    entries: dict[str, Entry] = field(default_factory=dict)
    revision: int = 0

    def get(self, key: str, now_ms: int) -> Entry | None:
        entry = self.entries.get(key)
        if entry is not None and now_ms - entry.written_ms >= self.ttl_ms:
            del self.entries[key]
            return None
        return entry

    def create(self, key: str, value: str, now_ms: int) -> int | None:
        if self.get(key, now_ms) is not None:
            return None
        self.revision += 1
        self.entries[key] = Entry(value, self.revision, now_ms)
        return self.revision

    def update(self, key: str, value: str, last: int, now_ms: int) -> int | None:
        entry = self.get(key, now_ms)
        if entry is None or entry.revision != last:
            return None
        self.revision += 1
        self.entries[key] = Entry(value, self.revision, now_ms)
        return self.revision

    def delete(self, key: str, last: int, now_ms: int) -> bool:
        entry = self.get(key, now_ms)
        if entry is None or entry.revision != last:
            return False
        del self.entries[key]
        return True


@dataclass
class Cluster:
    """Instances whose shells perform every KV operation at once (sent and applied at `now`)."""

    config: LeadershipConfig = CONFIG
    kv: SimKV = field(default_factory=lambda: SimKV(CONFIG.lease_ttl_ms))
    registry: dict[str, int] = field(default_factory=dict)  # instance id -> last announce
    nodes: dict[str, ShardLeadership] = field(default_factory=dict)
    now: int = 0
    log: list[tuple[str, Effect]] = field(default_factory=list)

    def add(self, instance_id: str) -> ShardLeadership:
        self.nodes[instance_id] = ShardLeadership(self.config, instance_id)
        return self.nodes[instance_id]

    def live(self) -> set[str]:
        return {i for i, t in self.registry.items() if self.now - t < self.config.members_ttl_ms}

    def perform(self, instance_id: str, effects: list[Effect]) -> None:
        core = self.nodes[instance_id]
        queue = list(effects)
        while queue:
            effect = queue.pop(0)
            self.log.append((instance_id, effect))
            key = key_of(effect.shard) if not isinstance(effect, AnnounceMember) else ""
            if isinstance(effect, AnnounceMember):
                self.registry[instance_id] = self.now
            elif isinstance(effect, Acquire):
                rev = self.kv.create(key, instance_id, self.now)
                queue += (
                    core.on_acquired(effect.shard, rev, self.now)
                    if rev is not None
                    else core.on_acquire_failed(effect.shard, self.now)
                )
            elif isinstance(effect, Renew):
                rev = self.kv.update(key, instance_id, effect.revision, self.now)
                queue += (
                    core.on_renewed(effect.shard, rev, self.now)
                    if rev is not None
                    else core.on_renew_failed(effect.shard, self.now)
                )
            elif isinstance(effect, Release):
                self.kv.delete(key, effect.revision, self.now)
                queue += core.on_released(effect.shard)

    def round(self) -> None:
        """Every instance ticks, then sees the registry (twice: announcements land in between)."""
        for instance_id, core in self.nodes.items():
            self.perform(instance_id, core.tick(self.now))
        for instance_id, core in self.nodes.items():
            self.perform(instance_id, core.on_members(self.live(), self.now))
        for core in self.nodes.values():
            core.check_invariants(self.now)

    def run_until(self, t_ms: int, step_ms: int = 100) -> None:
        while self.now < t_ms:
            self.now = min(self.now + step_ms, t_ms)
            self.round()

    def leader(self, shard: int) -> tuple[str, int] | None:
        holders = [
            (i, e) for i, c in self.nodes.items() if (e := c.epoch(shard, now_ms=self.now)) is not None
        ]
        assert len(holders) <= 1, f"two leaders of shard {shard}: {holders}"
        return holders[0] if holders else None

    def effects_since(self, mark: int, instance_id: str) -> list[Effect]:
        return [e for i, e in self.log[mark:] if i == instance_id]


def test_single_instance_acquires_every_shard() -> None:
    cfg = LeadershipConfig(shards=4)
    a = ShardLeadership(cfg, "a")
    assert a.tick(0) == [AnnounceMember()]  # not a member yet: desires nothing
    assert a.desired() == set()
    effects = a.on_members({"a"}, 10)
    assert effects == [Acquire(0), Acquire(1), Acquire(2), Acquire(3)]
    assert a.tick(20) == []  # one Acquire in flight per shard
    for shard in range(4):
        assert a.on_acquired(shard, revision=shard + 1, sent_ms=10) == [StartLeading(shard, shard + 1)]
    assert a.leading() == {0: 1, 1: 2, 2: 3, 3: 4}
    a.check_invariants(20)
    # Renewals are due renew_every_ms after the write was sent; the epoch stays.
    assert a.tick(1009) == [AnnounceMember()]  # every renew_every_ms after the first tick
    assert a.tick(1010) == [Renew(0, 1), Renew(1, 2), Renew(2, 3), Renew(3, 4)]
    assert a.on_renewed(0, revision=5, sent_ms=1010) == []
    assert a.epoch(0) == 1 and a.deadline_ms(0) == 1010 + 2500
    assert a.counters["acquires_total"] == 4 and a.counters["renewed_total"] == 1
    a.check_invariants(1010)


def test_a_leaders_crash_lets_the_standby_lead_after_the_ttl_with_a_higher_epoch() -> None:
    c = Cluster()
    c.add("a")
    c.add("b")
    c.run_until(500)
    owners = {s: desired_owner(s, {"a", "b"}) for s in range(CONFIG.shards)}
    assert {s: c.leader(s) is not None for s in owners} == dict.fromkeys(owners, True)
    a_shards = {s for s, o in owners.items() if o == "a"}
    assert a_shards and len(a_shards) < CONFIG.shards
    a_epochs = {s: c.nodes["a"].leading()[s] for s in a_shards}
    c.run_until(2000)
    a_last_write = max(e.written_ms for e in c.kv.entries.values() if e.value == "a")
    del c.nodes["a"]  # crashed: no more ticks, announcements or renewals
    crash_ms = c.now
    taken: dict[int, int] = {}
    while len(taken) < len(a_shards):
        c.run_until(c.now + 100)
        for s in a_shards:
            leader = c.leader(s)
            if leader is not None and s not in taken:
                assert leader[0] == "b"
                assert leader[1] > a_epochs[s]  # a later term has a greater epoch
                taken[s] = c.now
        assert c.now < crash_ms + 10_000
    # b waits for a's member key and then its leases to lapse, then retries within a period.
    assert min(taken.values()) >= a_last_write + CONFIG.lease_ttl_ms
    assert max(taken.values()) <= a_last_write + CONFIG.lease_ttl_ms + CONFIG.renew_every_ms + 100


def test_a_failed_renewal_stops_leading_at_once() -> None:
    a = ShardLeadership(LeadershipConfig(shards=1), "a")
    assert a.on_members({"a"}, 0) == [Acquire(0), AnnounceMember()]
    assert a.on_acquired(0, revision=7, sent_ms=0) == [StartLeading(0, 7)]
    assert a.tick(1000) == [Renew(0, 7), AnnounceMember()]
    assert a.on_renew_failed(0, 1005) == [StopLeading(0, 7, "renew_failed")]
    assert a.epoch(0) is None and a.leading() == {}
    assert a.tick(2004) == [AnnounceMember()]  # no retry before renew_every_ms
    assert a.tick(2005) == [Acquire(0)]
    assert a.counters["renew_failed_total"] == 1 and a.counters["leading_stopped_total"] == 1
    a.check_invariants(2005)


def test_an_unanswered_renewal_keeps_the_term_to_its_deadline_and_is_retried() -> None:
    """A renewal that times out (the KV's stream electing a leader) neither ends the term nor
    moves its deadline: it is sent again after renew_retry_ms; one that lands extends the term."""
    a = ShardLeadership(LeadershipConfig(shards=1), "a")
    a.on_members({"a"}, 0)
    assert a.on_acquired(0, revision=7, sent_ms=0) == [StartLeading(0, 7)]
    assert a.tick(1000) == [Renew(0, 7), AnnounceMember()]
    assert a.on_renew_unanswered(0, 2000) == []
    assert a.epoch(0, now_ms=2000) == 7 and a.deadline_ms(0) == 2500  # unchanged: 0 + 3000 - 500
    assert a.next_wakeup_ms() == 2000  # the announcement; the retry is due at 2250
    assert a.tick(2249) == [AnnounceMember()]
    assert a.tick(2250) == [Renew(0, 7)]
    assert a.on_renewed(0, revision=9, sent_ms=2250, now_ms=2400) == []
    assert a.deadline_ms(0) == 4750 and a.epoch(0, now_ms=4000) == 7  # the same term goes on
    assert a.tick(3249) == [AnnounceMember()]
    assert a.tick(3250) == [Renew(0, 9)]
    assert a.on_renew_unanswered(0, 4740) == []
    # Never past the last successful write's term:
    assert a.tick(4750) == [StopLeading(0, 7, "lease_expired"), AnnounceMember()]
    assert a.counters["renew_unanswered_total"] == 2 and a.counters["renew_failed_total"] == 0
    a.check_invariants(4750)


def test_missed_renewals_stop_leading_at_the_conservative_deadline() -> None:
    a = ShardLeadership(LeadershipConfig(shards=1), "a")
    a.on_members({"a"}, 0)
    kv = SimKV(3_000)
    revision = kv.create(key_of(0), "a", 400)  # sent at 0, applied by the server at 400
    assert revision is not None
    assert a.on_acquired(0, revision, sent_ms=0) == [StartLeading(0, revision)]
    assert a.tick(1000) == [Renew(0, revision), AnnounceMember()]  # never answered
    # The deadline counts from the send time, not from when the server wrote: 0 + 3000 - 500.
    assert a.epoch(0, now_ms=2499) == revision
    assert a.epoch(0, now_ms=2500) is None  # even before the shell ticks
    assert a.tick(2499) == [AnnounceMember()]
    assert a.tick(2500) == [StopLeading(0, revision, "lease_expired")]
    assert kv.get(key_of(0), 3399) is not None  # the key outlives the term by >= the margin
    # The renewal finally answers: too late to act on, so the key is handed back.
    assert a.on_renewed(0, revision + 1, sent_ms=1000) == [Release(0, revision + 1)]
    assert a.on_released(0) == []
    assert a.tick(2600) == [Acquire(0)]
    assert a.counters["lease_expired_total"] == 1
    a.check_invariants(2600)


def test_a_renewal_read_after_the_deadline_ends_the_term_as_a_tick_would() -> None:
    """A renewal that lands proves nobody else held the key, but the term ended at its deadline
    on this clock: the host may have abandoned the shard's start in that gap (`epoch(now)` was
    None), and a resumed term left the shard led and unserved (review, stop 65). Read with its
    time, the answer stops the term and hands the key back, as a tick first would have; without a
    time (as of the latest event, before the deadline) it renews."""
    a = ShardLeadership(LeadershipConfig(shards=1), "a")
    a.on_members({"a"}, 0)
    a.on_acquired(0, revision=3, sent_ms=0)
    assert a.tick(1000) == [Renew(0, 3), AnnounceMember()]
    assert a.epoch(0, now_ms=2600) is None  # past the deadline, no tick yet
    assert a.on_renewed(0, revision=4, sent_ms=1000, now_ms=2600) == [
        StopLeading(0, 3, "lease_expired"),
        Release(0, 4),
    ]
    assert a.epoch(0) is None and a.counters["lease_expired_total"] == 1
    assert a.on_released(0) == []
    a.check_invariants(2600)
    b = ShardLeadership(LeadershipConfig(shards=1), "b")
    b.on_members({"b"}, 0)
    b.on_acquired(0, revision=3, sent_ms=0)
    assert b.tick(1000) == [Renew(0, 3), AnnounceMember()]
    assert b.on_renewed(0, revision=4, sent_ms=1000) == []  # no time: as of 1000, within the term
    assert b.epoch(0, now_ms=2600) == 3  # new deadline 1000 + 2500
    assert b.tick(2600) == [Renew(0, 4), AnnounceMember()]


def test_a_create_answered_after_its_term_ended_starts_no_stale_term() -> None:
    """Shrunk from the state machine: a stalls with its create's answer unread, its key lapses
    and b leads with a greater epoch; a must not start the dead term when it reads the answer
    (StartLeading with an epoch below one already in use), whatever it last ticked."""
    kv = SimKV(3_000)
    a = ShardLeadership(LeadershipConfig(shards=1), "a")
    assert a.on_members({"a"}, 0) == [Acquire(0), AnnounceMember()]
    stale = kv.create(key_of(0), "a", 0)  # lands at once; a stalls before reading the answer
    assert stale is not None
    b = ShardLeadership(LeadershipConfig(shards=1), "b")
    assert b.on_members({"b"}, 3_000) == [Acquire(0), AnnounceMember()]
    fresh = kv.create(key_of(0), "b", 3_000)  # a's key lapsed at 3000
    assert fresh is not None and fresh > stale
    assert b.on_acquired(0, fresh, sent_ms=3_000, now_ms=3_000) == [StartLeading(0, fresh)]
    # a resumes at 4000 and reads the answer before its first tick: the term (deadline 2500) is
    # over, so the won key is handed back (a no-op: the key is b's now) instead of led.
    assert a.on_acquired(0, stale, sent_ms=0, now_ms=4_000) == [Release(0, stale)]
    assert a.epoch(0) is None and a.leading() == {}
    assert a.counters["acquired_unwanted_total"] == 1 and a.counters["leading_started_total"] == 0
    assert not kv.delete(key_of(0), stale, 4_000)
    assert a.on_released(0) == []
    a.check_invariants(4_000)
    b.check_invariants(4_000)


def test_an_answer_within_the_term_starts_it_and_one_at_the_deadline_does_not() -> None:
    for now_ms, expected in ((2_499, [StartLeading(0, 5)]), (2_500, [Release(0, 5)])):
        a = ShardLeadership(LeadershipConfig(shards=1), "a")
        a.on_members({"a"}, 0)
        assert a.on_acquired(0, 5, sent_ms=0, now_ms=now_ms) == expected
        a.check_invariants(now_ms)


def test_a_renewal_answered_after_its_new_deadline_stops_the_term() -> None:
    """The answer's time also stops the other terms it passed (a Renew in flight: draining)."""
    a = ShardLeadership(LeadershipConfig(shards=2), "a")
    assert a.on_members({"a"}, 0) == [Acquire(0), Acquire(1), AnnounceMember()]
    assert a.on_acquired(0, 1, sent_ms=0, now_ms=0) == [StartLeading(0, 1)]
    assert a.on_acquired(1, 2, sent_ms=0, now_ms=0) == [StartLeading(1, 2)]
    assert a.tick(1_000) == [Renew(0, 1), Renew(1, 2), AnnounceMember()]
    # Both answers wait out a 3 s stall: shard 0's term ended at 2500, before its answer was
    # read, so the key it renewed is handed back at once (standbys need not wait for it to lapse).
    assert a.on_renewed(0, 3, sent_ms=1_000, now_ms=4_000) == [
        StopLeading(0, 1, "lease_expired"),
        StopLeading(1, 2, "lease_expired"),  # its deadline (2500) passed too: stopped, draining
        Release(0, 3),
    ]
    assert a.leading() == {}
    assert a.on_renewed(1, 4, sent_ms=1_000, now_ms=4_000) == [Release(1, 4)]
    assert a.counters["lease_expired_total"] == 2
    a.check_invariants(4_000)


def test_a_new_member_triggers_handover_of_exactly_the_moved_shards() -> None:
    c = Cluster(config=LeadershipConfig(shards=32))
    c.add("a")
    c.add("b")
    c.run_until(500)
    before = {s: c.leader(s) for s in range(32)}
    assert all(before.values())
    moved = {s for s in range(32) if desired_owner(s, {"a", "b", "c"}) == "c"}
    # Rendezvous: a joining member takes only shards it now wins; no shard moves between a and b.
    assert {
        s for s in range(32) if desired_owner(s, {"a", "b"}) != desired_owner(s, {"a", "b", "c"})
    } == moved
    assert 0 < len(moved) < 32
    mark = len(c.log)
    c.add("c")
    c.run_until(700)  # c announces; a and b see it and hand over at once
    for instance_id in ("a", "b"):
        stops = [e for e in c.effects_since(mark, instance_id) if isinstance(e, StopLeading)]
        releases = [e for e in c.effects_since(mark, instance_id) if isinstance(e, Release)]
        led = {s for s, leader in before.items() if leader is not None and leader[0] == instance_id}
        assert {e.shard for e in stops} == moved & led
        assert {e.reason for e in stops} <= {"handover"}
        assert {e.shard for e in releases} == moved & led
    c.run_until(700 + CONFIG.renew_every_ms + 200)  # c's failed creates retry after the deletes
    for s in range(32):
        leader = c.leader(s)
        before_s = before[s]
        assert leader is not None and before_s is not None
        if s in moved:
            assert leader[0] == "c" and leader[1] > before_s[1]
        else:
            assert leader == before_s  # untouched: same instance, same term
    assert c.nodes["a"].counters["handovers_total"] + c.nodes["b"].counters["handovers_total"] == len(moved)


def test_stop_leading_comes_before_every_other_effect() -> None:
    c = Cluster(config=LeadershipConfig(shards=16))
    a = c.add("a")
    c.run_until(100)
    assert len(a.leading()) == 16
    c.now = 1100  # renewals due, and b appears in the same step
    effects = a.on_members({"a", "b"}, c.now)
    kinds = [type(e).__name__ for e in effects]
    first_other = next(i for i, k in enumerate(kinds) if k != "StopLeading")
    assert "StopLeading" in kinds and "StopLeading" not in kinds[first_other:]
    assert any(isinstance(e, Renew) for e in effects) and any(isinstance(e, Release) for e in effects)


def test_leaving_hands_every_shard_over_and_drains() -> None:
    c = Cluster(config=LeadershipConfig(shards=8))
    a = c.add("a")
    c.add("b")
    c.run_until(500)
    led = set(a.leading())
    mark = len(c.log)
    c.perform("a", a.leave(c.now))
    c.registry.pop("a")  # the shell deletes its member key
    assert a.desired() == set() and a.leading() == {} and a.drained()
    stops = [e for e in c.effects_since(mark, "a") if isinstance(e, StopLeading)]
    assert {e.shard for e in stops} == led and {e.reason for e in stops} == {"leaving"}
    assert AnnounceMember() not in a.tick(c.now + 5_000)
    del c.nodes["a"]
    c.run_until(c.now + 1_300)
    assert all((leader := c.leader(s)) is not None and leader[0] == "b" for s in range(8))


def test_a_create_won_after_the_shard_moved_away_is_released_without_leading() -> None:
    a = ShardLeadership(LeadershipConfig(shards=4), "a")
    a.on_members({"a"}, 0)
    moved = next(s for s in range(4) if desired_owner(s, {"a", "b"}) == "b")
    a.on_members({"a", "b"}, 10)  # b joined while the create was in flight
    assert a.on_acquired(moved, revision=9, sent_ms=0) == [Release(moved, 9)]
    assert a.epoch(moved) is None and a.counters["acquired_unwanted_total"] == 1
    a.check_invariants(10)


def test_results_for_operations_never_asked_for_are_bugs() -> None:
    a = ShardLeadership(LeadershipConfig(shards=2), "a")
    with pytest.raises(InvariantViolation):
        a.on_acquired(0, revision=1, sent_ms=0)
    with pytest.raises(InvariantViolation):
        a.on_renewed(0, revision=2, sent_ms=0)
    with pytest.raises(InvariantViolation):
        a.on_released(1)
    a.on_members({"a"}, 100)
    with pytest.raises(InvariantViolation):  # sent before the core asked: a clock mix-up
        a.on_acquired(0, revision=1, sent_ms=99)
    with pytest.raises(InvariantViolation):
        a.tick(50)  # time went backwards


def test_config_rejects_leases_that_cannot_survive_one_lost_renewal() -> None:
    with pytest.raises(InvariantViolation):
        LeadershipConfig(shards=8, lease_ttl_ms=3_000, renew_every_ms=1_500, safety_margin_ms=500)
    with pytest.raises(InvariantViolation):
        LeadershipConfig(shards=8, safety_margin_ms=0)
    with pytest.raises(InvariantViolation):
        LeadershipConfig(shards=4097)


def test_keys_match_what_the_directory_shell_parses() -> None:
    assert key_of(7) == "shard-7"
    assert member_key("dir-1") == "member-dir-1"
    assert member_key("dir-1").removeprefix("member-") == "dir-1"


def test_shard_of_is_the_little_endian_prefix_mod_shards() -> None:
    assert shard_of(bytes([1, 0, 0, 0]) + b"\xff" * 28, 4096) == 1
    assert shard_of(bytes([0, 1, 0, 0]), 4096) == 256
    assert shard_of(bytes([0xFF, 0xFF, 0xFF, 0xFF]), 1000) == 0xFFFFFFFF % 1000
    with pytest.raises(InvariantViolation):
        shard_of(b"abc", 8)


def test_desired_owner_is_deterministic_stable_and_balanced() -> None:
    # Golden values: every instance (and every version) must agree on them.
    golden = ["d1", "d0", "d0", "d2", "d2", "d1", "d0", "d0", "d2", "d1", "d2", "d0"]
    assert [desired_owner(s, ["d0", "d1", "d2"]) for s in range(12)] == golden
    assert [desired_owner(s, {"d2", "d0", "d1"}) for s in range(12)] == golden  # order-free
    members = [f"dir-{i}" for i in range(8)]
    owners = {s: desired_owner(s, members) for s in range(4096)}
    counts = Counter(owners.values())
    assert set(counts) == set(members)
    assert all(4096 / 8 * 0.8 <= n <= 4096 / 8 * 1.2 for n in counts.values()), counts
    # Removing a member moves only its own shards.
    fewer = [m for m in members if m != "dir-3"]
    assert all(desired_owner(s, fewer) == o for s, o in owners.items() if o != "dir-3")
    with pytest.raises(InvariantViolation):
        desired_owner(0, [])
