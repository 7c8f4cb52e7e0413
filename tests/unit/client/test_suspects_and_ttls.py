"""Client, review of stop 68. A report of a corrupt replica that failed (a directory
restarting) or was refused (its relay bound full) is forgotten, so the next load that sees the
same bad replica reports it again: it was remembered as reported before its outcome was known,
and never sent again for the client's life, the directory handing the bad replica out until the
scrubber's pass. And TTLs past what the directory takes are refused at settings."""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from kvfabric.client.suspects import SuspectReporter
from kvfabric.format.errors import Indeterminate
from kvfabric.proto import directory as m

REPLICA = m.Replica(segment_id="s1", incarnation=1, slot=7, slot_generation=2)
LOCATION = m.ObjectLocation(
    chunk_index=0, member=m.Member(0, 0, 0), size_bytes=1, checksum=b"c" * 16, replicas=[REPLICA]
)


class Router:
    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers
        self.asked = 0

    async def ask_any(self, verb: str, message: Any, timeout_s: float) -> Any:
        self.asked += 1
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def sightings(answers: list[Any], times: int) -> int:
    router = Router(answers)

    async def run() -> None:
        counter = Counter("reports", "r", ["outcome"], registry=CollectorRegistry())
        reporter = SuspectReporter(asyncio.get_running_loop(), lambda: router, counter)  # type: ignore[arg-type,return-value]
        for _ in range(times):
            reporter.seen(LOCATION, REPLICA)
            await asyncio.sleep(0.01)
        await reporter.close(1.0)

    asyncio.run(run())
    return router.asked


def test_a_failed_or_refused_report_is_sent_again_at_the_next_sighting() -> None:
    relayed = m.ReplicaSuspectReply(relayed=True)
    assert sightings([Indeterminate("no answer"), relayed], 3) == 2  # failed, then relayed, then not again
    assert sightings([m.ReplicaSuspectReply(relayed=False), relayed], 3) == 2
    assert sightings([relayed], 3) == 1


def test_ttls_past_what_the_directory_takes_are_refused_at_settings() -> None:
    """A lease or write TTL above the directory's bound made every lookup (or save) a
    `bad_request` miss with the client enabled, no `config_error` (review, stop 68)."""
    import pytest

    from kvfabric.client import ClientSettings
    from kvfabric.format.errors import BadRequest

    for name, most in (("lease_ttl_ms", m.LEASE_TTL_MS_MAX), ("write_ttl_ms", m.WRITE_TTL_MS_MAX)):
        ClientSettings(nats_url="nats://x:1", **{name: most})  # type: ignore[arg-type]
        with pytest.raises(BadRequest, match=name):
            ClientSettings(nats_url="nats://x:1", **{name: most + 1})  # type: ignore[arg-type]
