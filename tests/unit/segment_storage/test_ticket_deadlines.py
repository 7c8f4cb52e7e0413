"""A write ticket used again after its slot was aborted keeps one deadline entry (review,
2026-12-06): each `begin_put` appended one, so a holder PUTting wrong bytes on one ticket in a
loop grew the deque at its request rate until the ticket's deadline."""

from __future__ import annotations

import os
from pathlib import Path

from .test_ssd_backend import close, make, signed_ticket


def test_reusing_one_ticket_keeps_one_deadline_entry(tmp_path: Path) -> None:
    seg = make(tmp_path)
    try:
        ticket = signed_ticket(os.urandom(4096), b"loop", ticket_id=77)
        for _ in range(1000):  # (as a PUT of wrong bytes: ChecksumMismatch aborts, the ticket may go again)
            put = seg.backend.begin_put(ticket, conn=1)
            seg.backend.abort_put(put, conn=1)
        assert len(seg.backend._ticket_deadlines) == 1
    finally:
        close(seg)
