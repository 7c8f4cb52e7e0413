"""`ShardLifecycleShell` (kvfabric.directory.shard_lifecycle) performs the lifecycle core's effects
on a host and a runtime: starts beside the election loop, retried with their backoff and given up
by stopping the instance; a handover stops serving before the callback returns (the election
releases the key after); a lapsed lease or an ended election loop stops the instance; the host is
built with the shell's `may_act` and `restart_shard`."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from kvfabric.core.leadership import Acquire, LeadershipConfig, ShardLeadership
from kvfabric.core.shard_lifecycle import LifecycleConfig
from kvfabric.directory.shard_lifecycle import ShardLifecycleShell
from kvfabric.format.clock import monotonic_ms

FAST = LifecycleConfig(start_attempts_max=3, start_retry_ms=20, handover_drain_ms=1_000)


class Election:
    """Leads every shard from now on (a lease of 60 s: nothing lapses during a test)."""

    def __init__(self, shards: int = 2, run_error: BaseException | None = None) -> None:
        config = LeadershipConfig(
            shards=shards,
            lease_ttl_ms=60_000,
            renew_every_ms=1_000,
            safety_margin_ms=500,
            members_ttl_ms=60_000,
        )
        self.core = ShardLeadership(config, "dir-a")
        self.instance_id = "dir-a"
        self.run_error = run_error
        now = monotonic_ms()
        for revision, effect in enumerate(self.core.on_members({"dir-a"}, now), start=1):
            if isinstance(effect, Acquire):
                self.core.on_acquired(effect.shard, revision, now, now_ms=now)

    async def run(self, on_start: Any, on_stop: Any) -> None:
        if self.run_error is not None:
            raise self.run_error
        await asyncio.sleep(3600)


class Runtime:
    def __init__(self) -> None:
        self.stops: list[str] = []

    def request_stop(self, reason: str) -> None:
        self.stops.append(reason)


class Host:
    """Fails the first `failures` starts of each shard; records what it was asked."""

    def __init__(self, may_act: Any, restart_shard: Any, failures: int = 0) -> None:
        self.may_act = may_act
        self.restart_shard = restart_shard
        self.failures = failures
        self.starts: list[tuple[int, int, float]] = []
        self.stopped: list[tuple[int, float]] = []

    async def start_shard(self, shard: int, epoch: int) -> None:
        self.starts.append((shard, epoch, asyncio.get_running_loop().time()))
        await asyncio.sleep(0)
        if sum(1 for s, _, _ in self.starts if s == shard) <= self.failures:
            raise RuntimeError("report timed out")

    async def stop_shard(self, shard: int, *, drain_s: float = 0.0) -> None:
        await asyncio.sleep(0)
        self.stopped.append((shard, drain_s))


def make(
    failures: int = 0, run_error: BaseException | None = None
) -> tuple[ShardLifecycleShell, Host, Runtime]:
    runtime = Runtime()
    hosts: list[Host] = []

    def make_host(may_act: Any, restart_shard: Any) -> Any:
        hosts.append(Host(may_act, restart_shard, failures))
        return hosts[0]

    shell = ShardLifecycleShell(cast(Any, Election(run_error=run_error)), cast(Any, runtime), make_host, FAST)
    return shell, hosts[0], runtime


def test_the_host_is_built_with_the_shells_may_act_and_restart() -> None:
    shell, host, _runtime = make()
    epoch = shell.election.core.epoch(0)
    assert epoch is not None
    assert host.may_act(0, epoch) and not host.may_act(0, epoch + 1)
    assert host.restart_shard == shell.restart_shard


def test_a_start_that_fails_twice_is_retried_with_backoff_and_serves() -> None:
    async def go() -> tuple[Host, Runtime, ShardLifecycleShell]:
        shell, host, runtime = make(failures=2)
        epoch = shell.election.core.epoch(0) or 0
        await shell.on_start(0, epoch)  # returns at once: the start runs in its own task
        assert len(shell.start_tasks()) == 1
        await asyncio.gather(*shell.start_tasks())
        return host, runtime, shell

    host, runtime, shell = asyncio.run(go())
    assert [(s, e) for s, e, _ in host.starts] == [(0, host.starts[0][1])] * 3
    gaps = [b[2] - a[2] for a, b in zip(host.starts, host.starts[1:], strict=False)]
    assert gaps[0] >= 0.019 and gaps[1] >= 0.039  # 20 ms x attempt after each failure
    assert runtime.stops == [] and not shell.lost and shell.core.serving() == {0: host.starts[0][1]}


def test_a_start_that_keeps_failing_stops_the_instance() -> None:
    async def go() -> tuple[Host, Runtime, ShardLifecycleShell]:
        shell, host, runtime = make(failures=99)
        await shell.on_start(1, shell.election.core.epoch(1) or 0)
        await asyncio.gather(*shell.start_tasks())
        return host, runtime, shell

    host, runtime, shell = asyncio.run(go())
    assert len(host.starts) == 3 and runtime.stops == ["shard_start_failed"] and shell.lost
    epoch = host.starts[0][1]
    assert not host.may_act(1, epoch)  # a stopping instance acts on nothing


def test_a_handover_stops_serving_before_the_callback_returns_and_a_lapse_stops_the_instance() -> None:
    async def go() -> tuple[Host, Runtime, ShardLifecycleShell]:
        shell, host, runtime = make()
        await shell.on_stop(0, 1, "handover")
        assert host.stopped == [(0, 1.0)]  # before the election releases the key
        assert runtime.stops == []
        await shell.on_stop(1, 2, "lease_expired")
        return host, runtime, shell

    _host, runtime, shell = asyncio.run(go())
    assert runtime.stops == ["leadership_lost:lease_expired"] and shell.lost


def test_a_restart_returns_once_the_shard_is_started_again() -> None:
    async def go() -> Host:
        shell, host, _runtime = make(failures=1)
        await shell.restart_shard(0, shell.election.core.epoch(0) or 0)
        assert len(host.starts) == 2 and shell.start_tasks() == []
        return host

    asyncio.run(go())


@pytest.mark.parametrize("error", [RuntimeError("kv gone")])
def test_an_ended_election_loop_stops_the_instance(error: BaseException) -> None:
    async def go() -> tuple[Runtime, ShardLifecycleShell]:
        shell, _host, runtime = make(run_error=error)
        task = shell.run_election()
        with pytest.raises(RuntimeError):
            await task
        await asyncio.sleep(0)  # the done callback
        return runtime, shell

    runtime, shell = asyncio.run(go())
    assert runtime.stops == ["election_loop_failed"] and shell.lost
