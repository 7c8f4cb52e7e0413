"""Two tiers in the eviction policy (issue 23): a segment's arena is pool `<segment id>`, its disk
tier is pool `<segment id>#ssd`. A victim of an arena pool is demoted (moved to that segment's
disk tier) or dropped, by `demote_or_drop`; a victim of a disk pool is dropped (evicted: its
last tier). Pure functions: the shell (`handlers.py`) does the requests.
"""

from __future__ import annotations

from typing import Final, Literal

__all__ = [
    "SSD_POOL_SUFFIX",
    "Choice",
    "demote_or_drop",
    "is_ssd_pool",
    "ssd_pool",
    "ssd_pool_capacity",
    "tiered_pools",
]

SSD_POOL_SUFFIX: Final = "#ssd"  # never in a segment id (they are [A-Za-z0-9_-])
Choice = Literal["demote", "drop"]


def ssd_pool(segment_id: str) -> str:
    return segment_id + SSD_POOL_SUFFIX


def is_ssd_pool(pool: object) -> bool:
    return isinstance(pool, str) and pool.endswith(SSD_POOL_SUFFIX)


def tiered_pools(placements: dict[str, int], disk: dict[str, int]) -> dict[str, int]:
    """A published group's pools: per segment its arena bytes (placements minus the disk share)
    and `<segment>#ssd` its disk bytes; empty ones left out."""
    pools: dict[str, int] = {}
    for segment_id, held in placements.items():
        on_disk = min(held, disk.get(segment_id, 0))
        if held > on_disk:
            pools[segment_id] = held - on_disk
        if on_disk:
            pools[ssd_pool(segment_id)] = on_disk
    return pools


def demote_or_drop(hits: int, min_hits: int) -> Choice:
    """Expected reuse, in its simplest form: a chunk group read at least `min_hits` times since
    it was published is worth a disk write; 0 demotes every arena victim (the disk tier's own
    watermark then drops its coldest). The one place a reuse predictor (issue 25, the
    simulator's) plugs in."""
    return "demote" if hits >= min_hits else "drop"


def ssd_pool_capacity(ssd_bytes: int, ssd_high_watermark: float, high_watermark: float) -> int:
    """The capacity the core is told for a disk pool so that its one high watermark presses the
    disk at `ssd_high_watermark` of its bytes (the low one scales with it: low x ssd_high / high)."""
    return int(ssd_bytes * ssd_high_watermark / high_watermark)
