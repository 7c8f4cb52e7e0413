"""`DirectoryRouter.ask` fences replaced shard leaders (docs/design.md 3.4): a request leaves with the
newest epoch known for its shard, a reply of an older epoch is rejected (`StaleGeneration`), and
a route that failed (`wrong_shard`, gone) or timed out is forgotten so the map is asked again."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import msgspec
import nats.errors
import pytest

from kvfabric.cluster import directory_router
from kvfabric.cluster.directory_router import DirectoryRouter, ShardRoute
from kvfabric.format.errors import BadRequest, Indeterminate, StaleGeneration, Unavailable, WrongShard
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode


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


class SilentOrAnsweringNats:
    """Just what `DirectoryRouter.refresh` uses: `shard_map` is answered with `answer`, or by
    nobody in time when it is None (a directory slow under load)."""

    def __init__(self) -> None:
        self.answer: m.ShardMapReply | None = None
        self._callbacks: dict[str, Any] = {}

    def new_inbox(self) -> str:
        return "_INBOX.test"

    async def subscribe(self, subject: str, cb: Any) -> Any:
        self._callbacks[subject] = cb
        nc = self

        class Sub:
            async def unsubscribe(self) -> None:
                nc._callbacks.pop(subject, None)

        return Sub()

    async def publish(self, subject: str, data: bytes, reply: str = "") -> None:
        if self.answer is not None:
            msg = type("Msg", (), {"data": msgspec.msgpack.encode(self.answer)})()
            await self._callbacks[reply](msg)


def test_a_suspect_map_keeps_its_routes_until_an_instance_answers() -> None:
    """`forget_all` (a segment's heartbeat missed an instance) must not leave the router with
    nobody to send to while refreshes go unanswered: before, the routes were emptied, heartbeats
    stopped, and the directory declared a live segment down."""
    nc = SilentOrAnsweringNats()
    router = DirectoryRouter(cast(Any, nc), gather_s=0.01)
    nc.answer = m.ShardMapReply(
        shards=2, instance="dir-a", leaders=[m.ShardLeader(0, "dir-a", 3), m.ShardLeader(1, "dir-a", 4)]
    )

    async def go() -> None:
        await router.refresh()
        assert router.complete and router.instances() == ["dir-a"]
        router.forget_all()
        assert not router.complete  # the next ask_all refreshes first
        nc.answer = None
        await router.refresh()  # nobody answered in time
        assert router.instances() == ["dir-a"] and not router.complete  # kept, still suspect
        nc.answer = m.ShardMapReply(
            shards=2, instance="dir-b", leaders=[m.ShardLeader(0, "dir-b", 5), m.ShardLeader(1, "dir-b", 6)]
        )
        await router.refresh()
        assert router.complete and router.instances() == ["dir-b"]

    asyncio.run(go())


def test_a_leader_whose_epoch_moved_past_the_map_refusing_as_stale_is_asked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same instance won its shard back under a newer epoch (its lease lapsed): it refuses
    the map's epoch as stale before running the request. The router forgets the route and asks
    again with the refreshed map (review, 2026-12-05: the caller got `stale_generation` for that
    shard until something else refreshed it). A stale refusal of the caller's own epoch (a
    ticket's) is a real conflict: raised, not retried."""
    router = MapRouter()
    router.next_map = {0: ShardRoute("dir-a", 3)}
    sent: list[int] = []

    async def fake_request(nc: Any, subject: str, message: msgspec.Struct, *args: Any, **kwargs: Any) -> Any:
        epoch = message.epoch  # type: ignore[attr-defined]
        sent.append(epoch)
        if epoch < 5:
            router.next_map = {0: ShardRoute("dir-a", 5)}  # what a refresh now finds
            raise StaleGeneration("directory_epoch", epoch, 5)
        return m.LeaseReply(epoch=5, lease_id=1, expires_ms=0)

    monkeypatch.setattr(directory_router, "request", fake_request)
    release = m.LeaseRelease(holder_id="h", lease_id=1)
    reply = asyncio.run(router.ask(0, "lease_release", release, 1.0))
    assert isinstance(reply, m.LeaseReply) and sent == [3, 5]
    with pytest.raises(StaleGeneration):  # the caller named epoch 4 itself: not re-stamped
        asyncio.run(router.ask(0, "lease_release", msgspec.structs.replace(release, epoch=4), 1.0))


class FailingNats:
    """A NATS client during an outage whose reconnect buffer is full: every publish raises."""

    def __init__(self) -> None:
        self.unsubscribed = 0

    def new_inbox(self) -> str:
        return "_INBOX.x"

    async def subscribe(self, subject: str, cb: Any = None) -> Any:
        outer = self

        class Sub:
            async def unsubscribe(self) -> None:
                outer.unsubscribed += 1
                raise nats.errors.ConnectionClosedError

        return Sub()

    async def publish(self, subject: str, payload: bytes, reply: str = "") -> None:
        raise nats.errors.OutboundBufferLimitError


def test_a_shard_map_refresh_in_a_nats_outage_is_unavailable_not_a_nats_error() -> None:
    """The segment's heartbeat loop retries on `KvfError`: a NATS error out of the refresh
    ended it, and the segment served on, declared down, never re-registering (review,
    2026-12-06)."""
    fake = FailingNats()
    router = DirectoryRouter(cast(Any, fake))
    with pytest.raises(Unavailable):
        asyncio.run(router.refresh())
    assert fake.unsubscribed == 1  # the inbox subscription is let go, its own error swallowed


class PartsNats:
    """Answers a shard-map request with `answers` (instance -> the shards it leads, epoch 1);
    an instance not in it does not answer within the gather time."""

    def __init__(self, shards: int) -> None:
        self.shards = shards
        self.answers: dict[str, list[int]] = {}
        self.cb: Any = None

    def new_inbox(self) -> str:
        return "_INBOX.x"

    async def subscribe(self, subject: str, cb: Any = None) -> Any:
        self.cb = cb

        class Sub:
            async def unsubscribe(self) -> None:
                return None

        return Sub()

    async def publish(self, subject: str, payload: bytes, reply: str = "") -> None:
        for instance, led in self.answers.items():
            part = m.ShardMapReply(
                shards=self.shards,
                instance=instance,
                leaders=[m.ShardLeader(shard=s, instance=instance, epoch=1) for s in led],
            )
            await self.cb(SimpleNamespace(data=encode(part)))


def test_a_refresh_keeps_the_shards_of_an_instance_that_did_not_answer_in_time() -> None:
    """The map was replaced whole: an instance slower than the gather time lost every route,
    and its shards' lookups and saves failed while it was healthy (review, stop 68). An instance
    that answers without a shard gives it up, as before."""
    fake = PartsNats(shards=4)
    router = DirectoryRouter(cast(Any, fake), gather_s=0.05)
    both = {0: "dir-a", 1: "dir-a", 2: "dir-b", 3: "dir-b"}

    def routes_after(answers: dict[str, list[int]]) -> dict[int, str]:
        fake.answers = answers
        asyncio.run(router.refresh())
        return {s: r.instance for s, r in router.routes.items()}

    assert routes_after({"dir-a": [0, 1], "dir-b": [2, 3]}) == both
    assert routes_after({"dir-a": [0, 1]}) == both  # dir-b slow this time
    # dir-b gave shard 2 up (no new leader yet)
    assert routes_after({"dir-a": [0, 1], "dir-b": [3]}) == {0: "dir-a", 1: "dir-a", 3: "dir-b"}


@pytest.mark.parametrize("raw", [b"", b"ab", b"x" * 40])
def test_a_key_holding_no_chain_hash_is_a_bad_request_not_a_value_error(raw: bytes) -> None:
    # a ValueError was no KvfError: a segment's `_directory` caller lost such a request unanswered
    router = DirectoryRouter(cast(Any, None))
    router.shards = 4
    with pytest.raises(BadRequest, match="malformed key"):
        router.shard_of(raw)
