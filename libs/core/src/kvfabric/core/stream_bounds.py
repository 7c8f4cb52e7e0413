"""Whether a JetStream stream that a follower resumes still holds every event it has not applied.

Both followers of the directory's events stream (the router's index,
`kvfabric.core.routing_index`, and the eviction policy, `kvfabric.eviction_policy.shell`) read
the stream's bounds as they (re)subscribe, and resume after the last sequence they applied. No
delivery shows what is gone before that; `StreamBounds.lost` does. Events never applied are gone
when:
- they aged out, or the stream was purged: its first sequence is past ours + 1 (an empty stream
  reports first = last + 1, so a purge right after our last event loses nothing);
- the stream was recreated with its sequences restarted below ours: its last sequence is below
  ours (new events would look like duplicates), or its creation time is new and its first
  sequence is not past ours (recreated from 1 and already grown past us: every sequence after
  ours names an event of the new stream, and the old stream's are gone).

A stream recreated at (its old last sequence + 1), as the directory's own repair does
(`kvfabric.directory.events`), loses nothing a follower that had caught up applied; one that
lagged is caught by the first rule. Gaps while subscribed (a sequence that is not ours + 1) are
each follower's own check, on delivery.

Pure and I/O-free; the creation time is whatever the stream info reports, compared for
equality only.
"""

from __future__ import annotations

__all__ = ["StreamBounds"]


class StreamBounds:
    """The creation time of the stream last seen, and the check (module docstring)."""

    __slots__ = ("created",)

    def __init__(self) -> None:
        self.created: object = None  # None until a stream info carried one

    def lost(self, last_applied: int, first_seq: int, last_seq: int, created: object = None) -> bool:
        """Whether events after `last_applied` are gone from a stream that now holds
        `first_seq`..`last_seq` and was created at `created` (None: not known; remembered
        otherwise, so the next check sees a recreation)."""
        recreated = created is not None and self.created is not None and created != self.created
        if created is not None:
            self.created = created
        aged_out = first_seq > last_applied + 1
        restarted = last_seq < last_applied or (recreated and first_seq <= last_applied)
        return aged_out or restarted
