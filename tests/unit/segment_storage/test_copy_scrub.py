"""Segment-to-segment copy (`ArenaBackend.copy_in` + `fetch_replica`) and the scrubber, in process:
a source segment's backend served over real TCP, a destination backend with a scripted confirm.
No NATS, no event loop: the shell's `copy`/scrub wiring is covered by the integration tests."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvfabric.core.segment_slots import SlotTable
from kvfabric.dataplane.tcp import TcpDataServer
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import (
    BadRequest,
    ChecksumMismatch,
    Conflict,
    NoCapacity,
    NotFound,
    StaleGeneration,
    Unauthorized,
    Unavailable,
)
from kvfabric.format.ids import ObjectKey
from kvfabric.proto.dataplane import ReadRef
from kvfabric.proto.directory import WriteTicket
from kvfabric.proto.tickets import sign_ticket
from kvfabric.segment_storage.arena import Arena
from kvfabric.segment_storage.backend import CLOCK_SKEW_TOLERANCE_MS_DEFAULT, ArenaBackend
from kvfabric.segment_storage.copier import fetch_replica
from kvfabric.segment_storage.scrubber import Scrubber, ScrubPacer

SECRET = b"unit-copy-secret-0123456789"
ARENA_BYTES = 8 << 20
NOW_MS = 1_000_000
TIMEOUT_S = 2.0


@dataclass
class Seg:
    backend: ArenaBackend
    slots: SlotTable
    verdicts: list[str] = field(default_factory=list)  # confirm answers to give, in order ("ok" if none)
    confirmed: list[tuple[int, int]] = field(default_factory=list)

    def ticket(
        self, data: bytes, *, key: bytes = b"k", digest: bytes | None = None, **fields: Any
    ) -> WriteTicket:
        ticket = WriteTicket(
            ticket_id=len(self.confirmed) + 100,
            key=ObjectKey(key),
            segment_id=self.backend.segment_id,
            incarnation=self.backend.incarnation,
            size_bytes=len(data),
            checksum=digest if digest is not None else checksum(data),
            writer_id="repair",
            deadline_ms=NOW_MS + 30_000,
            epoch=1,
        )
        return sign_ticket(msgspec.structs.replace(ticket, **fields), SECRET)

    def store(self, data: bytes, key: bytes = b"k") -> ReadRef:
        """A PUT as a transport does it: the object ends up stored and confirmed."""
        ticket = self.ticket(data, key=key)
        put = self.backend.begin_put(ticket, conn=0)  # 0: neither a TCP connection nor a copy
        put.view[:] = data
        slot, generation = self.backend.finish_put(put, conn=0)
        return ReadRef(self.backend.incarnation, slot, generation, len(data))

    def arena_view(self, ref: ReadRef) -> memoryview:
        with self.backend.lock:
            grant = self.slots.acquire(ref.slot, ref.slot_generation, ref.size_bytes)
            self.slots.release(ref.slot, ref.slot_generation)
        return self.backend.arena.slice(grant.offset, grant.size)


def make_segment(tmp: Path, segment_id: str, incarnation: int) -> Seg:
    arena = Arena(tmp, segment_id, incarnation, ARENA_BYTES)
    slots = SlotTable(ARENA_BYTES)
    seg: Seg

    def confirm(ticket: WriteTicket, slot: int, generation: int, trace_id: str = "", writes: int = 0) -> str:
        seg.confirmed.append((slot, generation))
        return seg.verdicts.pop(0) if seg.verdicts else "ok"

    backend = ArenaBackend(
        arena,
        slots,
        segment_id=segment_id,
        incarnation=incarnation,
        secret=SECRET,
        confirm=confirm,
        clock_ms=lambda: NOW_MS,
    )
    seg = Seg(backend, slots)
    return seg


@pytest.fixture
def source(tmp_path: Path) -> Iterator[tuple[Seg, str]]:
    seg = make_segment(tmp_path, "src", 11)
    server = TcpDataServer(seg.backend)
    server.start()
    try:
        yield seg, server.address
    finally:
        server.stop()
        seg.backend.arena.close()


@pytest.fixture
def dest(tmp_path: Path) -> Iterator[Seg]:
    seg = make_segment(tmp_path, "dst", 22)
    yield seg
    seg.backend.arena.close()


def copy(
    dest: Seg, ticket: WriteTicket, addr: str, ref: ReadRef, timeout_s: float = TIMEOUT_S
) -> tuple[int, int]:
    return dest.backend.copy_in(ticket, lambda view: fetch_replica(addr, ref, view, timeout_s))


def settled(seg: Seg) -> None:
    """Nothing held, nothing leaked."""
    seg.slots.check_invariants()
    assert seg.slots.used_bytes == 0 and seg.slots.writing == 0 and seg.slots.deferred_frees == 0


# ---- copy ------------------------------------------------------------------------------------


def test_copy_stores_identical_bytes_and_confirms(source: tuple[Seg, str], dest: Seg) -> None:
    src, addr = source
    data = os.urandom(3 << 20)
    ref = src.store(data, key=b"obj")
    slot, generation = copy(dest, dest.ticket(data, key=b"obj"), addr, ref)
    assert dest.confirmed == [(slot, generation)]
    assert bytes(dest.arena_view(ReadRef(22, slot, generation, len(data)))) == data
    assert dest.slots.held()[0].checksum == checksum(data) and dest.slots.held()[0].key == b"obj"
    assert dest.backend.counters["copies_total"] == 1
    assert dest.backend.counters["bytes_copied_total"] == len(data)
    src.slots.check_invariants()  # the source's transfer reference is back
    assert src.slots.held()[0].slot == ref.slot


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ("stale_generation", StaleGeneration),
        ("stale_incarnation", StaleGeneration),
        ("unknown_slot", NotFound),
        ("checksum", ChecksumMismatch),
        ("refused", Conflict),
        ("closed_port", Unavailable),
        ("no_tcp", BadRequest),
    ],
)
def test_a_failed_copy_leaves_nothing(
    source: tuple[Seg, str], dest: Seg, change: str, error: type[Exception]
) -> None:
    src, addr = source
    data = os.urandom(1 << 20)
    ref = good = src.store(data)
    ticket = dest.ticket(data)
    if change == "stale_generation":
        src.backend.free_slots([(ref.slot, ref.slot_generation)])
    elif change == "stale_incarnation":
        ref = ReadRef(ref.incarnation - 1, ref.slot, ref.slot_generation, ref.size_bytes)
    elif change == "unknown_slot":
        ref = ReadRef(ref.incarnation, 999, 1, ref.size_bytes)
    elif change == "checksum":  # the source's bytes are not the ticket's object
        ticket = dest.ticket(data, digest=checksum(b"something else"))
    elif change == "refused":
        dest.verdicts.append("unknown_ticket")
    elif change == "closed_port":
        with socket.create_server(("127.0.0.1", 0)) as probe:
            addr = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    elif change == "no_tcp":
        addr = "ucx://127.0.0.1:1"
    with pytest.raises(error):
        copy(dest, ticket, addr, ref)
    settled(dest)
    assert dest.backend.counters["copies_failed_total"] == 1
    assert "copies_total" not in dest.backend.counters
    assert dest.confirmed == ([(0, 1)] if change == "refused" else [])  # confirmed only what arrived intact
    if change != "stale_generation":  # the same copy from the real replica now succeeds
        slot, generation = copy(dest, dest.ticket(data), source[1], good)
        assert bytes(dest.arena_view(ReadRef(22, slot, generation, len(data)))) == data


def test_a_stalled_source_times_out_and_the_slot_goes_back(dest: Seg) -> None:
    data = os.urandom(64 << 10)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (backlog), never answers
        addr = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(Unavailable):
            copy(dest, dest.ticket(data), addr, ReadRef(11, 0, 1, len(data)), timeout_s=0.3)
    settled(dest)


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"signature": b"x" * 32}, Unauthorized),
        ({"segment_id": "other"}, BadRequest),
        ({"incarnation": 21}, StaleGeneration),
        ({"epoch": 0}, StaleGeneration),
        ({"deadline_ms": NOW_MS - CLOCK_SKEW_TOLERANCE_MS_DEFAULT}, Conflict),  # past, and past the skew
        ({"size_bytes": ARENA_BYTES * 2}, NoCapacity),
    ],
)
def test_the_ticket_is_checked_like_a_put_before_anything_is_read(
    dest: Seg, fields: dict[str, Any], error: type[Exception]
) -> None:
    dest.backend.saw_epoch(0, 1)
    data = b"abc"
    signature = fields.pop("signature", None)
    ticket = dest.ticket(data, **fields)
    if signature is not None:
        ticket = msgspec.structs.replace(ticket, signature=signature)
    fetched: list[int] = []
    with pytest.raises(error):
        dest.backend.copy_in(ticket, lambda view: fetched.append(len(view)))
    assert fetched == []
    settled(dest)


def test_a_draining_segment_refuses_copies(dest: Seg) -> None:
    dest.backend.draining = True
    with pytest.raises(Conflict):
        dest.backend.copy_in(dest.ticket(b"abc"), lambda view: None)
    settled(dest)


# ---- scrub -----------------------------------------------------------------------------------


def test_scrub_finds_a_flipped_byte_and_frees_the_slot_at_once(source: tuple[Seg, str]) -> None:
    seg, _ = source
    datas = [os.urandom(100_000 + i) for i in range(3)]
    refs = [seg.store(d, key=bytes([i])) for i, d in enumerate(datas)]
    scrubber = Scrubber(seg.backend, pass_min_ms=0)
    assert scrubber.step(1 << 30, NOW_MS) == (sum(map(len, datas)), [])  # one whole pass, all good
    seg.arena_view(refs[1])[777] ^= 0x5A
    spent, corrupt = scrubber.step(1 << 30, NOW_MS)
    assert spent == sum(map(len, datas))
    assert [(c.key, c.slot, c.generation, c.size) for c in corrupt] == [
        (b"\x01", refs[1].slot, refs[1].slot_generation, len(datas[1]))
    ]
    with pytest.raises(StaleGeneration):  # no read of it from now on
        seg.slots.acquire(refs[1].slot, refs[1].slot_generation, refs[1].size_bytes)
    seg.slots.check_invariants()
    assert seg.slots.used_bytes == sum(-(-len(d) // 64) * 64 for i, d in enumerate(datas) if i != 1)
    assert seg.backend.counters["scrub_corrupt_total"] == 1
    assert seg.backend.counters["scrub_passes_total"] == 2
    assert scrubber.step(1 << 30, NOW_MS) == (len(datas[0]) + len(datas[2]), [])  # the rest stays good


def test_scrub_a_corrupt_object_under_a_reader_is_reclaimed_when_the_reader_lets_go(
    source: tuple[Seg, str],
) -> None:
    seg, _ = source
    ref = seg.store(os.urandom(4096))
    seg.arena_view(ref)[0] ^= 1
    with seg.backend.lock:
        seg.slots.acquire(ref.slot, ref.slot_generation, ref.size_bytes)  # a transfer in progress
    _, corrupt = Scrubber(seg.backend, pass_min_ms=0).step(1 << 20, NOW_MS)
    assert len(corrupt) == 1 and seg.slots.deferred_frees == 1  # fenced, memory still under the reader
    with seg.backend.lock:
        seg.slots.release(ref.slot, ref.slot_generation)
    settled(seg)


def test_scrub_walks_round_robin_within_its_budget_and_skips_what_was_freed(source: tuple[Seg, str]) -> None:
    seg, _ = source
    refs = [seg.store(os.urandom(1000), key=bytes([i])) for i in range(5)]
    scrubber = Scrubber(seg.backend, pass_min_ms=0, objects_max=2)
    assert scrubber.step(1, NOW_MS) == (1000, [])  # the budget: one object (may overshoot by one)
    assert scrubber.step(1 << 20, NOW_MS) == (2000, [])  # objects_max per step
    seg.backend.free_slots([(refs[3].slot, refs[3].slot_generation)])  # listed on its page, then freed
    assert scrubber.step(1 << 20, NOW_MS) == (1000, [])  # slot 3 skipped, slot 4 checked
    assert seg.backend.counters["scrub_skipped_total"] == 1
    assert scrubber.step(1 << 20, NOW_MS) == (0, [])  # end of the pass
    assert scrubber.step(1 << 20, NOW_MS) == (2000, [])  # a new pass from slot 0
    assert seg.backend.counters["scrub_objects_total"] == 6


def test_scrub_of_an_empty_segment_does_nothing(dest: Seg) -> None:
    assert Scrubber(dest.backend, pass_min_ms=0).step(1 << 20, NOW_MS) == (0, [])
    assert "scrub_passes_total" not in dest.backend.counters


def test_a_pass_starts_at_most_once_per_pass_min(source: tuple[Seg, str]) -> None:
    seg, _ = source
    scrubber = Scrubber(seg.backend, pass_min_ms=1_000)
    assert scrubber.step(1 << 20, 0) == (0, [])  # an empty store: the pass starts and ends at once
    seg.store(b"x" * 100)
    assert scrubber.step(1 << 20, 999) == (0, [])  # too soon for the next pass
    assert scrubber.step(1 << 20, 1_000) == (100, [])
    assert scrubber.step(1 << 20, 1_500) == (0, [])  # that pass ended; the next waits
    assert scrubber.step(1 << 20, 2_000) == (100, [])
    assert seg.backend.counters["scrub_passes_total"] == 2  # the empty one is not counted


def test_pacer_refills_at_the_rate_caps_at_one_second_and_carries_debt() -> None:
    pacer = ScrubPacer(1000, now_s=0.0)
    assert pacer.available(0.0) == 0
    assert pacer.available(0.1) == 100
    assert pacer.available(10.0) == 1000  # capped: no burst after idling
    pacer.spend(5000)  # one large object
    assert pacer.available(1.0 + 10.0) == 0  # still paying back: 1000 - 5000 + 1000
    assert pacer.available(14.0) == 0
    assert pacer.available(14.5) == 500
