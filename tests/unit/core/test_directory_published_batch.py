"""One `published` event per put_commit (issue 20): what the directory core emits for a commit."""

from __future__ import annotations

from kvfabric.core.directory import DirectoryCore, EmitEvent, Outcome
from kvfabric.core.directory.keys import chain_of
from kvfabric.core.directory.writes import one_event_per_commit
from kvfabric.format.ids import ChainHash, ObjectKey
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode

from .dirkit import confirm_all, groups, key, new_core, register, spec


def commit(core: DirectoryCore, keys: list[ObjectKey]) -> Outcome:
    begin = core.handle(m.PutBegin(writer_id="w", request_id="r", objects=[spec(k) for k in keys]), 0)
    assert isinstance(begin.reply, m.PutBeginReply)
    confirm_all(core, begin.reply, 0)
    return core.handle(m.PutCommit(writer_id="w", request_id="c", keys=keys), 0)


def test_a_commit_of_several_groups_emits_one_event_naming_them_in_order() -> None:
    core = new_core()
    register(core, "s1", capacity=1 << 20)
    gs = groups(5)
    out = commit(core, [key(g) for g in gs])
    assert isinstance(out.reply, m.PutCommitReply)
    assert [r.status for r in out.reply.results] == ["published"] * 5
    (effect,) = out.effects
    assert isinstance(effect, EmitEvent) and effect.kind == "published"
    assert isinstance(effect.event, m.GroupsPublished)
    assert [g.group for g in effect.event.groups] == [chain_of(g.to_bytes()) for g in gs]
    assert [g.chunk_index for g in effect.event.groups] == [g.chunk_index for g in gs]
    assert [g.placements for g in effect.event.groups] == [[m.SegmentBytes("s1", 100)]] * 5
    assert [g.group_bytes for g in effect.event.groups] == [100] * 5  # one copy of each


def test_degraded_groups_are_announced_under_replicated_after_the_commits_event() -> None:
    core = new_core(replicas_default=2)
    register(core, "s1", capacity=1 << 20)  # one segment: every group has 1 replica of 2
    gs = groups(3)
    out = commit(core, [key(g) for g in gs])
    kinds = [e.kind for e in out.effects if isinstance(e, EmitEvent)]
    assert kinds == ["published", "under_replicated", "under_replicated", "under_replicated"]
    first = out.effects[0]
    assert isinstance(first, EmitEvent) and isinstance(first.event, m.GroupsPublished)
    assert all(g.degraded for g in first.event.groups)


def test_a_commit_of_more_groups_than_an_event_holds_emits_several_in_order() -> None:
    core = new_core()
    register(core, "s1", capacity=1 << 30)
    gs = groups(m.PUBLISHED_BATCH_MAX + 3)
    out = commit(core, [key(g) for g in gs])
    events = [e.event for e in out.effects if isinstance(e, EmitEvent)]
    assert [type(e) for e in events] == [m.GroupsPublished, m.GroupsPublished]
    assert [len(e.groups) for e in events if isinstance(e, m.GroupsPublished)] == [m.PUBLISHED_BATCH_MAX, 3]
    named = [g.group for e in events if isinstance(e, m.GroupsPublished) for g in e.groups]
    assert named == [chain_of(g.to_bytes()) for g in gs]


def test_a_commit_that_publishes_nothing_emits_nothing() -> None:
    core = new_core()
    register(core, "s1", capacity=1 << 20)
    (g,) = groups(1, tp_size=2)  # two members: one committed is not a published group
    out = commit(core, [key(g, rank=0)])
    assert isinstance(out.reply, m.PutCommitReply)
    assert out.reply.results[0].status == "waiting_group"
    assert out.effects == []


def published(i: int) -> m.GroupPublished:
    return m.GroupPublished(group=ChainHash(bytes([i % 256]) * 32), chunk_index=i, members=1)


def test_one_event_per_commit_keeps_the_other_effects_in_order_after_the_batch() -> None:
    under = EmitEvent("under_replicated", m.GroupUnderReplicated(group=ChainHash(b"u" * 32)))
    effects = [EmitEvent("published", published(0)), under, EmitEvent("published", published(1))]
    out = one_event_per_commit(list(effects))
    assert out == [EmitEvent("published", m.GroupsPublished(groups=[published(0), published(1)])), under]
    assert one_event_per_commit([under]) == [under]


def wide_group(i: int, segments: int) -> m.GroupPublished:
    """A group whose members' replicas lie on `segments` segments with 64-char ids (~5 KB at 78)."""
    placements = [m.SegmentBytes(f"segment-{s:02d}-" + "x" * 53, 1 << 20) for s in range(segments)]
    group = ChainHash(i.to_bytes(32, "little"))
    return m.GroupPublished(group=group, chunk_index=i, members=64, placements=placements)


def test_a_commits_events_stay_under_nats_payload_limit_however_wide_its_groups() -> None:
    """Review: 256 groups of 64 members on 96 segments (2 replicas: ~78 segments a group) made one
    1.3 MB event; nats-py refuses a publish over 1 MiB and the shard's ordered outbox retried it
    forever. Events are cut by encoded size too; groups stay whole and in order."""
    groups_in = [wide_group(i, 78) for i in range(256)]
    assert len(encode(m.GroupsPublished(groups=groups_in))) > 1 << 20  # one event would not fit
    out = one_event_per_commit([EmitEvent("published", g) for g in groups_in])
    events = [e.event for e in out if isinstance(e, EmitEvent)]
    assert all(isinstance(e, m.GroupsPublished) for e in events) and len(events) > 1
    assert [g for e in events if isinstance(e, m.GroupsPublished) for g in e.groups] == groups_in
    assert max(len(encode(e)) for e in events) <= m.PUBLISHED_BATCH_BYTES_MAX


def test_a_group_larger_than_the_byte_bound_goes_alone() -> None:
    small, big, small_too = wide_group(0, 1), wide_group(1, 8000), wide_group(2, 1)
    assert len(encode(big)) > m.PUBLISHED_BATCH_BYTES_MAX
    out = one_event_per_commit([EmitEvent("published", g) for g in (small, big, small_too)])
    events = [e.event for e in out if isinstance(e, EmitEvent)]
    assert [e.groups for e in events if isinstance(e, m.GroupsPublished)] == [[small], [big], [small_too]]
