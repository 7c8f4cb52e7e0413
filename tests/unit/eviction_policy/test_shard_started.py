"""A directory shard's `shard_started` event (its new core: a new leader's, or a rebuild's) is a
loss to the eviction policy: the core before it may have stopped with events queued and never
published (a handover drains them for at most 1 s), which no gap in the sequences shows, so the
policy never learnt of a group published then. It adopts the directory's listing once it has
applied that event, as for events aged out (no NATS here)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import msgspec

from kvfabric.core.eviction import EvictionConfig, EvictionCore
from kvfabric.eviction_policy.shell import EvictionShell
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode


def message(seq: int, event: msgspec.Struct) -> Any:
    """A JetStream message of the directory's events as the follower reads it."""
    return SimpleNamespace(data=encode(event), metadata=SimpleNamespace(sequence=SimpleNamespace(stream=seq)))


def test_a_shard_started_event_makes_the_policy_adopt_the_listing_after_it() -> None:
    core = EvictionCore(EvictionConfig(policy="lru", high_watermark=0.5, low_watermark=0.1))
    sh = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0)
    sh._adopt_wanted.clear()  # (set at every start: the first replay adopts anyway)
    for seq in (1, 2, 3):
        sh._on_message(cast(Any, message(seq, m.GroupsAccessed(groups=[]))))
    assert not sh._adopt_wanted.is_set()
    sh._on_message(cast(Any, message(4, m.ShardStarted(shard=1, epoch=5))))
    assert sh._adopt_wanted.is_set() and sh._adopt_after_seq == 4 and sh.last_seq == 4
