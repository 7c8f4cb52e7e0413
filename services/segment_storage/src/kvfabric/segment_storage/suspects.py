"""Re-verifying a slot a reader found corrupt, now rather than at the scrubber's next pass.

A reader that gets bytes whose hash does not match the object's checksum tells the directory
(`ReplicaSuspect`), which relays it here (`kvf.v1.segment.verify.<segment_id>`, `VerifyRequest`):
the reader cannot drop a replica itself (it may lie, or be another tenant), the segment that
holds the bytes decides. A suspect slot is re-hashed by `ArenaBackend.verify_stored` (under a
read reference; a mismatch frees it at once, so no later read is served) and, when corrupt,
reported to the directory like a scrubber finding (`replica_corrupt`): the replica is dropped
and repair restores the target. A slot that is fine, or was freed or reused meanwhile, is left
as it is: a forged report costs one re-hash.

Bounds: at most `SUSPECTS_PENDING_MAX` slots wait (more are refused: `queued` false), of them at
most `SUSPECTS_PER_REPORTER_MAX` reported by one reporter (its share domains, as the directory
relays them; a report with none, a service's or any where tenants are off, is bounded by the
queue alone: one tenant reporting its own good objects filled the queue and every other tenant's
report was refused; review, 2026-12-06), one is
hashed at a time on a worker thread, a slot whose object lies outside the reporter's share
domains (`VerifyRequest.domains`) is not hashed at all, a slot found fine is not hashed again for
`VERIFIED_OK_HOLD_S` (at most `VERIFIED_OK_MAX` remembered), so a flood of reports of one good
slot costs one hash, and the checks hash at most `SUSPECTS_BYTES_PER_S` (after each, the worker
waits its bytes' share of a second: reports of ~200 distinct large objects kept it hashing, and
reading the disk tier, back to back, at over a GB/s; review, stop 68).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Final

import msgspec

from kvfabric.core.quotas import tenant_of
from kvfabric.format.errors import Busy
from kvfabric.proto.segment import VerifyReply, VerifyRequest
from kvfabric.segment_storage.backend import ArenaBackend
from kvfabric.segment_storage.disk_calls import DiskCalls
from kvfabric.segment_storage.scrubber import CorruptObject

__all__ = [
    "SUSPECTS_BYTES_PER_S",
    "SUSPECTS_PENDING_MAX",
    "SUSPECTS_PER_REPORTER_MAX",
    "VERIFIED_OK_HOLD_S",
    "VERIFIED_OK_MAX",
    "SuspectChecker",
]

SUSPECTS_PENDING_MAX: Final = 32
SUSPECTS_PER_REPORTER_MAX: Final = SUSPECTS_PENDING_MAX // 4  # one tenant's share of the queue
VERIFIED_OK_HOLD_S: Final = 10.0
VERIFIED_OK_MAX: Final = 1024
SUSPECTS_BYTES_PER_S: Final = 256 << 20  # bytes the checks hash a second, at most
BUSY_RETRY_S: Final = 0.1  # a check the disk tier refused as busy is tried again after this

Slot = tuple[int, int]  # (slot, generation)


class SuspectChecker:
    """The `verify` endpoint's queue and its one worker; one event loop."""

    def __init__(
        self,
        backend: ArenaBackend,
        incarnation: int,
        report: Callable[[CorruptObject], Awaitable[None]],
        *,
        clock_s: Callable[[], float] = time.monotonic,
        disk_calls: DiskCalls | None = None,
        bytes_per_s: float = SUSPECTS_BYTES_PER_S,
    ) -> None:
        self.backend = backend
        self._bytes_per_s = bytes_per_s
        # a check may read and free a disk slot: counted, the stop closes the tier after it
        self.disk_calls = disk_calls or DiskCalls()
        self.incarnation = incarnation
        self._report = report
        self._clock_s = clock_s
        self._pending: deque[tuple[Slot, frozenset[bytes]]] = deque()
        self._queued: set[Slot] = set()
        self._queued_by: Counter[frozenset[bytes]] = Counter()  # reporter's domains -> slots queued
        self._verified_ok: OrderedDict[Slot, float] = OrderedDict()  # -> when it was found fine
        self._worker: asyncio.Task[None] | None = None
        self.checked = 0
        self.corrupt_found = 0
        self.refused = 0
        self.busy_retries = 0  # checks put back because the disk tier was busy

    async def on_verify(self, request: VerifyRequest, headers: Mapping[str, str]) -> msgspec.Struct:
        return VerifyReply(queued=self.suspect(request))

    def suspect(self, request: VerifyRequest) -> bool:
        """Queue one slot for a check; whether it was queued (see the module docstring)."""
        if request.incarnation != self.incarnation:
            return False  # about an earlier life of this segment: its slots are gone
        slot = (request.slot, request.slot_generation)
        found_ok = self._verified_ok.get(slot)
        if found_ok is not None and self._clock_s() - found_ok < VERIFIED_OK_HOLD_S:
            return False
        reporter = frozenset(request.domains)
        if (
            slot in self._queued
            or len(self._pending) >= SUSPECTS_PENDING_MAX
            # (no domains: a service's report, or any client's where tenants are off: not a
            # tenant to share against, the whole queue)
            or (reporter and self._queued_by[reporter] >= SUSPECTS_PER_REPORTER_MAX)
        ):
            self.refused += 1
            return False
        self._pending.append((slot, reporter))
        self._queued.add(slot)
        self._queued_by[reporter] += 1
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return True

    async def _drain(self) -> None:
        while self._pending:
            slot, domains = self._pending.popleft()
            try:
                verdict, found, hashed = await self.disk_calls.run(
                    functools.partial(self._check, slot, domains)
                )
            except Busy:  # the disk tier's reads are at their byte limit: later, not never
                self._pending.append((slot, domains))
                self.busy_retries += 1
                await asyncio.sleep(BUSY_RETRY_S)
                continue
            except BaseException:
                self._dequeued(slot, domains)
                raise
            self._dequeued(slot, domains)
            if verdict == "ok":
                self._verified_ok[slot] = self._clock_s()
                self._verified_ok.move_to_end(slot)
                while len(self._verified_ok) > VERIFIED_OK_MAX:
                    self._verified_ok.popitem(last=False)
            if found is not None:
                self.corrupt_found += 1
                await self._report(found)
            if hashed:
                await asyncio.sleep(hashed / self._bytes_per_s)  # the checks' byte rate

    def _dequeued(self, slot: Slot, reporter: frozenset[bytes]) -> None:
        self._queued.discard(slot)
        self._queued_by[reporter] -= 1
        if self._queued_by[reporter] <= 0:
            del self._queued_by[reporter]  # (no entry per reporter ever seen)

    def _check(self, slot: Slot, domains: frozenset[bytes]) -> tuple[str, CorruptObject | None, int]:
        """Blocking (hashes one object): the verdict, the corrupt object (freed already), and the
        bytes hashed."""
        held = self.backend.held_one(*slot)  # an arena or a disk slot
        if held is None:
            return "skipped", None, 0  # freed or reused meanwhile: nothing of it is served any more
        if domains and tenant_of(held.key) not in domains:
            return "foreign", None, 0  # another tenant's object: not the reporter's to question
        self.checked += 1
        verdict = self.backend.verify_stored(held.slot, held.generation, held.size)
        if verdict == "corrupt":
            return verdict, CorruptObject(held.key, held.slot, held.generation, held.size), held.size
        return verdict, None, held.size

    async def stop(self) -> None:
        self._pending.clear()
        self._queued_by.clear()
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
