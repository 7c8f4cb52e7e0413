"""The segment shell's confirms: a written replica confirmed to its shard's leader, synchronously
for a transport thread (`_confirm`) or a demotion (`_confirm_async`), or in the background for a
write answered with a receipt (`_confirm_later`, `_confirm_in_background`).

`ShellConfirms` is a mixin of `SegmentShell` (`kvfabric.segment_storage.shell`): it reads the
shell's loop, router, settings, backend and batchers (`kvfabric.segment_storage.confirms`) and
writes only the queue of receipted writes not yet on the loop (`_later`, `_later_woken`,
`_later_timer`, `_later_tasks`, `_later_stopped`). At stop, `_stop_confirming_later` ends them
before the arena closes: no gather timer or background confirm is left, and a receipted write
that lands afterwards (its transport still serving) is refused instead of queued.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import TYPE_CHECKING, Final

from kvfabric.format.errors import Indeterminate, NotFound, StaleGeneration, Unavailable
from kvfabric.proto import directory as m
from kvfabric.runtime.deadline import cancel_and_wait

if TYPE_CHECKING:
    from kvfabric.cluster.directory_router import DirectoryRouter
    from kvfabric.segment_storage.backend import ArenaBackend
    from kvfabric.segment_storage.confirms import ConfirmBatcher
    from kvfabric.segment_storage.settings import SegmentSettings

__all__ = ["CONFIRM_LATER_GIVE_UP_MS", "CONFIRM_LATER_RETRY_S", "ShellConfirms"]

# A receipted write's background confirm that got no verdict (directory unreachable, busy) is
# asked again every this long until one comes; past the ticket's deadline (plus the clock skew
# tolerance) the directory has committed or dropped the write, so any verdict is final then,
# and a confirm still without one after CONFIRM_LATER_GIVE_UP_MS more frees the slot.
CONFIRM_LATER_RETRY_S: Final = 0.5
CONFIRM_LATER_GIVE_UP_MS: Final = 30_000
LATER_STOP_S: Final = 5.0  # a stop's wait for the cancelled confirms (`_stop_confirming_later`)
# Refusals that are final: the slot is freed at once (the others are asked again). Not
# `StaleGeneration`: the leader that issued the ticket was replaced, and its successor adopted
# this slot from this segment's report (a write of an older epoch is fenced once the successor
# is seen, and the successor asks for the report only after; `kvfabric.core.directory.rebuild`):
# it publishes the slot (the writer's commit may have, at the old epoch) or frees it after its
# grace. Freeing it here lost a published replica (the reviewer's failover repro, stop 33).
_CONFIRM_FINAL_ERRORS: Final = (NotFound,)


def _replica_confirm(ticket: m.WriteTicket, slot: int, generation: int) -> m.ReplicaConfirm:
    """The confirm of a replica written under `ticket` into `slot` at `generation`: the one
    shape every confirm path (synchronous, background, demotion) sends."""
    return m.ReplicaConfirm(
        ticket_id=ticket.ticket_id,
        key=ticket.key,
        slot=slot,
        slot_generation=generation,
        size_bytes=ticket.size_bytes,
        checksum=ticket.checksum,
    )


def _given_up(backend: ArenaBackend, ticket: m.WriteTicket) -> bool:
    """Whether a background confirm stops asking (its ticket's write is long settled)."""
    return backend.clock_ms() >= backend.ticket_deadline_ms(ticket) + CONFIRM_LATER_GIVE_UP_MS


class ShellConfirms:
    """Confirms of written replicas, answered on the shell's event loop."""

    settings: SegmentSettings
    router: DirectoryRouter | None
    backend: ArenaBackend
    confirms: ConfirmBatcher
    confirms_later: ConfirmBatcher
    _loop: asyncio.AbstractEventLoop | None
    _later: list[tuple[m.WriteTicket, int, int, str]]
    _later_lock: threading.Lock
    _later_woken: bool
    _later_tasks: set[asyncio.Task[None]]
    _later_timer: asyncio.TimerHandle | None
    _later_stopped: bool

    def _confirm(
        self, ticket: m.WriteTicket, slot: int, generation: int, trace_id: str = "", save_writes: int = 0
    ) -> str:
        """Called from a transport thread: confirm on the event loop (batched with the other
        replicas of the same save, `ConfirmBatcher`), wait for the verdict."""
        if self._loop is None or self.router is None:
            raise Unavailable("the segment is not connected to the directory")
        confirm = _replica_confirm(ticket, slot, generation)
        shard = self.router.shard_of(ticket.key)
        future = asyncio.run_coroutine_threadsafe(
            self.confirms.confirm(shard, ticket.epoch, confirm, trace_id, expected=save_writes), self._loop
        )
        try:
            return future.result(timeout=self.settings.confirm_timeout_ms / 1000)
        except TimeoutError:  # the caller keeps the slot and confirms it again in the background
            future.cancel()
            raise Indeterminate(
                "no confirm verdict in time", timeout_ms=self.settings.confirm_timeout_ms
            ) from None
        except (concurrent.futures.CancelledError, RuntimeError):  # stopping: the slot is freed
            raise Unavailable("the segment stopped confirming") from None

    def _confirm_later(self, ticket: m.WriteTicket, slot: int, generation: int, trace_id: str = "") -> None:
        """Called from a transport thread for a write answered with a receipt: its confirm goes
        in the background (`_confirm_in_background`); never blocks. The writes that arrive within
        `confirm_later_gather_ms` of the first share one wake-up, one task and one request. Not
        at once: that loop work (a task, a future per write, the request) ran while the same
        save's later writes were served, and its GIL holds and CPU delayed them (docs/segment.md,
        "Receipted writes"). Nobody waits on these confirms: the writer's put_commit carries the
        receipts and usually lands first (the confirm is then a no-op)."""
        loop = self._loop
        if loop is None or self.router is None:
            raise Unavailable("the segment is not connected to the directory")
        with self._later_lock:
            if self._later_stopped:
                raise Unavailable("the segment stopped confirming")
            self._later.append((ticket, slot, generation, trace_id))
            if self._later_woken:
                return
            self._later_woken = True
        try:
            loop.call_soon_threadsafe(self._gather_later)
        except RuntimeError:  # the loop is closing
            raise Unavailable("the segment stopped confirming") from None

    def _gather_later(self) -> None:
        """On the loop: start the queued writes' confirms `confirm_later_gather_ms` from now."""
        if self._later_stopped:
            return
        gather_s = self.settings.confirm_later_gather_ms / 1000
        self._later_timer = asyncio.get_running_loop().call_later(gather_s, self._start_later)

    def _start_later(self) -> None:
        """On the loop, `confirm_later_gather_ms` after the first of them: the receipted writes
        queued since, confirmed together."""
        self._later_timer = None
        with self._later_lock:
            items, self._later = self._later, []
            self._later_woken = False
        if self._later_stopped or not items:
            return
        task = asyncio.ensure_future(self._confirm_in_background(items))
        self._later_tasks.add(task)
        task.add_done_callback(self._later_tasks.discard)

    async def _stop_confirming_later(self) -> None:
        """At stop, before the arena closes: no receipted write is queued from now on, the
        gather's timer is cancelled, and every background confirm is cancelled and awaited, so
        none starts or runs on a closed arena (their slots die with this incarnation; the
        directory frees what no commit named)."""
        with self._later_lock:
            self._later_stopped = True
            self._later = []
        if self._later_timer is not None:
            self._later_timer.cancel()
            self._later_timer = None
        # cancelled again while they run (`cancel_and_wait`: 3.11's `wait_for` can swallow one),
        # for at most `LATER_STOP_S`; what still runs then is the stop watchdog's
        await cancel_and_wait(list(self._later_tasks), LATER_STOP_S)

    async def _confirm_in_background(self, items: list[tuple[m.WriteTicket, int, int, str]]) -> None:
        """Confirm receipted writes until the directory gives each a verdict: `ok` keeps the slot
        (the writer's commit named it, or will; `pending`, for a ticket without a checksum whose
        writer has not committed yet, is asked again), a refusal frees it (the write expired or was
        aborted uncommitted, or the ticket already names another slot); a newer leader
        (`StaleGeneration`) leaves it to that leader, which adopted it from this segment's
        report. Those without a verdict are asked again (`CONFIRM_LATER_RETRY_S`): freeing a slot
        the writer's receipt may have published would lose a replica. After a ticket's deadline
        every verdict is final; a directory silent for `CONFIRM_LATER_GIVE_UP_MS` past it gets
        the slot freed (as a synchronous confirm without a verdict does)."""
        assert self.router is not None
        waiting = items
        while waiting:
            asked = [
                (
                    (ticket, slot, generation, trace_id),
                    self.confirms_later.submit(
                        self.router.shard_of(ticket.key),
                        ticket.epoch,
                        _replica_confirm(ticket, slot, generation),
                        trace_id,
                        shared=True,
                    ),
                )
                for ticket, slot, generation, trace_id in waiting
            ]
            await asyncio.wait([f for _, f in asked], timeout=self.settings.confirm_timeout_ms / 1000)
            waiting = []
            for (ticket, slot, generation, trace_id), verdict in asked:
                if not verdict.done():
                    verdict.cancel()  # its batch skips it (or drops its late verdict)
                    err: BaseException | None = TimeoutError()
                else:
                    err = verdict.exception()
                if err is None and verdict.result() == "pending" and not _given_up(self.backend, ticket):
                    # a ticket without a checksum, its writer's receipt not committed yet
                    waiting.append((ticket, slot, generation, trace_id))
                elif err is None:
                    if verdict.result() != "ok":
                        self.backend.unconfirmed(slot, generation, verdict.result())
                elif isinstance(err, _CONFIRM_FINAL_ERRORS):
                    self.backend.unconfirmed(slot, generation, err.code)
                elif isinstance(err, StaleGeneration) and err.details.get("kind") == "directory_epoch":
                    self.backend.count("confirm_later_superseded_total")  # the successor owns its fate
                elif isinstance(err, StaleGeneration):  # a stale incarnation: no report adopts it
                    self.backend.unconfirmed(slot, generation, err.code)
                elif _given_up(self.backend, ticket):
                    self.backend.unconfirmed(slot, generation, "no_verdict")
                else:
                    waiting.append((ticket, slot, generation, trace_id))
            if waiting:
                self.backend.count("confirm_later_retries_total", len(waiting))
                await asyncio.sleep(CONFIRM_LATER_RETRY_S)

    async def _confirm_async(self, ticket: m.WriteTicket, slot: int, generation: int) -> str:
        """A demotion's disk replica, confirmed on the loop like a transport's write."""
        assert self.router is not None
        confirm = _replica_confirm(ticket, slot, generation)
        try:
            return await asyncio.wait_for(
                self.confirms.confirm(self.router.shard_of(ticket.key), ticket.epoch, confirm, ""),
                self.settings.confirm_timeout_ms / 1000,
            )
        except TimeoutError:
            raise Indeterminate(
                "no confirm verdict in time", timeout_ms=self.settings.confirm_timeout_ms
            ) from None
