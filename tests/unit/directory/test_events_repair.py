"""`EventsStream.repair` against a fake JetStream (kvfabric.directory.events): a stream is deleted
only when it is stuck (its last sequence did not move during the streak), at most once per
`repair_interval_s`; a missing stream is added back at once, its sequences continued."""

from __future__ import annotations

import asyncio
from typing import Any

import nats.js.errors
from nats.js.api import StreamConfig, StreamInfo

from kvfabric.directory.events import EVENTS_STREAM, EventsStream, _Streak, failure_reason


class FakeJs:
    def __init__(self, last_seqs: list[int | None]) -> None:
        self.last_seqs = last_seqs  # stream_info answers in turn; None: not found
        self.calls: list[tuple[str, Any]] = []

    async def stream_info(self, name: str) -> StreamInfo:
        last = self.last_seqs.pop(0) if len(self.last_seqs) > 1 else self.last_seqs[0]
        if last is None:
            raise nats.js.errors.NotFoundError(code=404, err_code=10059, description="stream not found")
        info: StreamInfo = StreamInfo.from_response(
            {
                "config": {"name": name},
                "state": {"messages": 0, "bytes": 0, "first_seq": 1, "last_seq": last, "consumer_count": 0},
            }
        )
        return info

    async def delete_stream(self, name: str) -> bool:
        self.calls.append(("delete", name))
        return True

    async def add_stream(self, config: StreamConfig) -> None:
        self.calls.append(("add", config.first_seq))


class FakeNc:
    def __init__(self, js: FakeJs) -> None:
        self.js = js

    def jetstream(self, timeout: float = 5.0) -> FakeJs:
        return self.js


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stream(js: FakeJs, clock: Clock) -> EventsStream:
    config = StreamConfig(name=EVENTS_STREAM, subjects=["kvf.v1.events.directory.>"])
    return EventsStream(FakeNc(js), config, repair_jitter_s=0.0, repair_interval_s=30.0, clock=clock)  # type: ignore[arg-type]


def test_a_stream_others_append_to_is_not_deleted() -> None:
    js = FakeJs([41, 44])
    s = stream(js, Clock())
    streak = _Streak(failures=5, last_seq=40)
    assert asyncio.run(s.repair(streak)) == "moving" and streak.last_seq == 41
    assert asyncio.run(s.repair(streak)) == "moving" and js.calls == []


def test_a_stuck_stream_is_recreated_after_its_last_sequence_once_per_interval() -> None:
    js = FakeJs([40])
    clock = Clock()
    s = stream(js, clock)
    assert asyncio.run(s.repair(_Streak(failures=5, last_seq=40))) == "recreated"
    assert js.calls == [("delete", EVENTS_STREAM), ("add", 41)] and s.recreated == 1
    clock.now += 29.0
    assert asyncio.run(s.repair(_Streak(failures=5, last_seq=40))) == "recently"
    clock.now += 1.0
    assert asyncio.run(s.repair(_Streak(failures=5, last_seq=40))) == "recreated" and s.recreated == 2


def test_a_missing_stream_is_added_back_at_once_with_its_sequences_continued() -> None:
    js = FakeJs([40, None])
    s = stream(js, Clock())
    assert asyncio.run(s.last_seq()) == 40
    assert asyncio.run(s.repair(_Streak(failures=5, last_seq=None))) == "added"
    assert js.calls == [("add", 41)]


def test_failure_reasons() -> None:
    assert failure_reason(TimeoutError()) == "timeout"
    assert failure_reason(nats.errors.TimeoutError()) == "timeout"
    assert failure_reason(nats.errors.NoRespondersError()) == "no_responders"
    assert failure_reason(nats.js.errors.NoStreamResponseError()) == "no_responders"
    assert failure_reason(nats.js.errors.ServiceUnavailableError()) == "unavailable"
    assert failure_reason(nats.js.errors.BadRequestError()) == "api_error"
    assert failure_reason(nats.errors.ConnectionClosedError()) == "other"
