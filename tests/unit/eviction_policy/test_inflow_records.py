"""What the policy counts as a writer's inflow (`EvictionCore.tick`, "Writers faster than the
ticks"): a put_commit's groups (`GroupsPublished`) applied moments after they were stored; not
a backlog (a replay at start, a stalled follower), a republish (`GroupPublished`: a rebuild, a
tier change) or an adopted group's own event (its bytes were there already)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
from types import SimpleNamespace
from typing import Any, cast

import pytest

from kvfabric.core.eviction import EvictionConfig, EvictionCore
from kvfabric.eviction_policy.shell import INFLOW_EVENT_AGE_MAX_MS, EvictionShell, _fresh
from kvfabric.proto import directory as m
from tests.unit.eviction_policy.test_shell import published


def shell() -> EvictionShell:
    core = EvictionCore(EvictionConfig(policy="lru", inflow_horizon_ms=1_000))
    sh = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0)
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=1 << 20), 0)
    sh.core.tick(0)  # starts the count
    return sh


def inflow_after(sh: EvictionShell, *events: m.DirectoryEvent) -> float:
    for event in events:
        sh.apply(event, 500)
    sh.core.tick(1_000)
    return sh.core.inflow("s1")


def test_a_fresh_put_commit_is_inflow() -> None:
    sh = shell()
    assert inflow_after(sh, m.GroupsPublished(groups=[published(1, s1=100), published(2, s1=100)])) == 200


def test_a_backlog_is_not_inflow() -> None:
    sh = shell()
    sh._events_fresh = False  # the follower found the event stored long before
    assert inflow_after(sh, m.GroupsPublished(groups=[published(1, s1=100)])) == 0
    assert sh.core.used_bytes("s1") == 100  # tracked all the same


def test_a_republish_is_not_inflow() -> None:
    sh = shell()
    assert inflow_after(sh, published(1, s1=100)) == 0  # one GroupPublished: a rebuild's
    assert sh.core.used_bytes("s1") == 100


def test_an_adopted_group_s_own_event_is_not_inflow() -> None:
    sh = shell()
    sh._published(published(1, s1=100), 400, listed_ms=300)  # adopted from a listing
    assert inflow_after(sh, m.GroupsPublished(groups=[published(1, s1=100), published(2, s1=50)])) == 50


def test_an_event_is_fresh_when_stored_moments_before() -> None:
    now = datetime.datetime.now(datetime.UTC)
    now_ms = int(now.timestamp() * 1000)

    def msg(age_ms: int) -> Any:
        stored = now - datetime.timedelta(milliseconds=age_ms)
        return cast(Any, SimpleNamespace(metadata=SimpleNamespace(timestamp=stored)))

    assert _fresh(msg(0), now_ms)
    assert _fresh(msg(INFLOW_EVENT_AGE_MAX_MS - 50), now_ms)
    assert not _fresh(msg(INFLOW_EVENT_AGE_MAX_MS + 50), now_ms)
    assert not _fresh(cast(Any, SimpleNamespace()), now_ms)  # no stream metadata: not known fresh


def test_the_follower_judges_each_event_by_when_the_stream_stored_it() -> None:
    """A put_commit stored 5 s before the follower applies it (a backlog) is tracked but not
    counted as inflow; one stored just now is (`_read_events` sets `_events_fresh` per event)."""
    from kvfabric.proto.codec import encode

    now = datetime.datetime.now(datetime.UTC)

    def stored(seq: int, age_s: float, group: int) -> Any:
        event = m.GroupsPublished(groups=[published(group, s1=100)])
        meta = SimpleNamespace(
            sequence=SimpleNamespace(stream=seq), timestamp=now - datetime.timedelta(seconds=age_s)
        )
        return SimpleNamespace(data=encode(event), metadata=meta)

    class OneBatch:
        def __init__(self) -> None:
            self.given = False
            self.done = asyncio.Event()

        async def fetch(self, batch: int = 1, timeout: float | None = 5) -> list[Any]:  # noqa: ASYNC109
            if self.given:
                self.done.set()
                await asyncio.sleep(3600)
            self.given = True
            return [stored(1, 5.0, 1), stored(2, 0.0, 2)]

    async def run() -> tuple[EvictionShell, int]:
        sh = shell()
        started = sh._driver.now_ms()
        sh.core.tick(started)  # the count from here (the follower applies at the wall clock)
        sub = OneBatch()
        follower = asyncio.create_task(sh._read_events(cast(Any, sub), end_seq=0))
        await asyncio.wait_for(sub.done.wait(), 30)
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
        return sh, started

    sh, started = asyncio.run(run())
    assert sh.last_seq == 2 and sh.core.used_bytes("s1") == 200 and sh.events_stale == 1
    ended = max(sh._driver.now_ms(), started + 1_000)
    sh.core.tick(ended)
    assert sh.core.inflow("s1") * (ended - started) / 1000 == pytest.approx(100)  # the fresh one only
