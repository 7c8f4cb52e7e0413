"""The prefetch shell keys hints by (tenant, hint id) as its core does, cancels name the tenant,
and a hint id accepted again leaks none of its earlier read leases (review, 2026-12-06)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import msgspec
import pytest

from kvfabric.prefetch import shell as shell_module
from kvfabric.prefetch.shell import PrefetchShell
from kvfabric.proto import directory as m
from kvfabric.proto import prefetch as p
from tests.unit.core.dirkit import groups
from tests.unit.prefetch.test_shell_shards import NOW, FakeRouter, location, make_shell


def leasing_router() -> tuple[FakeRouter, list[int]]:
    """Every lookup hits and grants a new lease id; the ids given back are listed."""
    lease_ids = itertools.count(100)
    released: list[int] = []

    def answer(shard: int, verb: str, message: msgspec.Struct) -> Any:
        if verb == "lease_release":
            assert isinstance(message, m.LeaseRelease)
            released.append(message.lease_id)
            return m.LeaseReply(epoch=1, lease_id=message.lease_id, expires_ms=0)
        assert verb == "lookup" and isinstance(message, m.Lookup)
        return m.LookupReply(
            epoch=1,
            hit_chunks=len(message.groups),
            lease_id=next(lease_ids),
            lease_expires_ms=NOW + 60_000,
            objects=[location(g) for g in message.groups],
        )

    return FakeRouter(answer), released


def hint(hint_id: str, tenant: str, seed: int) -> p.PrefetchHint:
    return p.PrefetchHint(
        hint_id=hint_id,
        tenant=tenant,
        groups=[g.group_id() for g in groups(1, seed=seed)],
        target_segment="s2",
        deadline_ms=NOW + 60_000,
    )


async def collect_ended(shell: PrefetchShell) -> None:
    """What the ticker does after each tick: ended hints' leases go back off it."""
    await shell._release_ended()
    await asyncio.gather(*shell._releases)


def test_a_hint_id_accepted_again_before_its_leases_were_collected_leaks_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`_leases[hint_id] = leases` overwrote the earlier entry: its leases were never given back
    (held until they expired)."""
    monkeypatch.setattr(shell_module, "now_ms", lambda: NOW)
    router, released = leasing_router()
    shell = make_shell(router)

    async def scenario() -> None:
        first = await shell._add(hint("h1", "t", seed=1))
        assert first.status == "accepted" and first.objects_queued == 1
        assert shell.core.cancel_hint("h1")  # the request finished; no tick has collected it yet
        again = await shell._add(hint("h1", "t", seed=1))  # the same id, accepted again
        assert again.status == "accepted" and again.objects_queued == 1
        await collect_ended(shell)

    asyncio.run(scenario())
    assert released == [100]  # the first hint's lease; the second's still protects its sources
    assert shell.status().gauges["leases_held"] == 1


def test_two_tenants_may_use_one_hint_id_and_a_cancel_names_its_tenant(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A's `req-1` and B's `req-1` were one hint (B's answered `deduped`), and one cancel ended both."""
    monkeypatch.setattr(shell_module, "now_ms", lambda: NOW)
    router, released = leasing_router()
    shell = make_shell(router)

    async def scenario() -> None:
        a = await shell._on_hint(hint("req-1", "A", seed=1), {})
        b = await shell._on_hint(hint("req-1", "B", seed=2), {})
        assert isinstance(a, p.HintReply) and isinstance(b, p.HintReply)
        assert (a.status, b.status) == ("accepted", "accepted")
        retried = await shell._on_hint(hint("req-1", "B", seed=2), {})
        assert isinstance(retried, p.HintReply) and retried.status == "deduped"
        cancelled = await shell._on_cancel(p.CancelHint(hint_id="req-1", tenant="A"), {})
        assert cancelled == p.CancelReply(cancelled=True)
        assert not shell.core.has_hint("req-1", "A") and shell.core.has_hint("req-1", "B")
        await collect_ended(shell)

    asyncio.run(scenario())
    assert released == [100]  # A's lease only: B's hint still needs its sources
    assert shell.status().gauges["leases_held"] == 1


def test_a_hint_deduped_into_a_live_one_keeps_it_leased_when_the_first_name_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two requests of one tenant hint the same objects under two ids: one live hint. The second's
    leases went back at once, so cancelling the first id left the hint copying with no lease."""
    monkeypatch.setattr(shell_module, "now_ms", lambda: NOW)
    router, released = leasing_router()
    shell = make_shell(router)

    async def scenario() -> None:
        first = await shell._add(hint("h1", "t", seed=1))
        second = await shell._add(hint("h2", "t", seed=1))  # the same objects, another request
        assert (first.status, second.status) == ("accepted", "deduped")
        assert released == []  # the joining hint's lease is kept under its own name
        assert shell.core.cancel_hint("h1", "t")  # the first request finished
        await collect_ended(shell)
        assert released == [100]  # h1's lease; h2's (101) still protects the live hint
        assert shell.core.has_hint("h2", "t")
        assert shell.core.cancel_hint("h2", "t")
        await collect_ended(shell)

    asyncio.run(scenario())
    assert released == [100, 101]
    assert shell.status().gauges["leases_held"] == 0


def test_a_cancel_that_comes_while_its_hint_is_looked_up_ends_it_once_added(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cancel found no live hint (it was still being resolved) and was lost: the hint lived
    to its deadline, holding its tenant's share, copy slots and its sources' leases for a
    request already finished (review, stop 70)."""
    monkeypatch.setattr(shell_module, "now_ms", lambda: NOW)
    router, released = leasing_router()
    shell = make_shell(router)
    looked_up = asyncio.Event()
    answer = router.answer

    async def scenario() -> None:
        gate = asyncio.Event()
        real_lookup = shell._lookup

        async def slow_lookup(h: p.PrefetchHint, ttl_ms: int) -> Any:
            looked_up.set()
            await gate.wait()
            return await real_lookup(h, ttl_ms)

        shell._lookup = slow_lookup  # type: ignore[method-assign,assignment]
        adding = asyncio.create_task(shell._on_hint(hint("req-1", "A", seed=1), {}))
        await looked_up.wait()
        again = await shell._on_hint(hint("req-1", "A", seed=1), {})  # a retry meanwhile: no second lookup
        assert isinstance(again, p.HintReply) and again.status == "deduped"
        cancelled = await shell._on_cancel(p.CancelHint(hint_id="req-1", tenant="A"), {})
        assert cancelled == p.CancelReply(cancelled=True)
        gate.set()
        added = await adding
        assert isinstance(added, p.HintReply) and added.status == "accepted"
        assert not shell.core.has_hint("req-1", "A")  # ended as it was added
        await collect_ended(shell)

    asyncio.run(scenario())
    assert answer is router.answer and released == [100]  # its lease given back
    assert shell.status().gauges["leases_held"] == 0 and not shell._resolving_names


def test_a_hints_lookups_are_not_counted_as_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """No engine reads what a hint's lookup finds: counted as reads, each hinted prefix looked
    read twice (hot replicas, eviction frequency; review, stop 70)."""
    monkeypatch.setattr(shell_module, "now_ms", lambda: NOW)
    router, _ = leasing_router()
    shell = make_shell(router)
    added = asyncio.run(shell._add(hint("h1", "t", seed=1)))
    assert added.status == "accepted"
    lookups = [message for _, verb, message in router.asked if verb == "lookup"]
    assert lookups and all(isinstance(q, m.Lookup) and q.count_hits is False for q in lookups)
