"""A segment's heartbeat is heard by every shard led here even when one of them stops (handed
over, rebuilt) while an earlier shard's step waited: its `WrongShard` failed the whole
broadcast, so the shards after it missed the heartbeat, and a lone directory's registration of
the segment failed with it (review, stop 68)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

from kvfabric.core.directory import DirectoryConfig
from kvfabric.directory.shard_host import ShardHost
from kvfabric.format.errors import WrongShard
from kvfabric.proto import directory as m

CONFIG = DirectoryConfig(ticket_secret=b"s" * 32)


class Shell:
    def __init__(self, shard: int, stopped: bool = False) -> None:
        self.core = SimpleNamespace(shard=shard, epoch=shard + 1, segments={"s1": object()})
        self.stopped = stopped
        self.heard: list[object] = []

    def may_act(self) -> bool:
        return True  # (checked before the broadcast; it stops during it)

    async def handle(self, message: object) -> object:
        await asyncio.sleep(0)
        if self.stopped:
            raise WrongShard("this shard's shell stopped", shard=self.core.shard)
        self.heard.append(message)
        return m.HeartbeatAck(epoch=self.core.epoch)


def test_a_shard_stopped_during_a_broadcast_does_not_fail_it() -> None:
    host = ShardHost("dir-a", 3, CONFIG, registry=cast(Any, None), make_shell=cast(Any, None))
    shells = [Shell(0), Shell(1, stopped=True), Shell(2)]
    for shell in shells:
        host.shells[shell.core.shard] = cast(Any, shell)
    heartbeat = m.Heartbeat(segment_id="s1", incarnation=1, used_bytes=0)
    reply = asyncio.run(host._broadcast(heartbeat))
    assert isinstance(reply, m.HeartbeatAck)
    assert [e.shard for e in reply.shard_epochs] == [0, 2]
    assert len(shells[0].heard) == 1 and len(shells[2].heard) == 1
