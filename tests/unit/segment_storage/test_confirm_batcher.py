"""Replica confirms of one save go to the directory together (`ConfirmBatcher`): the first at once,
those arriving while it is in flight in one more request; verdicts go back by ticket id; a failed
request fails every confirm in it; keys (shard, epoch, trace id) never mix."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from kvfabric.format.errors import Unavailable
from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from kvfabric.segment_storage.confirms import CONFIRM_GATHER_S, ConfirmBatcher


def confirm(ticket_id: int) -> m.ReplicaConfirm:
    return m.ReplicaConfirm(
        ticket_id=ticket_id,
        key=ObjectKey(b"k%d" % ticket_id),
        slot=ticket_id,
        slot_generation=1,
        size_bytes=1,
        checksum=b"c" * 16,
    )


class FakeDirectory:
    def __init__(self, fail: bool = False) -> None:
        self.requests: list[tuple[m.ConfirmReplicas, str]] = []
        self.fail = fail

    async def send(self, message: m.ConfirmReplicas, trace_id: str) -> msgspec.Struct:
        self.requests.append((message, trace_id))
        await asyncio.sleep(0.01)  # in flight: later confirms queue for the next request
        if self.fail:
            raise Unavailable("no leader")
        results = [
            m.ConfirmResult(ticket_id=c.ticket_id, status="ok" if c.ticket_id % 2 else "unknown_ticket")
            for c in message.confirms
        ]
        return m.ConfirmReply(epoch=message.epoch, results=results)


async def test_one_saves_confirms_take_two_requests_and_get_their_own_verdicts() -> None:
    directory = FakeDirectory()
    batcher = ConfirmBatcher("seg", 7, directory.send)
    first = asyncio.create_task(batcher.confirm(3, 2, confirm(0), "trace"))
    await asyncio.sleep(0.001)  # sent alone; the next seven arrive while it is in flight
    rest = await asyncio.gather(*(batcher.confirm(3, 2, confirm(i), "trace") for i in range(1, 8)))
    verdicts = [await first, *rest]
    assert verdicts == ["unknown_ticket" if i % 2 == 0 else "ok" for i in range(8)]
    assert [len(msg.confirms) for msg, _ in directory.requests] == [1, 7]
    assert all(msg.epoch == 2 and msg.incarnation == 7 and t == "trace" for msg, t in directory.requests)
    assert not batcher._senders and not batcher._pending


async def test_keys_never_share_a_request() -> None:
    directory = FakeDirectory()
    batcher = ConfirmBatcher("seg", 7, directory.send)
    await asyncio.gather(
        batcher.confirm(1, 2, confirm(1), "a"),
        batcher.confirm(1, 2, confirm(3), "b"),
        batcher.confirm(2, 2, confirm(5), "a"),
        batcher.confirm(1, 3, confirm(7), "a"),
    )
    assert len(directory.requests) == 4


async def test_a_failed_request_fails_each_of_its_confirms() -> None:
    batcher = ConfirmBatcher("seg", 7, FakeDirectory(fail=True).send)
    outcomes = await asyncio.gather(
        *(batcher.confirm(0, 1, confirm(i)) for i in range(3)), return_exceptions=True
    )
    assert all(isinstance(o, Unavailable) for o in outcomes)


async def test_a_stopped_sender_leaves_nobody_waiting() -> None:
    directory = FakeDirectory()
    batcher = ConfirmBatcher("seg", 7, directory.send)
    waiting = [asyncio.create_task(batcher.confirm(0, 1, confirm(i))) for i in range(3)]
    await asyncio.sleep(0.001)
    for task in list(batcher._senders.values()):
        task.cancel()
    with pytest.raises(Unavailable):
        await asyncio.wait_for(asyncio.gather(*waiting), 1)


async def test_a_save_that_says_how_many_writes_come_gets_one_request() -> None:
    """`PutRequest.save_writes`: the first confirm waits (at most CONFIRM_GATHER_S) for the rest
    of its save; a straggler past that rides the next request; keys never mix."""
    directory = FakeDirectory()
    batcher = ConfirmBatcher("seg", 7, directory.send)

    async def late(i: int, delay_s: float, turns: int = 0) -> str:
        await asyncio.sleep(delay_s)
        for _ in range(turns):  # arrive `turns` loop iterations later (the first is sent by then)
            await asyncio.sleep(0)
        return await batcher.confirm(3, 2, confirm(i), "save", expected=8)

    verdicts = await asyncio.gather(*(late(i, 0.0, turns=i) for i in range(8)))
    assert verdicts == ["unknown_ticket" if i % 2 == 0 else "ok" for i in range(8)]
    assert [len(msg.confirms) for msg, _ in directory.requests] == [8]
    directory.requests.clear()
    slow = [late(10, 0.0), late(11, 0.0), late(12, CONFIRM_GATHER_S * 3)]
    await asyncio.gather(*(batcher.confirm(4, 2, confirm(20)),), *slow)  # shard 4: its own request
    # 10 and 11 leave together once the gathering gives up; 12 rides the next request (or, on a
    # loop so late that its timer fired in the same turn as the gathering's, the same one).
    assert sorted(len(msg.confirms) for msg, _ in directory.requests) in ([1, 1, 2], [1, 3])
    assert not batcher._senders and not batcher._pending and not batcher._arrived and not batcher._expected
