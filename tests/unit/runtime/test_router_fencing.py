"""`DirectoryRouter.ask` fences replaced shard leaders (DESIGN.md 3.4): a request leaves with the
newest epoch known for its shard, a reply of an older epoch is rejected (`StaleGeneration`), and
a route that failed (`wrong_shard`, gone) or timed out is forgotten so the map is asked again."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import msgspec
import pytest

from kvfabric.format.errors import Indeterminate, StaleGeneration, WrongShard
from kvfabric.proto import directory as m
from kvfabric.runtime import directory_router
from kvfabric.runtime.directory_router import DirectoryRouter, ShardRoute


class MapRouter(DirectoryRouter):
    """Refreshing installs `next_map` (what the instances would say)."""

    def __init__(self) -> None:
        super().__init__(cast(Any, None), retries_max=3, retry_wait_s=0.0)
        self.shards = 2
        self.next_map: dict[int, ShardRoute] = {}

    async def refresh(self) -> None:
        self.routes = dict(self.next_map)
        for shard, route in self.routes.items():
            self.epochs[shard] = max(self.epochs.get(shard, 0), route.epoch)


def test_requests_carry_the_known_epoch_and_older_replies_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    router = MapRouter()
    router.next_map = {1: ShardRoute("dir-b", 7)}
    sent: list[tuple[str, msgspec.Struct]] = []
    replies: list[Any] = [
        m.LeaseReply(epoch=7, lease_id=1, expires_ms=0),
        m.LeaseReply(epoch=6, lease_id=1, expires_ms=0),
    ]

    async def fake_request(nc: Any, subject: str, message: msgspec.Struct, *args: Any, **kwargs: Any) -> Any:
        sent.append((subject, message))
        return replies.pop(0)

    monkeypatch.setattr(directory_router, "request", fake_request)
    release = m.LeaseRelease(holder_id="h", lease_id=1, shard=1)
    asyncio.run(router.ask(1, "lease_release", release, 1.0))
    assert sent[0][0] == "kvf.v1.directory.lease_release.dir-b" and sent[0][1].epoch == 7  # type: ignore[attr-defined]
    with pytest.raises(StaleGeneration):  # a deposed leader's answer is never used
        asyncio.run(router.ask(1, "lease_release", release, 1.0))


def test_a_wrong_shard_answer_or_a_timeout_makes_the_router_ask_the_map_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    router = MapRouter()
    router.next_map = {0: ShardRoute("dir-a", 3)}
    outcomes: list[Any] = [WrongShard("moved"), m.LeaseReply(epoch=9, lease_id=1, expires_ms=0)]
    subjects: list[str] = []

    async def fake_request(nc: Any, subject: str, message: msgspec.Struct, *args: Any, **kwargs: Any) -> Any:
        subjects.append(subject)
        if len(subjects) == 1:
            router.next_map = {0: ShardRoute("dir-c", 9)}  # the shard moved meanwhile
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(directory_router, "request", fake_request)
    reply = asyncio.run(router.ask(0, "lease_release", m.LeaseRelease(holder_id="h", lease_id=1), 1.0))
    assert isinstance(reply, m.LeaseReply) and reply.epoch == 9
    assert subjects == ["kvf.v1.directory.lease_release.dir-a", "kvf.v1.directory.lease_release.dir-c"]

    async def hang(*args: Any, **kwargs: Any) -> Any:
        raise Indeterminate("no reply")

    monkeypatch.setattr(directory_router, "request", hang)
    with pytest.raises(Indeterminate):  # may have run: not retried here, but the route is dropped
        asyncio.run(router.ask(0, "lease_release", m.LeaseRelease(holder_id="h", lease_id=1), 1.0))
    assert 0 not in router.routes
