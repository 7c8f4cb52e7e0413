"""`KvClient.save_async` bounds the saves handed to its loop and not yet ended there by
`saves_queued_max` (review, stop 68): the loop admits at most that many at once, but while it was
stalled or busy an engine thread went on handing it saves, each holding its sources, without
bound. Over the bound a save is dropped in the engine's thread (`queue_full`), as the loop drops
one, and the count goes down as the handed saves end."""

from __future__ import annotations

import threading

from kvfabric.client.settings import ClientSettings
from kvfabric.client.sync import ENABLED, ClientStatus, KvClient
from kvfabric.testing.clientkit import SPEC, TOKENS_PER_CHUNK, objects_for, prompt

QUEUED_MAX = 3


def test_saves_handed_to_a_stalled_loop_are_bounded() -> None:
    settings = ClientSettings(nats_url="nats://unused:1", saves_queued_max=QUEUED_MAX, save_timeout_ms=200)
    kv = KvClient.disabled(SPEC, "config_error", "test", settings=settings)
    kv.status = ClientStatus(ENABLED)  # as if started: saves are handed to the loop
    unstall = threading.Event()
    kv._loop.call_soon_threadsafe(unstall.wait, 30)  # the loop is busy in a call
    tokens = prompt(TOKENS_PER_CHUNK)
    try:
        handed = [kv.save_async(tokens, objects_for(tokens, 0, 1)) for _ in range(QUEUED_MAX)]
        assert all(f is not None and not f.done() for f in handed)  # queued on the loop
        dropped = kv.save_async(tokens, objects_for(tokens, 0, 1))
        assert dropped is not None and dropped.done()  # dropped at once, in this thread
        assert dropped.result(0).causes == {"queue_full": 1} and dropped.result(0).chunks_failed == 1
        assert kv.metrics.saves_dropped.labels("queue_full")._value.get() == 1
        unstall.set()
        for future in handed:
            assert future is not None
            future.exception(10)  # each ends on the loop (how does not matter here)
        again = kv.save_async(tokens, objects_for(tokens, 0, 1))
        assert again is not None
        again.exception(10)
        assert kv.metrics.saves_dropped.labels("queue_full")._value.get() == 1  # handed, not dropped
    finally:
        unstall.set()
        kv.close()
