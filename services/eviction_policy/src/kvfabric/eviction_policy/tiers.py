"""Two tiers in the eviction policy (issue 23): a segment's arena is pool `<segment id>`, its disk
tier is pool `<segment id>#ssd`. A victim of an arena pool is demoted (moved to that segment's
disk tier) or dropped, by `demote_or_drop`; a victim of a disk pool is dropped (evicted: its
last tier; one still in an arena, a head copied to disk, loses only its disk replica). The
groups to demote go to the segment several per request (`demote_request_fits`, each group's
outcome from its own objects' results: `group_outcome`). Pure functions: the shell (`shell.py`)
does the requests.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Final, Literal

from kvfabric.proto.segment import DEMOTE_BATCH_MAX

__all__ = [
    "DEMOTE_ON_DISK",
    "DEMOTE_REQUEST_BYTES_MAX",
    "DEMOTE_REQUEST_GROUPS_MAX",
    "DEMOTE_REQUEST_OBJECTS_MAX",
    "SSD_POOL_SUFFIX",
    "Choice",
    "DemoteOutcome",
    "copy_outcome",
    "demote_or_drop",
    "demote_request_fits",
    "disk_full_capacity",
    "group_outcome",
    "heads_first",
    "is_ssd_pool",
    "on_disk_whole",
    "ssd_pool",
    "ssd_pool_capacity",
    "tiered_pools",
]

SSD_POOL_SUFFIX: Final = "#ssd"  # never in a segment id (they are [A-Za-z0-9_-])
Choice = Literal["demote", "drop"]
DemoteOutcome = Literal["demoted", "copied", "no_capacity", "failed", "not_found"]
# The outcomes after which a group has a disk replica: its tails may follow it there.
DEMOTE_ON_DISK: Final = frozenset({"demoted", "copied"})

# One demote request names up to this many chunk groups, objects and bytes (several groups per
# request: the segment's directory steps are batched per request, not per group). A group is never
# split between requests unless it alone has more objects than a request takes (then it goes alone,
# in parts); one with more bytes goes alone.
DEMOTE_REQUEST_GROUPS_MAX: Final = 64
DEMOTE_REQUEST_OBJECTS_MAX: Final = DEMOTE_BATCH_MAX  # the segment's bound per request (64)
# Within `KVF_EVICTION_DEMOTE_TIMEOUT_MS` (30 s) at 2.3 MB/s of disk writes; 256 one-object
# groups of 256 KiB are 1 request of 16 MiB.
DEMOTE_REQUEST_BYTES_MAX: Final = 64 << 20


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


def on_disk_whole(pools: dict[str, int], group_bytes: int) -> bool:
    """Whether one segment's disk holds all of a group's bytes (`group_bytes`, one copy of each
    member), so a power cycle, which loses the arenas, leaves it findable: a tail may be demoted
    under it. A partial demotion (some members moved, the request failed for the others; a
    rebuild after a kill mid-demotion) is not: its disk bytes fall short on every segment, also
    when its replicas on two segments are each partly on disk (a sum over segments would count
    one member twice). A group whose members sit on different segments' disks is not either:
    the policy looks it up (`_learn_disk_copies`), as it does a head on no disk. Without
    `group_bytes` (0: a directory too old to say) any disk bytes count, as before."""
    return any(is_ssd_pool(p) and n >= group_bytes for p, n in pools.items())


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


def disk_full_capacity(used_bytes: int, high_watermark: float) -> int:
    """The capacity the core is told for a disk pool whose segment answered `no_capacity` while
    the pool's bytes sit below its watermark: its slot ids or extents ran out before its bytes
    did (small objects take a slot id per 64 KiB of disk: 16 KiB ones filled every id at a
    quarter of the bytes; a fragmented region). Just below what it holds, so the core presses it
    and drops its coldest; the next reply without `no_capacity` sets it back. It stayed unpressed
    for good, demotion stopped, and the disk kept its first objects (review, stop 70). 0 (no
    watermark) when the pool holds nothing here."""
    return max(1, int(used_bytes / high_watermark) - 1) if used_bytes > 0 else 0


def demote_request_fits(groups: int, objects: int, nbytes: int, more_objects: int, more_bytes: int) -> bool:
    """Whether one more group (`more_objects` objects, `more_bytes` bytes) joins a demote request
    already naming `groups` groups of `objects` objects and `nbytes` bytes. An empty request takes
    any group."""
    return groups == 0 or (
        groups < DEMOTE_REQUEST_GROUPS_MAX
        and objects + more_objects <= DEMOTE_REQUEST_OBJECTS_MAX
        and nbytes + more_bytes <= DEMOTE_REQUEST_BYTES_MAX
    )


def group_outcome(statuses: Collection[str]) -> DemoteOutcome:
    """A group's outcome from its objects' results (whatever else the request named): a full
    disk first, then a failure, then a lease that kept the arena replicas; "not_found" when no
    object was there to demote (the segment's `not_found`: the arena replica named was dropped
    or rewritten since the policy looked; one an earlier demotion copied is answered
    "demoted"): nothing moved, it was counted on the disk for nothing and the directory's
    republish set aside (`GroupRecords._moved`); "demoted" when every object was, or some were
    and the rest not found (those moved are on disk: the republish held back, showing the
    move, then applies)."""
    if "no_capacity" in statuses:
        return "no_capacity"
    if "failed" in statuses:
        return "failed"
    if "copied" in statuses:
        return "copied"
    return "not_found" if statuses and all(s == "not_found" for s in statuses) else "demoted"


def copy_outcome(statuses: Collection[str]) -> DemoteOutcome:
    """A group copied with `keep_arena` (a demoted tail's ancestor), from its objects' results:
    "copied" only when every object is on disk now (a copy moves no replica, so an object not
    found was not copied), a full disk first, anything else "failed"."""
    if "no_capacity" in statuses:
        return "no_capacity"
    return "copied" if statuses and all(s == "copied" for s in statuses) else "failed"


def heads_first(chains: Sequence[bytes], parent: Mapping[bytes, bytes]) -> list[bytes]:
    """`chains` (a batch's victims, tails before heads as the core chooses them) reordered so that
    each comes after every ancestor of it among them, however far up (`parent`: chain -> its
    parent): demoted in this order, a head reaches the disk in the same or an earlier request
    than its tails. Each chain once. Sorted by how many of its ancestors are among them (so all
    the roots first, then their children, ...; ties in the order given), each ancestor walked
    once (a walk stops at a repeat: a cycle of chain hashes cannot be made, but nothing here
    trusts that)."""
    among = set(chains)
    above: dict[bytes, int] = {}  # chain -> how many of its ancestors are among `chains`
    for chain in chains:
        walk: list[bytes] = []
        walked: set[bytes] = set()
        at: bytes | None = chain
        while at is not None and at not in above and at not in walked:
            walk.append(at)
            walked.add(at)
            at = parent.get(at)
        count = above[at] + (at in among) if at is not None and at in above else 0
        for node in reversed(walk):
            above[node] = count
            count += node in among
    return sorted(dict.fromkeys(chains), key=lambda c: above[c])  # stable: ties keep their order
