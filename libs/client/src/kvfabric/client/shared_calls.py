"""Directory requests of one save-path verb, shared by a client's concurrent saves (issue 20).

Saves in flight together (an engine's `save_async` while it computes the next prompt, or several
engine threads on one client) each needed their own `put_begin`, `put_commit` and `put_abort` per
shard: with 32 prompts in flight the directory answered 96 requests for what 3 could carry. Here,
per shard, one request of a verb is in flight at a time; the saves that arrive meanwhile queue
and ride the next one together (`kvfabric.client.saves.take_batch`: whole saves, in arrival order,
at most `batch_max` items, never a key twice). A save alone goes at once: nothing waits to fill a
batch. Each caller gets the whole reply (it picks its own keys' results) and the trace id the
request went with (the first save's: its writes use it too, so a segment confirms the writes of
the saves that shared a `put_begin` in one request).

A request the directory refuses whole as malformed (`bad_request`: one save's bad object, say an
empty one, refuses every object in it) is sent again save by save, so the refusal reaches only the
save that caused it, never a neighbour that shared the request.

Bounds: one request per (verb, shard) in flight; the queue holds at most one entry per running
save (bounded by `saves_queued_max`). Deadlines: a request is sent with the latest deadline of the
saves it carries (they arrived within about one round trip). A caller whose own deadline passes
while its items still wait is answered `directory_timeout` and they leave the queue; once they
went, it takes the request's answer, up to the request's deadline (review, stop 66: a reply that
came after an earlier caller's deadline was dropped for it, and what the directory did for it,
places held to their TTL or a commit that published, went unknown). A request whose own
deadline passed answers `directory_timeout`; a begin that went anyway expires at the directory
after its write TTL.
A caller cancelled while it waits leaves the queue too (its items never go); one cancelled after
its items went (or while they go) cannot take them back: `on_cancel_sent` is handed the answer to
come (resolved by the request's deadline, or `closed` when the client closes first), for the
shell to end what it places (a cancelled save's begin: `kvfabric.client.aio_saves`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

from kvfabric.client.saves import Queued, take_batch

__all__ = ["SharedCalls"]

T = TypeVar("T")

# (shard, items, trace id, deadline monotonic s) -> the reply, or a cause string (never raises)
Send = Callable[[int, list[T], str, float], Awaitable[object]]

# Causes of a whole-request refusal that one caller's items may have caused alone: sent again
# caller by caller (a retry of a bad request costs the directory one decode each).
SPLIT_CAUSES: frozenset[str] = frozenset({"bad_request"})


# How long past its request's deadline a caller waits for that request's answer (`call`).
SENT_ANSWER_GRACE_S: Final = 1.0


@dataclass(slots=True)
class _Wait:
    trace_id: str
    deadline_s: float
    future: asyncio.Future[tuple[object, str]]
    sent_until_s: float = 0.0  # once sent: the deadline of the request that carries it


class SharedCalls(Generic[T]):
    """One verb's requests, per shard one in flight; one event loop."""

    def __init__(self, send: Send[T], batch_max: int) -> None:
        self._send = send
        self.batch_max = batch_max
        self._queues: dict[int, list[Queued[T]]] = {}
        self._senders: dict[int, asyncio.Task[None]] = {}
        self.requests = 0  # sent (tests, metrics)

    async def call(
        self,
        shard: int,
        items: Sequence[T],
        keys: Sequence[Hashable],
        trace_id: str,
        deadline_s: float,
        on_cancel_sent: Callable[[asyncio.Future[tuple[object, str]]], None] | None = None,
    ) -> tuple[object, str]:
        """(reply or cause, the request's trace id) for `items` (at most `batch_max`) of one shard.
        Cancelled: withdrawn if still queued, else `on_cancel_sent(the answer to come)`."""
        if len(items) > self.batch_max:
            raise ValueError(f"{len(items)} items exceed a request's {self.batch_max}")
        future: asyncio.Future[tuple[object, str]] = asyncio.get_running_loop().create_future()
        entry: Queued[T] = Queued(list(items), frozenset(keys), _Wait(trace_id, deadline_s, future))
        queue = self._queues.setdefault(shard, [])
        queue.append(entry)
        if shard not in self._senders:
            self._senders[shard] = asyncio.create_task(self._drain(shard))
        try:
            try:
                async with asyncio.timeout(max(0.0, deadline_s - time.monotonic())):
                    return await asyncio.shield(future)
            except TimeoutError:
                if entry in queue:
                    queue.remove(entry)
                    return "directory_timeout", trace_id
            # Sent, with the latest deadline of its callers (`_drain`): its answer (a reply, or
            # its own timeout) is taken, up to that deadline, not dropped. A reply dropped for a
            # caller whose deadline came first left what the directory did for it unknown to it
            # (places held to their TTL, a commit that published reported failed), and sent with
            # the earliest, a slow request failed every caller with it (review, stop 66).
            wait = entry.tag
            until_s = wait.sent_until_s if isinstance(wait, _Wait) else 0.0
            try:
                async with asyncio.timeout(max(0.0, until_s - time.monotonic()) + SENT_ANSWER_GRACE_S):
                    return await asyncio.shield(future)
            except TimeoutError:
                return "directory_timeout", trace_id
        except asyncio.CancelledError:
            if entry in queue:
                queue.remove(entry)
            elif on_cancel_sent is not None:
                on_cancel_sent(future)
            raise

    async def _send_once(self, shard: int, items: list[T], trace_id: str, deadline_s: float) -> object:
        self.requests += 1
        try:
            return await self._send(shard, items, trace_id, deadline_s)
        except Exception as exc:  # `send` never raises; a bug must not strand the waiters
            return f"client_error:{type(exc).__name__}"

    async def _drain(self, shard: int) -> None:
        queue = self._queues[shard]
        try:
            while queue:
                taken = take_batch(queue, self.batch_max)
                waits = [e.tag for e in taken if isinstance(e.tag, _Wait)]
                trace_id = waits[0].trace_id
                deadline_s = max(w.deadline_s for w in waits)  # each of them takes its answer
                for wait in waits:
                    wait.sent_until_s = deadline_s
                items = [item for e in taken for item in e.items]
                reply = await self._send_once(shard, items, trace_id, deadline_s)
                if isinstance(reply, str) and reply in SPLIT_CAUSES and len(taken) > 1:
                    for entry in taken:  # whose items were refused: each save on its own
                        one = entry.tag
                        if isinstance(one, _Wait) and not one.future.done():
                            # (the request's deadline, each caller's until: its own may be past)
                            alone = await self._send_once(shard, entry.items, one.trace_id, deadline_s)
                            if not one.future.done():
                                one.future.set_result((alone, one.trace_id))
                    continue
                for wait in waits:
                    if not wait.future.done():
                        wait.future.set_result((reply, trace_id))
        finally:
            del self._senders[shard]
            if queue:  # cancelled (the client closes): nobody sends for the rest
                for entry in queue:
                    if isinstance(entry.tag, _Wait) and not entry.tag.future.done():
                        entry.tag.future.set_result(("closed", entry.tag.trace_id))
                queue.clear()
