"""A cancelled save leaves nothing reserved at the directory (docs/engines.md): every key a
`put_begin` placed for it is committed or aborted, whatever request of its own was queued or in
flight in the shared per-shard requests (`SharedCalls`) when it was cancelled; `close` waits for
those requests (review, 2026-12-06: a commit or abort queued then was withdrawn and never sent,
and what a begin in flight then placed was never aborted: both held a tenant's pending objects
and bytes until the write TTL)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import msgspec

from kvfabric.client import AsyncKvClient
from kvfabric.client.hits import SaveResult
from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from tests.integration.clientkit import SPEC
from tests.unit.client.test_save_sharing import CHUNKS, SaveRouter, client, objects, prompt


class HeldRouter(SaveRouter):
    """Holds each request of type `held` to a shard of `shards` until `release` is set;
    `entered`: (verb, shard) of every request that reached the directory, held or not."""

    def __init__(self, held: type[msgspec.Struct], shards: tuple[int, ...] = (0, 1)) -> None:
        super().__init__()
        self.held = held
        self.held_shards = shards
        self.release = asyncio.Event()
        self.entered: list[tuple[str, int]] = []

    async def ask(self, shard: int, verb: str, message: msgspec.Struct, timeout_s: float, **kw: Any) -> Any:
        self.entered.append((verb, shard))
        if isinstance(message, self.held) and shard in self.held_shards:
            await self.release.wait()
        return await super().ask(shard, verb, message, timeout_s, **kw)


def keys_of(router: SaveRouter, *verbs: str) -> list[ObjectKey]:
    return [k for verb, _, keys, _ in router.requests if verb in verbs for k in keys]


def key_of(kv: AsyncKvClient, n: int, chunk: int) -> bytes:
    return kv.chunk_groups(prompt(n))[chunk].member_key(*SPEC.required_members()[0]).to_bytes()


async def until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(5):
        while not condition():  # noqa: ASYNC110 (a bounded poll of the client's queues)
            await asyncio.sleep(0.001)


async def cancelled(task: asyncio.Future[SaveResult]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def assert_every_placed_key_ended_once(router: SaveRouter) -> None:
    begun = keys_of(router, "put_begin")
    ended = keys_of(router, "put_commit", "put_abort")
    assert begun and sorted(ended) == sorted(begun), f"placed {len(begun)}, ended {len(ended)}"


def test_a_save_cancelled_with_its_commit_queued_still_commits() -> None:
    """Save b's put_commit waits in the shared queue behind save a's (in flight) when b is
    cancelled: its commit still goes (before, it left the queue unsent and `abandon` counted its
    keys ended: neither committed nor aborted), and `close` waits for it."""
    router = HeldRouter(m.PutCommit)
    kv, _ = client(router)

    async def run() -> int:
        try:
            a = asyncio.ensure_future(kv.save(prompt(1), objects(1)))
            await until(
                lambda: router.entered.count(("put_commit", 0)) + router.entered.count(("put_commit", 1)) == 2
            )
            b = asyncio.ensure_future(kv.save(prompt(2), objects(2)))
            await until(lambda: sum(len(q) for q in kv._commits._queues.values()) == 2)  # b's, both shards
            await cancelled(b)
            router.release.set()
            assert (await a).chunks_saved == CHUNKS
        finally:
            await kv.close()
        return len(kv._abandoned)

    assert asyncio.run(run()) == 0  # close waited for b's commits
    committed = keys_of(router, "put_commit")
    assert {key_of(kv, 2, c) for c in range(CHUNKS)} <= set(committed)
    assert_every_placed_key_ended_once(router)


def test_a_save_cancelled_with_its_abort_queued_still_aborts() -> None:
    """As for a commit: save b's put_abort (a failed write) queued behind save a's when b is
    cancelled still goes (before, b's failed key stayed reserved until the write TTL)."""
    probe, _ = client(SaveRouter())
    a_bad = key_of(probe, 1, 0)
    shard = probe._router().shard_of(a_bad)
    b_bad = next(k for c in range(CHUNKS) if probe._router().shard_of(k := key_of(probe, 2, c)) == shard)
    router = HeldRouter(m.PutAbort, (shard,))
    kv, _ = client(router, frozenset((a_bad, b_bad)))

    async def run() -> None:
        try:
            a = asyncio.ensure_future(kv.save(prompt(1), objects(1)))
            await until(lambda: ("put_abort", shard) in router.entered)
            b = asyncio.ensure_future(kv.save(prompt(2), objects(2)))
            await until(lambda: bool(kv._aborts._queues.get(shard)))
            await cancelled(b)
            router.release.set()
            assert (await a).chunks_failed == 1
        finally:
            await kv.close()

    asyncio.run(run())
    assert b_bad in keys_of(router, "put_abort") and b_bad not in keys_of(router, "put_commit")
    assert_every_placed_key_ended_once(router)


def test_a_save_cancelled_while_its_begin_is_out_aborts_what_the_begin_places() -> None:
    """Save a's put_begins are at the directory and save b's queued behind them when both are
    cancelled: once the begins' answers come, what they placed for a is aborted (before, nothing:
    a's table had no answer when abandoned); b's begins never go (withdrawn unsent: nothing to
    abort); `close` waits for the aborts."""
    router = HeldRouter(m.PutBegin)
    kv, _ = client(router)

    async def run() -> int:
        try:
            a = asyncio.ensure_future(kv.save(prompt(1), objects(1)))
            await until(
                lambda: router.entered.count(("put_begin", 0)) + router.entered.count(("put_begin", 1)) == 2
            )
            b = asyncio.ensure_future(kv.save(prompt(2), objects(2)))
            await until(lambda: sum(len(q) for q in kv._begins._queues.values()) == 2)
            await cancelled(a)
            await cancelled(b)
            router.release.set()
        finally:
            await kv.close()
        return len(kv._abandoned)

    assert asyncio.run(run()) == 0
    a_keys = sorted(key_of(kv, 1, c) for c in range(CHUNKS))
    assert sorted(keys_of(router, "put_begin")) == a_keys  # b's begins were withdrawn
    assert sorted(keys_of(router, "put_abort")) == a_keys
    assert not keys_of(router, "put_commit")
    assert_every_placed_key_ended_once(router)


def test_a_save_cancelled_with_one_shards_begin_answered_and_one_out_aborts_both() -> None:
    """Shard 0's put_begin answered, shard 1's at the directory when the save is cancelled: the
    answer that came (before, dropped with the cancelled wait for both) and the one that comes
    after are both aborted."""
    router = HeldRouter(m.PutBegin, (1,))
    kv, _ = client(router)

    async def run() -> None:
        try:
            task = asyncio.ensure_future(kv.save(prompt(1), objects(1)))
            await until(lambda: ("put_begin", 1) in router.entered and bool(keys_of(router, "put_begin")))
            await asyncio.sleep(0.01)  # shard 0's answer reaches the save
            await cancelled(task)
            router.release.set()
        finally:
            await kv.close()

    asyncio.run(run())
    assert sorted(keys_of(router, "put_abort")) == sorted(key_of(kv, 1, c) for c in range(CHUNKS))
    assert_every_placed_key_ended_once(router)


def test_a_save_cancelled_as_its_commits_start_still_commits(monkeypatch: Any) -> None:
    """Cancelled in the loop turn its two shards' commits were made in, before their tasks first
    ran: neither was sent, and `abandon` counted their keys ended (review, 2026-12-06)."""
    from kvfabric.client import save_table

    router = SaveRouter()
    kv, _ = client(router)
    writes_done = save_table.SaveTable.writes_done
    saving: list[asyncio.Future[SaveResult]] = []

    def and_cancel(self: Any, outcomes: Any, now_ms: int) -> Any:
        effects = writes_done(self, outcomes, now_ms)
        assert len(effects) == 2  # a commit per shard: the step that makes tasks
        asyncio.get_running_loop().call_soon(saving[0].cancel)
        return effects

    monkeypatch.setattr(save_table.SaveTable, "writes_done", and_cancel)

    async def run() -> None:
        saving.append(asyncio.ensure_future(kv.save(prompt(1), objects(1))))
        with contextlib.suppress(asyncio.CancelledError):
            await saving[0]
        await kv.close()

    asyncio.run(run())
    assert sorted(keys_of(router, "put_commit", "put_abort")) == sorted(keys_of(router, "put_begin"))
    assert len(keys_of(router, "put_begin")) == CHUNKS


def test_close_lets_a_save_still_running_past_its_wait_end_before_nats_drains() -> None:
    """A save has three phases of `save_timeout_ms` each; `close` waited one, then drained NATS
    under a save still writing: its commit or abort failed on the closed connection, its
    placements reserved until the write TTL (review, stop 65). Now its commit goes first."""

    class Slow(SaveRouter):
        drained = False

        async def ask(
            self, shard: int, verb: str, message: msgspec.Struct, timeout_s: float, **kw: Any
        ) -> Any:
            assert not self.drained, f"{verb} sent after the drain"
            if isinstance(message, m.PutBegin):
                await asyncio.sleep(0.2)  # within its phase's timeout, most of close's wait
            return await super().ask(shard, verb, message, timeout_s, **kw)

    router = Slow()
    kv, _ = client(router, save_timeout_ms=300)
    write_many = kv.pool.write_many

    def slow_writes(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.2)  # (a transfer thread) the save is writing when close's wait ends
        return write_many(*args, **kwargs)

    kv.pool.write_many = slow_writes  # type: ignore[method-assign]

    class Nats:
        async def drain(self) -> None:
            router.drained = True

    kv.nc = Nats()  # type: ignore[assignment]

    async def run() -> SaveResult:
        save = asyncio.ensure_future(kv.save(prompt(1), objects(1)))
        await asyncio.sleep(0.01)
        await kv.close()
        return await save

    result = asyncio.run(run())
    assert router.drained and result.chunks_saved == CHUNKS
    assert_every_placed_key_ended_once(router)
    assert sorted(keys_of(router, "put_commit")) == sorted(keys_of(router, "put_begin"))


def test_a_save_reaching_its_writes_after_close_shut_the_executor_ends_closed() -> None:
    """`close` shuts the save executor down before NATS drains; a save still in its begin phase
    then reached its writes and `submit` raised RuntimeError out of `save`, which never raises
    for a cluster's state (review, stop 65). Its writes end `closed`, its keys aborted."""
    router = SaveRouter()
    kv, _ = client(router)
    kv._save_executor.shutdown(wait=False, cancel_futures=True)  # as close does mid-save
    result = asyncio.run(kv.save(prompt(1), objects(1)))
    assert result.chunks_saved == 0 and result.causes.get("closed") == CHUNKS
    assert sorted(keys_of(router, "put_abort")) == sorted(keys_of(router, "put_begin"))
