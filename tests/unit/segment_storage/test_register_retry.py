"""A segment that starts before any directory instance leads a shard (a cluster coming up, a busy
directory that answers the shard map late) registers once one does, instead of exiting at once:
`SegmentShell._register` asks again with a doubling wait, for at most its wait, and never retries
an answer that this incarnation was declared down."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from kvfabric.format.errors import NotFound, Unavailable
from kvfabric.proto import directory as m
from kvfabric.runtime.logs import get_logger
from kvfabric.segment_storage.shell import SegmentShell

REGISTRATION = m.RegisterSegment(
    segment_id="s1",
    incarnation=1,
    capacity_bytes=1 << 20,
    domain=m.FailureDomain(zone="z", rack="r", host="h"),
    data_addr="tcp://127.0.0.1:1",
)


class FakeShell:
    """What `_register` uses of the shell: `_every_leader` answering from a script, and a log."""

    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers
        self.asked = 0
        self._log = get_logger("test")

    async def _every_leader(self, verb: str, message: msgspec.Struct) -> list[msgspec.Struct]:
        assert verb == "register" and message is REGISTRATION
        answer = self.answers[min(self.asked, len(self.answers) - 1)]
        self.asked += 1
        if isinstance(answer, Exception):
            raise answer
        return list(answer)


def register(shell: FakeShell, wait_s: float) -> list[msgspec.Struct]:
    return asyncio.run(SegmentShell._register(shell, REGISTRATION, wait_s=wait_s, retry_s=0.01))  # type: ignore[arg-type]


def test_no_leader_yet_is_asked_again_until_one_answers() -> None:
    registered = m.SegmentRegistered(epoch=1, heartbeat_interval_ms=1000, heartbeat_timeout_ms=5000)
    no_leader = Unavailable("no directory instance leads a shard yet")
    shell = FakeShell([no_leader, no_leader, [registered]])
    assert register(shell, wait_s=5.0) == [registered]
    assert shell.asked == 3


def test_the_wait_is_bounded() -> None:
    shell = FakeShell([Unavailable("no directory instance leads a shard yet")])
    with pytest.raises(Unavailable):
        register(shell, wait_s=0.1)
    assert 2 <= shell.asked <= 10  # 0.01, 0.02, 0.04 ... s within 0.1 s


def test_declared_down_is_not_retried() -> None:
    shell = FakeShell([NotFound("segment incarnation unknown")])
    with pytest.raises(NotFound):
        register(shell, wait_s=5.0)
    assert shell.asked == 1
