"""Reporting a replica whose bytes failed their checksum (issue 22).

The load that saw the mismatch already went on to the object's next replica (or reported the
chunk failed, and the engine recomputes it). This tells the cluster, so that the next lookup
does not hand out the same bad replica until the scrubber's next pass: `ReplicaSuspect` to any
directory instance, which relays it to the segment; the segment re-hashes the slot and, if it is
corrupt, frees it and has the directory drop the replica (kvfabric.directory.suspects,
kvfabric.segment_storage.suspects). The client never drops anything on its own word.

Called from transfer threads (`seen`); the reports go out on the client's loop, without waiting
in the load. Bounds: one report per (segment, incarnation, slot, generation) relayed
(`REPORTED_MAX` remembered; one that failed or was refused is forgotten, so the next sighting
reports it again), at most `REPORTS_INFLIGHT_MAX` in flight (more are dropped: the scrubber still
finds them), each within `REPORT_TIMEOUT_S`. Counted in `kvfabric_client_corrupt_reports_total`
by outcome: relayed, refused (over a bound at the directory), failed, dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Final

from prometheus_client import Counter

from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.format.errors import KvfError
from kvfabric.proto import directory as m

__all__ = ["REPORTED_MAX", "REPORTS_INFLIGHT_MAX", "REPORT_TIMEOUT_S", "SuspectReporter"]

REPORTED_MAX: Final = 4096
REPORTS_INFLIGHT_MAX: Final = 16
REPORT_TIMEOUT_S: Final = 2.0

ReplicaId = tuple[str, int, int, int]  # (segment id, incarnation, slot, generation)


class SuspectReporter:
    """Owns the reports in flight; `router` gives the directory router (None: not started)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        router: Callable[[], DirectoryRouter | None],
        counter: Counter,
    ) -> None:
        self._loop = loop
        self._router = router
        self._counter = counter
        self._reported: dict[ReplicaId, None] = {}  # insertion-ordered: the oldest forgotten first
        self._tasks: set[asyncio.Task[None]] = set()

    def seen(self, location: m.ObjectLocation, replica: m.Replica) -> None:
        """A replica's bytes failed their checksum: report it (any thread; never blocks)."""
        del location  # the segment knows the object by its slot
        ident = (replica.segment_id, replica.incarnation, replica.slot, replica.slot_generation)
        with contextlib.suppress(RuntimeError):  # the loop is closed: the client is gone
            self._loop.call_soon_threadsafe(self._start, ident)

    def _start(self, ident: ReplicaId) -> None:
        if ident in self._reported:
            return
        if len(self._tasks) >= REPORTS_INFLIGHT_MAX:
            self._counter.labels("dropped").inc()
            return
        self._reported[ident] = None
        while len(self._reported) > REPORTED_MAX:
            del self._reported[next(iter(self._reported))]
        task = self._loop.create_task(self._report(ident))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _report(self, ident: ReplicaId) -> None:
        router = self._router()
        if router is None:
            self._counter.labels("dropped").inc()
            self._reported.pop(ident, None)
            return
        segment_id, incarnation, slot, generation = ident
        message = m.ReplicaSuspect(
            segment_id=segment_id, incarnation=incarnation, slot=slot, slot_generation=generation
        )
        try:
            reply = await router.ask_any("replica_suspect", message, REPORT_TIMEOUT_S)
        except KvfError:
            self._counter.labels("failed").inc()
            self._reported.pop(ident, None)  # a later sighting reports it again (review, stop 68:
            return  # one failed report, as a directory restarted, silenced it for the client's life)
        relayed = isinstance(reply, m.ReplicaSuspectReply) and reply.relayed
        self._counter.labels("relayed" if relayed else "refused").inc()
        if not relayed:
            self._reported.pop(ident, None)

    async def close(self, timeout_s: float) -> None:
        """Wait for the reports in flight (each ends within `REPORT_TIMEOUT_S`), then cancel."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
