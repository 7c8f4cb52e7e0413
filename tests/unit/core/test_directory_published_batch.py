"""One `published` event per put_commit (issue 20): what the directory core emits for a commit."""

from __future__ import annotations

from kvfabric.core.directory import DirectoryCore, EmitEvent, Outcome
from kvfabric.core.directory.keys import chain_of
from kvfabric.core.directory.writes import one_event_per_commit
from kvfabric.format.ids import ChainHash, ObjectKey
from kvfabric.proto import directory as m

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
