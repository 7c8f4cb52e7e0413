"""The scrubber: re-verifies stored objects' checksums in the background, at a bounded rate.

`Scrubber.step(budget_bytes, now_ms)` walks the STORED slots round-robin by slot id (a page of
`SlotTable.held()` at a time, resumed after the last slot checked; a pass ends when the walk wraps)
and hashes objects until `budget_bytes` are spent (the last object may overshoot: the pacer counts
the debt), at most `objects_max` per step and never past the end of a pass. A pass starts at most
once per `pass_min_ms`: a small store is not re-hashed over and over just because the rate allows
it (and an object stored meanwhile waits at most that long for its first check). Each object is checked
by `ArenaBackend.verify_stored` under a read reference: an object freed or rewritten since its page
was listed is skipped; a mismatch frees the slot at once and is returned for the shell to report
(`ReplicaCorrupt`). Blocking (it hashes): the shell runs it on a worker thread.

`ScrubPacer` is the rate: the project's one token bucket (`kvfabric.core.quotas.TokenBucket`) of
bytes, starting empty, refilled at `bytes_per_s`, capped at one second's worth, with time passed
in; a step's overshoot is a debt (`charge` with no floor) paid back before the next step. Over
any window of w seconds the scrubber reads at most bytes_per_s × (w + 1) + the largest object.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Final

from kvfabric.core.quotas import TokenBucket
from kvfabric.core.segment_slots import HeldSlot
from kvfabric.segment_storage.backend import ArenaBackend

__all__ = ["CorruptObject", "ScrubPacer", "Scrubber"]

PAGE_OBJECTS: Final = 256  # slots listed per `held()` call (it sorts the live slot ids)


@dataclass(frozen=True, slots=True)
class CorruptObject:
    """A stored object whose bytes no longer match its checksum: already freed locally."""

    key: bytes
    slot: int
    generation: int
    size: int


class Scrubber:
    def __init__(self, backend: ArenaBackend, *, pass_min_ms: int, objects_max: int = PAGE_OBJECTS) -> None:
        assert objects_max >= 1 and pass_min_ms >= 0
        self.backend = backend
        self.pass_min_ms = pass_min_ms
        self.objects_max = objects_max
        self._after_slot = -1  # the walk resumes after this slot id; -1: a pass is to start
        self._pass_started_ms: int | None = None
        self._page: deque[HeldSlot] = deque()

    def _next(self, now_ms: int) -> HeldSlot | None:
        """The next stored object of the walk; None at the end of a pass, while the next pass may
        not start yet, or when nothing is stored."""
        if not self._page:
            if self._after_slot < 0:
                started = self._pass_started_ms
                if started is not None and now_ms - started < self.pass_min_ms:
                    return None
                self._pass_started_ms = now_ms
            with self.backend.lock:
                self._page.extend(self.backend.slots.held(self._after_slot, PAGE_OBJECTS))
            if not self._page:
                if self._after_slot >= 0:
                    self.backend.count("scrub_passes_total")
                self._after_slot = -1
                return None
        held = self._page.popleft()
        self._after_slot = held.slot
        return held

    def step(self, budget_bytes: int, now_ms: int) -> tuple[int, list[CorruptObject]]:
        """Check objects until `budget_bytes` are read. Returns (bytes read, corrupt objects found)."""
        spent = 0
        corrupt: list[CorruptObject] = []
        for _ in range(self.objects_max):
            if spent >= budget_bytes:
                break
            held = self._next(now_ms)
            if held is None:
                break
            verdict = self.backend.verify_stored(held.slot, held.generation, held.size)
            if verdict == "skipped":
                continue
            spent += held.size
            if verdict == "corrupt":
                corrupt.append(CorruptObject(held.key, held.slot, held.generation, held.size))
        return spent, corrupt


class ScrubPacer:
    """Bytes the scrubber may read now: refilled at `bytes_per_s`, capped at one second's worth."""

    def __init__(self, bytes_per_s: int, now_s: float) -> None:
        assert bytes_per_s > 0
        self.bytes_per_s = bytes_per_s
        self.bucket = TokenBucket(float(bytes_per_s), float(bytes_per_s), 0.0, now_s)

    def available(self, now_s: float) -> int:
        return max(0, int(self.bucket.refill(now_s)))

    def spend(self, n: int) -> None:
        """Debt is allowed (one large object): nothing is available until it is paid back.
        Charged at the last `available` time (the bytes were read since)."""
        self.bucket.charge(n, self.bucket.updated_s, floor=-math.inf)
