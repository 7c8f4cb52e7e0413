"""Replica tickets are found by key (`ReplicaTable._by_key`): a put_abort or a retried
replicate_begin looks at that key's tickets only, never at every copy in flight (review: a
tenant's 256-key put_abort scanned all 10,000 replica tickets of the shard per key, 343 ms; a
`ReplicateBeginMany` was quadratic). A tenant's scoped writer never holds a copy, so its abort
does not look at the table at all. `check_invariants` (which checks the index) after each step."""

from __future__ import annotations

from typing import Any

import pytest

from kvfabric.core.directory import DirectoryCore
from kvfabric.core.directory.replicas import ReplicaTicket
from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from kvfabric.proto.segment import SSD_SLOT_BASE
from tests.unit.core.dirkit import groups, key, new_core, put, register

COPIES = 64
WRITE_TTL_MS = 30_000  # a copy's default deadline


class CountingTickets(dict[int, ReplicaTicket]):
    """The ticket table, counting every walk through it."""

    walks = 0

    def items(self) -> Any:
        CountingTickets.walks += 1
        return super().items()

    def values(self) -> Any:
        CountingTickets.walks += 1
        return super().values()

    def keys(self) -> Any:
        CountingTickets.walks += 1
        return super().keys()

    def __iter__(self) -> Any:
        CountingTickets.walks += 1
        return super().__iter__()


def copying() -> tuple[DirectoryCore, list[ObjectKey]]:
    """64 published objects on s1, each being copied to s2's disk tier by a service."""
    core = new_core()
    register(core, "s1", capacity=1 << 30)
    keys = [key(g) for g in groups(COPIES, seed=1)]
    put(core, keys)
    register(core, "s2", capacity=1 << 30)
    reply = begin_copies(core, keys)
    assert all(r.status == "placed" for r in reply.replies)
    assert len(core.replica_table.tickets) == COPIES
    core.check_invariants()
    return core, keys


def begin_copies(core: DirectoryCore, keys: list[ObjectKey]) -> m.ReplicateBeginManyReply:
    reply = core.handle(
        m.ReplicateBeginMany(
            writer_id="demote:s2",
            segment_id="s2",
            items=[m.ReplicateItem(key=k, request_id=f"c{i}") for i, k in enumerate(keys)],
            tier="ssd",
        ),
        0,
    ).reply
    assert isinstance(reply, m.ReplicateBeginManyReply)
    return reply


def counting(core: DirectoryCore) -> None:
    core.replica_table.tickets = CountingTickets(core.replica_table.tickets)
    CountingTickets.walks = 0


def abort(core: DirectoryCore, writer: str, keys: list[ObjectKey]) -> int:
    reply = core.handle(m.PutAbort(writer_id=writer, request_id="a", keys=keys), 0).reply
    assert isinstance(reply, m.PutAbortReply)
    return reply.aborted


def test_a_tenants_put_abort_never_walks_the_replica_tickets(monkeypatch: pytest.MonkeyPatch) -> None:
    core, _ = copying()
    counting(core)
    asked: list[bytes] = []

    def abort_copies(k: bytes, writer_id: str) -> int:
        asked.append(k)
        return 0

    monkeypatch.setattr(core.replica_table, "abort", abort_copies)
    other = [key(g) for g in groups(256, seed=2)]  # keys the tenant's writer does not hold
    assert abort(core, "bob/w", other) == 0
    assert CountingTickets.walks == 0
    assert asked == []  # a tenant's writer holds no copy: the table is not even asked
    assert len(core.replica_table.tickets) == COPIES
    core.check_invariants()


def test_a_services_put_abort_looks_at_its_keys_copies_only() -> None:
    core, keys = copying()
    counting(core)
    other = [key(g) for g in groups(256, seed=2)]
    assert abort(core, "demote:s2", other) == 0  # no copy of these keys
    assert abort(core, "repair", keys[:8]) == 0  # another service's copies stay
    assert CountingTickets.walks == 0
    assert abort(core, "demote:s2", keys[:8]) == 8  # its own copies go, reservations with them
    assert CountingTickets.walks == 0
    assert len(core.replica_table.tickets) == COPIES - 8
    core.check_invariants()


def test_a_retried_copy_batch_finds_its_tickets_without_a_walk() -> None:
    core, keys = copying()
    first = set(core.replica_table.tickets)
    counting(core)
    again = begin_copies(core, keys)  # a retry: the same tickets, one each
    assert {r.ticket.ticket_id for r in again.replies if r.ticket is not None} == first
    assert CountingTickets.walks == 0
    assert len(core.replica_table.tickets) == COPIES
    core.check_invariants()


def test_the_key_index_follows_confirms_and_expiry() -> None:
    core, keys = copying()
    tickets = sorted(core.replica_table.tickets.items())
    ticket_id, rt = tickets[0]
    confirm = m.ReplicaConfirm(
        ticket_id=ticket_id,
        key=rt.key,
        slot=SSD_SLOT_BASE + 1,  # a disk slot, as the ticket's tier
        slot_generation=1,
        size_bytes=rt.size_bytes,
        checksum=rt.checksum,
    )
    out = core.handle(m.ConfirmReplicas(segment_id="s2", incarnation=1, confirms=[confirm]), 0).reply
    assert isinstance(out, m.ConfirmReply) and out.results[0].status == "ok"
    core.check_invariants()
    assert rt.key not in core.replica_table._by_key
    assert len(core.replica_table._by_key) == len(keys) - 1
    core.tick(WRITE_TTL_MS)  # every other copy's deadline passes
    assert not core.replica_table.tickets and not core.replica_table._by_key
    core.check_invariants()
