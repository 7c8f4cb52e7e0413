"""A directory instance's orderly stop against a real nats-server (`LeaderElection.run`'s end and
`release_held`, kvfabric.directory.leader, "An orderly stop"): its KV operations are awaited,
not only cancelled; then the lease keys it holds, a lease key its lost create left with its id,
and its member key are gone (a rebalancing instance stops counting it at once), while another
instance's lease and member keys stay."""

from __future__ import annotations

import asyncio
from typing import Any

import nats
import nats.js.errors
import pytest
from nats.js.kv import KeyValue

from kvfabric.core.leadership import LeadershipConfig
from kvfabric.directory.kv_buckets import MEMBERS_BUCKET
from kvfabric.directory.kv_keys import bucket_keys
from kvfabric.directory.leader import LeaderElection
from kvfabric.testing.nats_server import NatsServer

pytestmark = [pytest.mark.timeout(120)]

CONFIG = LeadershipConfig(
    shards=4, lease_ttl_ms=3_000, renew_every_ms=1_000, safety_margin_ms=500, members_ttl_ms=3_000
)
WAIT_S = 30.0  # generous: 2 loaded cores


class LostCreate:
    """The leaders bucket, except that shard 2's create reaches the server and its answer never
    comes back (the stop then cancels it); that cancellation takes a few turns of the loop to
    finish, as a request cleaning up does."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv
        self.landed = asyncio.Event()
        self.ended = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kv, name)

    async def create(self, key: str, value: bytes) -> int:
        revision = await self.kv.create(key, value)
        if key != "shard-2":
            return revision
        self.landed.set()
        try:
            await asyncio.Event().wait()
        finally:
            for _ in range(3):  # a few turns of the loop, well within cancel_and_wait's first wait
                await asyncio.sleep(0)
            self.ended.set()
        raise AssertionError("unreachable")


async def _stop(url: str) -> None:
    nc = await nats.connect(url)
    try:
        election = LeaderElection(nc, "a", CONFIG)
        await election.open()
        leaders, members = election._leaders, election._members
        assert leaders is not None and members is not None
        await leaders.create("shard-1", b"b")  # another instance leads shard 1
        await members.put("member-b", b"")
        lost = LostCreate(leaders)
        election._leaders = lost  # type: ignore[assignment]

        async def on_start(shard: int, epoch: int) -> None:
            return None

        async def on_stop(shard: int, epoch: int, reason: str) -> None:
            return None

        run = asyncio.create_task(election.run(on_start, on_stop))
        js = nc.jetstream(timeout=5)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        while not (
            set(election.core.leading()) == {0, 3}
            and lost.landed.is_set()
            and "member-a" in await bucket_keys(js, MEMBERS_BUCKET)
        ):
            assert loop.time() < deadline, "the election never led shards 0 and 3"
            await asyncio.sleep(0.05)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        # (a) nothing outlives the loop: the lost create's cancellation was awaited
        assert lost.ended.is_set() and not election._ops

        released = await election.release_held(5.0)
        assert released == 3  # shards 0 and 3 (held) and 2 (its id, held by nobody)
        for key in ("shard-0", "shard-2", "shard-3"):
            with pytest.raises(nats.js.errors.KeyNotFoundError):
                await leaders.get(key)
        assert (await leaders.get("shard-1")).value == b"b"  # another instance's: kept
        # what a rebalancing instance lists: "a" is no member any more, "b" still is
        assert await bucket_keys(js, MEMBERS_BUCKET) == ["member-b"]
    finally:
        await nc.close()


def test_an_orderly_stop_hands_back_its_leases_a_lost_creates_key_and_its_member_key(
    nats_server: NatsServer,
) -> None:
    asyncio.run(_stop(nats_server.url))
