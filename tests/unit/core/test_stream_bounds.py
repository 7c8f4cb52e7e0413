"""`StreamBounds.lost`: whether a follower resuming after `last_applied` finds every event it has
not applied still in the stream (aged out, purged, recreated with sequences restarted)."""

from __future__ import annotations

import pytest

from kvfabric.core.stream_bounds import StreamBounds


@pytest.mark.parametrize(
    ("last_applied", "first_seq", "last_seq", "lost", "why"),
    [
        (0, 0, 0, False, "a new, empty stream"),
        (0, 1, 40, False, "all there: read from the start"),
        (0, 101, 100, True, "purged while nothing was applied"),
        (100, 101, 100, False, "purged right after our last event"),
        (100, 90, 130, False, "our next event is still there"),
        (100, 101, 130, False, "our next event is the first"),
        (100, 102, 130, True, "101 aged out unread"),
        (100, 1, 40, True, "recreated: its end below ours"),
        (100, 1, 100, False, "same bounds, same stream (no creation time known)"),
    ],
)
def test_events_are_lost_when_aged_out_purged_or_restarted(
    last_applied: int, first_seq: int, last_seq: int, lost: bool, why: str
) -> None:
    assert StreamBounds().lost(last_applied, first_seq, last_seq) is lost, why


def test_a_new_creation_time_with_sequences_not_past_ours_is_a_restart() -> None:
    bounds = StreamBounds()
    assert not bounds.lost(100, 1, 150, "t0")  # the first check only remembers the time
    assert not bounds.lost(150, 151, 150, "t1")  # the directory's repair: recreated at its end + 1
    assert bounds.created == "t1"
    assert bounds.lost(150, 1, 170, "t2")  # recreated from 1 and already past us
    assert not bounds.lost(170, 1, 200, "t2")  # the same stream again: nothing more lost
    assert not bounds.lost(200, 1, 210)  # no creation time: the last one is kept
    assert str(bounds.created) == "t2"
