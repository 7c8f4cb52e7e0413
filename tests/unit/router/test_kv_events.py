"""The router follows an engine's KV events (vLLM's ZMQ publisher): batches in vLLM's wire shape
become the core's events; LoRA, extra keys, other cache groups and unknown event types are
skipped; a jump in the sequence or an undecodable batch clears the engine's map; a real PUB ->
SUB round trip feeds the core until the follower is cancelled; the settings name the endpoint."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any
from unittest.mock import patch

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvfabric.core.routing_events import EngineCleared, EngineRemoved, EngineStored, RoutingEvent
from kvfabric.router import kv_events
from kvfabric.router.kv_events import KvEventsFollower, decode_batch
from kvfabric.router.settings import load_router_settings
from kvfabric.runtime.config import SettingsError
from kvfabric.testing.ports import free_port
from tests.unit.router.test_settings_refit import ENV


def stored(
    hashes: list[Any], parent: Any, tokens: list[int], block_size: int = 4, **extra: Any
) -> dict[str, Any]:
    """A BlockStored as vLLM 0.32 encodes it (msgspec, tag field `type`, defaults omitted)."""
    event = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",  # vLLM's own block pool, on CPU backends too
        "lora_name": None,
    }
    return event | extra


def batch(*events: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode([1733400000.5, list(events), None])


def test_a_batch_in_vllms_shape_becomes_the_cores_events() -> None:
    counters: dict[str, int] = {}
    payload = batch(
        stored([11, 12], None, list(range(8))),
        stored([b"\x01" * 32], 12, list(range(8, 12)), group_idx=0, kv_cache_spec_kind="full_attention"),
        stored([13], 11, list(range(4)), lora_id=3),
        stored([14], 11, list(range(4)), extra_keys=[["salt"]]),
        stored([15], 11, list(range(4)), extra_keys=[None]),
        stored([16], 11, list(range(4)), group_idx=1),
        stored([17], 11, list(range(4)), kv_cache_spec_kind="sliding_window"),
        stored([18], 11, list(range(4)), medium="CPU"),  # an offloading connector's copy
        stored([19], 11, list(range(4)), locality="REMOTE"),
        {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"},
        {"type": "BlockRemoved", "block_hashes": [16], "medium": "GPU", "group_idx": 1},
        {"type": "BlockRemoved", "block_hashes": [12], "medium": "STORAGE"},
        {"type": "AllBlocksCleared"},
        {"type": "SomethingNew", "x": 1},
    )
    events = decode_batch("e1", payload, counters)
    assert events == [
        EngineStored("e1", [11, 12], None, list(range(8)), 4, True),
        EngineStored("e1", [b"\x01" * 32], 12, list(range(8, 12)), 4, True),
        EngineStored("e1", [13], 11, list(range(4)), 4, False),
        EngineStored("e1", [14], 11, list(range(4)), 4, False),
        EngineStored("e1", [15], 11, list(range(4)), 4, True),
        EngineStored("e1", [16], 11, list(range(4)), 4, False),
        EngineStored("e1", [17], 11, list(range(4)), 4, False),
        EngineRemoved("e1", [11]),
        EngineCleared("e1"),
    ]
    assert counters == {"unknown_events": 1, "other_medium": 3}


def test_a_gap_in_the_sequence_or_an_undecodable_batch_clears_the_engines_map() -> None:
    fed: list[RoutingEvent] = []

    async def feed(event: RoutingEvent) -> None:
        fed.append(event)

    follower = KvEventsFollower("e1", "tcp://unused:1", feed)
    one = batch(stored([1], None, list(range(4))))

    async def run() -> None:
        await follower.receive([b"", (5).to_bytes(8, "big"), one])  # the first heard: no gap
        await follower.receive([b"", (6).to_bytes(8, "big"), one])
        await follower.receive([b"", (9).to_bytes(8, "big"), one])  # 7, 8 lost
        await follower.receive([b"", (10).to_bytes(8, "big"), b"\xc1 not msgpack"])
        await follower.receive([b"", b"short", one])
        # a token id no chain hash takes: the batch is undecodable, not half applied
        await follower.receive([b"", (11).to_bytes(8, "big"), batch(stored([2], None, [1, 2, 3, -4]))])

    asyncio.run(run())
    stored_event = EngineStored("e1", [1], None, list(range(4)), 4, True)
    cleared = EngineCleared("e1")
    assert fed == [stored_event, stored_event, cleared, stored_event, cleared, cleared]
    assert follower.counters["gaps"] == 1 and follower.counters["undecodable"] == 3
    assert follower.counters["batches"] == 3


def test_a_published_batch_reaches_the_core_and_the_follower_stops_when_cancelled() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"

    async def run() -> list[RoutingEvent]:
        context = zmq.asyncio.Context()
        pub = context.socket(zmq.PUB)
        pub.bind(endpoint)
        fed: list[RoutingEvent] = []
        got = asyncio.Event()

        async def feed(event: RoutingEvent) -> None:
            fed.append(event)
            got.set()

        follower = KvEventsFollower("e1", endpoint, feed, context)
        task = asyncio.create_task(follower.run())
        try:
            for seq in range(200):  # PUB drops until the subscription lands: publish until heard
                await pub.send_multipart(
                    [b"", seq.to_bytes(8, "big"), batch(stored([seq], None, [1, 2, 3, 4]))]
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(got.wait(), 0.05)
                if got.is_set():
                    break
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            pub.close(linger=0)
            context.term()
        assert task.cancelled()
        return fed

    fed = asyncio.run(run())
    assert fed and isinstance(fed[0], EngineStored) and fed[0].token_ids == [1, 2, 3, 4]


def test_settings_name_an_engines_kv_events_endpoint() -> None:
    engines = [
        {"id": "e1", "url": "http://a", "cache_chunks": 64, "kv_events": "tcp://127.0.0.1:5557"},
        {"id": "e2", "url": "http://b", "cache_chunks": 64},
    ]
    s = load_router_settings({**ENV, "KVF_ROUTER_ENGINES": json.dumps(engines)})
    assert [(e.kv_events, e.spec.engine_events) for e in s.engines] == [
        ("tcp://127.0.0.1:5557", True),
        ("", False),
    ]


def test_a_replay_endpoint_needs_an_events_endpoint() -> None:
    engines = [{"id": "e1", "url": "http://a", "cache_chunks": 64, "kv_events_replay": "tcp://h:5558"}]
    with pytest.raises(SettingsError, match="kv_events_replay without kv_events"):
        load_router_settings({**ENV, "KVF_ROUTER_ENGINES": json.dumps(engines)})


def test_a_follower_that_fails_clears_the_map_and_subscribes_again_after_a_backoff() -> None:
    """A bad endpoint (or any failure) is counted and logged, the engine's map cleared, and the
    follower tries again after a growing wait, until cancelled: it never dies silently."""
    fed: list[RoutingEvent] = []

    async def feed(event: RoutingEvent) -> None:
        fed.append(event)

    async def run() -> KvEventsFollower:
        with patch.object(kv_events, "RETRY_S_MIN", 0.01):
            follower = KvEventsFollower("e1", "not-an-endpoint", feed)
            task = asyncio.create_task(follower.run())
            await asyncio.sleep(0.2)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert task.cancelled()
            return follower

    follower = asyncio.run(run())
    assert follower.counters["failures"] >= 2  # tried again
    assert fed and all(e == EngineCleared("e1") for e in fed)
