"""`KvClient.save_async`'s future ends only when the save has ended on the client's loop, and its
holder cannot cancel it: cancelled from the engine's thread, the future of
`run_coroutine_threadsafe` ended at once and ran its done callbacks (save slots given back)
while the save's writes still read those slots (review, stop 66)."""

from __future__ import annotations

import concurrent.futures

import pytest

from kvfabric.client.sync import _ends_with


def test_the_future_cannot_be_cancelled_and_ends_with_the_save() -> None:
    inner: concurrent.futures.Future[str] = concurrent.futures.Future()
    outer = _ends_with(inner)
    ended: list[str] = []
    outer.add_done_callback(lambda f: ended.append("done"))
    assert outer.cancel() is False and not outer.done() and ended == []  # the save still runs
    inner.set_result("saved")
    assert outer.result(0) == "saved" and ended == ["done"]


def test_a_save_that_failed_or_that_the_loop_cancelled_ends_its_future_too() -> None:
    failed: concurrent.futures.Future[str] = concurrent.futures.Future()
    outer = _ends_with(failed)
    failed.set_exception(RuntimeError("a bug"))
    with pytest.raises(RuntimeError, match="a bug"):
        outer.result(0)
    closing: concurrent.futures.Future[str] = concurrent.futures.Future()
    outer = _ends_with(closing)
    closing.cancel()  # the client's loop cancelled it (closing)
    with pytest.raises(concurrent.futures.CancelledError):
        outer.result(0)
