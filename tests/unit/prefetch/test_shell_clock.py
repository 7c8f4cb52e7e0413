"""The prefetch shell never hands its core an earlier time than the core has seen.

Regression: a hint's directory lookup is awaited; meanwhile the ticker advanced the core; the
shell then passed the time it had read *before* the lookup, the core's `time went backwards`
invariant fired, the service answered `internal` and stopped (a flaky integration test).
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

import msgspec
import pytest

from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.prefetch import shell as shell_module
from kvfabric.proto import directory as m
from kvfabric.proto import prefetch as p
from tests.unit.core.dirkit import groups
from tests.unit.prefetch.test_shell_shards import make_shell


def test_a_tick_during_the_hint_lookup_does_not_send_time_backwards(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = {"ms": 1_000_000}
    monkeypatch.setattr(shell_module, "now_ms", lambda: clock["ms"])
    (g,) = groups(1, seed=3)
    router = DirectoryRouter(cast(Any, None))  # never asked: `ask` is replaced below
    router.shards = 1  # the map is known: no refresh
    shell = make_shell(router)

    async def directory(shard: int, verb: str, message: msgspec.Struct, timeout_s: float, **_: Any) -> Any:
        assert verb == "lookup" and shard == 0
        clock["ms"] += 5
        shell.core.tick(shell._now())  # the ticker ran while the lookup was in flight
        clock["ms"] -= 3  # and the wall clock even stepped back a little
        replica = m.Replica(segment_id="s1", incarnation=1, slot=0, slot_generation=1)
        location = m.ObjectLocation(
            chunk_index=0, member=m.Member(0, 0, 0), size_bytes=10, checksum=b"c" * 16, replicas=[replica]
        )
        return m.LookupReply(
            epoch=1, hit_chunks=1, lease_id=7, lease_expires_ms=clock["ms"] + 60_000, objects=[location]
        )

    monkeypatch.setattr(router, "ask", directory)
    hint = p.PrefetchHint(
        hint_id="h1", tenant="t", groups=[g.group_id()], target_segment="s2", deadline_ms=clock["ms"] + 60_000
    )
    reply = asyncio.run(shell._add(hint))  # raised InvariantViolation before the fix
    assert isinstance(reply, p.HintReply) and reply.status == "accepted"
