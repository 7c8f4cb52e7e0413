"""Replica placement over failure domains (pure).

Domains nest: segment < host < rack < zone. For each replica after the first we pick the
candidate that differs from every chosen one at the widest level available (another zone if
one exists, else another rack, else another host, else another segment), breaking ties by most
free bytes, then by a rendezvous hash of (the object's key, segment id): deterministic, and
spread. The directory shows placement coarse free space (1/64ths of a segment, so a writer
cannot read the exact free bytes), which makes equal free space the common case: a tie broken by
segment id alone sent every object to the same segments until a 64th of one filled (a killed
segment then held 15 of 96 objects' replicas instead of about 64). A segment is never chosen twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

__all__ = ["Candidate", "choose_segments"]


@dataclass(frozen=True, slots=True)
class Candidate:
    segment_id: str
    zone: str
    rack: str
    host: str
    free_bytes: int


def _spread(candidate: Candidate, chosen: list[Candidate]) -> int:
    """3 = new zone, 2 = new rack, 1 = new host, 0 = only a new segment."""
    if all(c.zone != candidate.zone for c in chosen):
        return 3
    if all((c.zone, c.rack) != (candidate.zone, candidate.rack) for c in chosen):
        return 2
    if all((c.zone, c.rack, c.host) != (candidate.zone, candidate.rack, candidate.host) for c in chosen):
        return 1
    return 0


def _rendezvous(key: bytes, segment_id: str) -> int:
    return xxhash.xxh3_64_intdigest(segment_id.encode(), seed=xxhash.xxh3_64_intdigest(key))


def choose_segments(
    candidates: list[Candidate], replicas: int, size_bytes: int, key: bytes = b""
) -> list[Candidate]:
    """Up to `replicas` distinct segments that can hold `size_bytes`, spread widest first; ties
    broken per object `key` (rendezvous), then by segment id.

    Returns fewer than asked when fewer fit (the caller decides: degraded or no capacity).
    """
    fitting = [c for c in candidates if c.free_bytes >= size_bytes]
    chosen: list[Candidate] = []
    while fitting and len(chosen) < replicas:
        best = max(
            fitting,
            key=lambda c: (_spread(c, chosen), c.free_bytes, _rendezvous(key, c.segment_id), c.segment_id),
        )
        chosen.append(best)
        fitting.remove(best)
    return chosen
