"""`O_DIRECT` writes from an unaligned source (a demotion's arena slot) go through a pooled bounce
buffer (`SsdTier.write_buffers`), reused from one write to the next instead of a fresh mapping
faulted in per write, its tail past the object zeroed: no byte of an earlier object reaches the
disk."""

from __future__ import annotations

import os
from pathlib import Path

from kvfabric.proto.segment import SSD_SLOT_BASE
from tests.unit.segment_storage.test_ssd_backend import close, make


def test_demotions_reuse_a_bounce_buffer_and_zero_its_tail(tmp_path: Path) -> None:
    seg = make(tmp_path, direct=True)
    try:
        first = os.urandom(8000)  # not whole blocks: through a bounce buffer, random up to 8000
        seg.demote(seg.store(first, b"key-a"))
        made = seg.ssd.write_buffers.made_total
        assert made >= 1
        second = os.urandom(5000)  # the same 8 KiB extent size: the same buffer again
        ref = seg.demote(seg.store(second, b"key-b"))
        assert seg.ssd.write_buffers.made_total == made and seg.ssd.write_buffers.reused_total >= 1
        assert seg.ssd.write_buffers.lent() == 0  # given back when the write returned
        read = seg.ssd.read(ref.slot, ref.slot_generation, len(second))
        assert read.status == "ok" and read.view is not None and bytes(read.view) == second
        read.release()
        local = ref.slot - SSD_SLOT_BASE
        grant = seg.ssd.table.acquire(local, ref.slot_generation, len(second))
        seg.ssd.table.release(local, ref.slot_generation)
        with open(seg.ssd.path, "rb") as f:
            f.seek(seg.ssd.geometry.data_offset + grant.offset)
            on_disk = f.read(grant.extent_bytes)
        assert on_disk[: len(second)] == second
        assert on_disk[len(second) :] == bytes(grant.extent_bytes - len(second))  # zeroed, not `first`
    finally:
        close(seg)
