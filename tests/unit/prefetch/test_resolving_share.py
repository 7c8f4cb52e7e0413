"""Hints being resolved (directory lookups) are bounded per tenant too (review, stop 68): one
tenant's flood of slow hints took every one of `resolving_max` slots, and every other tenant's
hints were answered `busy` meanwhile. A tenant now gets at most a quarter of them (at least one)."""

from __future__ import annotations

import asyncio
from typing import Any

from kvfabric.format.ids import GroupId
from kvfabric.proto import prefetch as p
from tests.unit.prefetch.test_shell_shards import FakeRouter, make_shell

GROUP = GroupId(b"g" * 90)


def hint(tenant: str, n: int) -> p.PrefetchHint:
    return p.PrefetchHint(
        hint_id=f"h{n}", tenant=tenant, groups=[GROUP], target_segment="s1", deadline_ms=2**62
    )


def test_one_tenants_hints_take_at_most_its_share_of_the_resolving_slots() -> None:
    shell = make_shell(FakeRouter(lambda *_: None))  # resolving_max=4: a tenant's share is 1
    release = asyncio.Event()

    async def slow_add(h: p.PrefetchHint) -> p.HintReply:
        await release.wait()  # its lookups are slow
        return p.HintReply(hint_id=h.hint_id, status="accepted")

    shell._add = slow_add  # type: ignore[method-assign,assignment]

    async def main() -> list[Any]:
        first = asyncio.create_task(shell._on_hint(hint("alice", 1), {}))
        await asyncio.sleep(0)
        flood = await asyncio.wait_for(shell._on_hint(hint("alice", 2), {}), 2)  # alice's share is in use
        others = [asyncio.create_task(shell._on_hint(hint(t, 3), {})) for t in ("bob", "carol")]
        await asyncio.sleep(0)
        release.set()
        return [flood, await first, *(await asyncio.gather(*others))]

    flood, first, bob, carol = asyncio.run(main())
    assert (flood.status, flood.reason) == ("busy", "tenant_resolving_full")
    assert (shell.busy_tenant_resolving, shell.busy_resolving) == (1, 0)
    assert first.status == bob.status == carol.status == "accepted"
    assert shell._resolving == 0 and not shell._resolving_by  # nothing left counted


def test_a_hint_id_or_tenant_past_its_bound_is_refused_at_decode() -> None:
    """A live hint keeps its id and tenant: unbounded, 1,024 hints of 1 MiB ids held ~1 GiB
    (review, stop 70)."""
    import msgspec
    import pytest

    from kvfabric.format.errors import BadRequest
    from kvfabric.proto import prefetch as p

    def hint(hint_id: str, tenant: str) -> bytes:
        return msgspec.msgpack.encode(
            {
                "t": "prefetch.hint.v1",
                "hint_id": hint_id,
                "tenant": tenant,
                "groups": [],
                "target_segment": "s1",
                "deadline_ms": 1,
            }
        )

    assert isinstance(p.prefetch_decoder.decode(hint("h" * p.HINT_ID_CHARS_MAX, "t")), p.PrefetchHint)
    with pytest.raises(BadRequest):
        p.prefetch_decoder.decode(hint("h" * (p.HINT_ID_CHARS_MAX + 1), "t"))
    with pytest.raises(BadRequest):
        p.prefetch_decoder.decode(hint("h", "t" * (p.TENANT_CHARS_MAX + 1)))


def test_a_hint_the_core_would_answer_busy_asks_the_directory_nothing() -> None:
    """The tenant's hint share full: each more hint was resolved first (a lookup on every shard,
    leases, their release, the tenant's directory rate) and only then answered busy by the core
    (review, stop 70). Now answered busy before any lookup."""
    from kvfabric.core.prefetch import PrefetchConfig, PrefetchCore

    router = FakeRouter(lambda *_: AssertionError("no lookup for a hint answered busy"))
    shell = make_shell(router)
    shell.core = PrefetchCore(PrefetchConfig(hints_queued_per_tenant_max=1))
    shell.core._tenant_ids["alice"] = 1  # (alice's one hint live)
    reply = asyncio.run(shell._on_hint(hint("alice", 9), {}))
    assert isinstance(reply, p.HintReply)
    assert (reply.status, reply.reason) == ("busy", "tenant_hints_full") and router.asked == []
    assert shell.status().gauges["busy_before_lookup"] == 1
