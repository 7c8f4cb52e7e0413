"""Clock skew between the directory (which writes absolute expiries into read tokens and write
tickets) and a segment (which checks them against its own wall clock), issue 27 clock-skew drill.
A segment honours an expiry up to `clock_skew_tolerance_ms` past it, and that is safe: a token
honoured late never reads a slot the directory freed or reused (the free bumped the generation).
The last test is the drill's finding in miniature: a repair copy from a source segment whose
clock is ahead of the directory's by the copy TTL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfabric.core.segment_slots import SlotTable
from kvfabric.dataplane.tcp import TcpDataServer
from kvfabric.directory.settings import load_directory_settings
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import Conflict, Unauthorized
from kvfabric.format.ids import ObjectKey
from kvfabric.format.invariant import InvariantViolation
from kvfabric.proto.dataplane import GetRequest, PutRequest, ReadRef
from kvfabric.proto.directory import WriteTicket
from kvfabric.proto.tickets import read_token, sign_ticket
from kvfabric.runtime.config import SettingsError
from kvfabric.segment_storage.arena import Arena
from kvfabric.segment_storage.backend import (
    CLOCK_SKEW_TOLERANCE_MS_DEFAULT,
    CLOCK_SKEW_TOLERANCE_MS_MAX,
    ArenaBackend,
)
from kvfabric.segment_storage.copier import fetch_replica
from kvfabric.segment_storage.settings import load_segment_settings

SECRET = b"unit-clock-skew-secret-0123456789"
ARENA_BYTES = 4 << 20
DIRECTORY_NOW_MS = 1_000_000_000
COPY_TTL_MS = 10_000  # KVF_REPAIR_COPY_TIMEOUT_MS's default: a copy's source token lives this long
SIZE = 4096


class Clock:
    def __init__(self, now_ms: int) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms


def make_backend(tmp: Path, segment_id: str, clock: Clock, tolerance_ms: int | None) -> ArenaBackend:
    extra = {} if tolerance_ms is None else {"clock_skew_tolerance_ms": tolerance_ms}
    tmp.mkdir(parents=True, exist_ok=True)
    return ArenaBackend(
        Arena(tmp, segment_id, 3, ARENA_BYTES),
        SlotTable(ARENA_BYTES),
        segment_id=segment_id,
        incarnation=3,
        secret=SECRET,
        confirm=lambda *_: "ok",
        clock_ms=clock,
        read_tokens_required=True,
        **extra,  # type: ignore[arg-type]
    )


def ticket_for(backend: ArenaBackend, data: bytes, deadline_ms: int, ticket_id: int = 1) -> WriteTicket:
    ticket = WriteTicket(
        ticket_id=ticket_id,
        key=ObjectKey(b"k%d" % ticket_id),
        segment_id=backend.segment_id,
        incarnation=backend.incarnation,
        size_bytes=len(data),
        checksum=checksum(data),
        writer_id="w",
        deadline_ms=deadline_ms,
        epoch=1,
    )
    return sign_ticket(ticket, SECRET)


def store(backend: ArenaBackend, data: bytes, ticket_id: int = 1) -> tuple[int, int]:
    put = backend.begin_put(ticket_for(backend, data, backend.clock_ms() + 30_000, ticket_id), conn=0)
    put.view[:] = data
    return backend.finish_put(put, conn=0)


def ref_for(backend: ArenaBackend, slot: int, generation: int, expires_ms: int) -> ReadRef:
    token = read_token(SECRET, backend.segment_id, backend.incarnation, slot, generation, SIZE, expires_ms)
    return ReadRef(backend.incarnation, slot, generation, SIZE, token, expires_ms)


def get_status(backend: ArenaBackend, ref: ReadRef) -> str:
    grant = backend.begin_get([ref], conn=7)
    try:
        return grant.statuses[0]
    finally:
        backend.end_get(grant, conn=7)


@pytest.fixture
def skewed(tmp_path: Path) -> Iterator[tuple[ArenaBackend, ArenaBackend, Clock]]:
    """Two backends on the same clock: one with the default tolerance, one with none."""
    clock = Clock(DIRECTORY_NOW_MS)
    tolerant = make_backend(tmp_path / "a", "tolerant", clock, None)
    strict = make_backend(tmp_path / "b", "strict", clock, 0)
    yield tolerant, strict, clock
    tolerant.arena.close()
    strict.arena.close()


def test_a_token_expired_by_less_than_the_tolerance_is_still_honoured(
    skewed: tuple[ArenaBackend, ArenaBackend, Clock],
) -> None:
    tolerant, strict, clock = skewed
    assert tolerant.clock_skew_tolerance_ms == CLOCK_SKEW_TOLERANCE_MS_DEFAULT == 5_000
    refs = {}
    for backend in (tolerant, strict):
        slot, generation = store(backend, b"x" * SIZE)
        refs[backend.segment_id] = ref_for(backend, slot, generation, clock.now_ms + 1_000)
    clock.now_ms += 4_000  # this segment's clock 3 s past the token's expiry (the directory's)
    assert get_status(tolerant, refs["tolerant"]) == "ok"
    assert tolerant.admits(GetRequest(reads=[refs["tolerant"]]))
    assert get_status(strict, refs["strict"]) == "unauthorized"
    assert not strict.admits(GetRequest(reads=[refs["strict"]]))
    clock.now_ms += 3_000  # 6 s past: past the tolerance too
    assert get_status(tolerant, refs["tolerant"]) == "unauthorized"


def test_a_ticket_past_its_deadline_by_less_than_the_tolerance_still_stores(
    skewed: tuple[ArenaBackend, ArenaBackend, Clock],
) -> None:
    tolerant, strict, clock = skewed
    data = b"t" * SIZE
    late = {b.segment_id: ticket_for(b, data, clock.now_ms - 3_000) for b in (tolerant, strict)}
    with pytest.raises(Conflict):
        strict.begin_put(late["strict"], conn=1)
    assert not strict.admits(PutRequest(ticket=late["strict"]))
    assert tolerant.admits(PutRequest(ticket=late["tolerant"]))
    put = tolerant.begin_put(late["tolerant"], conn=1)
    put.view[:] = data
    slot, generation = tolerant.finish_put(put, conn=1)
    assert tolerant.slots.used_bytes > 0 and generation >= 1 and slot >= 0
    past = ticket_for(tolerant, data, clock.now_ms - 6_000, ticket_id=2)
    with pytest.raises(Conflict):
        tolerant.begin_put(past, conn=2)


def test_a_token_honoured_late_never_reads_a_freed_or_reused_slot(
    skewed: tuple[ArenaBackend, ArenaBackend, Clock],
) -> None:
    """The safety argument: the lease behind the token expired (directory clock), the directory
    freed the slot, another object took it; the token, still inside the tolerance, reads nothing."""
    tolerant, _, clock = skewed
    slot, generation = store(tolerant, b"a" * SIZE)
    ref = ref_for(tolerant, slot, generation, clock.now_ms + 1_000)
    clock.now_ms += 2_000  # the lease expired; the token is inside the tolerance
    assert tolerant.free_slots([(slot, generation)]) == [(slot, generation)]
    assert get_status(tolerant, ref) == "stale_generation"
    reused_slot, reused_generation = store(tolerant, b"b" * SIZE, ticket_id=2)
    assert reused_slot == slot and reused_generation > generation  # the same slot id, reused
    assert get_status(tolerant, ref) == "stale_generation"  # never the new object's bytes


def test_a_copy_from_a_source_ahead_of_the_directory_by_the_copy_ttl(tmp_path: Path) -> None:
    """The clock-skew drill's finding: the directory (5 s behind) signs the source token to expire
    at its now + the copy TTL (10 s); the source (5 s ahead) reads that as already expired. With
    no tolerance it refuses every such copy (and says it is the source: `source_addr`); with the
    default one the copy goes through."""
    for tolerance_ms, copied in ((0, False), (None, True)):
        source_clock = Clock(DIRECTORY_NOW_MS + COPY_TTL_MS)
        source = make_backend(tmp_path / f"src{tolerance_ms}", "src", source_clock, tolerance_ms)
        server = TcpDataServer(source, authenticate=source.admits)  # as the segment shell does
        server.start()
        try:
            data = bytes(range(256)) * (SIZE // 256)
            slot, generation = store(source, data)
            ref = ref_for(source, slot, generation, DIRECTORY_NOW_MS + COPY_TTL_MS)
            into = memoryview(bytearray(SIZE))
            if copied:
                fetch_replica(server.address, ref, into, 2.0)
                assert bytes(into) == data
            else:
                with pytest.raises(Unauthorized) as refused:
                    fetch_replica(server.address, ref, into, 2.0)
                assert refused.value.details["source_addr"] == server.address
        finally:
            server.stop()
            source.arena.close()


def test_the_tolerance_setting_is_bounded_below_the_directorys_lease_grace(tmp_path: Path) -> None:
    env = {"KVF_SEGMENT_ID": "s1", "KVF_CLUSTER_SECRET": SECRET.decode()}
    assert load_segment_settings(env).clock_skew_tolerance_ms == CLOCK_SKEW_TOLERANCE_MS_DEFAULT
    assert load_segment_settings({**env, "KVF_CLOCK_SKEW_TOLERANCE_MS": "0"}).clock_skew_tolerance_ms == 0
    with pytest.raises(SettingsError):
        load_segment_settings({**env, "KVF_CLOCK_SKEW_TOLERANCE_MS": str(CLOCK_SKEW_TOLERANCE_MS_MAX + 1)})
    with pytest.raises(InvariantViolation):
        make_backend(tmp_path, "s", Clock(0), CLOCK_SKEW_TOLERANCE_MS_MAX + 1)
    # A new shard leader's grace (no frees for the longest lease) outlasts any tolerance.
    grace_ms = load_directory_settings({"KVF_CLUSTER_SECRET": SECRET.decode()}).core.lease_ttl_ms_max
    assert grace_ms > CLOCK_SKEW_TOLERANCE_MS_MAX
