"""Saves in flight together share their directory requests (issue 20): per shard one `put_begin`,
`put_commit` and `put_abort` in flight at a time, the saves that arrive meanwhile riding the next
one; a save alone goes at once; a key never twice in one request; the writes of saves that shared
a `put_begin` carry its trace id, and a segment is never told to gather more confirms than the
client writes at once."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Sequence
from typing import Any, cast

import msgspec

from kvfabric.client import AsyncKvClient, ClientSettings
from kvfabric.client.aio import SAVE_WRITE_STREAM_BYTES_TARGET
from kvfabric.client.hits import SaveResult
from kvfabric.client.saves import write_streams
from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.format.errors import BadRequest
from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from tests.integration.clientkit import SPEC

SHARDS = 2
CHUNKS = 8
TPC = SPEC.layout.tokens_per_chunk
EPOCH = 3
RECEIPT_MAC = b"r" * 16


class SaveRouter(DirectoryRouter):
    """A directory for saves: places every object (one ticket, segment `seg-a`), publishes every
    commit; records each request (verb, shard, keys, trace id) and checks no key repeats in one."""

    def __init__(self) -> None:
        super().__init__(cast(Any, None))
        self.shards = SHARDS
        self.requests: list[tuple[str, int, list[ObjectKey], str]] = []
        self.tickets = 0
        self.receipts: list[m.WriteReceipt] = []  # carried by put_commits

    async def ask(self, shard: int, verb: str, message: msgspec.Struct, timeout_s: float, **kw: Any) -> Any:
        trace = (kw.get("headers") or {}).get("Kvf-Trace-Id", "")
        await asyncio.sleep(0.002)  # a round trip: saves started meanwhile queue
        if isinstance(message, m.PutBegin):
            keys = [o.key for o in message.objects]
            results = []
            for spec in message.objects:
                self.tickets += 1
                ticket = m.WriteTicket(
                    ticket_id=self.tickets,
                    key=spec.key,
                    segment_id="seg-a",
                    incarnation=1,
                    size_bytes=spec.size_bytes,
                    checksum=spec.checksum,
                    writer_id="w",
                    deadline_ms=1 << 40,
                    epoch=EPOCH,
                    data_addr="tcp://127.0.0.1:1",
                )
                results.append(m.BeginResult(key=spec.key, status="placed", tickets=[ticket]))
            reply: Any = m.PutBeginReply(epoch=EPOCH, results=results)
        elif isinstance(message, m.PutCommit):
            keys = list(message.keys)
            self.receipts += message.receipts
            reply = m.PutCommitReply(
                epoch=EPOCH, results=[m.CommitResult(key=k, status="published") for k in keys]
            )
        else:
            assert isinstance(message, m.PutAbort)
            keys = list(message.keys)
            reply = m.PutAbortReply(epoch=EPOCH, aborted=len(keys))
        assert len(set(keys)) == len(keys), "a key twice in one request"
        assert all(self.shard_of(k) == shard for k in keys)
        self.requests.append((verb, shard, keys, trace))
        return reply

    def count(self, verb: str) -> Counter[int]:
        return Counter(shard for v, shard, _, _ in self.requests if v == verb)


def client(
    router: SaveRouter, fail_keys: frozenset[bytes] = frozenset(), *, use_shm: bool = True, **settings: Any
) -> tuple[AsyncKvClient, list[Any]]:
    kv = AsyncKvClient(ClientSettings(nats_url="nats://unused:1", use_shm=use_shm, **settings), SPEC)
    kv.router = router
    kv.nc = cast(Any, object())  # "connected": the router does every request
    writes: list[Any] = []

    def write(
        ticket: m.WriteTicket,
        data: memoryview,
        trace_id: str = "",
        save_writes: int = 0,
        *,
        receipt: bool = False,
        cut_at_s: float | None = None,
    ) -> tuple[str, m.WriteReceipt | None]:
        writes.append((ticket.key, trace_id, save_writes))
        if ticket.key in fail_keys:
            return "segment_unreachable", None
        # a segment that signs receipts (slot = ticket id here); the router checks them at commit
        return "ok", (m.WriteReceipt(ticket.ticket_id, ticket.ticket_id, 1, RECEIPT_MAC) if receipt else None)

    def write_many(
        quads: Sequence[tuple[m.WriteTicket, memoryview, str, int]],
        *,
        receipt: bool = False,
        cut_at_s: float | None = None,
    ) -> list[tuple[str, m.WriteReceipt | None]]:
        streams.append([t.key for t, *_ in quads])
        return [write(t, d, trace, n, receipt=receipt) for t, d, trace, n in quads]

    streams: list[list[bytes]] = []
    kv.pool.write = write  # type: ignore[method-assign]
    kv.pool.write_many = write_many  # type: ignore[method-assign,assignment]
    kv.streams = streams  # type: ignore[attr-defined]
    return kv, writes


def prompt(n: int) -> list[int]:
    return [n, *range(1, CHUNKS * TPC)]


def objects(n: int) -> list[list[bytes]]:
    return [[bytes([n, c]) * 64] for c in range(CHUNKS)]


def save_all(kv: AsyncKvClient, prompts: list[int]) -> list[SaveResult]:
    async def run() -> list[SaveResult]:
        try:
            return list(
                await asyncio.gather(*(kv.save(prompt(n), objects(n), trace_id=f"t{n}") for n in prompts))
            )
        finally:
            await kv.close()

    return asyncio.run(run())


def test_a_save_alone_sends_one_begin_and_one_commit_per_shard() -> None:
    router = SaveRouter()
    kv, writes = client(router)
    (result,) = save_all(kv, [1])
    assert result == SaveResult(chunks_saved=CHUNKS, bytes_written=CHUNKS * 128)
    shards = set(router.count("put_begin"))
    assert router.count("put_begin") == router.count("put_commit") == Counter(dict.fromkeys(shards, 1))
    assert not router.count("put_abort")
    assert {trace for _, trace, _ in writes} == {"t1"}


def test_concurrent_saves_share_their_directory_requests() -> None:
    """8 saves started together: the first goes alone, the other 7 ride one request per shard
    (before, each save sent its own: 8 per shard and verb)."""
    router = SaveRouter()
    kv, writes = client(router)
    results = save_all(kv, list(range(10, 18)))
    assert all(r.chunks_saved == CHUNKS and r.chunks_failed == 0 for r in results)
    assert all(n <= 2 for n in router.count("put_begin").values()), router.count("put_begin")
    assert all(n <= 2 for n in router.count("put_commit").values()), router.count("put_commit")
    keys = [k for verb, _, ks, _ in router.requests if verb == "put_commit" for k in ks]
    assert len(keys) == len(set(keys)) == 8 * CHUNKS
    # The writes of saves that shared a put_begin carry its trace id: the segment confirms them
    # together, but never waits for more than the client writes at once.
    begin_traces = {trace for verb, _, _, trace in router.requests if verb == "put_begin"}
    assert {trace for _, trace, _ in writes} <= begin_traces
    assert max(n for _, _, n in writes) == kv._writes_at_once < 7 * CHUNKS


def test_the_same_prompt_saved_twice_at_once_never_names_a_key_twice_in_a_request() -> None:
    router = SaveRouter()
    kv, _ = client(router)
    results = save_all(kv, [5, 5, 5])
    assert all(r.chunks_saved == CHUNKS for r in results)  # the fake directory places every begin
    begins = [keys for verb, _, keys, _ in router.requests if verb == "put_begin"]
    assert sum(len(k) for k in begins) == 3 * CHUNKS  # each save's keys went, in separate requests


def test_a_failed_write_is_aborted_and_fails_its_chunk_only() -> None:
    router = SaveRouter()
    probe, _ = client(SaveRouter())
    bad = probe.chunk_groups(prompt(7))[2].member_key(*SPEC.required_members()[0]).to_bytes()
    kv, _ = client(router, frozenset((bad,)))
    (result,) = save_all(kv, [7])
    assert result.chunks_saved == CHUNKS - 1 and result.chunks_failed == 1
    assert result.causes == {"segment_unreachable": 1}
    aborted = [k for verb, _, keys, _ in router.requests if verb == "put_abort" for k in keys]
    committed = [k for verb, _, keys, _ in router.requests if verb == "put_commit" for k in keys]
    assert aborted == [bad] and bad not in committed and len(committed) == CHUNKS - 1


def save_thread_jobs(size: int) -> tuple[int, int, list[bytes]]:
    """(jobs the save threads got, writes, the checksums its put_begins named) for one save of
    CHUNKS objects of `size` bytes."""
    router = SaveRouter()
    named: list[bytes] = []
    ask = router.ask

    async def recording(shard: int, verb: str, message: msgspec.Struct, timeout_s: float, **kw: Any) -> Any:
        if isinstance(message, m.PutBegin):
            named.extend(o.checksum for o in message.objects)
        return await ask(shard, verb, message, timeout_s, **kw)

    router.ask = recording  # type: ignore[method-assign]
    kv, writes = client(router)
    submitted = []
    submit = kv._save_executor.submit

    def counting(fn: Any, *args: Any, **kw: Any) -> Any:
        submitted.append(fn)
        return submit(fn, *args, **kw)

    kv._save_executor.submit = counting  # type: ignore[method-assign,assignment]

    async def run() -> SaveResult:
        try:
            return await kv.save(prompt(3), [[bytes(size)] for _ in range(CHUNKS)])
        finally:
            await kv.close()

    assert asyncio.run(run()).chunks_saved == CHUNKS
    return len(submitted), len(writes), named


def test_a_save_hashes_nothing_before_put_begin_its_save_threads_only_write() -> None:
    """put_begin names no checksum (the segments hash what they store, a sent PUT names its own:
    `ObjectSpec.checksum`), so nothing is hashed before it: the only save-thread jobs are the
    write streams (one per ~`SAVE_WRITE_STREAM_BYTES_TARGET` of one segment's writes:
    `write_streams`), small save or large."""
    jobs, writes, named = save_thread_jobs(128)
    assert (jobs, writes) == (1, CHUNKS) and named == [b""] * CHUNKS
    size = (4 << 20) // CHUNKS + 1
    streams = write_streams([("seg-a", size)] * CHUNKS, SAVE_WRITE_STREAM_BYTES_TARGET)
    jobs, writes, named = save_thread_jobs(size)
    assert (jobs, writes) == (len(streams), CHUNKS) and named == [b""] * CHUNKS


class StrictRouter(SaveRouter):
    """Refuses a whole put_begin naming an empty object, as the directory does (`bad_request`)."""

    async def ask(self, shard: int, verb: str, message: msgspec.Struct, timeout_s: float, **kw: Any) -> Any:
        if isinstance(message, m.PutBegin) and any(o.size_bytes <= 0 for o in message.objects):
            await asyncio.sleep(0.002)
            raise BadRequest("object size 0 out of range")
        return await super().ask(shard, verb, message, timeout_s, **kw)


def test_a_save_the_directory_refuses_as_malformed_does_not_fail_the_saves_sharing_its_request() -> None:
    router = StrictRouter()
    kv, _ = client(router)

    async def run() -> list[SaveResult]:
        try:
            first = asyncio.ensure_future(kv.save(prompt(9), objects(9), trace_id="t9"))  # busy shards
            await asyncio.sleep(0)
            empty: list[list[bytes]] = [[b""] for _ in range(CHUNKS)]
            bad = asyncio.ensure_future(kv.save(prompt(1), empty, trace_id="bad"))
            good = asyncio.ensure_future(kv.save(prompt(2), objects(2), trace_id="good"))
            return list(await asyncio.gather(first, bad, good))
        finally:
            await kv.close()

    first, bad, good = asyncio.run(run())
    assert first.chunks_saved == CHUNKS
    assert good.chunks_saved == CHUNKS, good
    assert bad.chunks_saved == 0 and bad.causes == {"bad_request": CHUNKS}, bad
    shared = [
        keys for verb, _, keys, _ in router.requests if verb == "put_begin" and len(keys) > CHUNKS // SHARDS
    ]
    assert shared, "the bad and the good save never shared a put_begin: the test proves nothing"


def test_each_commit_carries_the_receipts_of_its_keys_writes() -> None:
    """Writes ask for receipts; each put_commit carries those of the keys it commits (none of an
    aborted key), so the directory confirms the replicas at commit (no confirm round trip)."""
    router = SaveRouter()
    probe, _ = client(SaveRouter())
    bad = probe.chunk_groups(prompt(7))[2].member_key(*SPEC.required_members()[0]).to_bytes()
    kv, _ = client(router, frozenset((bad,)))
    save_all(kv, [7, 8])
    committed = [k for verb, _, keys, _ in router.requests if verb == "put_commit" for k in keys]
    tickets = {r.ticket_id for r in router.receipts}
    assert len(router.receipts) == len(tickets) == len(committed) == 2 * CHUNKS - 1
    assert all(r.mac == RECEIPT_MAC and r.slot == r.ticket_id for r in router.receipts)


def test_a_saves_writes_to_a_segment_go_in_one_stream() -> None:
    """A save's small writes to one segment go as one pipelined stream (`SegmentPool.write_many`:
    one thread, one round trip; staged when co-located), not one thread each; their receipts
    still reach the commit."""
    for use_shm in (False, True):
        router = SaveRouter()
        kv, writes = client(router, use_shm=use_shm)
        (result,) = save_all(kv, [5])
        assert result.chunks_saved == CHUNKS and len(writes) == CHUNKS
        assert [len(s) for s in kv.streams] == [CHUNKS]  # type: ignore[attr-defined]
        assert len(router.receipts) == CHUNKS


def test_a_cancelled_save_waits_for_its_running_writes_and_aborts_what_was_placed() -> None:
    """A save cancelled while its writes run (`wait_for` timing out, a task cancelled): it
    returns only once the write threads that had started are done with the caller's buffers
    (`run_in_executor`'s future was cancelled at once, the thread going on), the client's
    in-flight accounting is given back only then, and the keys the directory placed for it are
    aborted in the background instead of staying reserved until the write TTL (review,
    2026-12-05)."""
    import threading
    import time as time_module

    router = SaveRouter()
    kv, _ = client(router)
    write_started = threading.Event()
    write_ended: list[float] = []

    def slow_write_many(quads: Sequence[Any], *, receipt: bool = False, **_: Any) -> list[Any]:
        write_started.set()
        time_module.sleep(0.4)  # reading the caller's buffers
        write_ended.append(time_module.monotonic())
        return [("ok", None)] * len(quads)

    kv.pool.write_many = slow_write_many  # type: ignore[method-assign,assignment]
    kv.pool.write = lambda t, d, *a, **k: slow_write_many([t])[0]  # type: ignore[method-assign]

    async def run() -> tuple[float, int, int]:
        try:
            task = asyncio.ensure_future(kv.save(prompt(CHUNKS), objects(CHUNKS)))
            await asyncio.to_thread(write_started.wait, 5)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            returned = time_module.monotonic()
            accounted = kv._save_bytes + kv._saves_running
            await asyncio.wait(list(kv._abandoned), timeout=5)
            return returned, accounted, len(kv._abandoned)
        finally:
            await kv.close()

    returned, accounted, _ = asyncio.run(run())
    assert write_ended and returned >= write_ended[-1]
    assert accounted == 0
    begun = [k for verb, _, keys, _ in router.requests if verb == "put_begin" for k in keys]
    aborted = [k for verb, _, keys, _ in router.requests if verb == "put_abort" for k in keys]
    assert len(begun) == CHUNKS and sorted(aborted) == sorted(begun)
    assert not [1 for verb, *_ in router.requests if verb == "put_commit"]


def test_a_save_whose_queued_writes_a_closing_client_cancels_ends_with_a_result() -> None:
    """`close()` with a save still writing: after waiting `save_timeout_ms` for it, the save
    executor's queued writes are cancelled. The save then ends with its result (those writes
    `closed`, their keys aborted), not with a `CancelledError` raised into a caller that was
    never cancelled (review, 2026-12-05)."""
    import time as time_module

    router = SaveRouter()
    kv, _ = client(router, transfers_max=2, save_timeout_ms=300)  # one save thread
    size = 3 << 20  # one object per write stream: three streams, one thread

    def slow_write(ticket: m.WriteTicket, data: memoryview, *args: Any, **kw: Any) -> Any:
        time_module.sleep(0.5)
        return "ok", None

    kv.pool.write = slow_write  # type: ignore[method-assign]

    async def run() -> SaveResult:
        task = asyncio.ensure_future(kv.save(prompt(3), [[bytes([c]) * size] for c in range(3)]))
        await asyncio.sleep(0.1)
        await kv.close()
        return await task

    result = asyncio.run(run())
    assert isinstance(result, SaveResult)
    assert result.chunks_saved == 1 and result.causes.get("closed") == 2


def test_the_write_phase_has_the_saves_timeout() -> None:
    """Each write is cut at the write phase's deadline (`save_timeout_ms` from its start: the
    segment pool's `cut_at_s`), and a write stream still queued then is never sent (`timeout`):
    a trickling segment held a save, and the caller's buffers, for a socket timeout per write
    (review, 2026-12-05)."""
    import time as time_module

    router = SaveRouter()
    kv, _ = client(router, transfers_max=2, save_timeout_ms=300)  # one save thread
    calls: list[float | None] = []

    def slow_write(
        ticket: m.WriteTicket, data: memoryview, *args: Any, cut_at_s: float | None = None, **kw: Any
    ) -> Any:
        calls.append(cut_at_s)
        time_module.sleep(0.4)  # past the phase's deadline: the next stream is not sent
        return "timeout", None

    kv.pool.write = slow_write  # type: ignore[method-assign]

    async def run() -> tuple[SaveResult, float]:
        try:
            started = time_module.monotonic()
            result = await kv.save(prompt(2), [[bytes([c]) * (3 << 20)] for c in range(2)])
            return result, started
        finally:
            await kv.close()

    result, started = asyncio.run(run())
    assert len(calls) == 1 and calls[0] is not None
    assert 0.25 < calls[0] - started < 3.0  # the deadline it was given: save_timeout_ms on
    assert result.chunks_failed == 2 and result.causes == {"timeout": 2}
