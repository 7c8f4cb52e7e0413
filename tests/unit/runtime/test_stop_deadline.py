"""Bounded stops (`kvfabric.runtime.deadline`, docs/design.md "liveness is an invariant"): a task whose
cancellation was swallowed is cancelled again, a task that never ends is reported within the
deadline, and a process whose stop overruns (or whose loop is wedged) exits with 79 on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

from kvfabric.runtime.deadline import EXIT_STOP_OVERRUN, StopWatchdog, cancel_and_wait

PROCESS_WAIT_S = 10.0


async def _publisher_like(outbox: asyncio.Queue[int], replies: list[asyncio.Future[int]]) -> None:
    """The directory's event publisher, reduced: take an event, await its reply with a timeout
    (what nats-py's request does: `asyncio.wait_for`), forever."""
    loop = asyncio.get_running_loop()
    while True:
        await outbox.get()
        reply: asyncio.Future[int] = loop.create_future()
        replies.append(reply)
        await asyncio.wait_for(reply, 10.0)


async def test_a_cancellation_swallowed_by_wait_for_is_cancelled_again() -> None:
    """The hang of issue 21, reproduced with asyncio alone: the reply and the cancel land in the
    same loop iteration; Python 3.11's wait_for returns the reply instead of raising, and the
    cancelled task runs on (the old stop, cancel once then gather, waited on it forever)."""
    outbox: asyncio.Queue[int] = asyncio.Queue()
    replies: list[asyncio.Future[int]] = []
    task = asyncio.create_task(_publisher_like(outbox, replies))
    outbox.put_nowait(1)
    for _ in range(10):  # the task takes the event and sends its request
        await asyncio.sleep(0)
    assert len(replies) == 1
    replies[0].set_result(1)
    task.cancel()  # same iteration as the reply
    _, pending = await asyncio.wait({task}, timeout=0.2)
    swallowed = bool(pending)
    assert swallowed is (sys.version_info < (3, 12)), "3.12 rewrote wait_for (no swallow)"
    started_s = time.monotonic()
    assert await cancel_and_wait([task], 2.0) == set()
    assert task.cancelled() and time.monotonic() - started_s < 1.0


async def test_a_task_that_never_ends_is_returned_at_the_deadline() -> None:
    released = asyncio.Event()

    async def immortal() -> None:  # ignores every cancellation until the test releases it
        while not released.is_set():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                continue

    async def polite() -> None:
        await asyncio.sleep(10)

    stuck, fine = asyncio.create_task(immortal()), asyncio.create_task(polite())
    await asyncio.sleep(0)
    started_s = time.monotonic()
    assert await cancel_and_wait([stuck, fine], 0.3) == {stuck}
    assert 0.25 < time.monotonic() - started_s < 1.0
    assert fine.cancelled() and not stuck.done()
    released.set()
    stuck.cancel()
    await asyncio.wait({stuck}, timeout=1.0)
    assert stuck.done()


def test_the_watchdog_exits_once_the_deadline_passes(capfd: pytest.CaptureFixture[str]) -> None:
    codes: list[int] = []
    watchdog = StopWatchdog(identity={"service": "test"}, exit=codes.append, poll_s=0.01)
    watchdog.start()
    watchdog.arm(0.1, "sigterm")
    watchdog.arm(5.0, "later")  # the earlier deadline is kept
    time.sleep(0.05)
    assert codes == []
    deadline_s = time.monotonic() + 2.0
    while not codes and time.monotonic() < deadline_s:
        time.sleep(0.01)
    assert codes == [EXIT_STOP_OVERRUN]
    (line,) = [json.loads(x) for x in capfd.readouterr().err.splitlines() if x.startswith("{")]
    assert (line["event"], line["reason"], line["stop_deadline_ms"], line["service"]) == (
        "stop_overran",
        "sigterm",
        100,
        "test",
    )


def test_a_disarmed_watchdog_does_not_exit() -> None:
    codes: list[int] = []
    watchdog = StopWatchdog(exit=codes.append, poll_s=0.01)
    watchdog.start()
    watchdog.arm(0.05, "stop")
    watchdog.disarm()
    time.sleep(0.2)
    watchdog.close()
    assert codes == [] and not watchdog.fired


# A service process (the runtime's signal handling and watchdog, no NATS needed) that wedges:
# `block` blocks the event loop itself; `hang` leaves the loop free but its stop never ends.
SERVICE = textwrap.dedent(
    """
    import asyncio, sys, time
    from kvfabric.proto.subjects import Service
    from kvfabric.runtime.config import RuntimeSettings
    from kvfabric.runtime.logs import configure_logging
    from kvfabric.runtime.service import ServiceRuntime

    async def main(mode: str, deadline_ms: int) -> int:
        settings = RuntimeSettings(metrics_port=-1, shutdown_grace_ms=50, stop_deadline_ms=deadline_ms)
        runtime = ServiceRuntime(Service.ECHO, settings, version="0.0.1", description="test")
        runtime.stop_on_signals()
        print("ready", flush=True)
        if mode == "block":
            time.sleep(60)  # a wedged loop: the signal is never handled by the loop
        await runtime.wait_stop_requested()
        while True:  # a stop that never ends
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                pass

    configure_logging(level="info", json=True)
    sys.exit(asyncio.run(main(sys.argv[1], int(sys.argv[2]))))
    """
)


def _start(mode: str, deadline_ms: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVICE, mode, str(deadline_ms)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _events(stderr: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in stderr.splitlines() if x.startswith("{")]


def _wait(proc: subprocess.Popen[str], timeout_s: float) -> tuple[int, float, str]:
    started_s = time.monotonic()
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"still running {timeout_s} s after SIGTERM: the stop is not bounded")
    return proc.returncode, time.monotonic() - started_s, err


@pytest.mark.parametrize("mode", ["block", "hang"])
def test_sigterm_ends_a_wedged_process_by_its_stop_deadline(mode: str) -> None:
    proc = _start(mode, deadline_ms=500)
    time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    code, waited_s, err = _wait(proc, PROCESS_WAIT_S)
    assert code == EXIT_STOP_OVERRUN, err
    assert 0.4 < waited_s < 3.0
    overran = [e for e in _events(err) if e["event"] == "stop_overran"]
    assert [(e["reason"], e["service"]) for e in overran] == [("sigterm", "echo")]
    assert "Thread" in err  # every thread's stack, for the post-mortem


def test_a_second_sigterm_exits_at_once() -> None:
    proc = _start("hang", deadline_ms=60_000)
    time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert proc.poll() is None  # stopping, within its (long) deadline
    proc.send_signal(signal.SIGTERM)
    code, waited_s, err = _wait(proc, PROCESS_WAIT_S)
    assert code == EXIT_STOP_OVERRUN and waited_s < 2.0
    assert [e["signal"] for e in _events(err) if e["event"] == "stop_forced"] == ["sigterm"]


START_FAILS = textwrap.dedent(
    """
    import asyncio, sys
    from kvfabric.proto.subjects import Service
    from kvfabric.runtime.config import RuntimeSettings
    from kvfabric.runtime.logs import configure_logging, get_logger
    from kvfabric.runtime.service import ServiceRuntime
    from kvfabric.runtime.shells import serve_shell

    class Shell:
        def attach(self, runtime): runtime.add_endpoint("x", lambda r: r)
        async def start(self, nc): raise RuntimeError("cannot start")
        async def stop(self): await asyncio.sleep(3600)  # its cleanup hangs

    class Collector:
        def collect(self): return []

    async def main() -> int:
        settings = RuntimeSettings(
            nats_url="nats://127.0.0.1:1", metrics_port=-1, shutdown_grace_ms=50, stop_deadline_ms=500,
            nats_reconnect_attempts_max=1, nats_reconnect_wait_ms=10, nats_connect_timeout_ms=200,
        )
        runtime = ServiceRuntime(Service.ECHO, settings, version="0.0.1", description="test")
        return await serve_shell(runtime, Shell(), Collector(), get_logger("t"))

    configure_logging(level="info", json=True)
    sys.exit(asyncio.run(main()))
    """
)


def test_a_start_failure_whose_cleanup_hangs_still_exits() -> None:
    """A service whose start failed cleans up under the stop deadline too (it ran without the
    watchdog: a cleanup that hung left a live process serving nothing; review, 2026-12-05)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", START_FAILS], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    code, took_s, err = _wait(proc, 20)
    assert code == EXIT_STOP_OVERRUN, err[-2000:]
    assert took_s < 15
