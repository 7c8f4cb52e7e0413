"""The directory's events stream `KVF_DIRECTORY_EVENTS`: in-order publishing, and getting a stuck
stream going again without restarting nats-server.

Every shard's shell publishes its events in order, each retried until JetStream takes it
(`EventPublisher.publish`). One `EventsStream` per instance owns the stream's configuration,
counts failures by reason and notices a stream that is *stuck*.

## Why a stream gets stuck (nats-server 2.15.1)
A store write that fails with an I/O error (a full disk: ENOSPC) is kept by the stream's file
store for the rest of its life. `fileStore.setWriteErr` sets `fs.werr` once and nothing clears it;
`fileStore.StoreMsg`/`StoreRawMsg` ("Always return previous write errors"), `PurgeEx`,
`removeMsg`, `Compact` and `Truncate` return it first (server/filestore.go). The stream keeps it
too (`stream.setWriteErrLocked`, `mset.werr`, server/stream.go; an R>1 stream's leader also steps
down and turns observer, so another replica with a working disk takes over). A standalone
server's append path (`processJetStreamMsg`) logs "JetStream failed to store a msg ... no space
left on device" and returns *without answering* the publisher: the client sees a timeout, not
an error code. Neither a stream update (`UpdateConfig` keeps the store), nor a purge (returns the
error), nor time clears it; the store is replaced only when the stream is deleted and added
again, or when the server restarts (it reopens every store). nats-server's `/healthz` reports it
("JetStream stream '<acc> > <stream>' write error", server/monitor.go): that is what a
supervisor or an alert can watch. The same holds for a KV bucket (a stream `KV_<bucket>`): the
directory cannot recreate its leader-lease bucket (revisions are the shards' epochs and the
bucket holds the live leases) nor its segment registry, so a stuck KV bucket still needs a
nats-server restart (docs/chaos.md, runbook).

## What the directory does
A shell whose head event failed `stuck_after_failures` times in a row, for at least as long as
that many attempts take when each waits its whole `publish_timeout_s` (~11 s: an R3 stream
electing a leader fails fast and for less), asks `EventsStream.repair` (again every ~11 s): if
the stream's last sequence has not moved since that streak began (nobody, on any instance,
could append meanwhile) and the stream answers
`stream_info` (it exists and has a leader), the stream is stuck: it is deleted and added again
with the same configuration and `first_seq` = its last sequence + 1. Sequences go on where they
stopped, so the followers (the eviction policy, the router's index) resume after the last event
they applied: their ephemeral consumers died with the old stream, their next fetch fails
(`ServiceUnavailableError`), and they create a consumer from `last_seq + 1` (the router also
checks the stream's first/last sequence and resyncs on a gap). What the deletion costs: the old
stream's events (a follower that starts later rebuilds from the new stream only; one still behind
the old stream's end misses what it had not read: the router notices the gap and resyncs, the
eviction policy adopts the published groups it does not track from the directory's listing).
Repairs are bounded: at most one deletion per `repair_interval_s` per instance; a stream found
missing is added again at once (after a deletion whose add failed, e.g. the disk still full).
Two instances repairing at the same moment can at worst delete the other's fresh stream (events
published to it in between are lost to followers that had not read them): each instance waits a
random part of a second before it checks again, so that is unlikely.

Counted (`kvfabric.directory.metrics`): publish failures by reason (`timeout`, `no_responders`,
`unavailable`, `api_error`, `other`), shells stuck right now (head event failed at least
`stuck_after_failures` times in a row), streams recreated, repairs that failed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js.api import StreamConfig
from nats.js.errors import BadRequestError

from kvfabric.directory.kv_doctor import add_or_find_stream
from kvfabric.runtime.logs import get_logger

__all__ = [
    "EVENTS_STREAM",
    "PUBLISH_RETRY_S",
    "PUBLISH_TIMEOUT_S",
    "EventPublisher",
    "EventsStream",
    "failure_reason",
]

EVENTS_STREAM: Final = "KVF_DIRECTORY_EVENTS"
# JetStream's API error codes for a stream whose `max_bytes` the store cannot reserve:
# insufficient resources (10023), storage resources exceeded (10047).
STORE_CANNOT_RESERVE: Final = frozenset({10023, 10047})
PUBLISH_TIMEOUT_S: Final = 2.0  # one attempt's wait for JetStream's acknowledgement
PUBLISH_RETRY_S: Final = 0.2  # pause between attempts
STUCK_AFTER_FAILURES: Final = 5  # ~11 s of failed attempts (2.2 s each) before a repair
REPAIR_INTERVAL_S: Final = 30.0  # at most one deletion of the stream this often per instance
REPAIR_JITTER_S: Final = 1.0  # random wait before a repair checks the stream (instances apart)
API_TIMEOUT_S: Final = 5.0  # JetStream API calls (add, update, info, delete of the stream)


def failure_reason(exc: BaseException) -> str:
    """A publish failure's reason label: a stuck stream answers nothing (`timeout`)."""
    if isinstance(exc, TimeoutError | nats.errors.TimeoutError):
        return "timeout"
    if isinstance(exc, nats.errors.NoRespondersError | nats.js.errors.NoStreamResponseError):
        return "no_responders"
    if isinstance(exc, nats.js.errors.ServiceUnavailableError):
        return "unavailable"
    if isinstance(exc, nats.js.errors.APIError):
        return "api_error"
    return "other"


@dataclass(slots=True)
class _Streak:
    """One shell's run of failed attempts at its head event."""

    failures: int = 0
    started_mono: float = 0.0
    last_seq: int | None = None  # the stream's last sequence when the streak began (None: unread)
    repair_at_mono: float = 0.0  # no repair before this


class EventsStream:
    """The instance's view of the events stream: its configuration, failure counts, repairs."""

    def __init__(
        self,
        nc: NatsClient,
        config: StreamConfig,
        *,
        stuck_after_failures: int = STUCK_AFTER_FAILURES,
        repair_interval_s: float = REPAIR_INTERVAL_S,
        repair_jitter_s: float = REPAIR_JITTER_S,
        api_timeout_s: float = API_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.nc = nc
        self.config = config
        self.stuck_after_failures = stuck_after_failures
        self.repair_interval_s = repair_interval_s
        self.repair_jitter_s = repair_jitter_s
        self.api_timeout_s = api_timeout_s
        self.clock = clock
        self.failures: Counter[str] = Counter()  # publish attempts failed, by reason
        self.recreated = 0
        self.repairs_failed = 0
        self.stuck: set[object] = set()  # publishers whose head event is stuck now
        self._deleted_mono: float | None = None  # the last deletion
        self._next_first_seq = 1  # where a recreated stream starts (the last one seen + 1)
        self._lock = asyncio.Lock()
        self._log = get_logger("kvfabric.directory.events")

    async def ensure(self) -> None:
        """Add the stream, or update its configuration when it exists. A size bound the store
        cannot reserve (nats-server reserves `max_bytes` x replicas of its `max_file_store`: a
        small store, e.g. a drill's 64 MiB tmpfs) is dropped with a warning: the stream is
        bounded by age only then, as before the bound."""
        js = self.nc.jetstream(timeout=self.api_timeout_s)
        try:
            await self._add_or_update(js)
        except nats.js.errors.APIError as exc:
            self._drop_unreservable_bound(exc, "ensure")
            await self._add_or_update(js)

    def _drop_unreservable_bound(self, exc: nats.js.errors.APIError, step: str) -> None:
        """Re-raise `exc` unless it says the store cannot reserve the stream's `max_bytes`; if it
        does, the stream is bounded by age only from now on (`ensure`, and the repair's
        recreate)."""
        if exc.err_code not in STORE_CANNOT_RESERVE or (self.config.max_bytes or -1) <= 0:
            raise exc
        self._log.warning(
            "events_stream_unbounded",
            max_bytes=self.config.max_bytes,
            step=step,
            reason=exc.description or "insufficient storage",
        )
        self.config = dataclasses.replace(self.config, max_bytes=-1)

    async def _add_or_update(self, js: nats.js.JetStreamContext) -> None:
        try:
            await js.add_stream(self.config)
        except BadRequestError:
            await js.update_stream(self.config)

    async def last_seq(self) -> int | None:
        """The stream's last sequence; None when it cannot be read (missing, no leader, ...)."""
        js = self.nc.jetstream(timeout=self.api_timeout_s)
        try:
            info = await js.stream_info(self.config.name or EVENTS_STREAM)
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
            return None
        self._next_first_seq = max(self._next_first_seq, info.state.last_seq + 1)
        return info.state.last_seq

    async def repair(self, streak: _Streak) -> str:
        """Called by a publisher whose streak reached `stuck_after_failures`. Returns what was
        done: `recreated`, `added` (it was missing), `moving` (its last sequence moved: not
        stuck), `unreadable`, `recently` (a deletion less than `repair_interval_s` ago),
        `failed`."""
        await asyncio.sleep(random.uniform(0, self.repair_jitter_s))
        async with self._lock:
            name = self.config.name or EVENTS_STREAM
            js = self.nc.jetstream(timeout=self.api_timeout_s)
            try:
                info = await js.stream_info(name)
            except nats.js.errors.NotFoundError:
                return await self._add(js, "added", missing=True)
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                self._log.warning("events_stream_unreadable", error=type(exc).__name__)
                return "unreadable"
            last = info.state.last_seq
            self._next_first_seq = max(self._next_first_seq, last + 1)
            if streak.last_seq is None or last != streak.last_seq:
                streak.last_seq = last  # appended meanwhile, or not read at the start: look again
                return "moving"
            now = self.clock()
            if self._deleted_mono is not None and now - self._deleted_mono < self.repair_interval_s:
                return "recently"
            self._deleted_mono = now
            stuck_s = round(now - streak.started_mono, 1)
            self._log.warning(
                "events_stream_recreating",
                stream=name,
                last_seq=last,
                failures=streak.failures,
                stuck_s=stuck_s,
            )
            try:
                await js.delete_stream(name)
            except nats.js.errors.NotFoundError:
                pass  # another instance deleted it first: add it
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                self.repairs_failed += 1
                self._log.error("events_stream_repair_failed", step="delete", error=type(exc).__name__)
                return "failed"
            return await self._add(js, "recreated", missing=False)

    async def _add(self, js: nats.js.JetStreamContext, done: str, *, missing: bool) -> str:
        first_seq = self._next_first_seq
        config = dataclasses.replace(self.config, first_seq=first_seq)
        try:
            try:
                added = await add_or_find_stream(js, config)
            except nats.js.errors.APIError as exc:  # a size bound the store cannot reserve now
                self._drop_unreservable_bound(exc, "recreate")
                added = await add_or_find_stream(js, dataclasses.replace(config, max_bytes=-1))
            if not added:
                return "moving" if missing else done  # added meanwhile by another instance
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            self.repairs_failed += 1
            self._log.error(
                "events_stream_repair_failed", step="add", first_seq=first_seq, error=type(exc).__name__
            )
            return "failed"
        self.recreated += 1
        self._log.warning("events_stream_recreated", stream=config.name, first_seq=first_seq, missing=missing)
        return done


class EventPublisher:
    """Publishes one shell's events in order: each retried until JetStream takes it, the stream
    repaired (`EventsStream.repair`) after `stuck_after_failures` failures in a row."""

    def __init__(
        self,
        stream: EventsStream,
        *,
        publish_timeout_s: float = PUBLISH_TIMEOUT_S,
        retry_s: float = PUBLISH_RETRY_S,
        name: str = "",
    ) -> None:
        self.stream = stream
        self.publish_timeout_s = publish_timeout_s
        self.retry_s = retry_s
        self.name = name
        self.published = 0
        self._log = get_logger("kvfabric.directory").bind(publisher=name)

    async def publish(self, subject: str, payload: bytes, headers: dict[str, str] | None = None) -> int:
        """Until JetStream takes it; returns the event's stream sequence. `headers`: its NATS
        headers (a shard's events name their core: `kvfabric.proto.directory.shard_epoch_header`)."""
        js = self.stream.nc.jetstream()
        streak = _Streak()
        try:
            while True:
                try:
                    ack = await js.publish(subject, payload, timeout=self.publish_timeout_s, headers=headers)
                except (TimeoutError, nats.errors.Error) as exc:
                    await self._failed(streak, subject, exc)
                    await asyncio.sleep(self.retry_s)
                    continue
                self.published += 1
                if streak.failures:
                    self._log.info("event_publish_recovered", subject=subject, failures=streak.failures)
                return ack.seq
        finally:
            self.stream.stuck.discard(self)

    async def _failed(self, streak: _Streak, subject: str, exc: BaseException) -> None:
        stream = self.stream
        reason = failure_reason(exc)
        stream.failures[reason] += 1
        if streak.failures == 0:
            streak.started_mono = stream.clock()
            streak.last_seq = await stream.last_seq()
        streak.failures += 1
        self._log.warning(
            "event_publish_retry", subject=subject, error=type(exc).__name__, failures=streak.failures
        )
        # Stuck: N failures *and* as long as N attempts that each waited their whole timeout (fast
        # failures, e.g. no responders while an R3 stream elects its leader, do not count sooner).
        stuck_after_s = stream.stuck_after_failures * (self.publish_timeout_s + self.retry_s)
        if (
            streak.failures < stream.stuck_after_failures
            or stream.clock() - streak.started_mono < stuck_after_s
        ):
            return
        if self not in stream.stuck:
            stream.stuck.add(self)
            self._log.error("events_publish_stuck", subject=subject, failures=streak.failures, reason=reason)
        if stream.clock() >= streak.repair_at_mono:  # bounded: one repair per stuck_after_s
            streak.repair_at_mono = stream.clock() + stuck_after_s
            done = await stream.repair(streak)
            self._log.warning("events_stream_repair", outcome=done, failures=streak.failures)
