"""A write confirmed synchronously (older clients, UCX, repair copies, promotions) whose confirm
is answered `stale_generation` keeps its slot: the ticket's leader was replaced after the slot
was stored (a write fenced before is never stored), so the successor's report listed it and the
successor publishes or frees it, as it does for a background confirm's. Freed, a rebuild that
published the group from the report served a replica that was gone (review, stop 67). Any other
refusal still frees it, a stale segment incarnation's too (review of the fix)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvfabric.core.segment_slots import SlotTable
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import KvfError, NotFound, StaleGeneration
from kvfabric.format.ids import ObjectKey
from kvfabric.proto.directory import WriteTicket
from kvfabric.proto.tickets import sign_ticket
from kvfabric.segment_storage.arena import Arena
from kvfabric.segment_storage.backend import ArenaBackend

SECRET = b"unit-sync-confirm-secret-0123456789"
ARENA_BYTES = 4 << 20


def sync_backend(
    tmp_path: Path, confirm: Callable[..., str], confirm_later: Callable[..., None] | None = None
) -> ArenaBackend:
    """Segment s1, incarnation 3, whose confirms are `confirm` (and `confirm_later`, if any)."""
    return ArenaBackend(
        Arena(tmp_path, "s1", 3, ARENA_BYTES),
        SlotTable(ARENA_BYTES),
        segment_id="s1",
        incarnation=3,
        secret=SECRET,
        confirm=confirm,
        confirm_later=confirm_later,
        clock_ms=lambda: 1_000,
    )


def signed_ticket(data: bytes) -> WriteTicket:
    """A write ticket for `data` on s1, signed with `SECRET`."""
    ticket = WriteTicket(
        ticket_id=1,
        key=ObjectKey(b"k1"),
        segment_id="s1",
        incarnation=3,
        size_bytes=len(data),
        checksum=checksum(data),
        writer_id="w",
        deadline_ms=60_000,
        epoch=1,
    )
    return sign_ticket(ticket, SECRET)


@pytest.mark.parametrize(
    ("refusal", "kept"),
    [
        (StaleGeneration("directory_epoch", 1, 2), True),
        (StaleGeneration("segment_incarnation", 3, 4), False),  # a newer incarnation: no report adopts it
        (NotFound("no such ticket"), False),
    ],
)
def test_a_superseded_confirm_leaves_the_slot_to_the_successor(
    tmp_path: Path, refusal: KvfError, kept: bool
) -> None:
    def confirm(*_: object) -> str:
        raise refusal

    backend = sync_backend(tmp_path, confirm)
    data = b"x" * 4096
    put = backend.begin_put(signed_ticket(data), conn=0)
    put.view[:] = data
    with pytest.raises(type(refusal)):  # the writer hears it all the same
        backend.finish_put(put, conn=0)
    held = [(h.slot, h.checksum) for h in backend.slots.held()]
    assert held == ([(put.slot, checksum(data))] if kept else [])
    assert backend.counters.get("confirm_superseded_total", 0) == (1 if kept else 0)
    backend.slots.check_invariants()
    backend.arena.close()
