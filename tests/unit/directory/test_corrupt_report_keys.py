"""A corruption report (`replica_corrupt`, `replica_corrupt_many`) that names a short key (none
of the id forms that carry a chain hash, `kvfabric.proto.shards`) is refused `bad_request` on
the service plane's path (`ShardHost`'s endpoint: routed by `shard_of_request`, then the shard's
shell and core), never an untyped exception (an `internal` reply, or an `InvariantViolation`
that stops the instance): with several shards at routing ("malformed key"), with one shard by
the core's key parse. The shard goes on answering well-formed reports."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import msgspec
import pytest

from kvfabric.directory.shard_host import ShardHost
from kvfabric.format.errors import BadRequest
from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from tests.unit.core.dirkit import groups, key
from tests.unit.directory.test_shell_side_channels import new_core, shell_of

SEGMENT = "segment-00"  # registered by `new_core`


def report(verb: str, raw: bytes, epoch: int) -> msgspec.Struct:
    if verb == "replica_corrupt":
        return m.ReplicaCorrupt(
            segment_id=SEGMENT, incarnation=1, key=ObjectKey(raw), slot=0, slot_generation=0, epoch=epoch
        )
    item = m.CorruptItem(key=ObjectKey(raw), slot=0, slot_generation=0)
    return m.ReplicaCorruptMany(segment_id=SEGMENT, incarnation=1, items=[item], epoch=epoch)


@pytest.mark.parametrize("shards", [1, 16])
@pytest.mark.parametrize("verb", ["replica_corrupt", "replica_corrupt_many"])
def test_a_corruption_report_of_a_short_key_is_a_bad_request(shards: int, verb: str) -> None:
    core = new_core()
    host = ShardHost("dir-a", shards, core.config, registry=cast(Any, None), make_shell=cast(Any, None))
    shell = shell_of(core)
    for shard in range(shards):  # (one core behind every shard: what is refused never reaches it)
        host.shells[shard] = shell
    handle = host._endpoint(verb)

    async def go() -> None:
        for raw in (b"", b"\x01", b"abc", b"abcd", bytes(40), bytes(95)):
            with pytest.raises(BadRequest) as refused:
                await handle(report(verb, raw, core.epoch), {})
            assert refused.value.code == "bad_request"
        # a well-formed report of an object it does not know: answered, nothing dropped
        reply = await handle(report(verb, key(groups(1)[0]), core.epoch), {})
        assert isinstance(reply, m.ReplicaCorruptReply | m.ReplicaCorruptManyReply)
        assert reply.dropped in (False, [False])

    asyncio.run(go())
