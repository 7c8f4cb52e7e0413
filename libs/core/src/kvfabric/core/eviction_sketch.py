"""A count-min frequency sketch with periodic halving (TinyLFU's aging): fixed memory.

Einziger, Friedman, Manes, "TinyLFU: A Highly Efficient Cache Admission Policy", ACM
Transactions on Storage 13(4), 2017. `SKETCH_DEPTH` rows of `SKETCH_WIDTH` 4-bit counters (kept
as Python ints, capped at `COUNTER_MAX`); every `halve_every` increments all counters halve, so
old popularity fades. Used by second-hit admission (`eviction.py`) and W-TinyLFU
(`eviction_wtinylfu.py`).

Each key's `hash()` is mixed (splitmix64's finalizer) into 64 bits, one 16-bit slice per row, so
the rows index independently. (The first sketch took `h ^ h` for row 0, always cell 0, and
multiples of `h` for the others, so integer ids 65536 apart collided in every row.)
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Final

__all__ = ["COUNTER_MAX", "SKETCH_DEPTH", "SKETCH_WIDTH", "FrequencySketch"]

SKETCH_WIDTH: Final = 1 << 16  # a 16-bit slice of the mixed hash per row
SKETCH_DEPTH: Final = 4  # 4 x 16 bits = the 64 mixed bits
COUNTER_MAX: Final = 15  # 4 bits
_MASK64: Final = (1 << 64) - 1


def _mix64(value: int) -> int:
    """splitmix64's finalizer: every input bit moves about half the output bits."""
    x = (value + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass(slots=True)
class FrequencySketch:
    rows: list[list[int]] = field(default_factory=lambda: [[0] * SKETCH_WIDTH for _ in range(SKETCH_DEPTH)])
    increments: int = 0

    def cells(self, key: Hashable) -> list[int]:
        """The counter `key` uses in each row."""
        mixed = _mix64(hash(key) & _MASK64)
        return [(mixed >> (16 * i)) & (SKETCH_WIDTH - 1) for i in range(SKETCH_DEPTH)]

    def add(self, key: Hashable, halve_every: int) -> None:
        for row, cell in zip(self.rows, self.cells(key), strict=True):
            row[cell] = min(row[cell] + 1, COUNTER_MAX)
        self.increments += 1
        if self.increments >= halve_every:
            self.increments = 0
            for row in self.rows:
                for i, v in enumerate(row):
                    row[i] = v >> 1

    def estimate(self, key: Hashable) -> int:
        return min(row[cell] for row, cell in zip(self.rows, self.cells(key), strict=True))
