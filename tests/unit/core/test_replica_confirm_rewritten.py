"""A replica copy confirmed after its object was evicted and saved again under the same key with
other bytes is not added to the new object (review, 2026-12-06): the confirm checked the copy
against its ticket's checksum only, so the new member got a replica holding the old bytes."""

from __future__ import annotations

from kvfabric.core.directory import FreeSlots
from kvfabric.proto import directory as m
from tests.unit.core.dirkit import groups, key, new_core, register


def test_a_copy_of_the_old_bytes_is_not_added_to_an_object_saved_again() -> None:
    core = new_core()
    register(core, "s1")
    register(core, "s2")
    group = groups(1)[0]
    k = key(group)

    def save(checksum: bytes, request_id: str, now: int) -> None:
        spec = m.ObjectSpec(key=k, size_bytes=100, checksum=checksum)
        begin = core.handle(m.PutBegin(writer_id="w", request_id=request_id, objects=[spec]), now).reply
        assert isinstance(begin, m.PutBeginReply) and begin.results[0].status == "placed"
        (t,) = begin.results[0].tickets
        confirm = m.ReplicaConfirm(
            ticket_id=t.ticket_id, key=k, slot=7, slot_generation=now, size_bytes=100, checksum=checksum
        )
        core.handle(m.ConfirmReplicas(segment_id=t.segment_id, incarnation=1, confirms=[confirm]), now)
        commit = core.handle(m.PutCommit(writer_id="w", request_id=request_id + "c", keys=[k]), now).reply
        assert isinstance(commit, m.PutCommitReply) and commit.results[0].status == "published"

    save(b"A" * 16, "r1", 1)
    copy = core.handle(
        m.ReplicateBegin(writer_id="repair", request_id="x", key=k, segment_id="s2", tier="dram"), 2
    ).reply
    assert isinstance(copy, m.ReplicateBeginReply) and copy.ticket is not None
    old = copy.ticket
    evicted = core.handle(m.Evict(groups=[group.group_id()]), 3)
    assert isinstance(evicted.reply, m.EvictReply) and evicted.reply.results[0].status == "evicting"
    for effect in evicted.effects:
        if isinstance(effect, FreeSlots):  # the segment freed the evicted slots
            core.handle(
                m.SlotsFreed(segment_id=effect.segment_id, incarnation=1, freed=list(effect.slots)), 4
            )
    save(b"B" * 16, "r2", 5)  # the same key, other bytes
    late = m.ReplicaConfirm(
        ticket_id=old.ticket_id, key=k, slot=9, slot_generation=1, size_bytes=100, checksum=old.checksum
    )
    reply = core.handle(m.ConfirmReplicas(segment_id="s2", incarnation=1, confirms=[late]), 6).reply
    assert isinstance(reply, m.ConfirmReply) and reply.results[0].status == "unknown_ticket"
    shown = core.handle(m.ShowGroup(group=group.group_id()), 7).reply
    assert isinstance(shown, m.GroupList)
    (member,) = shown.groups[0].objects
    assert len(member.replicas) == 1  # the new save's only
    core.check_invariants()
