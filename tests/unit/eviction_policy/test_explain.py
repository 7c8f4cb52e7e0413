"""`kvctl eviction explain` at the policy (no NATS): the bounded decision log, and the shell's
`explain` of a group after directory events, a victim batch and the directory's answers."""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

import msgspec
import pytest

from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.core.eviction import EvictBatch, EvictionConfig, EvictionCore
from kvfabric.ctl.queries import jsonable
from kvfabric.eviction_policy.decisions import DecisionLog
from kvfabric.eviction_policy.group_records import group_id_of
from kvfabric.eviction_policy.shell import EvictionShell, now_ms
from kvfabric.format.errors import BadRequest, Indeterminate
from kvfabric.format.ids import chain_in_id
from kvfabric.proto import directory as m
from kvfabric.proto import eviction as e
from kvfabric.proto.codec import encode
from tests.unit.eviction_policy.test_shell import NAMESPACE_A, A, chain, published


def what(decisions: list[e.EvictionDecision]) -> list[tuple[str, str]]:
    return [(d.what, d.reason) for d in decisions]


def test_the_log_keeps_the_latest_decisions_of_the_latest_groups() -> None:
    log = DecisionLog(groups_max=3)
    for i in range(e.DECISIONS_PER_GROUP_MAX + 2):
        log.record(b"g0", i, "chosen", f"r{i}", "s1", "watermark")
    kept = log.of(b"g0")
    assert [d.reason for d in kept] == [f"r{i}" for i in range(2, e.DECISIONS_PER_GROUP_MAX + 2)]
    assert kept[-1] == e.EvictionDecision(
        at_ms=e.DECISIONS_PER_GROUP_MAX + 1, what="chosen", reason=f"r{e.DECISIONS_PER_GROUP_MAX + 1}",
        pool="s1", cause="watermark",
    )  # fmt: skip
    for g in (b"g1", b"g2"):
        log.record(g, 20, "tracked", "always")
    log.record(b"g0", 21, "evicted", "evicting")  # g0 is the newest again: g1 is the oldest
    log.record(b"g3", 22, "tracked", "always")
    assert len(log) == 3 and b"g1" not in log and log.of(b"g1") == []
    assert log.of(b"g0")[-1].what == "evicted" and b"g2" in log and b"g3" in log
    log.check_invariants()
    off = DecisionLog(groups_max=0)
    off.record(b"g0", 1, "tracked")
    assert len(off) == 0 and off.of(b"g0") == []


def test_a_decision_that_arrives_late_takes_its_place_in_time() -> None:
    """A lost segment dropped in steps records `lost` at its event's time, after the ticker
    decided about the group's other replicas meanwhile: shown in time order."""
    log = DecisionLog(groups_max=4)
    log.record(b"g0", 100, "tracked", "always")
    log.record(b"g0", 300, "chosen", "watermark", "s1")
    log.record(b"g0", 200, "lost", "heartbeat_timeout", "s2")
    log.record(b"g0", 300, "evicted", "evicting", "s1")  # the same instant: after, as it came
    assert [(d.at_ms, d.what) for d in log.of(b"g0")] == [
        (100, "tracked"), (200, "lost"), (300, "chosen"), (300, "evicted"),
    ]  # fmt: skip
    for i in range(e.DECISIONS_PER_GROUP_MAX):
        log.record(b"g0", 1_000 + i, "tracked", "always")
    log.record(b"g0", 50, "lost", "heartbeat_timeout", "s2")  # older than every kept one: dropped
    assert [d.at_ms for d in log.of(b"g0")] == [1_000 + i for i in range(e.DECISIONS_PER_GROUP_MAX)]
    log.check_invariants()


class Directory(DirectoryRouter):
    """One shard that answers each evict with `statuses` in order (then `evicting`)."""

    def __init__(self, statuses: list[m.EvictStatus]) -> None:
        super().__init__(cast(Any, None))
        self.shards = 1
        self.statuses = statuses

    async def refresh(self) -> None:
        raise AssertionError("the map is known")

    async def ask(self, shard: int, verb: str, message: msgspec.Struct, timeout_s: float, **_: Any) -> Any:
        assert verb == "evict" and isinstance(message, m.Evict)
        results = [
            m.EvictResult(group=g, status=self.statuses.pop(0) if self.statuses else "evicting")
            for g in message.groups
        ]
        return m.EvictReply(epoch=1, results=results)


def test_explain_shows_features_victim_reasons_and_the_directorys_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("kvfabric.eviction_policy.shell.now_ms", lambda: 5)  # the answers' time
    core = EvictionCore(EvictionConfig(policy="lru", high_watermark=0.5, low_watermark=0.1))
    sh = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0, demote=False)
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=100), 0)
    sh.apply(published(1, s1=20), 1)  # head 1 <- tail 2, and 3 alone
    sh.apply(published(2, parent=1, s1=20), 2)
    sh.apply(published(3, s1=20), 3)
    sh.apply(m.GroupsAccessed(groups=[m.GroupHits(chain(3), 1, A)]), 4)
    head, tail, other = (group_id_of(NAMESPACE_A, i > 1 and i != 3, chain(i)) for i in (1, 2, 3))
    before = sh.explain(head)
    assert before.tracked and before.policy == "lru" and before.decisions_kept
    assert what(before.decisions) == [("tracked", "always")] and before.decisions[0].pool == "s1"
    assert before.features["tenant"] == A.hex() and before.features["bytes"] == 20
    assert before.features["leaf"] is False and before.admission is None  # its tail holds it
    encode(before)  # the features go on the wire as they are
    (batch,) = core.tick(5)  # 60 % > 50 %: down to 10 %, the tail before its head, 3 last
    assert isinstance(batch, EvictBatch) and batch.victims == (A + chain(2), A + chain(1), A + chain(3))
    sh._router = Directory(["leased", "tail_stays"])  # the tail stays, and so its head
    asyncio.run(sh._evict(batch))
    assert what(sh.explain(tail).decisions) == [
        ("tracked", "always"),
        ("chosen", "least_recent"),
        ("stays", "leased"),
    ]
    assert what(sh.explain(head).decisions)[1:] == [("chosen", "least_recent"), ("stays", "tail_stays")]
    assert sh.explain(head).decisions[1].cause == "watermark"
    gone = sh.explain(other)
    assert not gone.tracked and not gone.features
    assert what(gone.decisions) == [
        ("tracked", "always"),
        ("chosen", "least_recent"),
        ("evicted", "evicting"),
    ]
    # The directory's own `evicted` of a group the policy did not ask for (an operator's) and a
    # segment's loss: recorded; its `evicted` for one the policy evicted: not twice.
    sh.apply(m.GroupEvicted(group=chain(3), reason="policy", domain=A), 6)
    sh.apply(m.GroupEvicted(group=chain(2), reason="admin", domain=A), 7)
    assert what(sh.explain(other).decisions)[-1] == ("evicted", "evicting")
    assert what(sh.explain(tail).decisions)[-1] == ("evicted", "admin")
    sh.apply(m.SegmentDown(segment_id="s1", incarnation=1, reason="heartbeat_timeout"), 8)
    lost = sh.explain(head)
    assert not lost.tracked and lost.decisions[-1].what == "lost" and lost.decisions[-1].pool == "s1"
    sh.apply(m.GroupInvalidated(group=chain(1), reason="replica_lost", domain=A), 8)
    assert what(sh.explain(head).decisions)[-1] == ("invalidated", "replica_lost")
    sh._decisions.check_invariants()
    with pytest.raises(BadRequest, match="90 bytes"):
        sh.explain(head[:-1])


def test_explain_says_what_the_last_admission_filter_says_of_a_group() -> None:
    core = EvictionCore(EvictionConfig(policy="density", high_watermark=0.5, low_watermark=0.1))
    sh = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0, decisions_max=0)
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=100), 0)
    sh.apply(published(1, s1=30), 1)
    sh._admission = e.AdmissionFilter(
        generated_ms=5,
        events_seq=2,
        policy="density",
        pools=[e.PoolAdmission(segment_id="s1", group_bytes_max=[7, 8, 9, 10, 11, 12, 13, 14])],
        protected_domains=[A],
    )
    known = sh.explain(group_id_of(NAMESPACE_A, 0, chain(1)))
    assert known.tracked and not known.decisions and not known.decisions_kept
    assert "density_class" in known.features and "hit_density_per_byte_ms" in known.features
    admission = sh.explain(group_id_of(NAMESPACE_A, 5, chain(9))).admission
    assert admission == e.AdmissionExplain(
        generated_ms=5, length_class=3, protected=True, seen=False, limits={"s1": 10}
    )


class Silent(Directory):
    async def ask(self, shard: int, verb: str, message: msgspec.Struct, timeout_s: float, **_: Any) -> Any:
        raise Indeterminate("no reply")


def test_a_batch_without_an_answer_stays_with_no_answer() -> None:
    core = EvictionCore(EvictionConfig(policy="lru", high_watermark=0.5, low_watermark=0.1))
    sh = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0, demote=False)
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=100), 0)
    sh.apply(published(1, s1=60), 1)
    (batch,) = core.tick(5)
    assert isinstance(batch, EvictBatch)
    sh._router = Silent([])
    asyncio.run(sh._evict(batch))
    explained = sh.explain(group_id_of(NAMESPACE_A, 0, chain(1)))
    assert explained.tracked and what(explained.decisions)[1:] == [
        ("chosen", "least_recent"),
        ("stays", "no_answer"),
    ]


class EventFirst(Directory):
    """Applies the directory's `evicted` event to the policy before it answers (the directory
    publishes a slice's events before its reply, so the follower may see them first)."""

    def __init__(self, shell: EvictionShell) -> None:
        super().__init__([])
        self.shell = shell

    async def ask(self, shard: int, verb: str, message: msgspec.Struct, timeout_s: float, **_: Any) -> Any:
        assert isinstance(message, m.Evict)
        for gid in message.groups:
            self.shell.apply(
                m.GroupEvicted(group=chain_in_id(gid), reason=message.reason, domain=A), now_ms()
            )
        return await super().ask(shard, verb, message, timeout_s)


def test_an_eviction_reads_the_same_whether_its_event_or_its_answer_comes_first() -> None:
    fates = []
    for directory in (lambda sh: Directory([]), EventFirst):
        core = EvictionCore(EvictionConfig(policy="lru", high_watermark=0.5, low_watermark=0.1))
        sh = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0, demote=False)
        t = now_ms()
        sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=100), t)
        sh.apply(published(1, s1=60), t)
        (batch,) = core.tick(t)
        assert isinstance(batch, EvictBatch)
        sh._router = directory(sh)
        asyncio.run(sh._evict(batch))
        decisions = sh.explain(group_id_of(NAMESPACE_A, 0, chain(1))).decisions
        fates.append([(d.what, d.reason, d.cause) for d in decisions])
    assert (
        fates[0]
        == fates[1]
        == [
            ("tracked", "always", ""),
            ("chosen", "least_recent", "watermark"),
            ("evicted", "evicting", "watermark"),
        ]
    )


def test_a_big_segment_s_loss_does_not_push_other_groups_out_of_the_log() -> None:
    core = EvictionCore(EvictionConfig(policy="lru"))
    sh = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0, decisions_max=2)
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=1_000), 0)
    for i in range(1, 6):
        sh.apply(published(i, s1=10), i)
    sh.apply(m.SegmentDown(segment_id="s1", incarnation=1, reason="heartbeat_timeout"), 10)
    for i in range(1, 6):  # the directory's, in the same tick: no replica left
        sh.apply(m.GroupInvalidated(group=chain(i), reason="replica_lost", domain=A), 10)
    for i in range(1, 6):
        kept = [d.what for d in sh.explain(group_id_of(NAMESPACE_A, 0, chain(i))).decisions]
        assert kept == ([] if i < 4 else ["tracked", "lost", "invalidated"]), (i, kept)
    sh._decisions.check_invariants()


def test_a_density_not_computed_yet_goes_out_as_text_json_can_carry() -> None:
    core = EvictionCore(EvictionConfig(policy="density"))
    sh = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0)
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=100), 0)
    sh.apply(published(1, s1=30), 1)
    reply = sh.explain(group_id_of(NAMESPACE_A, 0, chain(1)))
    assert reply.features["hit_density_per_byte_ms"] == "inf"
    json.dumps(jsonable(reply), allow_nan=False)  # what `kvctl eviction explain --json` prints
