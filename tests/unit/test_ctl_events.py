"""kvctl events tail: how directory events are shown."""

from __future__ import annotations

from kvfabric.ctl.render import event_fields


def test_kvctl_events_shows_a_batch_events_groups_one_line_each() -> None:
    """`kvctl events tail`: a `GroupsPublished` (up to 256 groups) was one run-on line of dicts."""
    event = {
        "t": "dir.ev.published_many.v1",
        "groups": [{"group": "aa", "chunk_index": 0}, {"group": "bb", "chunk_index": 1}],
    }
    assert event_fields(event).splitlines() == [
        "groups=2:",
        "  group=aa chunk_index=0",
        "  group=bb chunk_index=1",
    ]
    assert event_fields({"t": "dir.ev.evicted.v1", "group": "aa", "reason": "lru"}) == "group=aa reason=lru"
