"""`close` and the saves it outlives.

- The aborts of a cancelled save may take `ABORT_PHASES` (2) × `save_timeout_ms` from its cancel:
  a `put_begin` out then is answered up to its deadline, and the aborts of what it placed have a
  deadline of their own. `close` waited one `save_timeout_ms`, for the requests held when it
  began only, then drained NATS under such an abort: its placements stayed reserved at the
  directory until the write TTL. Those still running when it stops waiting are counted
  (`kvfabric_client_close_aborts_unfinished_total`) and logged.
- A save still running when `close` stops waiting for it (it overran its deadlines, or its loop
  was stalled) went on after `close` returned: its commit went out on the drained connection.
  Now no begin, write or commit of it is performed once `close` gave up on it (answered
  `closed`; what was placed for it is aborted instead), and no save request goes once `close`
  is past its wait for aborts. No save starts once `close` began (`closed`).
- That wait is for the saves cut, the save write threads and the aborts together, before the
  directory is shut (review of the fix): it was for the held aborts only, so a commit sent just
  before the cut went on under the drain, and a cut save's abort, sent once its writes returned
  (close waited for the write threads only after the drain), was answered `closed` unsent and
  uncounted. An abort answered `closed` once the directory is shut is counted now.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from kvfabric.client import AsyncKvClient, KvClient
from kvfabric.client.aio_saves import ABORT_PHASES
from kvfabric.client.hits import SaveResult
from kvfabric.client.settings import ClientSettings
from kvfabric.client.sync import ClientStatus
from kvfabric.proto import directory as m
from tests.integration.clientkit import SPEC
from tests.unit.client.test_save_cancel_aborts import cancelled, keys_of, until
from tests.unit.client.test_save_sharing import CHUNKS, SaveRouter, client, objects, prompt


class Nats:
    """The client's NATS connection: records when it drained (what the directory had seen then)."""

    def __init__(self, router: SaveRouter) -> None:
        self.router = router
        self.requests_at_drain: int | None = None

    async def drain(self) -> None:
        self.requests_at_drain = len(self.router.requests)


# Long enough that the loop's timers keep their order on a loaded machine (they fire in deadline
# order: 0.6 + 0.6 after the begins went, the old wait's end 1.0 after the cancel).
LATE_TIMEOUT_S = 1.0


def drained(kv: AsyncKvClient, router: SaveRouter) -> Nats:
    nats = Nats(router)
    kv.nc = nats  # type: ignore[assignment]
    return nats


def polled(condition: Callable[[], bool], limit_s: float = 5.0) -> None:
    """(In a save thread) until `condition` holds, at most `limit_s`."""
    end = time.monotonic() + limit_s
    while not condition() and time.monotonic() < end:
        time.sleep(0.002)


class Watching(SaveRouter):
    """Records, as each put_abort reaches it, whether the client held it (`_abandoned`: `close`
    waits for it, and counts it if still running at its bound), and answers it `abort_delay_s`
    later; answers a put_commit only once the client's saves were cut (`commit_until_cut`),
    recording whether they were cut already when it came."""

    def __init__(self, *, abort_delay_s: float = 0.0, commit_until_cut: bool = False) -> None:
        super().__init__()
        self.kv: AsyncKvClient | None = None
        self.abort_delay_s = abort_delay_s
        self.commit_until_cut = commit_until_cut
        self.held_at_abort: list[bool] = []
        self.cut_at_commit: list[bool] = []

    async def ask(self, shard: int, verb: str, message: msgspec.Struct, timeout_s: float, **kw: Any) -> Any:
        kv = self.kv
        assert kv is not None
        if isinstance(message, m.PutAbort):
            self.held_at_abort.append(bool(kv._abandoned))
            await asyncio.sleep(self.abort_delay_s)
        if isinstance(message, m.PutCommit) and self.commit_until_cut:
            self.cut_at_commit.append(kv._saves_cut)
            await until(lambda: kv._saves_cut)
        return await super().ask(shard, verb, message, timeout_s, **kw)


def watched(router: Watching, timeout_s: float) -> tuple[AsyncKvClient, Nats]:
    kv, _ = client(router, save_timeout_ms=int(timeout_s * 1000))
    router.kv = kv
    return kv, drained(kv, router)


def shards_begun(router: SaveRouter) -> int:
    return len(router.count("put_begin"))


def test_close_waits_for_a_cancelled_saves_late_aborts_before_nats_drains() -> None:
    """The save is cancelled with its put_begins at the directory; they are answered 0.6
    `save_timeout_ms` later (within their deadline), the aborts of what they placed take 0.6
    more (within theirs): 1.2 after the cancel, past the one `save_timeout_ms` close waited."""
    assert ABORT_PHASES == 2

    class Late(SaveRouter):
        out = 0  # put_begins and put_aborts that reached it

        async def ask(
            self, shard: int, verb: str, message: msgspec.Struct, timeout_s: float, **kw: Any
        ) -> Any:
            if isinstance(message, m.PutBegin | m.PutAbort):
                self.out += 1
                await asyncio.sleep(0.6 * LATE_TIMEOUT_S)
            return await super().ask(shard, verb, message, timeout_s, **kw)

    router = Late()
    kv, _ = client(router, save_timeout_ms=int(LATE_TIMEOUT_S * 1000))
    nats = drained(kv, router)

    async def run() -> int:
        save = asyncio.ensure_future(kv.save(prompt(1), objects(1)))
        await until(lambda: router.out == 2)  # a put_begin per shard out
        await cancelled(save)
        await kv.close()
        return len(kv._abandoned)

    assert asyncio.run(run()) == 0
    begun = sorted(keys_of(router, "put_begin"))
    assert len(begun) == CHUNKS and sorted(keys_of(router, "put_abort")) == begun
    assert nats.requests_at_drain == len(router.requests)  # every abort answered before the drain
    assert kv.metrics.close_aborts_unfinished._value.get() == 0


def test_close_counts_and_logs_the_aborts_still_running_when_it_stops_waiting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An abort that outlives its deadline (a stalled loop, say) is not waited for without bound:
    close waits `aborts_bound_s`, then counts it."""
    router = SaveRouter()
    kv, _ = client(router, save_timeout_ms=100)
    drained(kv, router)

    async def run() -> float:
        stuck = asyncio.ensure_future(asyncio.sleep(30))
        kv._hold(stuck)
        started = time.monotonic()
        try:
            await kv.close()
            return time.monotonic() - started
        finally:
            stuck.cancel()

    took_s = asyncio.run(run())
    assert 0.2 <= took_s < 10  # 2 × 0.1 s and the 1 s grace, bounded
    assert kv.metrics.close_aborts_unfinished._value.get() == 1
    assert "1 aborts of cancelled saves unanswered at close" in caplog.text


def test_a_save_running_past_its_deadlines_at_close_commits_nothing_after_close_returned() -> None:
    """Its writes overrun their cut (5 `save_timeout_ms`, past close's 3): it committed on the
    drained connection after `close` returned. Now it ends `closed`, nothing committed, what was
    placed for it aborted (close waits for it once cut), and no request of it reaches the
    directory after the drain."""
    timeout_s = 0.3
    router = SaveRouter()
    kv, _ = client(router, save_timeout_ms=int(timeout_s * 1000))
    nats = drained(kv, router)
    write_many = kv.pool.write_many

    def overrunning(*args: Any, **kwargs: Any) -> Any:
        time.sleep(5 * timeout_s)  # (a save thread) past its cut and close's wait
        return write_many(*args, **kwargs)

    kv.pool.write_many = overrunning  # type: ignore[method-assign]

    async def run() -> tuple[SaveResult, int]:
        save = asyncio.ensure_future(kv.save(prompt(1), objects(1)))
        await asyncio.sleep(0.05)  # begun: writing
        await kv.close()
        at_close = len(router.requests)
        result = await save
        await asyncio.sleep(0.1)  # whatever it would still send
        assert len(router.requests) == at_close
        return result, at_close

    result, at_close = asyncio.run(run())
    assert nats.requests_at_drain == at_close  # nothing after the drain
    assert not keys_of(router, "put_commit")
    begun = sorted(keys_of(router, "put_begin"))
    assert len(begun) == CHUNKS and sorted(keys_of(router, "put_abort")) == begun
    assert result.chunks_saved == 0 and result.causes == {"closed": CHUNKS}
    assert kv.metrics.close_aborts_unfinished._value.get() == 0


class Cutting(SaveRouter):
    """Marks the client's saves cut (as `close` does when it stops waiting for them) as it answers
    a request of type `at`."""

    def __init__(self, at: type[msgspec.Struct]) -> None:
        super().__init__()
        self.at = at
        self.kv: AsyncKvClient | None = None

    async def ask(self, shard: int, verb: str, message: msgspec.Struct, timeout_s: float, **kw: Any) -> Any:
        reply = await super().ask(shard, verb, message, timeout_s, **kw)
        if isinstance(message, self.at) and self.kv is not None:
            self.kv._saves_cut = True
        return reply


@pytest.mark.parametrize(
    ("cut_at", "writes_made", "aborted"),
    [(None, False, False), (m.PutBegin, False, True)],
    ids=["before_its_begins", "before_its_writes"],
)
def test_a_save_close_gave_up_on_begins_and_writes_nothing_and_aborts_what_was_placed(
    cut_at: type[msgspec.Struct] | None, writes_made: bool, aborted: bool
) -> None:
    router = Cutting(cut_at or m.PutBegin)
    kv, writes = client(router)
    if cut_at is None:
        kv._saves_cut = True
    else:
        router.kv = kv
    result = asyncio.run(kv.save(prompt(1), objects(1)))
    assert result.chunks_saved == 0 and result.causes == {"closed": CHUNKS}
    assert bool(writes) is writes_made and not keys_of(router, "put_commit")
    begun = sorted(keys_of(router, "put_begin"))
    assert len(begun) == (CHUNKS if aborted else 0)
    assert sorted(keys_of(router, "put_abort")) == begun


def test_a_save_close_gave_up_on_after_its_writes_aborts_instead_of_committing() -> None:
    router = Watching()
    kv, writes = client(router)
    router.kv = kv
    write_many = kv.pool.write_many

    def then_cut(*args: Any, **kwargs: Any) -> Any:
        done = write_many(*args, **kwargs)
        kv._saves_cut = True  # (the save thread) close gave up on the save meanwhile
        return done

    kv.pool.write_many = then_cut  # type: ignore[method-assign]

    result = asyncio.run(kv.save(prompt(1), objects(1)))
    assert writes and not keys_of(router, "put_commit")
    assert sorted(keys_of(router, "put_abort")) == sorted(keys_of(router, "put_begin"))
    assert result.chunks_saved == 0 and result.causes == {"closed": CHUNKS}
    # its aborts were held (close waits for them, and counts those still running at its bound)
    assert router.held_at_abort == [True] * shards_begun(router)


def test_close_waits_for_a_commit_sent_before_it_cut_the_save() -> None:
    """The save's writes end as close's wait for saves nears its end (2.5 of its 3
    `save_timeout_ms`): its commit is at the directory when close cuts the saves, answered just
    after, within its deadline. Close held only what was sent after the cut: it drained NATS
    under the commit, which reached the directory after `close` returned. Now it waits for the
    saves it cut: the save ends committed before the drain.

    The writes' end is tied to close's progress, not to when the save began writing: they
    return 1.5 `save_timeout_ms` into close's second wait for saves (it begins, one
    `save_timeout_ms` in, by shutting the save executor down), so the commit goes half a
    `save_timeout_ms` before the cut and its deadline is half a `save_timeout_ms` past it (the
    commit must be sent before the cut, and be held past it within its deadline: that window is
    one `save_timeout_ms` wide whatever the test does, and the test sits in its middle)."""
    timeout_s = 1.0
    router = Watching(commit_until_cut=True)
    kv, nats = watched(router, timeout_s)
    writing = threading.Event()
    write_many = kv.pool.write_many
    second_wait: list[bool] = []  # whether the writes saw close's second wait begin

    def late(*args: Any, **kwargs: Any) -> Any:
        writing.set()
        executor: Any = kv._save_executor
        give_up = time.monotonic() + 10 * timeout_s
        while not executor._shutdown and time.monotonic() < give_up:  # close's second wait began
            time.sleep(0.005)
        second_wait.append(bool(executor._shutdown))
        time.sleep(1.5 * timeout_s)  # (a save thread) its commit then goes before the cut
        return write_many(*args, **kwargs)

    kv.pool.write_many = late  # type: ignore[method-assign]

    async def run() -> tuple[SaveResult, int]:
        save = asyncio.ensure_future(kv.save(prompt(1), objects(1)))
        await asyncio.to_thread(writing.wait, 5)
        await kv.close()
        at_close = len(router.requests)
        return await save, at_close

    result, at_close = asyncio.run(run())
    assert second_wait == [True]  # the writes waited for close (not given up at their bound)
    assert router.cut_at_commit == [False] * shards_begun(router)  # sent before the cut
    assert nats.requests_at_drain == at_close == len(router.requests)
    assert result.chunks_saved == CHUNKS
    assert sorted(keys_of(router, "put_commit")) == sorted(keys_of(router, "put_begin"))
    assert kv.metrics.close_aborts_unfinished._value.get() == 0


def test_a_cut_saves_abort_sent_as_its_writes_return_goes_before_the_drain() -> None:
    """The save's writes return during close's last wait (a little after it cut the save): its
    keys are aborted instead of committed, held, and the aborts (answered late) go before NATS
    drains. Close waited for the held aborts only and then for the write threads after the
    drain: the aborts were answered `closed` unsent, the placements held until the write TTL."""
    timeout_s = 0.2
    router = Watching(abort_delay_s=0.5 * timeout_s)
    kv, nats = watched(router, timeout_s)
    write_many = kv.pool.write_many

    def past_the_cut(*args: Any, **kwargs: Any) -> Any:
        polled(lambda: kv._saves_cut)  # (a save thread) overran its cut and close's wait
        time.sleep(0.25 * timeout_s)
        return write_many(*args, **kwargs)

    kv.pool.write_many = past_the_cut  # type: ignore[method-assign]

    async def run() -> SaveResult:
        save = asyncio.ensure_future(kv.save(prompt(1), objects(1)))
        await asyncio.sleep(0.05)  # begun: writing
        await kv.close()
        return await save

    result = asyncio.run(run())
    begun = sorted(keys_of(router, "put_begin"))
    assert len(begun) == CHUNKS and sorted(keys_of(router, "put_abort")) == begun
    assert not keys_of(router, "put_commit")
    assert nats.requests_at_drain == len(router.requests)  # the aborts answered before the drain
    assert router.held_at_abort == [True] * shards_begun(router)
    assert result.chunks_saved == 0 and result.causes == {"closed": CHUNKS}
    assert kv.metrics.close_aborts_unfinished._value.get() == 0


def test_a_cut_saves_abort_still_running_when_close_stops_waiting_is_counted() -> None:
    """The aborts that replace a cut save's commits stall (a stalled loop, say): close waits
    `aborts_bound_s` for them (held), then counts each one still running."""
    router = SaveRouter()
    kv, _ = client(router, save_timeout_ms=100)
    drained(kv, router)
    write_many = kv.pool.write_many

    def past_the_cut(*args: Any, **kwargs: Any) -> Any:
        polled(lambda: kv._saves_cut)
        return write_many(*args, **kwargs)

    kv.pool.write_many = past_the_cut  # type: ignore[method-assign]

    async def run() -> SaveResult:
        released = asyncio.Event()

        async def stalled(*args: Any, **kwargs: Any) -> tuple[object, str]:
            await released.wait()
            return "directory_timeout", ""

        kv._aborts.call = stalled  # type: ignore[method-assign]
        save = asyncio.ensure_future(kv.save(prompt(1), objects(1)))
        try:
            await asyncio.sleep(0.05)  # begun: writing
            await kv.close()
        finally:
            released.set()
        return await save

    result = asyncio.run(run())
    assert result.causes == {"closed": CHUNKS}
    assert kv.metrics.close_aborts_unfinished._value.get() == shards_begun(router)


def test_an_abort_answered_closed_once_the_directory_is_shut_is_counted() -> None:
    """A cut save whose writes return only after close's last wait (a write past every bound):
    its aborts are answered `closed` unsent (NATS drains), and counted: what they would end stays
    reserved until the write TTL. They were not counted."""
    router = SaveRouter()
    kv, _ = client(router, save_timeout_ms=100)
    nats = drained(kv, router)
    write_many = kv.pool.write_many

    def past_every_bound(*args: Any, **kwargs: Any) -> Any:
        polled(lambda: kv._directory_shut)
        return write_many(*args, **kwargs)

    kv.pool.write_many = past_every_bound  # type: ignore[method-assign]

    async def run() -> SaveResult:
        save = asyncio.ensure_future(kv.save(prompt(1), objects(1)))
        await asyncio.sleep(0.05)  # begun: writing
        await kv.close()
        return await save

    result = asyncio.run(run())
    assert result.causes == {"closed": CHUNKS}
    assert not keys_of(router, "put_abort", "put_commit")
    assert nats.requests_at_drain == len(router.requests)
    assert kv.metrics.close_aborts_unfinished._value.get() == shards_begun(router)


def test_close_waits_for_a_cancelled_saves_write_thread_before_nats_drains() -> None:
    """A save cancelled while its write thread runs returns after `save_timeout_ms` with the
    thread still running (`_wait_for_threads`); close waits for the save write threads before it
    shuts the directory and drains NATS (it waited for them only after the drain)."""
    timeout_s = 0.1
    router = SaveRouter()
    kv, _ = client(router, save_timeout_ms=int(timeout_s * 1000))
    nats = drained(kv, router)
    writing = threading.Event()
    ended_before_drain: list[bool] = []
    write_many = kv.pool.write_many

    def slow(*args: Any, **kwargs: Any) -> Any:
        writing.set()
        polled(lambda: kv._saves_cut)  # (a save thread) running until close cut the saves
        time.sleep(timeout_s)
        ended_before_drain.append(nats.requests_at_drain is None)
        return write_many(*args, **kwargs)

    kv.pool.write_many = slow  # type: ignore[method-assign]

    async def run() -> None:
        save = asyncio.ensure_future(kv.save(prompt(1), objects(1)))
        await asyncio.to_thread(writing.wait, 5)
        await cancelled(save)
        await kv.close()

    asyncio.run(run())
    assert ended_before_drain == [True]
    begun = sorted(keys_of(router, "put_begin"))
    assert len(begun) == CHUNKS and sorted(keys_of(router, "put_abort")) == begun


def test_no_save_request_goes_once_close_is_past_its_wait_for_aborts() -> None:
    """A cancelled save's abort (or a queued request) that would go after the aborts' wait, on
    a connection about to drain, is answered `closed` unsent."""
    router = SaveRouter()
    kv, _ = client(router)
    kv._directory_shut = True
    result = asyncio.run(kv.save(prompt(1), objects(1)))
    assert not router.requests
    assert result.chunks_saved == 0 and result.causes == {"closed": CHUNKS}


def test_no_save_starts_once_close_began() -> None:
    """A save asked while `close` waits for running ones, or after it, is dropped: `closed`
    (counted in saves_dropped), nothing sent; `KvClient.save_async` hands none (None)."""
    router = SaveRouter()
    kv, _ = client(router)
    drained(kv, router)

    async def run() -> tuple[SaveResult, SaveResult]:
        first = asyncio.ensure_future(kv.save(prompt(1), objects(1)))
        await asyncio.sleep(0)  # it runs: close waits for it
        closing = asyncio.ensure_future(kv.close())
        await asyncio.sleep(0)
        during = await kv.save(prompt(2), objects(2))
        await closing
        after = await kv.save(prompt(3), objects(3))
        assert (await first).chunks_saved == CHUNKS
        return during, after

    during, after = asyncio.run(run())
    assert during.causes == after.causes == {"closed": CHUNKS}
    assert kv.metrics.saves_dropped.labels("closed")._value.get() == 2
    assert len(keys_of(router, "put_begin")) == CHUNKS  # the first save's only

    sync_kv = KvClient.disabled(SPEC, "config_error", "test", settings=ClientSettings(nats_url="nats://x:1"))
    sync_kv.status = ClientStatus("enabled")
    sync_kv.close()
    assert sync_kv.save_async(prompt(1), objects(1)) is None
    assert sync_kv.save(prompt(1), objects(1)).causes == {"closed": CHUNKS}
    assert sync_kv.metrics.saves_dropped.labels("closed")._value.get() == 2
