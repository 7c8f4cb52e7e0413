"""`replicate_begin_many` / `replica_corrupt_many` (issue 23: a segment's demotion batch in one
round trip each): every item answered exactly as its own single request, in order, with the
same tickets, drops, frees and events; the whole request's checks first (batch size, epoch,
TTL, a live segment), nothing applied when one fails. `check_invariants` after each step."""

from __future__ import annotations

import pytest

from kvfabric.core.directory import DirectoryCore, FreeSlots
from kvfabric.core.directory.frees import batch_frees
from kvfabric.format.errors import BadRequest, BatchTooLarge, StaleGeneration
from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from kvfabric.proto.segment import SSD_SLOT_BASE
from tests.unit.core.dirkit import groups, key, lookup, new_core, one_group_and_a_copy_target, put, register

N = 6


def setup() -> tuple[DirectoryCore, list[ObjectKey]]:
    core = new_core()
    register(core, "s1", capacity=10_000)
    keys = [key(g) for g in groups(N)]
    put(core, keys, size=100)
    return core, keys


def begin_one(core: DirectoryCore, k: ObjectKey, i: int) -> m.ReplicateBeginReply:
    reply = core.handle(
        m.ReplicateBegin(writer_id="demote:s1", request_id=f"r{i}", key=k, segment_id="s1", tier="ssd"), 10
    ).reply
    assert isinstance(reply, m.ReplicateBeginReply)
    return reply


def begin_many(core: DirectoryCore, keys: list[ObjectKey]) -> m.ReplicateBeginManyReply:
    reply = core.handle(
        m.ReplicateBeginMany(
            writer_id="demote:s1",
            segment_id="s1",
            items=[m.ReplicateItem(key=k, request_id=f"r{i}") for i, k in enumerate(keys)],
            tier="ssd",
        ),
        10,
    ).reply
    assert isinstance(reply, m.ReplicateBeginManyReply)
    return reply


def confirm(core: DirectoryCore, replies: list[m.ReplicateBeginReply]) -> None:
    confirms = []
    for i, r in enumerate(replies):
        if r.ticket is not None:
            t = r.ticket
            confirms.append(
                m.ReplicaConfirm(
                    ticket_id=t.ticket_id,
                    key=t.key,
                    slot=SSD_SLOT_BASE + i,
                    slot_generation=1,
                    size_bytes=t.size_bytes,
                    checksum=t.checksum,
                )
            )
    reply = core.handle(m.ConfirmReplicas(segment_id="s1", incarnation=1, confirms=confirms), 10).reply
    assert isinstance(reply, m.ConfirmReply) and {c.status for c in reply.results} == {"ok"}


def test_each_item_is_answered_as_its_own_request() -> None:
    one, keys = setup()
    many, _ = setup()
    unknown = key(groups(1, seed=99)[0])
    asked = [*keys, unknown, keys[0]]  # a key the shard does not hold, and one named twice
    singles = [begin_one(one, k, i) for i, k in enumerate(asked)]
    one.check_invariants()
    batch = begin_many(many, asked)
    many.check_invariants()
    assert batch.replies == singles  # statuses, tickets (ids, signatures), sources: the same
    assert [r.status for r in batch.replies] == ["placed"] * N + ["not_found", "placed"]
    assert batch.replies[-1].ticket == batch.replies[0].ticket  # the same ticket again, as a retry
    assert len(many.replica_table.tickets) == N == len(one.replica_table.tickets)
    assert many.segments["s1"].reserved_bytes == N * 100  # disk tickets reserve no arena bytes

    # Confirmed on disk, then the arena replicas dropped in one request; one group is leased.
    confirm(one, singles[:N])
    confirm(many, batch.replies[:N])
    for core in (one, many):
        lookup(core, groups(1), now=10)  # a lease on the first group: its drop is refused
    arena = {
        k: (r.sources[0].slot, r.sources[0].slot_generation) for k, r in zip(keys, singles[:N], strict=True)
    }
    items = [m.CorruptItem(key=k, slot=arena[k][0], slot_generation=arena[k][1]) for k in keys]
    items.append(items[1])  # named twice: dropped once
    single_out = [
        one.handle(
            m.ReplicaCorrupt(
                segment_id="s1",
                incarnation=1,
                key=it.key,
                slot=it.slot,
                slot_generation=it.slot_generation,
                reason="demoted",
            ),
            11,
        )
        for it in items
    ]
    one.check_invariants()
    out = many.handle(m.ReplicaCorruptMany(segment_id="s1", incarnation=1, items=items, reason="demoted"), 11)
    many.check_invariants()
    assert isinstance(out.reply, m.ReplicaCorruptManyReply)
    expected = []
    for o in single_out:
        assert isinstance(o.reply, m.ReplicaCorruptReply)
        expected.append(o.reply.dropped)
    assert out.reply.dropped == expected == [False] + [True] * (N - 1) + [False]
    assert out.effects == batch_frees([e for o in single_out for e in o.effects])  # one request per segment
    freed = [s for e in out.effects if isinstance(e, FreeSlots) for s in e.slots]
    assert len(freed) == N - 1
    assert many.segments["s1"].reserved_bytes == one.segments["s1"].reserved_bytes  # freed once acknowledged
    assert many.counters == one.counters


def test_whole_request_checks_apply_to_none() -> None:
    core, keys = setup()
    too_many = [keys[0]] * (m.REPLICA_BATCH_MAX + 1)
    with pytest.raises(BatchTooLarge):
        begin_many(core, too_many)
    with pytest.raises(BadRequest):  # a TTL out of range: for every item
        core.handle(
            m.ReplicateBeginMany(
                writer_id="demote:s1",
                segment_id="s1",
                items=[m.ReplicateItem(key=k, request_id="r") for k in keys],
                write_ttl_ms=0,
                tier="ssd",
            ),
            10,
        )
    assert not core.replica_table.tickets  # nothing applied
    items = [m.CorruptItem(key=k, slot=0, slot_generation=1) for k in keys]
    with pytest.raises(BatchTooLarge):
        core.handle(
            m.ReplicaCorruptMany(
                segment_id="s1", incarnation=1, items=items * (m.REPLICA_BATCH_MAX // N + 1), reason="demoted"
            ),
            10,
        )
    with pytest.raises(StaleGeneration):  # not the live incarnation: nothing dropped
        core.handle(m.ReplicaCorruptMany(segment_id="s1", incarnation=7, items=items, reason="demoted"), 10)
    core.check_invariants()
    assert core.counters.get("replicas_dropped_total", 0) == 0


def test_a_copys_source_tokens_live_no_longer_than_a_lease() -> None:
    """A copy's source read tokens lasted its write TTL (up to 600 s), past the wait a drained
    replica's drop gives its readers (`lease_ttl_ms_max` + skew): now at most a lease's."""
    core = new_core(lease_ttl_ms_max=60_000)
    g, other = one_group_and_a_copy_target(core)
    begin = m.ReplicateBegin(
        writer_id="repair", request_id="1", key=key(g), segment_id=other, write_ttl_ms=600_000
    )
    reply = core.handle(begin, 1_000).reply
    assert isinstance(reply, m.ReplicateBeginReply) and reply.status == "placed" and reply.sources
    assert all(s.read_expires_ms == 1_000 + 60_000 for s in reply.sources)
    assert reply.ticket is not None and reply.ticket.deadline_ms == 1_000 + 600_000  # the write keeps its TTL
