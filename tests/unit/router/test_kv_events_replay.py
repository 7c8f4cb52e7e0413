"""The router's KV-event follower with vLLM's replay socket (`replay_endpoint`): a gap the
engine's buffer covers is filled without clearing the map; one it does not cover, or an engine
that restarted, clears the map and applies the buffer's run before the live batch; a replay that
fails clears as without replay; a follower that starts replays the buffer before any live batch
and skips the live batches it already held. The replay side is a ZMQ ROUTER speaking vLLM 0.32's
protocol (`ZmqEventPublisher._service_replay`: `(id, "", start)` in; `(id, "", topic, seq,
payload)` per buffered batch from `start`, then `(id, "", "", -1, "")`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from unittest.mock import patch

import pytest
import zmq
import zmq.asyncio

from kvfabric.core.routing_events import EngineStored, RoutingEvent
from kvfabric.router import kv_events
from kvfabric.router.kv_events import KvEventsFollower
from kvfabric.testing.ports import free_port
from tests.unit.router.test_kv_events import batch, stored

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def payload(seq: int, engine: int = 0) -> bytes:
    """Batch `seq`: one block whose hash is its sequence number (what was fed says which), plus
    `engine` (a restarted engine's blocks are others)."""
    return batch(stored([engine + seq], None, [1, 2, 3, 4]))


def fed_seqs(fed: list[RoutingEvent]) -> list[int | str]:
    """What reached the core: each stored block's hash (= its batch), "clear" for a clear."""
    return [e.block_hashes[0] if isinstance(e, EngineStored) else "clear" for e in fed]  # type: ignore[misc]


@contextlib.asynccontextmanager
async def vllm_replay(
    context: zmq.asyncio.Context,
    buffered: list[int],
    asked: list[int],
    *,
    endpoint: str = "",
    engine: int = 0,
    end: bool = True,
    lossy_after: int | None = None,
    cut: tuple[int, int] | None = None,
) -> AsyncIterator[str]:
    """A replay ROUTER holding batches `buffered`; each request's start goes into `asked`.
    `end`: False loses the end marker; `lossy_after`: of each answer, the messages after the
    first that many are sent every other one (vLLM's ROUTER drops past its send queue); `cut`
    (answer, n): that answer (0: the first) sends its first n batches, the rest and its end
    marker dropped."""
    endpoint = endpoint or f"tcp://127.0.0.1:{free_port()}"
    sock = context.socket(zmq.ROUTER)
    await bind_again(sock, endpoint)

    async def serve() -> None:
        while True:
            client, _, start_bytes = await sock.recv_multipart()
            start = int.from_bytes(start_bytes, "big")
            asked.append(start)
            cut_at = cut[1] if cut is not None and cut[0] == len(asked) - 1 else None
            sent = 0
            for seq in buffered:
                if seq >= start:
                    sent += 1
                    if lossy_after is not None and sent > lossy_after and sent % 2:
                        continue  # dropped
                    if cut_at is not None and sent > cut_at:
                        break  # dropped, the end marker too
                    await sock.send_multipart(
                        [client, b"", b"", seq.to_bytes(8, "big"), payload(seq, engine)]
                    )
            if end and (cut_at is None or sent <= cut_at):
                await sock.send_multipart([client, b"", b"", END_SEQ, b""])

    task = asyncio.create_task(serve())
    try:
        yield endpoint
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        sock.close(linger=0)


async def bind_again(sock: zmq.asyncio.Socket, endpoint: str) -> None:
    """Bind, waiting for a socket closed on the same endpoint to let it go (ZMQ closes in its
    I/O thread, after `close` returns)."""
    for _ in range(100):
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE:
                raise
            await asyncio.sleep(0.02)
    sock.bind(endpoint)


def live(seq: int) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), payload(seq)]


def replaying(
    buffered: list[int],
    live_seqs: list[int],
    *,
    end: bool = True,
    lossy_after: int | None = None,
    cut: tuple[int, int] | None = None,
    started: bool = False,
) -> tuple[list[int | str], list[int], KvEventsFollower]:
    """Live batches `live_seqs` through `receive`, the engine's buffer holding `buffered` (the
    ROUTER's `end`, `lossy_after` and `cut` as `vllm_replay`'s); `started`: the follower's
    replay at its start first, as `run` does once subscribed."""
    fed: list[RoutingEvent] = []
    asked: list[int] = []

    async def feed(event: RoutingEvent) -> None:
        fed.append(event)

    async def run() -> KvEventsFollower:
        context = zmq.asyncio.Context()
        try:
            async with vllm_replay(
                context, buffered, asked, end=end, lossy_after=lossy_after, cut=cut
            ) as endpoint:
                follower = KvEventsFollower("e1", "tcp://unused:1", feed, context, replay=endpoint)
                if started:
                    await follower._start_from_replay()
                for seq in live_seqs:
                    await follower.receive(live(seq))
                return follower
        finally:
            context.destroy(linger=0)

    follower = asyncio.run(run())
    return fed_seqs(fed), asked, follower


def test_a_gap_the_engines_buffer_covers_is_filled_in_order_and_the_map_kept() -> None:
    fed, asked, follower = replaying(list(range(0, 12)), [5, 6, 9, 10])
    assert asked == [0, 7]  # the first batch heard: everything before it; the gap: from 7
    assert fed == ["clear", 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    c = follower.counters
    assert (c["gaps"], c["gaps_replayed"], c["replayed"], c["replay_failures"]) == (1, 1, 7, 0)


def test_a_gap_the_buffer_no_longer_covers_clears_then_applies_its_run_before_the_live_batch() -> None:
    fed, asked, follower = replaying([8, 9, 10, 11], [5, 6, 10])
    assert asked == [0, 7]
    # 5 heard first (the buffer holds nothing before it); 7 is gone from the buffer: cleared,
    # then 8 and 9, then the live 10
    assert fed == ["clear", 5, 6, "clear", 8, 9, 10]
    assert follower.counters["gaps_replayed"] == 0 and follower.counters["gaps"] == 1


def test_an_engine_that_restarted_is_replayed_from_its_start_after_a_clear() -> None:
    # heard 4, 5 of the old engine; the restarted one publishes 0, 1, 2 and the follower hears 2
    fed, asked, _ = replaying([0, 1, 2], [4, 5, 2])
    assert asked == [0, 0]
    assert fed[-4:] == ["clear", 0, 1, 2]


def test_a_replay_that_fails_clears_the_map_as_without_replay() -> None:
    fed: list[RoutingEvent] = []

    async def feed(event: RoutingEvent) -> None:
        fed.append(event)

    async def run() -> KvEventsFollower:
        context = zmq.asyncio.Context()
        nobody = f"tcp://127.0.0.1:{free_port()}"  # no ROUTER there: no answer
        try:
            with patch.object(kv_events, "REPLAY_TIMEOUT_S", 0.2):
                follower = KvEventsFollower("e1", "tcp://unused:1", feed, context, replay=nobody)
                follower._last_seq = 5  # as after batch 5
                await follower.receive(live(9))
                return follower
        finally:
            context.destroy(linger=0)

    follower = asyncio.run(run())
    assert fed_seqs(fed) == ["clear", 9]
    assert follower.counters["replay_failures"] == 1 and follower.counters["gaps_replayed"] == 0


def test_a_follower_that_starts_replays_the_buffer_first_and_skips_what_it_held() -> None:
    """A router started while the engine holds blocks (and publishes nothing new): the map is
    filled from the buffer at once; the live batches the buffer held are not applied twice."""
    pub_endpoint = f"tcp://127.0.0.1:{free_port()}"
    fed: list[RoutingEvent] = []
    asked: list[int] = []

    async def run() -> KvEventsFollower:
        context = zmq.asyncio.Context()
        pub = context.socket(zmq.PUB)
        pub.bind(pub_endpoint)
        got_live = asyncio.Event()

        async def feed(event: RoutingEvent) -> None:
            fed.append(event)
            if isinstance(event, EngineStored) and event.block_hashes == [4]:
                got_live.set()

        try:
            async with vllm_replay(context, [0, 1, 2, 3], asked) as endpoint:
                follower = KvEventsFollower("e1", pub_endpoint, feed, context, replay=endpoint)
                task = asyncio.create_task(follower.run())
                try:
                    for _ in range(100):  # the replay, then live 3 (held) and 4 until heard
                        await asyncio.sleep(0.05)
                        if len(fed) >= 4:
                            await pub.send_multipart(live(3))
                            await pub.send_multipart(live(4))
                            with contextlib.suppress(TimeoutError):
                                await asyncio.wait_for(got_live.wait(), 0.05)
                        if got_live.is_set():
                            break
                finally:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                return follower
        finally:
            pub.close(linger=0)
            context.destroy(linger=0)

    follower = asyncio.run(run())
    assert asked[0] == 0
    seqs = fed_seqs(fed)
    assert seqs[:4] == [0, 1, 2, 3]  # before anything live
    assert seqs.count(4) == 1 and "clear" not in seqs, seqs
    assert follower.counters["duplicates"] >= 1 and follower.counters["gaps"] == 0


def test_a_replay_with_a_hole_the_buffer_lost_is_trusted_only_after_it() -> None:
    """vLLM's ROUTER drops what its send queue cannot hold: a gap replay with a hole is no
    filled gap (batch 8 might have removed a block): cleared, then the run after the hole."""
    fed, asked, follower = replaying([7, 9, 10, 11], [5, 6, 10])
    assert asked == [0, 7, 8]  # asked again from the hole: not in the buffer
    assert fed == ["clear", 5, 6, "clear", 9, 10]
    assert follower.counters["gaps_replayed"] == 0
    # the same at the start: only the run that ends just before the first live batch
    fed, _, _ = replaying([0, 1, 3, 4], [5])
    assert fed == ["clear", 3, 4, 5]


def test_a_replay_whose_end_marker_is_lost_keeps_what_came_and_stops_at_the_live_batch() -> None:
    with patch.object(kv_events, "REPLAY_TIMEOUT_S", 0.3):
        # a gap: done at the live batch's number, without waiting for the end
        fed, _, follower = replaying(list(range(0, 12)), [5, 6, 9], end=False)
        assert fed == ["clear", 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
        assert follower.counters["gaps_replayed"] == 1
        assert follower.counters["replay_failures"] == 0  # each stopped at its live batch
    # the buffer ends before the live batch: the round ends after a silence, what came kept
    fed, _, follower = replaying([0, 1, 2], [3], end=False)
    assert fed == ["clear", 0, 1, 2, 3]
    assert follower.counters["replay_failures"] == 0 and follower.counters["replays_skipped"] == 0
    with patch.object(kv_events, "REPLAY_SILENCE_S", 10.0), patch.object(kv_events, "REPLAY_TIMEOUT_S", 0.3):
        # a silence longer than the whole replay's time: it times out, and keeps what came
        fed, _, follower = replaying([0, 1, 2], [3], end=False)
        assert fed == ["clear", 0, 1, 2, 3]
        assert follower.counters["replay_failures"] == 1
        assert follower.counters["replays_skipped"] == 0  # it got something: asked again next time


def test_a_replay_endpoint_that_answers_nothing_is_not_asked_again_for_a_while() -> None:
    fed: list[RoutingEvent] = []

    async def feed(event: RoutingEvent) -> None:
        fed.append(event)

    async def run() -> KvEventsFollower:
        context = zmq.asyncio.Context()
        nobody = f"tcp://127.0.0.1:{free_port()}"
        try:
            with patch.object(kv_events, "REPLAY_TIMEOUT_S", 0.2):
                follower = KvEventsFollower("e1", "tcp://unused:1", feed, context, replay=nobody)
                follower._last_seq = 5
                await follower.receive(live(9))
                await follower.receive(live(12))  # another gap at once: no second wait
                return follower
        finally:
            context.destroy(linger=0)

    follower = asyncio.run(run())
    assert fed_seqs(fed) == ["clear", 9, "clear", 12]
    assert follower.counters["replay_failures"] == 1 and follower.counters["replays_skipped"] == 1


def test_after_the_duplicates_window_a_lower_number_is_an_engine_that_restarted() -> None:
    with patch.object(kv_events, "DUPLICATES_S", 0.0):
        fed, _, _ = replaying([0, 1, 2, 3], [3], started=True)  # 3: no longer a duplicate
    assert fed == [0, 1, 2, 3, "clear", 0, 1, 2, 3]


def test_a_dropped_connection_is_a_new_engine_even_when_the_numbers_seem_to_follow() -> None:
    """The engine restarts while the follower is subscribed; the new engine's first batch heard
    is 5 (its 0..4 published before the subscription was made again) and its buffer holds 0..4,
    as a gap of the old engine would: the map is cleared, not kept with the old engine's blocks,
    and the new engine's buffer is replayed after the clear (on the new subscription)."""
    pub_endpoint = f"tcp://127.0.0.1:{free_port()}"
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    fed: list[RoutingEvent] = []
    asked_old: list[int] = []
    asked_new: list[int] = []

    async def run() -> KvEventsFollower:
        context = zmq.asyncio.Context()
        heard = asyncio.Event()

        async def feed(event: RoutingEvent) -> None:
            fed.append(event)
            heard.set()

        async def publish_until_heard(
            pub: zmq.asyncio.Socket, seqs: range, engine: int, buffer: list[int]
        ) -> None:
            for seq in seqs:
                heard.clear()
                buffer.append(seq)  # what the engine publishes, its replay buffer holds
                await pub.send_multipart([b"", seq.to_bytes(8, "big"), payload(seq, engine)])
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(heard.wait(), 0.1)
                # heard: any live batch of this engine's (the replay's are below seqs.start)
                if any(isinstance(v, int) and v >= engine + seqs.start for v in fed_seqs(fed)):
                    return
            raise AssertionError(f"never heard: {fed_seqs(fed)} {follower.counters}")

        follower = KvEventsFollower("e1", pub_endpoint, feed, context, replay=replay_endpoint)
        try:
            pub = context.socket(zmq.PUB)
            await bind_again(pub, pub_endpoint)
            old_buffer: list[int] = []
            async with vllm_replay(context, old_buffer, asked_old, endpoint=replay_endpoint):
                task = asyncio.create_task(follower.run())
                await publish_until_heard(pub, range(0, 200), engine=0, buffer=old_buffer)  # the old engine
                pub.close(linger=0)
            pub = context.socket(zmq.PUB)  # restarted: same endpoints, numbers from 0 again
            await bind_again(pub, pub_endpoint)
            new_buffer = [0, 1, 2, 3, 4]
            async with vllm_replay(context, new_buffer, asked_new, endpoint=replay_endpoint, engine=1000):
                await publish_until_heard(pub, range(5, 200), engine=1000, buffer=new_buffer)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            pub.close(linger=0)
        finally:
            context.destroy(linger=0)
        return follower

    follower = asyncio.run(run())
    seqs = fed_seqs(fed)
    first_new = next(i for i, v in enumerate(seqs) if isinstance(v, int) and v >= 1000)
    assert "clear" in seqs[:first_new], seqs  # the old engine's blocks went before the new one's
    assert seqs[first_new : first_new + 6] == [1000, 1001, 1002, 1003, 1004, 1005], seqs
    assert asked_old[:1] == [0] and asked_new[:1] == [0], (asked_old, asked_new)  # both asked from 0
    c = follower.counters
    assert c["disconnects"] >= 1 and c["gaps_replayed"] == 0 and c["replays_skipped"] == 0, c


def test_a_dropped_connection_clears_the_map_at_once_while_the_engine_is_silent() -> None:
    """The engine dies: its blocks stop counting when the connection drops, not when (if ever)
    a next batch arrives."""
    pub_endpoint = f"tcp://127.0.0.1:{free_port()}"
    fed: list[RoutingEvent] = []

    async def run() -> KvEventsFollower:
        context = zmq.asyncio.Context()

        async def feed(event: RoutingEvent) -> None:
            fed.append(event)

        follower = KvEventsFollower("e1", pub_endpoint, feed, context)
        try:
            pub = context.socket(zmq.PUB)
            await bind_again(pub, pub_endpoint)
            task = asyncio.create_task(follower.run())
            for seq in range(200):
                await pub.send_multipart(live(seq))
                await asyncio.sleep(0.05)
                if fed:
                    break
            pub.close(linger=0)  # the engine is gone, and says nothing more
            for _ in range(100):
                await asyncio.sleep(0.05)
                if follower.counters["disconnects"]:
                    break
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        finally:
            context.destroy(linger=0)
        return follower

    follower = asyncio.run(run())
    seqs = fed_seqs(fed)
    assert follower.counters["disconnects"] == 1 and seqs[-1] == "clear", seqs


@pytest.mark.parametrize("end", [True, False])
def test_a_lossy_replay_is_asked_again_from_its_first_hole_until_whole(end: bool) -> None:
    """vLLM's ROUTER drops what its send queue cannot hold: each ask recovers its first
    messages, so asking again from the first hole fills the buffer's run in rounds (its end
    marker, the last message into the queue, dropped too or not)."""
    fed, asked, follower = replaying(list(range(20)), [], end=end, lossy_after=4, started=True)
    assert fed == list(range(20))
    assert asked[0] == 0 and len(asked) > 2 and asked == sorted(asked)
    assert follower.counters["replay_rounds"] == len(asked) - 1


def test_a_lossy_replay_of_a_buffer_that_moved_on_is_filled_from_its_first_batch() -> None:
    """A long-running engine's buffer no longer starts at 0: the holes are filled from its
    first batch on."""
    fed, _, _ = replaying(list(range(100, 120)), [], lossy_after=4, started=True)
    assert fed == list(range(100, 120))


def test_an_engine_whose_buffer_is_empty_answers_and_is_asked_again_at_the_next_gap() -> None:
    """An end marker alone (an engine that has published nothing yet, or just restarted) is an
    answer, not an endpoint down: the next replay is asked, not skipped for `REPLAY_SKIP_S`."""
    fed, asked, follower = replaying([], [3], started=True)
    assert asked == [0, 0] and fed == ["clear", 3]
    assert follower.counters["replays_skipped"] == 0 and follower.counters["replay_failures"] == 0


def test_a_gap_replay_whose_tail_was_dropped_asks_again_for_it() -> None:
    """The gap 7..9's first answer brings 7 alone (8, 9 and the end marker dropped): 8 and 9
    were published before the live 10, so the replay asks again from 8 and the map is kept."""
    fed, asked, follower = replaying(list(range(0, 12)), [5, 6, 10], cut=(1, 1))
    assert asked == [0, 7, 8]
    assert fed == ["clear", 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert follower.counters["gaps_replayed"] == 1 and follower.counters["replay_rounds"] == 1


def test_a_live_batch_after_the_replayed_ones_ends_the_duplicates_window() -> None:
    """After the start replay (0..3) the live 4 comes: a 3 heard after it is no batch the
    replay held but a restarted engine's (cleared, its buffer's run applied)."""
    fed, _, follower = replaying([0, 1, 2, 3], [4, 3], started=True)
    assert fed == [0, 1, 2, 3, 4, "clear", 0, 1, 2, 3]
    assert follower.counters["duplicates"] == 0


def test_a_buffer_larger_than_the_replay_bound_gives_its_newest_batches() -> None:
    with patch.object(kv_events, "REPLAY_BATCHES_MAX", 5):
        fed, _, follower = replaying(list(range(12)), [], started=True)
    assert fed == [7, 8, 9, 10, 11]
    assert follower.counters["replay_failures"] == 0


def test_a_replay_keeps_at_most_its_byte_bound_of_the_newest_batches() -> None:
    """20,000 batches of up to 16 MiB each were kept of a replay (an unauthenticated ZMQ peer's):
    now at most `REPLAY_BYTES_MAX` bytes of them, the newest (review, 2026-12-06)."""
    size = len(payload(11, 0))
    assert all(len(payload(seq, 0)) == size for seq in range(12))
    with patch.object(kv_events, "REPLAY_BYTES_MAX", 4 * size):
        fed, _, follower = replaying(list(range(12)), [], started=True)
    assert fed == [8, 9, 10, 11]
    assert follower.counters["replay_failures"] == 0


def test_the_retry_backoff_starts_again_after_a_follow_that_worked() -> None:
    """Two failures double the wait (0.5, 1 s); a follow that ended with its connection (it
    worked) starts the backoff again: the next failure waits 0.5 s, not 2."""
    slept: list[float] = []
    outcomes = iter(["fail", "fail", "ok", "fail"])

    async def follow() -> None:
        if next(outcomes) == "fail":
            raise RuntimeError("boom")

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 4:
            raise asyncio.CancelledError

    fed: list[RoutingEvent] = []

    async def feed(event: RoutingEvent) -> None:
        fed.append(event)

    async def run() -> None:
        context = zmq.asyncio.Context()
        try:
            follower = KvEventsFollower("e1", "tcp://unused:1", feed, context)
            with (
                patch.object(follower, "_follow", follow),
                patch.object(asyncio, "sleep", sleep),
                contextlib.suppress(asyncio.CancelledError),
            ):
                await follower.run()
        finally:
            context.destroy(linger=0)

    asyncio.run(run())
    assert slept == [
        kv_events.RETRY_S_MIN,
        2 * kv_events.RETRY_S_MIN,
        kv_events.RESUBSCRIBE_S,
        kv_events.RETRY_S_MIN,
    ]
    assert fed_seqs(fed) == ["clear"] * 3  # each failure cleared the engine's map
