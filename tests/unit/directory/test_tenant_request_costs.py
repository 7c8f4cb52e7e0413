"""What a tenant's request costs the directory, from a review (2026-12-05): a
`lookup_many` / `lease_release_many` runs its parts one after another and yields the loop
between them (each part of up to 128 groups is one core call, and 16 back to back held the loop
while every other tenant's request waited); a `list_groups` is charged at fair admission for the
groups it may examine, not as naming none."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import msgspec
import pytest

from kvfabric.directory.shard_requests import lookup_many, release_many
from kvfabric.proto import directory as m
from tests.unit.core.dirkit import groups


def test_the_loop_is_yielded_between_the_parts_of_a_many_request() -> None:
    ran: list[str] = []

    async def part(
        message: msgspec.Struct, verb: str, grant: Any, shard: int, room: int | None
    ) -> msgspec.Struct:
        ran.append(f"part{shard}")
        if verb == "lookup":
            return m.LookupReply(epoch=1, hit_chunks=0, lease_id=0, objects=[])
        return m.LeaseReply(epoch=1, lease_id=0, expires_ms=0, released=[])

    async def other() -> None:  # another tenant's request, one step each time it gets the loop
        while True:
            ran.append("other")
            await asyncio.sleep(0)

    async def main() -> None:
        background = asyncio.create_task(other())
        await asyncio.sleep(0)
        ids = [g.group_id() for g in groups(3, seed=5)]
        lookups = m.LookupMany(
            holder_id="h", parts=[m.LookupPart(shard=s, groups=[ids[s]]) for s in range(3)]
        )
        await lookup_many(lookups, None, part)
        releases = m.LeaseReleaseMany(
            holder_id="h", parts=[m.ReleasePart(shard=s, lease_ids=[1]) for s in range(3)]
        )
        await release_many(releases, None, part)
        background.cancel()
        await asyncio.gather(background, return_exceptions=True)

    asyncio.run(main())
    parts = [i for i, what in enumerate(ran) if what != "other"]
    assert len(parts) == 6
    for a, b in itertools.pairwise(parts):
        if (a, b) != (parts[2], parts[3]):  # within one request: the other ran in between
            assert b - a > 1, ran


def test_a_listing_costs_the_groups_it_may_examine_at_fair_admission() -> None:
    """Review, 2026-12-05: `list_groups` was charged as naming no id (the fixed cost alone) while
    one call examines up to `limit` groups (up to 1,000 for a `below_target` one)."""
    from kvfabric.core.directory import LIST_SCAN_GROUPS_MAX
    from kvfabric.directory.shard_requests import fair_ids
    from kvfabric.proto.codec import encode
    from tests.unit.core.dirkit import DOMAIN, new_core, register
    from tests.unit.directory.test_giveback_budget import _gate, _host

    assert fair_ids(m.ListGroups(limit=500)) == 500
    assert fair_ids(m.ListGroups(limit=1, below_target=True)) == LIST_SCAN_GROUPS_MAX
    assert fair_ids(m.Lookup(holder_id="h", groups=[g.group_id() for g in groups(4, seed=6)])) == 4
    core = new_core()
    register(core, "s1", capacity=10**6)
    now = [0.0]
    gate = _gate(now, 1.0, 1)
    runtime = _host(core, gate)
    before = gate.core.tokens("bob", now[0])

    async def main() -> None:
        listing = m.ListGroups(domain_digest=DOMAIN.digest(), limit=500)
        reply = await runtime.tenant["list_groups"](encode(listing), {}, "bob")
        assert isinstance(reply, m.GroupList)

    asyncio.run(main())
    assert before - gate.core.tokens("bob", now[0]) == gate.core.config.request_cost_ids + 500


def test_a_request_that_waits_too_long_for_its_turn_is_busy_and_gives_its_place_up() -> None:
    """Review, 2026-12-05: a request queued for a turn waited without a deadline (its client had
    long given up) and then ran on the tenant's slot and tokens. After `TURN_WAIT_S_MAX` it is
    `busy`, its place is given up, and the tenant's next request starts normally."""
    from unittest.mock import patch

    from kvfabric.directory import fair as fair_module
    from kvfabric.directory.admission import AdmissionConfig
    from kvfabric.directory.fair import FairGate
    from kvfabric.format.errors import Busy

    config = AdmissionConfig(
        ids_per_s=1_000, burst_ids=8_192, queue_max=4, running_max=4, tenant_running_max=1
    )
    gate = FairGate(config)

    async def main() -> None:
        running, release = asyncio.Event(), asyncio.Event()

        async def first() -> None:
            async with gate.turn("bob", 4):
                running.set()
                await release.wait()

        holder = asyncio.create_task(first())
        await running.wait()
        with patch.object(fair_module, "TURN_WAIT_S_MAX", 0.05), pytest.raises(Busy, match="too long"):
            async with gate.turn("bob", 4):
                raise AssertionError("it should not have started")
        assert gate.waited_out_total == 1 and gate.core.queue_depth("bob") == 0
        release.set()
        await holder
        async with gate.turn("bob", 4):  # the next one starts at once
            assert gate.core.running_of("bob") == 1
        assert gate.core.running_of("bob") == 0
        gate.core.check()

    asyncio.run(main())


def _located(replicas: int) -> m.ObjectLocation:
    return m.ObjectLocation(
        chunk_index=0,
        member=m.Member(0, 0, 0),
        size_bytes=1,
        checksum=b"c" * 16,
        replicas=[
            m.Replica(segment_id=f"s{r}", incarnation=1, slot=r, slot_generation=1) for r in range(replicas)
        ],
    )


def test_a_lookup_answering_many_replicas_costs_them() -> None:
    """One group of 255 members x 3 replicas cost ~1.9 ms of core work and read-token signing
    (and a 110 KB reply), a one-member group 0.02 ms, both charged one id at fair admission
    (review, 2026-12-06): the replicas answered past one per group named are charged after."""
    from kvfabric.directory.shard_requests import reply_extra_ids

    (g,) = groups(1, seed=9)
    asked = m.Lookup(holder_id="h", groups=[g.group_id()])
    big = m.LookupReply(epoch=1, hit_chunks=1, lease_id=1, objects=[_located(3) for _ in range(255)])
    assert reply_extra_ids(asked, big) == 255 * 3 - 1
    small = m.LookupReply(epoch=1, hit_chunks=1, lease_id=1, objects=[_located(1)])
    assert reply_extra_ids(asked, small) == 0
    many = m.LookupMany(holder_id="h", parts=[m.LookupPart(shard=0, groups=[g.group_id()])])
    answered = m.LookupManyReply(parts=[m.LookupPartReply(shard=0, reply=big)])
    assert reply_extra_ids(many, answered) == 255 * 3 - 1


def test_the_extra_is_taken_from_the_bucket_into_at_most_one_burst_of_debt() -> None:
    from kvfabric.directory.admission import AdmissionConfig, FairAdmission

    core = FairAdmission(
        AdmissionConfig(
            ids_per_s=1_000,
            burst_ids=4_000,
            queue_max=4,
            running_max=2,
            tenant_running_max=1,
            request_cost_ids=0,
        )
    )
    assert isinstance(core.offer("bob", 1, 0.0), int)
    assert len(core.start(0.0)) == 1
    core.charge_more("bob", 1_000_000, 0.0)  # a huge answer: the debt stops at one burst
    assert core.tokens("bob", 0.0) == pytest.approx(-4_000)
    core.done("bob", 0.0)
    core.check()
    assert core.retry_after_s("bob", 1, 0.0) == pytest.approx(4.001)  # bob waits for the refill
    assert core.charged_after_total == 3_999 + 4_000  # taken: what its bucket held, then one burst


def test_a_long_lookups_encoded_objects_are_counted_without_decoding() -> None:
    """A lookup of more than 128 groups is answered in slices whose objects are already encoded
    (`msgspec.Raw`): the charge read `.replicas` of them and raised, every long lookup answered
    `internal` (found by the corrupted-byte drill in CI, 2026-12-06). Each counts as one."""
    from kvfabric.directory.shard_requests import reply_extra_ids
    from kvfabric.proto.codec import encode

    gs = groups(3, seed=11)
    asked = m.Lookup(holder_id="h", groups=[g.group_id() for g in gs])
    raw = [msgspec.Raw(encode(_located(3))) for _ in range(10)]
    reply = m.LookupReply(epoch=1, hit_chunks=3, lease_id=1, objects=raw)  # type: ignore[arg-type]
    assert reply_extra_ids(asked, reply) == 10 - 3
