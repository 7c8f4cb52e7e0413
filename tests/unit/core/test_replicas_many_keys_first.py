"""`replica_corrupt_many` / `replicate_begin_many` validate every item's key before applying any:
a malformed key anywhere refuses the request with nothing applied (their docstring). Before
(review) each key was parsed as its item ran: a bad key later in the batch raised `BadRequest`
after the earlier items' drops (frees sent) or tickets (bytes reserved) were applied."""

from __future__ import annotations

import pytest

from kvfabric.core.directory import DirectoryCore
from kvfabric.format.errors import BadRequest
from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from kvfabric.proto.segment import SSD_SLOT_BASE
from tests.unit.core.dirkit import groups, key, new_core, put, register


def bad_key(k: ObjectKey) -> ObjectKey:
    """The right length, a field out of range (fails the key's full validation only)."""
    bad = bytearray(k)
    bad[-1] ^= 0xFF
    return ObjectKey(bytes(bad))


def demoted() -> tuple[DirectoryCore, ObjectKey]:
    """One object on s1 with an arena replica and a disk replica (a drop of the arena one is allowed)."""
    core = new_core()
    register(core, "s1")
    (g,) = groups(1, seed=9)
    k = key(g)
    put(core, [k])
    begun = core.handle(
        m.ReplicateBegin(writer_id="demote:s1", request_id="d", key=k, segment_id="s1", tier="ssd"), 0
    ).reply
    assert isinstance(begun, m.ReplicateBeginReply) and begun.ticket is not None
    t = begun.ticket
    confirm = m.ReplicaConfirm(
        ticket_id=t.ticket_id,
        key=k,
        slot=SSD_SLOT_BASE + 5,
        slot_generation=1,
        size_bytes=t.size_bytes,
        checksum=t.checksum,
    )
    core.handle(m.ConfirmReplicas(segment_id="s1", incarnation=1, confirms=[confirm]), 0)
    core.check_invariants()
    return core, k


def test_a_bad_key_in_a_drop_batch_drops_nothing() -> None:
    core, k = demoted()
    found = core.published_table.published_member(k)
    assert found is not None
    before = found[2].replicas
    (arena,) = [r for r in before if r.slot < SSD_SLOT_BASE]
    items = [
        m.CorruptItem(key=k, slot=arena.slot, slot_generation=arena.slot_generation),  # a valid drop
        m.CorruptItem(key=bad_key(k), slot=1, slot_generation=1),
    ]
    with pytest.raises(BadRequest):
        core.handle(m.ReplicaCorruptMany(segment_id="s1", incarnation=1, items=items, reason="demoted"), 0)
    core.check_invariants()
    found = core.published_table.published_member(k)
    assert found is not None and found[2].replicas == before  # item 0 not applied
    assert not core._freeing
    assert core.counters.get("replicas_dropped_total", 0) == 0


def test_a_bad_key_in_a_copy_batch_places_nothing() -> None:
    core = new_core()
    register(core, "s1")
    ks = [key(g) for g in groups(2, seed=3)]
    put(core, ks)
    register(core, "s2")
    items = [
        m.ReplicateItem(key=ks[0], request_id="c0"),
        m.ReplicateItem(key=bad_key(ks[1]), request_id="c1"),
    ]
    with pytest.raises(BadRequest):
        core.handle(m.ReplicateBeginMany(writer_id="repair", segment_id="s2", items=items), 0)
    core.check_invariants()
    assert not core.replica_table.tickets  # item 0 not applied
    assert core.segments["s2"].reserved_bytes == 0


def test_a_tenants_scoped_writer_id_is_refused_a_copy() -> None:
    """replicate_begin is a service verb: a tenant's scoped writer id (`<tenant>/<writer>`) is
    refused before anything is applied, single or batched. A tenant's put_abort skips the ticket
    index on the strength of it (`replicas`, "Finding a key's tickets")."""
    core = new_core()
    register(core, "s1")
    ks = [key(g) for g in groups(2, seed=4)]
    put(core, ks)
    register(core, "s2")
    with pytest.raises(BadRequest, match="service"):
        core.handle(m.ReplicateBegin(writer_id="bob/w", request_id="c", key=ks[0], segment_id="s2"), 0)
    items = [m.ReplicateItem(key=k, request_id=f"c{i}") for i, k in enumerate(ks)]
    with pytest.raises(BadRequest, match="service"):
        core.handle(m.ReplicateBeginMany(writer_id="bob/w", segment_id="s2", items=items), 0)
    core.check_invariants()
    assert not core.replica_table.tickets
    assert core.segments["s2"].reserved_bytes == 0
    # a service's own writer id is placed
    placed = core.handle(m.ReplicateBegin(writer_id="repair", request_id="c", key=ks[0], segment_id="s2"), 0)
    assert isinstance(placed.reply, m.ReplicateBeginReply) and placed.reply.status == "placed"
