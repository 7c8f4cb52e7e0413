"""A service's background task that dies stops the service (review, 2026-12-05): the eviction
policy's follower or ticker ending with an exception left the exception on the task until stop,
and the service looked healthy while it evicted nothing. `ServiceRuntime.watch` logs it and asks
for a stop with `EXIT_SOFTWARE` (the supervisor restarts the process); a task cancelled or ended
normally stops nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, cast

import msgspec
import pytest

from kvfabric.proto.subjects import Service
from kvfabric.runtime.config import RuntimeSettings
from kvfabric.runtime.service import EXIT_OK, EXIT_SOFTWARE, ServiceRuntime


def test_a_watched_task_that_raises_stops_the_service() -> None:
    async def main() -> tuple[str, int]:
        runtime = ServiceRuntime(
            Service.ECHO, RuntimeSettings(metrics_port=-1), version="0.0.1", description="t"
        )

        async def fine() -> None:
            return

        async def forever() -> None:
            await asyncio.sleep(60)

        async def broken() -> None:
            raise ValueError("a bug in a loop")

        ok, cancelled = asyncio.create_task(fine()), asyncio.create_task(forever())
        runtime.watch(ok, "fine")
        runtime.watch(cancelled, "forever")
        await ok
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        await asyncio.sleep(0)
        assert not runtime._stop_requested.is_set() and runtime._exit_code == EXIT_OK
        failing = asyncio.create_task(broken())
        runtime.watch(failing, "broken")
        reason = await asyncio.wait_for(runtime.wait_stop_requested(), 5)
        return reason, runtime._exit_code

    assert asyncio.run(main()) == ("task_failed", EXIT_SOFTWARE)


def test_a_watched_tasks_failure_keeps_the_grace_for_requests_in_flight() -> None:
    """A watched task's failure stops the service with EXIT_SOFTWARE, but the requests in
    flight get their shutdown grace, as on SIGTERM (they were cancelled unanswered at once;
    review, 2026-12-05); only a broken invariant cancels them at once."""

    async def main(invariant_broken: bool) -> bool:
        runtime = ServiceRuntime(
            Service.ECHO,
            RuntimeSettings(metrics_port=-1, shutdown_grace_ms=10_000),
            version="0.0.1",
            description="t",
        )

        async def handler() -> None:  # still running when the stop comes, on a loaded machine too
            await asyncio.sleep(1.0)

        async def broken() -> None:
            raise ValueError("a bug in a loop")

        request = asyncio.create_task(handler())
        runtime._tasks.add(request)
        failing = asyncio.create_task(broken())
        runtime.watch(failing, "broken")
        await asyncio.wait_for(runtime.wait_stop_requested(), 5)
        runtime._invariant_violated = invariant_broken
        await runtime._finish_inflight()
        return request.cancelled()

    assert asyncio.run(main(invariant_broken=False)) is False  # answered within the grace
    assert asyncio.run(main(invariant_broken=True)) is True


def test_request_lines_of_one_kind_are_sampled_per_second(monkeypatch: pytest.MonkeyPatch) -> None:
    """At most `LOG_LINES_PER_S_MAX` request lines a second for one (endpoint, outcome, code):
    the rest are left out and the next line logged says how many (`suppressed`); a flood of
    refused requests wrote a line each (review, 2026-12-05; issue 21 row 13)."""
    from kvfabric.runtime import service
    from kvfabric.runtime.metrics import Outcome

    now = [100.0]
    monkeypatch.setattr("kvfabric.runtime.service.time.monotonic", lambda: now[0])
    runtime = ServiceRuntime(Service.ECHO, RuntimeSettings(metrics_port=-1), version="0.0.1", description="t")
    busy = ("lookup", Outcome.BUSY, "busy", "bob")
    got = [runtime._log_sampled(busy) for _ in range(service.LOG_LINES_PER_S_MAX + 5)]
    assert got == [0] * service.LOG_LINES_PER_S_MAX + [-1] * 5
    assert runtime._log_sampled(("lookup", Outcome.ERROR, "bad_request", "bob")) == 0  # another kind
    assert runtime._log_sampled(("lookup", Outcome.BUSY, "busy", "alice")) == 0  # another tenant
    now[0] = 101.0
    assert runtime._log_sampled(busy) == 5  # the first line of the next second says so
    assert runtime._log_sampled(busy) == 0


def test_a_tenants_flood_of_refusals_leaves_another_tenants_lines_logged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bob's busy flood used up the second's lines of (lookup, busy) for every tenant: alice's
    refusals went unlogged (review, 2026-12-06). The line names the tenant; sampling is per tenant."""
    from kvfabric.runtime import service
    from kvfabric.runtime.metrics import Outcome

    monkeypatch.setattr("kvfabric.runtime.service.time.monotonic", lambda: 100.0)
    runtime = ServiceRuntime(Service.ECHO, RuntimeSettings(metrics_port=-1), version="0.0.1", description="t")
    logged: list[dict[str, object]] = []

    class Capture:
        def is_enabled_for(self, level: int) -> bool:
            return True

        def log(self, level: int, event: str, **fields: object) -> None:
            logged.append(fields)

    async def handler(data: bytes, headers: Mapping[str, str]) -> msgspec.Struct:
        raise AssertionError("not called")

    monkeypatch.setattr(runtime, "_log", Capture())
    endpoint = service._Endpoint(verb="lookup", subject="s", handler=handler, relative="lookup")
    for _ in range(service.LOG_LINES_PER_S_MAX + 50):
        runtime._finish(endpoint, Outcome.BUSY, 0.0, "busy", tenant="bob")
    runtime._finish(endpoint, Outcome.BUSY, 0.0, "busy", tenant="alice")
    tenants = [line["tenant"] for line in logged]
    assert tenants.count("bob") == service.LOG_LINES_PER_S_MAX and tenants.count("alice") == 1


def test_a_watched_task_that_breaks_an_invariant_gives_no_grace() -> None:
    from kvfabric.format.invariant import invariant

    async def main() -> bool:
        runtime = ServiceRuntime(
            Service.ECHO, RuntimeSettings(metrics_port=-1), version="0.0.1", description="t"
        )

        async def broken() -> None:
            invariant(False, "a core's state is broken")

        runtime.watch(asyncio.create_task(broken()), "ticker")
        await asyncio.wait_for(runtime.wait_stop_requested(), 5)
        return runtime._invariant_violated

    assert asyncio.run(main()) is True


def test_nats_errors_are_logged_once_a_second_per_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """nats-py reports every message a subscription past its pending bound drops (a slow
    consumer): hundreds of warning lines a second (review, 2026-12-06). One a second per kind,
    the next saying how many were left out."""
    import nats.errors

    now = [100.0]
    monkeypatch.setattr("kvfabric.runtime.service.time.monotonic", lambda: now[0])
    runtime = ServiceRuntime(Service.ECHO, RuntimeSettings(metrics_port=-1), version="0.0.1", description="t")
    logged: list[dict[str, object]] = []

    class Capture:
        def warning(self, event: str, **fields: object) -> None:
            logged.append(fields)

    monkeypatch.setattr(runtime, "_log", Capture())

    def dropped() -> Exception:
        return nats.errors.SlowConsumerError(subject="s", reply="", sid=1, sub=cast(Any, None))

    async def flood() -> None:
        for _ in range(300):
            await runtime._on_nats_error(dropped())
        await runtime._on_nats_error(nats.errors.OutboundBufferLimitError())  # another kind
        now[0] = 101.0
        await runtime._on_nats_error(dropped())

    asyncio.run(flood())
    assert [line["suppressed"] for line in logged] == [0, 0, 299]
