"""A write or copy whose synchronous confirm gets no verdict in time keeps its slot and is
confirmed again in the background (review, stop 68): the directory may have applied the confirm
(slow, its answer late), and for a repair or prefetch copy that made the slot a replica of a
published group; freed at once, the record named a slot that was gone (readers got
`stale_generation`, repair counted the replica healthy). Without background confirms (or once
they stopped) the slot is freed as before."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfabric.format.checksum import checksum
from kvfabric.format.errors import Indeterminate, Unavailable
from kvfabric.proto.directory import WriteTicket
from kvfabric.segment_storage.backend import ArenaBackend
from tests.unit.segment_storage.test_sync_confirm_superseded import signed_ticket, sync_backend

DATA = b"y" * 4096


def _backend(
    tmp_path: Path, later: list[tuple[int, int]] | None, later_stopped: bool = False
) -> ArenaBackend:
    def confirm(*_: object) -> str:
        raise Indeterminate("no confirm verdict in time")

    def confirm_later(ticket: WriteTicket, slot: int, generation: int, trace_id: str = "") -> None:
        if later_stopped:
            raise Unavailable("the segment stopped confirming")
        assert later is not None and ticket.checksum == checksum(DATA)
        later.append((slot, generation))

    return sync_backend(tmp_path, confirm, None if later is None else confirm_later)


@pytest.mark.parametrize(("background", "stopped"), [(True, False), (False, False), (True, True)])
def test_a_confirm_without_a_verdict_keeps_the_slot_for_the_background_confirm(
    tmp_path: Path, background: bool, stopped: bool
) -> None:
    later: list[tuple[int, int]] | None = [] if background else None
    backend = _backend(tmp_path, later, later_stopped=stopped)
    kept = background and not stopped

    def fetch(view: memoryview) -> None:
        view[:] = DATA

    with pytest.raises(Indeterminate):  # the copier hears it all the same (and aborts its ticket)
        backend.copy_in(signed_ticket(DATA), fetch)
    held = [h.slot for h in backend.slots.held()]
    assert len(held) == (1 if kept else 0)
    if kept:
        assert later == [(held[0], backend.slots.held()[0].generation)]  # confirmed again later
        backend.unconfirmed(held[0], later[0][1], "unknown_ticket")  # the abort came first: freed then
        assert backend.slots.held() == []
    assert backend.counters.get("confirm_indeterminate_kept_total", 0) == (1 if kept else 0)
    backend.slots.check_invariants()
    backend.arena.close()
