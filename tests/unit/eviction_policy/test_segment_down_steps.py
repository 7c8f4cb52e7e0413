"""A segment lost costs the policy's loop a walk over every group it follows (0.7-0.9 s at 300,000
groups in one go): the follower drops its pools in steps (`EvictionCore.drop_pool_steps`) and the
loop runs between them, while no later event is applied before the loss is whole."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace
from typing import Any

import msgspec

from kvfabric.core.eviction import EvictionConfig, EvictionCore
from kvfabric.eviction_policy.group_records import group_id_of
from kvfabric.eviction_policy.shell import EvictionShell
from kvfabric.format.ids import ChainHash, Namespace, group_key_of_id
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode

NAMESPACE = Namespace(bytes(4) + b"A" * 16 + bytes(34))
GROUPS = 12_000  # a third on s1 only, a third on s2 only, a third on both


def published(seq: int, segments: list[str]) -> m.GroupPublished:
    return m.GroupPublished(
        group=ChainHash(seq.to_bytes(32, "little")),
        chunk_index=0,
        members=1,
        namespace=NAMESPACE,
        parent=ChainHash(b""),
        placements=[m.SegmentBytes(s, 10) for s in segments],
    )


def filled_shell() -> EvictionShell:
    core = EvictionCore(EvictionConfig(policy="lru", high_watermark=0.9, low_watermark=0.5), {})
    shell = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0)
    for segment in ("s1", "s2"):
        shell.apply(m.SegmentUp(segment_id=segment, incarnation=1, capacity_bytes=1 << 30), 0)
    where = (["s1"], ["s2"], ["s1", "s2"])
    shell.apply(m.GroupsPublished(groups=[published(i, where[i % 3]) for i in range(GROUPS)]), 1)
    return shell


def message(seq: int, event: msgspec.Struct) -> Any:
    return SimpleNamespace(data=encode(event), metadata=SimpleNamespace(sequence=SimpleNamespace(stream=seq)))


class OneBatch:
    """The stream's events in one pull, then nothing (the follower waits)."""

    def __init__(self, events: list[msgspec.Struct]) -> None:
        self.batch = [message(seq, event) for seq, event in enumerate(events, start=1)]
        self.done = asyncio.Event()

    async def fetch(self, batch: int = 1, timeout: float | None = 5) -> list[Any]:  # noqa: ASYNC109
        if self.batch:
            got, self.batch = self.batch, []
            return got
        self.done.set()
        await asyncio.sleep(3600)
        return []


def test_a_segment_lost_is_dropped_in_steps_with_the_loop_running_between_them() -> None:
    later = published(GROUPS, ["s1"])  # published after the loss (the segment back)
    later_key = bytes(group_key_of_id(group_id_of(later.namespace, later.chunk_index, later.group)))
    events: list[msgspec.Struct] = [
        m.SegmentDown(segment_id="s1", incarnation=1, reason="heartbeat_timeout"),
        m.SegmentUp(segment_id="s1", incarnation=2, capacity_bytes=1 << 30),
        m.GroupsPublished(groups=[later]),
    ]

    async def run() -> tuple[EvictionShell, list[tuple[int, bool, int]]]:
        shell = filled_shell()
        seen: list[tuple[int, bool, int]] = []  # per loop turn: groups followed, the later group
        # in, events applied
        sub = OneBatch(events)
        follower = asyncio.create_task(shell._read_events(sub, end_seq=0))
        while not sub.done.is_set():
            seen.append((len(shell.core), later_key in shell.core, shell.events_applied))
            await asyncio.sleep(0)
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
        return shell, seen

    shell, seen = asyncio.run(run())
    remaining = GROUPS - GROUPS // 3  # (those on s2)
    before = seen[0][2]
    partway = [n for n, _, applied in seen if applied == before and remaining < n < GROUPS]
    assert len(set(partway)) >= 3, "the loop did not run while the segment's groups were dropped"
    assert all(n == remaining + 1 for n, _, applied in seen if applied > before), (
        "a later event was applied during the drop"
    )
    assert seen[-1] == (remaining + 1, True, before + len(events))  # then the later ones, in order
    # The same end as the events applied whole.
    whole = filled_shell()
    for event in events:
        whole.apply(event, 2)
    assert len(shell.core) == len(whole.core) == remaining + 1
    for segment in ("s1", "s2"):
        assert shell.core.used_bytes(segment) == whole.core.used_bytes(segment)
    assert shell.events_applied == whole.events_applied
    assert shell._capacity == whole._capacity and shell._held == whole._held
    shell.core.check_invariants()
