"""One tenant's disk reads in flight leave a quarter of the read budget to the others (review,
2026-12-06): a reader that took its GET's replies slowly held the whole `read_bytes_max` for the
transfer's deadline (minutes), and every other tenant's disk GETs were `busy` meanwhile. A lone
tenant (tenants off: every key is one domain's) still uses three quarters; the segment's own
reads (`verify`) are no tenant's. Likewise a quarter of the disk I/O queue's pieces, whether or
not another tenant reads; a streamed GET of more one-piece disk objects than a tenant's share of
them waits, bounded, for its own earlier objects to be read instead of failing."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvfabric.core.disk_records import BLOCK_BYTES
from kvfabric.core.quotas import DOMAIN_DIGEST
from kvfabric.core.segment_slots import SlotTable
from kvfabric.dataplane.backend import GetGrant
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import Busy
from kvfabric.proto.dataplane import ReadRef
from kvfabric.segment_storage import backend_reads
from kvfabric.segment_storage.arena import Arena
from kvfabric.segment_storage.backend import ArenaBackend
from kvfabric.segment_storage.ssd import (
    IO_TENANT_SHARE_DIVISOR,
    READ_TENANT_SHARE_DIVISOR,
    SsdIo,
    SsdRead,
    SsdStream,
    SsdTier,
)

from .test_ssd_backend import ARENA_BYTES, INCARNATION, NOW_MS, SECRET, SEGMENT, signed

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


def test_a_tenant_alone_stops_at_its_share_of_the_queue_and_the_others_get_in() -> None:
    """Applied only while another tenant had pieces in flight, the share let a tenant reading alone
    take all 256 slots: a second tenant's read, and the segment's own demotion write, were then
    `queue full` until that burst drained. A tenant holds at most 192 now, alone or not."""
    io = SsdIo(0, 256, 1 << 20)
    most = 256 - 256 // IO_TENANT_SHARE_DIVISOR
    for _ in range(most):
        io._admit(1, b"alice")
    with pytest.raises(Busy, match="share"):
        io._admit(1, b"alice")  # alone, at her share
    assert most == io.share_pieces == 192 and io.pieces_in_flight == 192 and io.busy_tenant_total == 1
    io._admit(1, b"bob")  # another tenant gets in
    io._admit(1, None)  # and a demotion's write
    assert io.pieces_in_flight == 194 and io.busy_total == 0


def test_a_tenant_leaves_a_quarter_of_the_io_queues_pieces_to_the_others(tmp_path: Path) -> None:
    """The byte share did not bound pieces: one tenant's GETs of many small disk objects (one
    piece each, far below its bytes) filled every slot of the I/O queue, and every other tenant's
    disk reads were `busy` meanwhile. Its pieces stop at three quarters of the queue (busy,
    counted) even while it reads alone; another tenant, a demotion's write and the segment's own
    check still get in."""
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
        held += [start(b"bob", i) for i in range(most)]  # bob alone
        assert io.pieces_in_flight == most and tier.read_bytes_in_flight == most * BLOCK_BYTES
        with pytest.raises(Busy, match="share"):
            start(b"bob", most)  # the queue has room, his bytes too, no one else reads: his share not
        slot, generation, data = stored[b"bob", most]
        with pytest.raises(Busy, match="share"):
            tier.read(slot, generation, len(data))  # a whole read too
        assert io.busy_tenant_total == 2 and tier.all_counters()["ssd_io_busy_tenant_total"] == 2
        assert io.busy_total == 0
        held.append(start(b"alice", 0))  # the quarter left: another tenant reads
        slot, generation, data = stored[b"alice", 1]
        alone = tier.read(slot, generation, len(data))
        assert alone.status == "ok" and alone.view is not None and bytes(alone.view) == data
        alone.release()
        demotion = os.urandom(BLOCK_BYTES)  # the segment's own write (no tenant's) lands
        demoted = tier.write(memoryview(demotion), key_of(b"carol", 0), checksum(demotion))
        assert tier.verify(*demoted, len(demotion)) == "ok"  # and its own check
        held.append(start(b"alice", 2))  # the last piece of the queue
        assert io.pieces_in_flight == queue_max
        with pytest.raises(Busy, match="full"):
            tier.verify(*demoted, len(demotion))  # the queue's own bound
        assert io.busy_total == 1 and io.busy_tenant_total == 2
        held.pop(0).release()
        held.append(start(b"bob", most))  # bob again, once one of his pieces left the queue
    finally:
        for one in held:
            one.release()
        assert io.pieces_in_flight == 0 and io._pieces_by_owner == {} and io._owned_pieces == 0
        tier.close()
        io.close()


def test_a_read_past_its_share_waits_for_its_tenants_pieces_until_its_deadline() -> None:
    """A read that may wait (`wait_until`) is admitted once one of its tenant's pieces ends, and
    is `Busy` at its deadline when none does; the queue's own bound never waits."""
    io = SsdIo(0, 8, BLOCK_BYTES)  # a tenant's most: 6
    for _ in range(8 - 8 // IO_TENANT_SHARE_DIVISOR):
        io._admit(1, b"alice")
    started = time.monotonic()
    with pytest.raises(Busy, match="share"):
        io._admit(1, b"alice", time.monotonic() + 0.05)  # nothing of hers ends
    assert time.monotonic() - started >= 0.05 and io.busy_tenant_total == 1 and io._waiters == 0
    admitted = threading.Event()

    def waiter() -> None:
        io._admit(1, b"alice", time.monotonic() + 60)
        admitted.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while io._waiters != 1:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.001)
        assert not admitted.is_set()
        io._admit(2, b"bob")  # the queue is full now: the waiter keeps waiting for a piece of hers
        with io._lock:
            io._ended(1, b"alice")  # one of her pieces ends
        assert admitted.wait(60)
    finally:
        thread.join(60)
    assert io._pieces_by_owner == {b"alice": 6, b"bob": 2} and io.pieces_in_flight == 8
    with pytest.raises(Busy, match="full"):
        io._admit(1, b"carol", time.monotonic() + 60)  # full: `Busy` at once, not waited
    assert io.busy_total == 1 and io.busy_tenant_total == 1
    # each call that waited counted once, however often it woke; the one that ended `Busy` too
    assert io.share_waits_total == 2 and io.share_wait_timeouts_total == 1


class GatedIo(SsdIo):
    """Pieces wait at a gate (a slow disk) until `gate` is set: every piece queued stays in flight."""

    def __init__(self, threads: int, queue_max: int, chunk_bytes: int) -> None:
        super().__init__(threads, queue_max, chunk_bytes)
        self.gate = threading.Event()
        self.gate.set()

    def _piece(self, fd: int, view: memoryview, offset: int, write: bool) -> None:
        assert self.gate.wait(60), "the test never opened the gate"
        super()._piece(fd, view, offset, write)


class OneGet:
    """One tenant's disk objects (one piece each) behind a segment backend, the disk held at a
    gate, a demotion's write in flight; `begin_get_streamed` of all of them on a thread of its own,
    as a connection's sender."""

    def __init__(self, tmp: Path, objects: int) -> None:
        self.io = GatedIo(8, 256, 1 << 20)
        self.tier = SsdTier(
            tmp / "ssd", SEGMENT, 1 << 26, 512, direct=False, io=self.io, read_bytes_max=256 << 20
        )
        self.backend = ArenaBackend(
            Arena(tmp, SEGMENT, INCARNATION, ARENA_BYTES),
            SlotTable(ARENA_BYTES),
            segment_id=SEGMENT,
            incarnation=INCARNATION,
            secret=SECRET,
            confirm=lambda *_: "ok",
            clock_ms=lambda: NOW_MS,
            read_tokens_required=True,
            ssd=self.tier,
        )
        self.datas = [os.urandom(16 << 10) for _ in range(objects)]
        self.refs = [
            signed(
                ReadRef(
                    INCARNATION, *self.tier.write(memoryview(d), key_of(b"alice", i), checksum(d)), len(d)
                )
            )
            for i, d in enumerate(self.datas)
        ]
        self.io.gate.clear()  # the disk holds every piece from here
        demotion = os.urandom(16 << 10)
        self.writer = threading.Thread(
            target=self.tier.write, args=(memoryview(demotion), key_of(b"segment", 0), checksum(demotion))
        )
        self.writer.start()
        self.wait_for(lambda: self.io.pieces_in_flight == 1)  # the write's piece is in flight
        self.got: list[object] = []
        self.get = threading.Thread(target=self._get)
        self.get.start()

    def _get(self) -> None:
        try:
            self.got.append(self.backend.begin_get_streamed(self.refs, conn=1))
        except BaseException as exc:
            self.got.append(exc)

    def wait_for(self, condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 60
        while not condition():
            assert time.monotonic() < deadline, "condition not met in time"
            time.sleep(0.001)

    def close(self) -> None:
        self.io.gate.set()
        self.get.join(60)
        self.writer.join(60)
        for got in self.got:
            if isinstance(got, GetGrant):
                self.backend.end_get(got, conn=1)
        self.backend.arena.close()
        self.tier.close()
        self.io.close()


def test_one_get_of_more_disk_objects_than_a_share_is_not_busy_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GET's own earlier disk objects counted against its tenant's piece share: one streamed GET
    of 200 one-piece objects (the default queue of 256, a share of 192) was `busy` at its 193rd
    object with no other tenant reading — with tenants off, every GET of that many. Not held to
    the share alone, it took every slot (the other tenants and the demotions `busy`). It stops
    at the share now, waits for its earlier objects to be read, and is read whole, never busy."""
    monkeypatch.setattr(backend_reads, "DISK_SHARE_WAIT_S", 60.0, raising=False)  # (a loaded machine: ample)
    get = OneGet(tmp_path, 200)
    io = get.io
    try:
        # it waits at its share (before: it took every slot, and returned; or was refused)
        get.wait_for(
            lambda: getattr(io, "_waiters", 0) == 1 or io.busy_tenant_total > 0 or not get.get.is_alive()
        )
        assert io.busy_tenant_total == 0 and io.busy_total == 0
        assert io._owned_pieces == 256 - 256 // IO_TENANT_SHARE_DIVISOR  # no more of the queue, alone
        assert io.pieces_in_flight == 193 and get.get.is_alive()  # and the demotion's write
        io.gate.set()  # the disk reads: its earlier objects leave the queue, the rest go in
        get.get.join(60)
        (grant,) = get.got
        assert isinstance(grant, GetGrant), grant
        assert grant.statuses == ["ok"] * 200 and grant.filling is not None and grant.verdicts is not None
        for fill, view, data in zip(grant.filling, grant.views, get.datas, strict=True):
            assert fill is not None and fill(len(data)) >= len(data)
            assert view is not None and bytes(view) == data
        assert [r.status for r in grant.verdicts()] == ["ok"] * 200
        assert io.busy_tenant_total == 0 and io.busy_total == 0
    finally:
        get.close()
    assert io.pieces_in_flight == 0 and io._owned_pieces == 0


def test_a_get_waits_for_its_share_no_longer_than_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that reads none of the GET's earlier objects (hung, or busy with others) ends the
    wait at `DISK_SHARE_WAIT_S`: the GET is `busy` (counted once) and gives back every read it
    began."""
    monkeypatch.setattr(backend_reads, "DISK_SHARE_WAIT_S", 0.3, raising=False)
    get = OneGet(tmp_path, 200)
    io = get.io
    try:
        get.wait_for(lambda: io.busy_tenant_total == 1 or not get.get.is_alive())  # the bound passed
        io.gate.set()  # the pieces running end: the GET gives back what it began
        get.get.join(60)
        (refused,) = get.got
        assert isinstance(refused, Busy) and "share" in str(refused), refused
        get.wait_for(lambda: io.pieces_in_flight == 0)  # the write's piece too
        assert get.tier.read_bytes_in_flight == 0 and io._owned_pieces == 0
        assert io.busy_tenant_total == 1 and io.busy_total == 0
        # the wait, and its end `busy`, counted and exported (none were before)
        assert (io.share_waits_total, io.share_wait_timeouts_total) == (1, 1)
        counters = get.tier.all_counters()
        assert counters["ssd_io_share_waits_total"] == 1 and counters["ssd_io_share_wait_timeouts_total"] == 1
    finally:
        get.close()
