"""The kv_doctor task keeps polling whatever a check raises, and is watched (review, stop 71):
it caught only OSError, ValueError, nats errors and timeouts, so a truncated `/healthz` reply
(`http.client.IncompleteRead`, `BadStatusLine`, `LineTooLong`: not OSErrors) or a JSON array
body (AttributeError) ended it silently, and a stuck lease bucket was never repaired again."""

from __future__ import annotations

import ast
import asyncio
import http.client
import inspect
from typing import Any, cast

import pytest

from kvfabric.directory import __main__ as directory_main
from kvfabric.directory import kv_doctor
from kvfabric.directory.kv_doctor import KvDoctor


class Logged:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))

    info = error = warning


def doctor(fetch: Any, clock: Any = lambda: 0.0) -> tuple[KvDoctor, Logged]:
    found = KvDoctor(
        cast(Any, None),  # no stream is stuck: the checks never reach NATS
        "http://monitor:8222",
        "dir-a",
        {"KV_leaders": 4.0},
        config_bucket="config",
        fetch=fetch,
        clock=clock,
    )
    logged = Logged()
    found._log = cast(Any, logged)
    return found, logged


@pytest.mark.parametrize(
    "raised",
    [
        http.client.IncompleteRead(b""),
        http.client.BadStatusLine("HTTP/1."),
        http.client.LineTooLong("header line"),
        AttributeError("'list' object has no attribute 'get'"),  # a JSON array body
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_check_that_raises_is_logged_and_polling_goes_on(raised: Exception) -> None:
    calls = 0
    polled_again = asyncio.Event()

    async def fetch(url: str) -> dict[str, str]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise raised
        if calls >= 4:
            polled_again.set()
        return {}

    found, logged = doctor(fetch)

    async def go() -> str:
        task = asyncio.create_task(found.run(poll_s=0.001))
        waiting = asyncio.create_task(polled_again.wait())
        await asyncio.wait([task, waiting], return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if task.done():
            return f"ended: {task.exception()!r}"
        task.cancel()
        await asyncio.gather(task, waiting, return_exceptions=True)
        return "polling"

    assert asyncio.run(asyncio.wait_for(go(), 10)) == "polling"  # still, after the failure
    assert calls >= 4 and found.check_failures == 1
    assert [(e, f["error"]) for e, f in logged.lines] == [("kv_doctor_check_failed", type(raised).__name__)]


def test_a_check_failing_the_same_way_is_logged_once_a_minute() -> None:
    now = [0.0]

    async def fetch(url: str) -> dict[str, str]:
        if now[0] >= 120.0:  # two minutes of checks, one every 2 s
            raise asyncio.CancelledError
        now[0] += 2.0
        raise http.client.IncompleteRead(b"{")

    found, logged = doctor(fetch, clock=lambda: now[0])
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(found.run(poll_s=0))
    assert found.check_failures == 60
    assert len(logged.lines) == 2 and logged.lines[1][1]["unlogged"] == kv_doctor.CHECK_FAILED_LOG_S / 2 - 1


def test_the_doctor_task_is_watched_like_the_services_other_tasks() -> None:
    """`serve` passes the kv_doctor task to `runtime.watch`: one that ends with an exception stops
    the instance (its supervisor restarts it) instead of dying unseen."""
    tree = ast.parse(inspect.getsource(directory_main.serve))
    watched = {
        arg.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "watch"
        for arg in node.args[:1]
        if isinstance(arg, ast.Name)
    }
    assert "doctor_task" in watched
