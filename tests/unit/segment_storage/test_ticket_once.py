"""One write ticket holds one slot (review, 2026-12-05): a writer could PUT the same ticket again
and again, a new slot each time (N times the bytes its tenant was charged for once, held until
the ticket's deadline), and the confirm batcher matched verdicts by ticket id, so two confirms of
one ticket both got the last one's verdict (a slot the directory never took was kept)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Literal

import pytest

from kvfabric.format.errors import Conflict
from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from kvfabric.segment_storage.confirms import ConfirmBatcher

from .test_ssd_backend import INCARNATION, SEGMENT, make, signed_ticket


def test_a_ticket_holding_a_slot_is_refused_a_second_one(tmp_path: Path) -> None:
    seg = make(tmp_path)
    backend = seg.backend
    try:
        data = os.urandom(4096)
        ticket = signed_ticket(data, b"once", ticket_id=5)
        first = backend.begin_put(ticket, conn=0)
        with pytest.raises(Conflict, match="already holds a slot"):
            backend.begin_put(ticket, conn=1)  # still writing
        first.view[:] = data
        backend.finish_put(first, conn=0)
        with pytest.raises(Conflict, match="already holds a slot"):
            backend.begin_put(ticket, conn=1)  # stored
        used = backend.slots.used_bytes
        assert backend.counters["ticket_reused_total"] == 2
        # its slot gone (freed: a repair's copy asked again): the ticket may be used once more
        backend.free_slots([(first.slot, first.slot_generation)])
        again = backend.begin_put(ticket, conn=0)
        backend.abort_put(again, conn=0)
        assert backend.slots.used_bytes < used
    finally:
        seg.backend.arena.close()
        seg.io.close()
        seg.ssd.close()


def test_two_confirms_of_one_ticket_get_their_own_verdicts() -> None:
    async def send(message: m.ConfirmReplicas, trace_id: str) -> m.ConfirmReply:
        statuses: list[Literal["ok", "unknown_ticket", "mismatch", "pending"]] = [
            "unknown_ticket",
            "ok",
        ]  # in order
        return m.ConfirmReply(
            epoch=1,
            results=[
                m.ConfirmResult(ticket_id=c.ticket_id, status=s)
                for c, s in zip(message.confirms, statuses, strict=True)
            ],
        )

    async def main() -> list[str]:
        batcher = ConfirmBatcher(SEGMENT, INCARNATION, send)
        confirms = [
            m.ReplicaConfirm(
                ticket_id=9, key=ObjectKey(b"k"), slot=slot, slot_generation=1, size_bytes=10, checksum=b""
            )
            for slot in (1, 2)
        ]
        futures = [batcher.submit(0, 1, c, "t", shared=True) for c in confirms]
        return list(await asyncio.gather(*futures))

    assert asyncio.run(main()) == ["unknown_ticket", "ok"]  # before: ["ok", "ok"]
