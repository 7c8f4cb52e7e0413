"""The `Kvf-Shard-Epoch` header every event of a directory shard's core carries, and the fence the
followers keep on it (`kvfabric.core.shard_fence`): the parser never raises and names nothing for a
header absent or malformed; the fence drops what names an epoch below its shard's highest, and is
bounded."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from kvfabric.core.shard_fence import ShardEpochFence
from kvfabric.proto import directory as m
from kvfabric.proto.shards import SHARDS_MAX


def test_the_header_a_shell_writes_is_read_back() -> None:
    headers = m.shard_epoch_header(3, 1_234_567)
    assert headers == {m.SHARD_EPOCH_HEADER: "3.1234567"}
    assert m.shard_epoch_of(headers) == (3, 1_234_567)
    largest = (m.SHARD_ID_MAX, (1 << 64) - 1)
    assert m.shard_epoch_of(m.shard_epoch_header(*largest)) == largest
    # the name's case is not guaranteed by every client; other headers beside it are ignored
    assert m.shard_epoch_of({"kvf-shard-epoch": "0.5", "Nats-Msg-Id": "x"}) == (0, 5)
    assert m.shard_epoch_of(OrderedDict([(m.SHARD_EPOCH_HEADER, " 1.2 ")])) == (1, 2)


@pytest.mark.parametrize(
    "headers",
    [
        None,
        {},
        "0.5",
        {"Other": "0.5"},
        {m.SHARD_EPOCH_HEADER: ""},
        {m.SHARD_EPOCH_HEADER: "5"},
        {m.SHARD_EPOCH_HEADER: "0."},
        {m.SHARD_EPOCH_HEADER: ".5"},
        {m.SHARD_EPOCH_HEADER: "-1.5"},
        {m.SHARD_EPOCH_HEADER: "1.-5"},
        {m.SHARD_EPOCH_HEADER: "1.5.6"},
        {m.SHARD_EPOCH_HEADER: "4096.5"},  # a shard past SHARD_ID_MAX (the cluster has 4,096)
        {m.SHARD_EPOCH_HEADER: "65535.5"},
        {m.SHARD_EPOCH_HEADER: f"1.{1 << 64}"},  # past uint64
        {m.SHARD_EPOCH_HEADER: "1." + "9" * 1000},
        {m.SHARD_EPOCH_HEADER: "\u0661.\u0662"},  # digits, but not ASCII ones
        {m.SHARD_EPOCH_HEADER: "1.0x5"},
        {m.SHARD_EPOCH_HEADER: b"1.5"},
        {m.SHARD_EPOCH_HEADER: 15},
        {7: "1.5"},
    ],
)
def test_a_header_absent_or_malformed_names_nothing(headers: object) -> None:
    assert m.shard_epoch_of(headers) is None


def test_the_fence_drops_what_names_an_epoch_below_its_shards_highest() -> None:
    fence = ShardEpochFence()
    assert fence.admit(None)  # an older directory's event: applied as before
    assert fence.admit((0, 5)) and fence.highest(0) == 5
    assert not fence.admit((0, 4))  # the replaced core's late event
    assert fence.admit((0, 5))  # the same core (and a same-epoch rebuild's) again
    assert fence.admit((1, 2))  # another shard has its own
    assert fence.admit((0, 6)) and not fence.admit((0, 5))
    fence.raise_to({0: 3, 1: 7})  # never lowered
    assert (fence.highest(0), fence.highest(1)) == (6, 7)
    assert not fence.admit((1, 6))


def test_the_fence_is_bounded() -> None:
    fence = ShardEpochFence(shards_max=4)
    for shard in range(10):
        assert fence.admit((shard, 9))
    assert len(fence) == 4
    assert fence.admit((9, 1))  # untracked past the bound: admitted, as without the header
    assert not fence.admit((3, 1))  # tracked ones stay fenced
    assert fence.admit((-1, 0)) and fence.admit((m.SHARD_ID_MAX + 1, 0)) and fence.admit((0, -1))
    assert len(fence) == 4


def test_a_foreign_publishers_made_up_shards_leave_every_real_one_fenced() -> None:
    """Shard ids stop at the cluster's (`SHARDS_MAX`, 0-4095): a publisher naming shards
    4096-8191 filled the 4,096-entry table (ids up to 65,535 were taken), the real shards past it
    going unfenced."""
    assert m.SHARD_ID_MAX == SHARDS_MAX - 1 == 4_095
    assert m.shard_epoch_of(m.shard_epoch_header(4_095, 1)) == (4_095, 1)
    fence = ShardEpochFence()
    for shard in range(SHARDS_MAX, 2 * SHARDS_MAX):
        assert m.shard_epoch_of(m.shard_epoch_header(shard, 9)) is None  # names nothing
        assert fence.admit((shard, 9))
    assert len(fence) == 0
    for shard in range(SHARDS_MAX):
        assert fence.admit((shard, 5))
    assert len(fence) == SHARDS_MAX and not fence.admit((SHARDS_MAX - 1, 4))


def test_the_first_fenced_event_of_each_shard_and_epoch_is_told_apart() -> None:
    fence = ShardEpochFence(shards_max=2)
    answers = [fence.first_fenced(o) for o in [(0, 4), (0, 4), (1, 4), (0, 3), (0, 4), (0, 4), (1, 4)]]
    assert answers == [True, False, True, True, True, False, False]
    assert fence.first_fenced((2, 4)) and fence.first_fenced((2, 4))  # past the bound: each one
    assert fence.first_fenced(None)
