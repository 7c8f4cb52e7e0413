"""Write receipts on the segment (issue 20): a PUT that asks for one is answered as soon as its bytes
are stored and verified, with the segment's MAC over what it stored; the confirm goes in the
background, and a refused one frees the slot. Bytes that fail the ticket's checksum get no receipt."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import patch

import msgspec
import pytest

from kvfabric.core.segment_slots import SlotTable
from kvfabric.dataplane.tcp import TcpDataClient, TcpDataServer
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import ChecksumMismatch, NotFound, StaleGeneration, Unavailable
from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from kvfabric.proto.directory import WriteTicket
from kvfabric.proto.tickets import sign_ticket, write_receipt
from kvfabric.segment_storage import shell_confirms
from kvfabric.segment_storage.arena import Arena
from kvfabric.segment_storage.backend import ArenaBackend
from kvfabric.segment_storage.settings import CONFIRM_LATER_GATHER_MS_DEFAULT
from kvfabric.segment_storage.shell import SegmentShell

SECRET = b"unit-write-receipts-secret-0123456789"
ARENA_BYTES = 4 << 20
SIZE = 64 << 10


class Directory:
    """The backend's two confirm paths: synchronous (`confirm`) and background (`later`)."""

    def __init__(self) -> None:
        self.confirmed: list[tuple[int, int, int]] = []
        self.later: list[tuple[int, int, int]] = []
        self.later_error: Unavailable | None = None

    def confirm(
        self, ticket: WriteTicket, slot: int, generation: int, trace_id: str, save_writes: int
    ) -> str:
        self.confirmed.append((ticket.ticket_id, slot, generation))
        return "ok"

    def confirm_later(self, ticket: WriteTicket, slot: int, generation: int, trace_id: str) -> None:
        if self.later_error is not None:
            raise self.later_error
        self.later.append((ticket.ticket_id, slot, generation))


@pytest.fixture
def segment(tmp_path: Path) -> Iterator[tuple[ArenaBackend, Directory, TcpDataServer]]:
    directory = Directory()
    backend = ArenaBackend(
        Arena(tmp_path, "seg-receipts", 5, ARENA_BYTES),
        SlotTable(ARENA_BYTES),
        segment_id="seg-receipts",
        incarnation=5,
        secret=SECRET,
        confirm=directory.confirm,
        confirm_later=directory.confirm_later,
    )
    server = TcpDataServer(backend)
    server.start()
    yield backend, directory, server
    server.stop()
    backend.arena.close()


def ticket(
    backend: ArenaBackend, data: bytes, ticket_id: int = 1, claimed: bytes | None = None
) -> WriteTicket:
    return sign_ticket(
        WriteTicket(
            ticket_id=ticket_id,
            key=ObjectKey(b"key-%d" % ticket_id),
            segment_id=backend.segment_id,
            incarnation=backend.incarnation,
            size_bytes=len(data),
            checksum=claimed if claimed is not None else checksum(data),
            writer_id="w",
            deadline_ms=backend.clock_ms() + 30_000,
            epoch=3,
            shard=2,
        ),
        SECRET,
    )


def client(server: TcpDataServer) -> TcpDataClient:
    return TcpDataClient.connect(server.address, timeout_s=5)


def test_a_receipted_put_is_answered_before_its_confirm(
    segment: tuple[ArenaBackend, Directory, TcpDataServer],
) -> None:
    backend, directory, server = segment
    data = bytes(range(256)) * (SIZE // 256)
    t = ticket(backend, data)
    with client(server) as c:
        reply = c.put(t, data, receipt=True)
    assert not reply.confirmed
    assert reply.receipt == write_receipt(SECRET, t, reply.slot, reply.slot_generation)
    assert directory.confirmed == []  # nothing waited on the directory
    assert directory.later == [(1, reply.slot, reply.slot_generation)]  # it still confirms, later
    assert backend.slots.held_one(reply.slot, reply.slot_generation) is not None  # stored
    assert backend.counters["puts_receipted_total"] == 1


def test_without_asking_the_put_is_confirmed_first(
    segment: tuple[ArenaBackend, Directory, TcpDataServer],
) -> None:
    backend, directory, server = segment
    data = b"a" * SIZE
    with client(server) as c:
        reply = c.put(ticket(backend, data), data)
    assert reply.confirmed and reply.receipt == b""
    assert directory.confirmed == [(1, reply.slot, reply.slot_generation)] and directory.later == []


def test_bytes_that_fail_the_checksum_get_no_receipt(
    segment: tuple[ArenaBackend, Directory, TcpDataServer],
) -> None:
    backend, directory, server = segment
    data = b"b" * SIZE
    with client(server) as c, pytest.raises(ChecksumMismatch):
        c.put(ticket(backend, data, claimed=checksum(b"c" * SIZE)), data, receipt=True)
    assert directory.later == [] and backend.slots.used_bytes == 0


def test_a_refused_background_confirm_frees_the_slot(
    segment: tuple[ArenaBackend, Directory, TcpDataServer],
) -> None:
    backend, _, server = segment
    data = b"d" * SIZE
    with client(server) as c:
        reply = c.put(ticket(backend, data), data, receipt=True)
    assert backend.slots.used_bytes > 0
    backend.unconfirmed(reply.slot, reply.slot_generation, "unknown_ticket")  # the shell, on the verdict
    assert backend.slots.used_bytes == 0
    assert backend.counters["confirm_later_unknown_ticket_total"] == 1


def test_a_segment_that_cannot_confirm_later_refuses_the_write(
    segment: tuple[ArenaBackend, Directory, TcpDataServer],
) -> None:
    backend, directory, server = segment
    directory.later_error = Unavailable("not connected")
    data = b"e" * SIZE
    with client(server) as c, pytest.raises(Unavailable):
        c.put(ticket(backend, data), data, receipt=True)
    assert backend.slots.used_bytes == 0  # freed: no receipt for a slot nobody will confirm


class LaterShell:
    """What `SegmentShell._confirm_in_background` reads: the router, the batcher, the backend."""

    def __init__(self, backend: ArenaBackend, answers: list[str | Exception]) -> None:
        self.backend = backend
        self.router = SimpleNamespace(shard_of=lambda key: 0)
        self.settings = SimpleNamespace(confirm_timeout_ms=1_000)
        self.answers = answers
        self.asked = 0
        self.confirms_later = self

    def submit(
        self, shard: int, epoch: int, confirm: m.ReplicaConfirm, trace_id: str, *, shared: bool
    ) -> asyncio.Future[str]:
        self.asked += 1
        verdict: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            verdict.set_exception(answer)
        else:
            verdict.set_result(answer)
        return verdict


@pytest.mark.parametrize(
    ("answers", "kept", "asked"),
    [
        (["ok"], True, 1),
        (["unknown_ticket"], False, 1),  # the write expired or was aborted uncommitted
        (["mismatch"], False, 1),  # the ticket names another slot
        ([Unavailable("no leader"), "ok"], True, 2),  # no verdict: asked again, never freed blind
        # a ticket without a checksum whose writer has not committed its receipt yet
        (["pending", "pending", "ok"], True, 3),
        (["pending", "unknown_ticket"], False, 2),  # its write expired uncommitted
        # A newer leader: it adopted the slot from the segment's report and decides (publishes
        # it, or frees it after its grace); freeing it here lost a published replica.
        ([StaleGeneration("directory_epoch", 1, 2)], True, 1),
        # a newer incarnation of this segment registered: no report adopts the slot (review, stop 67)
        ([StaleGeneration("segment_incarnation", 1, 2)], False, 1),
        ([NotFound("segment s1 is not registered")], False, 1),  # the incarnation is down: final
    ],
)
def test_the_background_confirm_frees_only_on_a_refusal(
    segment: tuple[ArenaBackend, Directory, TcpDataServer],
    answers: list[str | Exception],
    kept: bool,
    asked: int,
) -> None:
    backend, _, server = segment
    data = b"f" * SIZE
    t = ticket(backend, data)
    with client(server) as c:
        reply = c.put(t, data, receipt=True)
    shell = LaterShell(backend, answers)
    with patch.object(shell_confirms, "CONFIRM_LATER_RETRY_S", 0.001):
        later = [(t, reply.slot, reply.slot_generation, "trace")]
        asyncio.run(SegmentShell._confirm_in_background(shell, later))  # type: ignore[arg-type]
    assert shell.asked == asked
    assert (backend.slots.held_one(reply.slot, reply.slot_generation) is not None) == kept


@pytest.mark.parametrize(
    ("answer", "counted"), [(Unavailable("no leader"), "no_verdict"), ("pending", "pending")]
)
def test_a_directory_silent_past_the_deadline_gets_the_slot_freed(
    segment: tuple[ArenaBackend, Directory, TcpDataServer], answer: str | Exception, counted: str
) -> None:
    """No verdict, or still `pending` (a receipt nobody committed), long after the ticket's
    deadline: the slot is freed."""
    backend, _, server = segment
    data = b"g" * SIZE
    t = ticket(backend, data)
    with client(server) as c:
        reply = c.put(t, data, receipt=True)
    now = backend.clock_ms()
    backend.clock_ms = lambda: now + 30_000 + shell_confirms.CONFIRM_LATER_GIVE_UP_MS + 10_000
    shell = LaterShell(backend, [answer])
    asyncio.run(SegmentShell._confirm_in_background(shell, [(t, reply.slot, reply.slot_generation, "trace")]))  # type: ignore[arg-type]
    assert backend.slots.held_one(reply.slot, reply.slot_generation) is None
    assert backend.counters[f"confirm_later_{counted}_total"] == 1


def test_pipelined_puts_are_answered_in_order_and_a_refusal_stops_none_of_the_others(
    segment: tuple[ArenaBackend, Directory, TcpDataServer],
) -> None:
    """`TcpDataClient.put_many`: a save's writes to one segment, every request sent before any
    reply is read; the segment answers each in order, a refused one (bytes that fail the
    ticket's checksum, a ticket not signed by the cluster) with its error, the rest stored."""
    backend, directory, server = segment
    blobs = [bytes([i]) * SIZE for i in range(6)]
    tickets = [ticket(backend, b, ticket_id=i + 1) for i, b in enumerate(blobs)]
    tickets[2] = ticket(backend, blobs[2], ticket_id=3, claimed=checksum(b"x" * SIZE))  # fails its checksum
    tickets[4] = msgspec.structs.replace(tickets[4], signature=b"\0" * 32)  # not the cluster's
    with client(server) as c:
        replies = c.put_many([(t, b, "trace", 6) for t, b in zip(tickets, blobs, strict=True)], receipt=True)
        again = c.put(ticket(backend, blobs[0], ticket_id=9), blobs[0], receipt=True)  # still in step
    assert [type(r).__name__ for r in replies] == [
        "PutReply",
        "PutReply",
        "ChecksumMismatch",
        "PutReply",
        "Unauthorized",
        "PutReply",
    ]
    for t, r in zip(tickets, replies, strict=True):
        if not isinstance(r, Exception):
            assert r.receipt == write_receipt(SECRET, t, r.slot, r.slot_generation)
    assert [tid for tid, _, _ in directory.later] == [1, 2, 4, 6, 9]
    assert again.receipt and backend.counters["puts_receipted_total"] == 5


def queued_ticket() -> WriteTicket:
    """A ticket for the receipted-write queue's tests (nothing checks its signature there)."""
    return WriteTicket(
        ticket_id=1,
        key=ObjectKey(b"k"),
        segment_id="s",
        incarnation=1,
        size_bytes=1,
        checksum=b"c" * 16,
        writer_id="w",
        deadline_ms=1,
        epoch=1,
    )


def test_receipted_writes_queued_together_wake_the_loop_once() -> None:
    """A burst of receipted writes (a save's, from transport threads) costs one wake-up of the
    segment's loop and one task, not one each."""
    woken: list[object] = []
    fake = SimpleNamespace(
        _loop=SimpleNamespace(call_soon_threadsafe=lambda *args: woken.append(args), call_later=None),
        settings=SimpleNamespace(confirm_later_gather_ms=CONFIRM_LATER_GATHER_MS_DEFAULT),
        router=object(),
        _later=[],
        _later_lock=threading.Lock(),
        _later_woken=False,
        _later_stopped=False,
        _gather_later=lambda: None,
        _start_later=lambda: None,
    )
    t = queued_ticket()
    for slot in range(8):
        SegmentShell._confirm_later(fake, t, slot, 1, "trace")  # type: ignore[arg-type]
    assert len(woken) == 1 and [s for _, s, _, _ in fake._later] == list(range(8))


def queue_of_a_shell(loop: asyncio.AbstractEventLoop) -> SimpleNamespace:
    """What `SegmentShell`'s receipted-write queue reads and writes, on `loop` (its gather the
    shell's own; `_start_later` left to the test)."""
    fake = SimpleNamespace(
        _loop=loop,
        settings=SimpleNamespace(confirm_later_gather_ms=CONFIRM_LATER_GATHER_MS_DEFAULT),
        router=object(),
        _later=[],
        _later_lock=threading.Lock(),
        _later_woken=False,
        _later_timer=None,
        _later_tasks=set(),
        _later_stopped=False,
    )
    fake._gather_later = lambda: SegmentShell._gather_later(fake)  # type: ignore[arg-type]
    return fake


def test_receipted_writes_are_confirmed_after_the_gather_not_while_the_save_writes() -> None:
    """The loop starts a receipted write's background confirm `confirm_later_gather_ms` after the
    first write of a burst, not at once: that work (a task, futures, the request) delayed the same
    save's next writes (their transport thread waited for the GIL and a core). The wake-up only
    sets a timer of the gather; the writes queued until it fires are confirmed in one start."""
    started: list[int] = []

    async def run() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        fake = queue_of_a_shell(loop)
        fired = asyncio.Event()

        def start_later() -> None:
            started.append(len(fake._later))
            fired.set()

        fake._start_later = start_later
        t = queued_ticket()
        before = loop.time()
        for slot in range(16):  # one save's 8 writes, then another save's
            SegmentShell._confirm_later(fake, t, slot, 1, "trace")  # type: ignore[arg-type]
        await asyncio.sleep(0)  # the wake-up runs: a timer, no confirm
        assert started == [] and fake._later_timer is not None
        when = fake._later_timer.when()
        await asyncio.wait_for(fired.wait(), 30)
        return before, when

    before, when = asyncio.run(run())
    assert when - before >= CONFIRM_LATER_GATHER_MS_DEFAULT / 1000 > 0
    assert started == [16]


def test_stop_cancels_the_gather_and_the_background_confirms_and_refuses_later_writes() -> None:
    """At stop, before the arena closes, nothing of the receipted writes' confirms is left: the
    gather's timer is cancelled (it would start confirms on a closed arena), a running background
    confirm is cancelled and awaited, and a write landing afterwards (its transport still serves
    until the server stops) is refused: its slot is freed, nothing is queued or started."""
    started: list[int] = []

    async def run() -> None:
        loop = asyncio.get_running_loop()
        fake = queue_of_a_shell(loop)
        fake._start_later = lambda: started.append(len(fake._later))
        running = asyncio.ensure_future(asyncio.sleep(3600))  # a background confirm still asking
        fake._later_tasks.add(running)
        t = queued_ticket()
        for slot in range(8):
            SegmentShell._confirm_later(fake, t, slot, 1, "trace")  # type: ignore[arg-type]
        await asyncio.sleep(0)  # the wake-up ran: the gather's timer is set
        timer = fake._later_timer
        assert timer is not None
        await SegmentShell._stop_confirming_later(fake)  # type: ignore[arg-type]
        assert timer.cancelled() and fake._later_timer is None
        assert running.cancelled() and fake._later == []
        with pytest.raises(Unavailable):
            SegmentShell._confirm_later(fake, t, 9, 1, "trace")  # type: ignore[arg-type]
        SegmentShell._gather_later(fake)  # type: ignore[arg-type]  # a wake-up queued before the stop
        assert fake._later_timer is None
        fake._later.append((t, 10, 1, "trace"))  # whatever a late timer would find: not started
        SegmentShell._start_later(fake)  # type: ignore[arg-type]
        assert fake._later_tasks == {running} or not fake._later_tasks

    asyncio.run(run())
    assert started == []


@pytest.mark.parametrize("receipt", [True, False])
def test_a_write_whose_leader_was_replaced_while_it_landed_is_not_stored(
    segment: tuple[ArenaBackend, Directory, TcpDataServer], receipt: bool
) -> None:
    """A PUT that passed `begin_put` under epoch 3 is still landing when the successor (epoch 4)
    asks for this segment's report: the report, taken after its fence rose, cannot list the
    WRITING slot, and the successor refuses the writer's commit at epoch 3. Stored, the slot would
    have no owner (a receipted write's background confirm leaves a `stale_generation` slot to the
    successor: a leak until the segment restarts; review of 2026-12-02). The write is refused
    `stale_generation` and nothing is held or queued for a confirm."""
    backend, directory, _ = segment
    data = b"r" * SIZE
    put = backend.begin_put(ticket(backend, data), conn=1)  # the transport: passed the gate at epoch 3
    put.receipt_wanted = receipt
    put.view[:] = data
    put.checksum = checksum(data)
    backend.admit_directory(2, 4)  # the successor's report request raises the fence ...
    assert backend.slots.held() == []  # ... and its page lists nothing: the slot is WRITING
    with pytest.raises(StaleGeneration):
        backend.finish_put(put, conn=1)
    assert backend.slots.held() == [] and backend.slots.used_bytes == 0
    assert directory.later == [] and directory.confirmed == []
    assert backend.counters["stale_epoch_rejected_total"] == 1
