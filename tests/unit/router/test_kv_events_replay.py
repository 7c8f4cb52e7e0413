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

import zmq
import zmq.asyncio

from kvfabric.core.routing_events import EngineStored, RoutingEvent
from kvfabric.router import kv_events
from kvfabric.router.kv_events import KvEventsFollower
from kvfabric.testing.ports import free_port
from tests.unit.router.test_kv_events import batch, stored

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def payload(seq: int) -> bytes:
    """Batch `seq`: one block whose hash is its sequence number (what was fed says which)."""
    return batch(stored([seq], None, [1, 2, 3, 4]))


def fed_seqs(fed: list[RoutingEvent]) -> list[int | str]:
    """What reached the core: each stored block's hash (= its batch), "clear" for a clear."""
    return [e.block_hashes[0] if isinstance(e, EngineStored) else "clear" for e in fed]  # type: ignore[misc]


@contextlib.asynccontextmanager
async def vllm_replay(
    context: zmq.asyncio.Context, buffered: list[int], asked: list[int]
) -> AsyncIterator[str]:
    """A replay ROUTER holding batches `buffered`; each request's start goes into `asked`."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sock = context.socket(zmq.ROUTER)
    sock.bind(endpoint)

    async def serve() -> None:
        while True:
            client, _, start_bytes = await sock.recv_multipart()
            start = int.from_bytes(start_bytes, "big")
            asked.append(start)
            for seq in buffered:
                if seq >= start:
                    await sock.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), payload(seq)])
            await sock.send_multipart([client, b"", b"", END_SEQ, b""])

    task = asyncio.create_task(serve())
    try:
        yield endpoint
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        sock.close(linger=0)


def live(seq: int) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), payload(seq)]


def replaying(
    buffered: list[int], live_seqs: list[int]
) -> tuple[list[int | str], list[int], KvEventsFollower]:
    """Live batches `live_seqs` through `receive`, the engine's buffer holding `buffered`."""
    fed: list[RoutingEvent] = []
    asked: list[int] = []

    async def feed(event: RoutingEvent) -> None:
        fed.append(event)

    async def run() -> KvEventsFollower:
        context = zmq.asyncio.Context()
        try:
            async with vllm_replay(context, buffered, asked) as endpoint:
                follower = KvEventsFollower("e1", "tcp://unused:1", feed, context, replay=endpoint)
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
