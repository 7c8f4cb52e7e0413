"""One tenant's disk reads in flight leave a quarter of the read budget to the others (review,
2026-12-06): a reader that took its GET's replies slowly held the whole `read_bytes_max` for the
transfer's deadline (minutes), and every other tenant's disk GETs were `busy` meanwhile. A lone
tenant (tenants off: every key is one domain's) still uses three quarters; the segment's own
reads (`verify`) are no tenant's."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from kvfabric.core.disk_records import BLOCK_BYTES
from kvfabric.core.quotas import DOMAIN_DIGEST
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import Busy
from kvfabric.segment_storage.ssd import (
    IO_TENANT_SHARE_DIVISOR,
    READ_TENANT_SHARE_DIVISOR,
    SsdIo,
    SsdRead,
    SsdStream,
    SsdTier,
)

from .test_ssd_backend import SEGMENT

OBJECT = 4 * BLOCK_BYTES
BUDGET = 4 * READ_TENANT_SHARE_DIVISOR * OBJECT  # 16 objects; a tenant's most: 12


def key_of(tenant: bytes, i: int) -> bytes:
    key = bytearray(96)
    key[DOMAIN_DIGEST] = tenant.ljust(DOMAIN_DIGEST.stop - DOMAIN_DIGEST.start, b"-")
    key[-1] = i
    return bytes(key)


def test_a_tenant_leaves_a_quarter_to_the_others_and_they_still_read(tmp_path: Path) -> None:
    io = SsdIo(0, 64, BLOCK_BYTES)
    tier = SsdTier(tmp_path / "ssd", SEGMENT, 1 << 24, 64, direct=False, io=io, read_bytes_max=BUDGET)
    held: list[SsdRead] = []  # reads whose replies are not taken (their buffers lent)
    try:
        stored = {}
        for tenant, n in ((b"alice", 4), (b"bob", 14)):
            for i in range(n):
                data = os.urandom(OBJECT)
                stored[tenant, i] = (*tier.write(memoryview(data), key_of(tenant, i), checksum(data)), data)

        def read(tenant: bytes, i: int) -> SsdRead:
            slot, generation, data = stored[tenant, i]
            got = tier.read(slot, generation, len(data))
            assert got.status == "ok" and got.view is not None and bytes(got.view) == data
            return got

        held += [read(b"bob", i) for i in range(12)]  # three quarters: bob alone may
        with pytest.raises(Busy, match="share"):
            read(b"bob", 12)
        held += [read(b"alice", i) for i in range(4)]  # the quarter left is alice's to read
        held.pop(0).release()
        held.append(read(b"bob", 12))  # bob again, once one of his ended
    finally:
        for one in held:
            one.release()
        assert tier.read_bytes_in_flight == 0 and tier._read_bytes_by_tenant == {}
        tier.close()
        io.close()


def test_the_segments_own_reads_are_no_tenants(tmp_path: Path) -> None:
    io = SsdIo(0, 64, BLOCK_BYTES)
    tier = SsdTier(tmp_path / "ssd", SEGMENT, 1 << 24, 64, direct=False, io=io, read_bytes_max=BUDGET)
    held: list[SsdRead] = []
    try:
        objects = []
        for i in range(13):
            data = os.urandom(OBJECT)
            objects.append((*tier.write(memoryview(data), key_of(b"bob", i), checksum(data)), data))
        for slot, generation, data in objects[:12]:
            held.append(tier.read(slot, generation, len(data)))  # bob at his most
        slot, generation, data = objects[12]
        assert tier.verify(slot, generation, len(data)) == "ok"  # a demotion's check: not bob's
    finally:
        for one in held:
            one.release()
        assert tier.read_bytes_in_flight == 0 and tier._read_bytes_by_tenant == {}
        tier.close()
        io.close()


def test_a_tenants_first_read_keeps_to_its_share_unless_nothing_is_in_flight(tmp_path: Path) -> None:
    """The share applied only once a tenant held bytes: its first read of most of the budget was
    let through while others read, and held it for the transfer's deadline (review, stop 70).
    One read may still take more than the share when none is in flight (a large object)."""
    io = SsdIo(0, 64, BLOCK_BYTES)
    tier = SsdTier(tmp_path / "ssd", SEGMENT, 1 << 24, 64, direct=False, io=io, read_bytes_max=BUDGET)
    held: list[SsdRead] = []
    try:
        big = os.urandom(13 * OBJECT)  # past a tenant's share (12 objects)
        slot_big, gen_big = tier.write(memoryview(big), key_of(b"alice", 0), checksum(big))
        small = os.urandom(OBJECT)
        slot_small, gen_small = tier.write(memoryview(small), key_of(b"bob", 0), checksum(small))
        held.append(tier.read(slot_small, gen_small, len(small)))  # bob reads
        with pytest.raises(Busy, match="share"):
            tier.read(slot_big, gen_big, len(big))  # alice's first read: past her share
        held.pop().release()
        alone = tier.read(slot_big, gen_big, len(big))  # nothing in flight: it may
        assert alone.status == "ok" and alone.view is not None and bytes(alone.view) == big
        held.append(alone)
    finally:
        for one in held:
            one.release()
        assert tier.read_bytes_in_flight == 0 and tier._read_bytes_by_tenant == {}
        tier.close()
        io.close()


def test_a_tenant_leaves_a_quarter_of_the_io_queues_pieces_to_the_others(tmp_path: Path) -> None:
    """The byte share did not bound pieces: one tenant's GETs of many small disk objects (one
    piece each, far below its bytes) filled every slot of the I/O queue, and every other tenant's
    disk reads were `busy` meanwhile. While another tenant reads, its pieces stop at three
    quarters of the queue (busy, counted), and the other tenant still gets in; alone, it may go
    past them (its own earlier pieces are no other tenant's reads)."""
    queue_max = 2 * IO_TENANT_SHARE_DIVISOR  # 8 pieces; a tenant's most: 6
    io = SsdIo(1, queue_max, BLOCK_BYTES)
    tier = SsdTier(tmp_path / "ssd", SEGMENT, 1 << 24, 64, direct=False, io=io, read_bytes_max=1 << 24)
    held: list[SsdRead | SsdStream] = []
    try:
        stored = {}
        for tenant, n in ((b"alice", 3), (b"bob", 8)):
            for i in range(n):
                data = os.urandom(BLOCK_BYTES)  # one piece
                stored[tenant, i] = (*tier.write(memoryview(data), key_of(tenant, i), checksum(data)), data)

        def start(tenant: bytes, i: int) -> SsdStream:
            # streamed, its one piece left for the sender to read: in the queue until released
            slot, generation, data = stored[tenant, i]
            got = tier.read_stream(slot, generation, len(data))
            assert isinstance(got, SsdStream)
            return got

        most = queue_max - queue_max // IO_TENANT_SHARE_DIVISOR
        alices = start(b"alice", 0)  # another tenant reads
        held += [start(b"bob", i) for i in range(most)]
        assert io.pieces_in_flight == most + 1 and tier.read_bytes_in_flight == (most + 1) * BLOCK_BYTES
        with pytest.raises(Busy, match="share"):
            start(b"bob", most)  # the queue has room, his bytes too: his share of pieces not
        slot, generation, data = stored[b"bob", most]
        with pytest.raises(Busy, match="share"):
            tier.read(slot, generation, len(data))  # a whole read too
        assert io.busy_tenant_total == 2 and tier.all_counters()["ssd_io_busy_tenant_total"] == 2
        assert io.busy_total == 0
        slot, generation, data = stored[b"alice", 1]
        alone = tier.read(slot, generation, len(data))  # the quarter left is the others'
        assert alone.status == "ok" and alone.view is not None and bytes(alone.view) == data
        alone.release()
        alices.release()  # no other tenant's pieces in flight: bob may go past his share
        held.append(start(b"bob", most))
        assert io.pieces_in_flight == most + 1 and io.busy_tenant_total == 2
        held.append(start(b"alice", 2))  # the last piece of the queue
        with pytest.raises(Busy, match="full"):
            start(b"bob", most + 1)  # the queue's own bound
        assert io.busy_total == 1 and io.busy_tenant_total == 2
    finally:
        for one in held:
            one.release()
        assert io.pieces_in_flight == 0 and io._pieces_by_owner == {} and io._owned_pieces == 0
        tier.close()
        io.close()


class GatedIo(SsdIo):
    """Pieces wait at a gate (a slow disk) until `gate` is set: every piece queued stays in flight."""

    def __init__(self, threads: int, queue_max: int, chunk_bytes: int) -> None:
        super().__init__(threads, queue_max, chunk_bytes)
        self.gate = threading.Event()
        self.gate.set()

    def _piece(self, fd: int, view: memoryview, offset: int, write: bool) -> None:
        assert self.gate.wait(60), "the test never opened the gate"
        super()._piece(fd, view, offset, write)


def test_one_get_of_more_disk_objects_than_a_share_is_not_busy_alone(tmp_path: Path) -> None:
    """A GET's own earlier disk objects counted against its tenant's piece share: one GET of 200
    one-piece objects (the default queue of 256, a share of 192) was `busy` at its 193rd object
    with no other tenant reading — with tenants off, every GET of that many. A write in flight
    (a demotion: no tenant's) does not make the share apply either."""
    io = GatedIo(8, 256, 1 << 20)
    tier = SsdTier(tmp_path / "ssd", SEGMENT, 1 << 26, 512, direct=False, io=io, read_bytes_max=256 << 20)
    held: list[SsdStream] = []
    writer: threading.Thread | None = None
    try:
        objects = []
        for i in range(200):
            data = os.urandom(16 << 10)  # one piece each
            objects.append((*tier.write(memoryview(data), key_of(b"alice", i), checksum(data)), data))
        io.gate.clear()  # the disk holds every piece from here
        demotion = os.urandom(16 << 10)
        writer = threading.Thread(
            target=tier.write, args=(memoryview(demotion), key_of(b"segment", 0), checksum(demotion))
        )
        writer.start()
        deadline = time.monotonic() + 60
        while io.pieces_in_flight < 1:  # the write's piece is in flight
            assert time.monotonic() < deadline
            time.sleep(0.001)
        for n, (slot, generation, data) in enumerate(objects):  # as `backend_reads` sends one GET
            got = tier.read_stream(slot, generation, len(data), inline_first=n == 0, alone=False)
            assert isinstance(got, SsdStream)
            held.append(got)
        assert io.pieces_in_flight == 201 and io.busy_tenant_total == 0 and io.busy_total == 0
        io.gate.set()
        for got, (_, _, data) in zip(held, objects, strict=True):
            assert got.wait(len(data)) >= len(data) and got.verdict()
            assert got.view is not None and bytes(got.view) == data
    finally:
        io.gate.set()
        if writer is not None:
            writer.join(60)
        for one in held:
            one.release()
        tier.close()
        io.close()
