"""The segment shell's side of the directory: routing a keyed request to its shard's leader,
registration and heartbeats to every leader, and the directory epochs they reveal.

`ShellDirectory` is a mixin of `SegmentShell` (`kvfabric.segment_storage.shell`): it reads the
shell's router, settings, slots and backend and writes only `_beats` and `must_reregister`; the
lifecycle (when to register, when heartbeats start) stays in the shell.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Final

import msgspec

from kvfabric.format.errors import Indeterminate, KvfError, NotFound, StaleGeneration, Unavailable
from kvfabric.proto import directory as m
from kvfabric.proto.common import TRACE_ID_HEADER, header_trace_id

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from kvfabric.cluster.directory_router import DirectoryRouter
    from kvfabric.core.segment_slots import SlotTable
    from kvfabric.segment_storage.backend import ArenaBackend
    from kvfabric.segment_storage.settings import SegmentSettings
    from kvfabric.segment_storage.ssd import SsdTier

__all__ = [
    "HEARTBEATS_FAILED_WARN",
    "HEARTBEAT_TIMEOUT_MIN_S",
    "MAP_REFRESH_BEATS",
    "REGISTER_RETRY_S_MAX",
    "REGISTER_RETRY_S_MIN",
    "REGISTER_WAIT_S",
    "REQUEST_TIMEOUT_S",
    "ShellDirectory",
]

REQUEST_TIMEOUT_S: Final = 5.0
HEARTBEAT_TIMEOUT_MIN_S: Final = 0.2  # a heartbeat request waits one interval, at least this
HEARTBEATS_FAILED_WARN: Final = 2  # failed rounds in a row logged as a warning
MAP_REFRESH_BEATS: Final = 10  # the shard map is asked again at least every this many heartbeats
# A segment that starts before any directory instance leads a shard (a cluster coming up, a busy
# directory answering the shard map late) asks again, waiting this long doubling to the max,
# for at most REGISTER_WAIT_S in all; then its start fails (the supervisor restarts it).
REGISTER_RETRY_S_MIN: Final = 0.1
REGISTER_RETRY_S_MAX: Final = 2.0
REGISTER_WAIT_S: Final = 30.0


class ShellDirectory:
    """Requests to the directory's shard leaders, and the epochs their replies name."""

    settings: SegmentSettings
    incarnation: int
    router: DirectoryRouter | None
    backend: ArenaBackend
    slots: SlotTable
    ssd: SsdTier | None
    heartbeat_interval_ms: int
    must_reregister: asyncio.Event
    _beats: int
    _log: FilteringBoundLogger

    async def _directory(self, verb: str, message: msgspec.Struct, trace_id: str = "") -> msgspec.Struct:
        """A keyed request (confirm, replica_corrupt, replicate_begin, put_abort) to the leader of
        its key's shard."""
        assert self.router is not None
        if isinstance(message, m.ConfirmReplicas):
            shard = self.router.shard_of(message.confirms[0].key)
        elif isinstance(message, m.PutAbort):
            shard = self.router.shard_of(message.keys[0])
        elif isinstance(message, m.ReplicateBeginMany | m.ReplicaCorruptMany):  # one shard's keys
            shard = self.router.shard_of(message.items[0].key)
        else:
            shard = self.router.shard_of(getattr(message, "key", b""))
        reply = await self.router.ask(
            shard,
            verb,
            message,
            REQUEST_TIMEOUT_S,
            # only a trace id that fits a header: a writer's, as its PUT carried it, made the
            # message too large or broke its header, and NATS closed this connection (stop 68)
            headers={TRACE_ID_HEADER: trace_id} if (trace_id := header_trace_id(trace_id)) else None,
        )
        self._saw_epoch(shard, getattr(reply, "epoch", 0))
        return reply

    async def _every_leader(
        self, verb: str, message: msgspec.Struct, timeout_s: float = REQUEST_TIMEOUT_S
    ) -> list[msgspec.Struct]:
        """Registration and heartbeats: every instance that leads a shard keeps segments. Raises
        the first error when no instance took it (or `NotFound`/`StaleGeneration` from any: a
        leader declared this incarnation down)."""
        assert self.router is not None
        answers = await self.router.ask_all(verb, message, timeout_s)
        replies: list[msgspec.Struct] = [a for a in answers if not isinstance(a, KvfError)]
        errors = [a for a in answers if isinstance(a, KvfError)]
        for err in errors:
            if isinstance(err, NotFound | StaleGeneration):
                raise err
        covered = {e.shard for r in replies for e in getattr(r, "shard_epochs", [])}
        self._beats += 1
        if errors or len(covered) < self.router.shards or self._beats % MAP_REFRESH_BEATS == 0:
            # A gone or deposed instance, a shard nobody here answered for (it moved: a handover
            # or a failover), or just time: ask the map again before the next heartbeat, so
            # every shard's leader hears from this segment before it would declare it down.
            self.router.forget_all()
        if not replies:
            raise errors[0] if errors else Unavailable("no directory instance leads a shard yet")
        for reply in replies:
            for shard_epoch in getattr(reply, "shard_epochs", []):
                self._saw_epoch(shard_epoch.shard, shard_epoch.epoch)
        return replies

    def _saw_epoch(self, shard: int, epoch: int) -> None:
        """A leader of `shard` with `epoch` exists: tickets and frees of older epochs are fenced
        (the backend's gate, `kvfabric.segment_storage.gate`, is the one record of epochs seen)."""
        if self.backend.saw_epoch(shard, epoch):
            self._log.info("directory_epoch_seen", shard=shard, epoch=epoch)

    def _admit(self, shard: int, epoch: int) -> None:
        """A free or report from the leader of `shard` at `epoch`: `StaleGeneration` if that leader
        has been replaced, else its epoch is the oldest accepted from now on."""
        if self.backend.admit_directory(shard, epoch):
            self._log.info("directory_epoch_seen", shard=shard, epoch=epoch)

    async def _register(
        self,
        registration: m.RegisterSegment,
        *,
        wait_s: float = REGISTER_WAIT_S,
        retry_s: float = REGISTER_RETRY_S_MIN,
    ) -> list[msgspec.Struct]:
        """`register` with every shard leader; while none answers (`Unavailable`: no leader yet,
        or a shard map answered too late), asked again with a doubling wait for at most `wait_s`.
        `NotFound`/`StaleGeneration` (this incarnation declared down) and, once the wait is spent,
        the last error are raised."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return await self._every_leader("register", registration)
            except (NotFound, StaleGeneration):
                raise
            except (Unavailable, Indeterminate) as err:  # a register is idempotent per incarnation
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                self._log.info("register_retry", error=repr(err), wait_s=round(min(retry_s, left), 3))
                await asyncio.sleep(min(retry_s, left))
                retry_s = min(retry_s * 2, REGISTER_RETRY_S_MAX)

    async def _heartbeats(self) -> None:
        """One heartbeat round per interval, on a fixed cadence. A round waits at most one
        interval for its slowest instance: an instance that died with a heartbeat in flight
        (no reply, no `no responders`) must not hold back the next round to the others, or they
        declare this segment down (heartbeat timeout) and it restarts empty.

        Not `kvfabric.runtime.ticker.every` (which sleeps an interval after each run returned):
        rounds keep a fixed cadence (`due += interval`), the interval is re-read each round (the
        directory's `SegmentRegistered` sets it), a success resets the failure run, and the loop
        ends (returns) when the segment is declared down."""
        loop = asyncio.get_running_loop()
        due = loop.time()
        failed_in_a_row = 0
        while True:
            interval_s = self.heartbeat_interval_ms / 1000
            due = max(due + interval_s, loop.time())
            await asyncio.sleep(due - loop.time())
            try:
                await self._every_leader(
                    "heartbeat",
                    m.Heartbeat(
                        segment_id=self.settings.segment_id,
                        incarnation=self.incarnation,
                        used_bytes=self.slots.used_bytes,
                        draining=self.backend.draining,
                        disk_objects=self._disk_objects(),
                    ),
                    timeout_s=min(REQUEST_TIMEOUT_S, max(HEARTBEAT_TIMEOUT_MIN_S, interval_s)),
                )
            except (NotFound, StaleGeneration) as err:
                self._log.warning("segment_declared_down", code=err.code)
                self.must_reregister.set()
                return
            except KvfError as err:  # directory unreachable: keep trying, keep serving reads
                failed_in_a_row += 1  # one is routine (a failover); a run of them nears the timeout
                log = self._log.warning if failed_in_a_row >= HEARTBEATS_FAILED_WARN else self._log.info
                log("heartbeat_failed", code=err.code, failed_in_a_row=failed_in_a_row)
            else:
                failed_in_a_row = 0

    def _disk_objects(self) -> int:
        return self.ssd.table.objects if self.ssd is not None else 0
