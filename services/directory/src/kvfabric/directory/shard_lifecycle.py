"""The directory instance's shard lifecycle, performed: `ShardLifecycle`'s effects on the host.

`kvfabric.core.shard_lifecycle.ShardLifecycle` decides (states, invariants and effects in its
docstring); `ShardLifecycleShell` only feeds it events and performs what it returns:
- the election's StartLeading / StopLeading (`LeaderElection.run(on_start, on_stop)`) come in
  as `Led` / `Unled`; the host's restart after a rebuild for a missing segment as `RestartAsked`
  (`ShardHost.restart_shard`), the election loop's end as `ElectionEnded`;
- `StartShard` runs `ShardHost.start_shard` in the shard's own task, beside the election loop
  (renewals of other shards must not wait for a rebuild), and feeds back StartDone or
  StartFailed; `RetryStartAt` waits in that task and feeds back RetryDue;
- `StopShard` stops serving at once, inside the election's StopLeading callback, so that the
  election releases the lease key only after (`ShardHost.stop_shard`, queued events drained in
  the background); `StopInstance` asks the runtime to stop (the service then exits 75).

Clock: monotonic milliseconds (`kvfabric.format.clock.monotonic_ms`), the election's too: the
core compares the lease deadlines `ShardLeadership` keeps with it.

`ShellFactory` makes the `DirectoryShell` of each started shard; the first one opens the
instance's events stream, which the later ones share (one repair at a time).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NatsClient

from kvfabric.core.directory import DirectoryCore
from kvfabric.core.shard_lifecycle import (
    ElectionEnded,
    Led,
    LifecycleConfig,
    LifecycleEffect,
    RestartAsked,
    RetryDue,
    RetryStartAt,
    ShardLifecycle,
    StartDone,
    StartFailed,
    StartShard,
    StopInstance,
    StopShard,
    Unled,
)
from kvfabric.directory.events import EventsStream
from kvfabric.directory.leader import LeaderElection
from kvfabric.directory.settings import DirectorySettings
from kvfabric.directory.shard_host import ShardHost
from kvfabric.directory.shell import DirectoryShell
from kvfabric.format.clock import monotonic_ms
from kvfabric.runtime.logs import get_logger
from kvfabric.runtime.service import ServiceRuntime

__all__ = ["MakeHost", "ShardLifecycleShell", "ShellFactory"]

MayAct = Callable[[int, int], bool]
Restart = Callable[[int, int], Awaitable[None]]
# (may_act, restart_shard) -> the host, built with them (ShardHost's constructor)
MakeHost = Callable[[MayAct, Restart], ShardHost]


class ShellFactory:
    """Makes each started shard's `DirectoryShell`; the first opens the instance's events stream
    and the later ones share it (one stream repair at a time for the whole instance)."""

    def __init__(self, nc: NatsClient, config: DirectorySettings) -> None:
        self.nc = nc
        self.config = config
        self.events_stream: EventsStream | None = None

    def __call__(self, core: DirectoryCore) -> DirectoryShell:
        config = self.config
        shell = DirectoryShell(
            core,
            tick_ms=config.tick_ms,
            events_outbox_max=config.events_outbox_max,
            events_max_age_s=config.events_max_age_s,
            events_max_bytes=config.events_max_bytes,
            free_timeout_s=config.free_timeout_s,
            events_replicas=config.kv_replicas,
            events_stream=self.events_stream,
            write_slice_ids=config.write_slice_ids,
        )
        if self.events_stream is None:
            self.events_stream = EventsStream(
                self.nc, shell.events_config(), stuck_after_failures=config.events_stuck_after_failures
            )
            shell.events_stream = self.events_stream
        return shell


class ShardLifecycleShell:
    """Performs `ShardLifecycle`'s effects (module docstring). Builds the host with its own
    `may_act` and `restart_shard` (`make_host`), so the host asks it before every act."""

    def __init__(
        self,
        election: LeaderElection,
        runtime: ServiceRuntime,
        make_host: MakeHost,
        config: LifecycleConfig | None = None,
    ) -> None:
        self.election = election
        self.runtime = runtime
        self.core = ShardLifecycle(election.core, config)
        self.host = make_host(self.may_act, self.restart_shard)
        self._starts: dict[int, asyncio.Task[None]] = {}  # shard -> its start (and retries)
        self._log = get_logger("kvfabric.directory").bind(instance_id=election.instance_id)

    @property
    def lost(self) -> bool:
        """The instance stops for good (a lapsed lease, a start given up, the election ended)."""
        return self.core.lost

    def may_act(self, shard: int, epoch: int) -> bool:
        return self.core.may_act(shard, epoch, monotonic_ms())

    def start_tasks(self) -> list[asyncio.Task[None]]:
        """Shard starts in flight or waiting to retry (the service cancels them at its stop)."""
        return [task for task in self._starts.values() if not task.done()]

    def run_election(self) -> asyncio.Task[None]:
        """The election loop, as a task whose end (it runs forever) stops the instance."""
        task = asyncio.create_task(self.election.run(self.on_start, self.on_stop), name="directory-election")
        task.add_done_callback(self._election_ended)
        return task

    # ---- events in ---------------------------------------------------------------------------

    async def on_start(self, shard: int, epoch: int) -> None:
        await self._perform(self.core.step(Led(shard, epoch), monotonic_ms()))

    async def on_stop(self, shard: int, epoch: int, reason: str) -> None:
        await self._perform(self.core.step(Unled(shard, epoch, reason), monotonic_ms()))

    async def restart_shard(self, shard: int, epoch: int) -> None:
        """The host's restart after a rebuild for a missing segment: returns once the shard's
        start (with its retries) is over, as the host's own `start_shard` would."""
        await self._perform(self.core.step(RestartAsked(shard, epoch), monotonic_ms()))
        task = self._starts.get(shard)
        if task is not None and not task.done():
            await task

    def _election_ended(self, task: asyncio.Task[None]) -> None:
        # The loop runs forever: if it ends, nothing renews the leases; stop serving at once.
        if task.cancelled():
            return
        self._log.error("election_loop_failed", error=repr(task.exception()))
        for effect in self.core.step(ElectionEnded(repr(task.exception())), monotonic_ms()):
            if isinstance(effect, StopInstance):
                self.runtime.request_stop(effect.reason)

    # ---- effects out -------------------------------------------------------------------------

    async def _perform(self, effects: list[LifecycleEffect]) -> None:
        for effect in effects:
            if isinstance(effect, StopInstance):
                self.runtime.request_stop(effect.reason)
            elif isinstance(effect, StopShard):
                # Stops serving before the lease key is released; queued events drain meanwhile.
                await self.host.stop_shard(effect.shard, drain_s=effect.drain_ms / 1000)
            else:  # StartShard, RetryStartAt: the shard's own task (a rebuild takes seconds)
                task = asyncio.create_task(self._start(effect), name=f"directory-start-{effect.shard}")
                self._starts[effect.shard] = task

    async def _start(self, first: StartShard | RetryStartAt) -> None:
        """Performs the shard's StartShard and RetryStartAt, one after the other, until the core
        asks for neither (started, abandoned, given up)."""
        effect: StartShard | RetryStartAt | None = first
        while effect is not None:
            if isinstance(effect, RetryStartAt):
                await asyncio.sleep(max(0, effect.at_ms - monotonic_ms()) / 1000)
                effects = self.core.step(RetryDue(effect.shard), monotonic_ms())
            else:
                try:
                    await self.host.start_shard(effect.shard, effect.epoch)
                    effects = self.core.step(StartDone(effect.shard), monotonic_ms())
                except Exception as exc:
                    self._log.warning(
                        "shard_start_failed",
                        shard=effect.shard,
                        epoch=effect.epoch,
                        attempt=effect.attempt,
                        error=repr(exc),
                    )
                    effects = self.core.step(StartFailed(effect.shard, repr(exc)), monotonic_ms())
            shard, effect = effect.shard, None
            rest: list[LifecycleEffect] = []
            for out in effects:
                if isinstance(out, StartShard | RetryStartAt) and out.shard == shard:
                    effect = out  # this task goes on with it
                else:
                    rest.append(out)
            await self._perform(rest)
