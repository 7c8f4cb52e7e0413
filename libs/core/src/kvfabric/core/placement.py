"""Replica placement over failure domains (pure).

Domains nest: segment < host < rack < zone. For each replica after the first we pick the
candidate that differs from every chosen one at the widest level available (another zone if
one exists, else another rack, else another host, else another segment), breaking ties by most
free bytes, then by segment id (deterministic). A segment is never chosen twice.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def choose_segments(candidates: list[Candidate], replicas: int, size_bytes: int) -> list[Candidate]:
    """Up to `replicas` distinct segments that can hold `size_bytes`, spread widest first.

    Returns fewer than asked when fewer fit (the caller decides: degraded or no capacity).
    """
    fitting = [c for c in candidates if c.free_bytes >= size_bytes]
    chosen: list[Candidate] = []
    while fitting and len(chosen) < replicas:
        best = max(fitting, key=lambda c: (_spread(c, chosen), c.free_bytes, c.segment_id))
        chosen.append(best)
        fitting.remove(best)
    return chosen
