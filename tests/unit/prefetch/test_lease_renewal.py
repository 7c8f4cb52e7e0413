"""The prefetch service renews the read leases of a hint that lives past one lease TTL (30 s),
each at the shard that granted it, never past the hint's deadline; a lease the directory dropped
is no longer counted as held; a hint's deadline is bounded (known defect "Prefetch: leases of a
hint are not renewed past 30 s": the leases expired at the directory 30 s after the lookup, the
hint's sources could be evicted before they were copied, and `leases_held` still counted them)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import msgspec
import pytest

from kvfabric.core.prefetch_events import Tick
from kvfabric.format.errors import NotFound, Unavailable
from kvfabric.prefetch import shell as shell_module
from kvfabric.prefetch.shell import PrefetchShell
from kvfabric.proto import directory as m
from kvfabric.proto import prefetch as p
from kvfabric.proto.shards import shard_of
from tests.unit.prefetch.test_shell_shards import NOW, SHARDS, FakeRouter, location, make_shell, spread_prefix

SLOW_SHARD = 1
SLOW_RENEW_S = 2.0  # a hung leader: each lease_renew answered after this (its request timeout)


class Directory:
    """A fake directory's leases: granted by lookups, renewed, released and expired by the time
    `clock` says (a renewal of an expired or unknown lease is `not_found`, as in the core)."""

    def __init__(self, clock: dict[str, int], *, renew_lost: bool = False) -> None:
        self.clock = clock
        self.renew_lost = renew_lost
        self.expiry: dict[tuple[int, int], int] = {}  # (shard, lease id) -> expires_ms
        self.renewals: list[tuple[int, m.LeaseRenew]] = []
        self.released: list[tuple[int, int]] = []
        self._ids = itertools.count(100)

    def answer(self, shard: int, verb: str, message: msgspec.Struct) -> Any:
        now = self.clock["ms"]
        if verb == "lookup":
            assert isinstance(message, m.Lookup)
            lease_id = next(self._ids)
            self.expiry[(shard, lease_id)] = now + message.lease_ttl_ms
            return m.LookupReply(
                epoch=1,
                hit_chunks=len(message.groups),
                lease_id=lease_id,
                lease_expires_ms=now + message.lease_ttl_ms,
                objects=[location(g) for g in message.groups],
            )
        if verb == "lease_renew":
            assert isinstance(message, m.LeaseRenew) and message.shard == shard
            self.renewals.append((now, message))
            lease = (shard, message.lease_id)
            if self.renew_lost or self.expiry.get(lease, 0) <= now:
                return NotFound(f"no lease {message.lease_id}")
            assert 0 < message.lease_ttl_ms <= shell_module.LEASE_TTL_MS_MAX
            self.expiry[lease] = max(self.expiry[lease], now + message.lease_ttl_ms)
            return m.LeaseReply(epoch=1, lease_id=message.lease_id, expires_ms=self.expiry[lease])
        assert verb == "lease_release" and isinstance(message, m.LeaseRelease)
        self.released.append((shard, message.lease_id))
        self.expiry.pop((shard, message.lease_id), None)
        return m.LeaseReply(epoch=1, lease_id=message.lease_id, expires_ms=0)


async def after_tick(shell: PrefetchShell) -> None:
    """What the ticker does: a `Tick`, then the ended hints' releases and the renewals due, here
    awaited (the service leaves them to their background tasks)."""
    await shell._driver.feed(Tick())
    await shell._release_ended()
    await asyncio.gather(*shell._renewals, *shell._releases)


def setup(monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> tuple[dict[str, int], Directory, PrefetchShell]:
    clock = {"ms": NOW}
    monkeypatch.setattr(shell_module, "now_ms", lambda: clock["ms"])
    directory = Directory(clock, **kwargs)
    return clock, directory, make_shell(FakeRouter(directory.answer))


def hint(deadline_ms: int) -> p.PrefetchHint:
    return p.PrefetchHint(
        hint_id="h1", tenant="t", groups=spread_prefix(), target_segment="s2", deadline_ms=deadline_ms
    )


def test_a_hints_leases_are_renewed_past_30_s_until_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    clock, directory, shell = setup(monkeypatch)
    deadline = NOW + 120_000  # two minutes ahead: four lease TTLs

    async def scenario() -> list[tuple[int, int]]:
        reply = await shell._add(hint(deadline))
        assert reply.status == "accepted" and reply.objects_queued > 0  # no copies run: it stays
        kept = list(shell._leases[("t", "h1")])
        assert len({s for s, _ in kept}) > 1  # one lease per shard of the prefix
        while clock["ms"] < deadline:
            clock["ms"] += 500
            await after_tick(shell)
            if clock["ms"] < deadline:  # every lease still held at the directory, and counted
                assert all(directory.expiry[lease] > clock["ms"] for lease in kept)
                assert shell.status().gauges["leases_held"] == len(kept)
        # expired at its deadline, and so did its leases (renewed up to it, never past): none is
        # held, and none is released (a release of an expired lease is no use: not sent)
        assert not shell._leases and directory.released == []
        assert max(directory.expiry[lease] for lease in kept) == deadline
        return kept

    kept = asyncio.run(scenario())
    renewed = {(r.shard, r.lease_id) for _, r in directory.renewals}  # each at its own shard
    assert renewed == set(kept)
    assert all(r.lease_ttl_ms <= 30_000 for _, r in directory.renewals)
    assert all(now + r.lease_ttl_ms <= deadline for now, r in directory.renewals)  # never past it
    per_lease = len(directory.renewals) / len(renewed)
    assert 4 <= per_lease <= 6  # one per 20 s of the hint's life, not one per tick
    counters = shell.status().counters
    assert counters["lease_renewals_total"] == len(directory.renewals) and counters["leases_lost_total"] == 0


def test_a_lease_the_directory_dropped_is_not_counted_as_held(monkeypatch: pytest.MonkeyPatch) -> None:
    clock, directory, shell = setup(monkeypatch, renew_lost=True)  # e.g. a new leader forgot them

    async def scenario() -> None:
        reply = await shell._add(hint(NOW + 120_000))
        assert reply.status == "accepted"
        held = shell.status().gauges["leases_held"]
        assert held > 1
        clock["ms"] += 21_000
        await after_tick(shell)
        assert len(directory.renewals) == held
        assert shell.status().gauges["leases_held"] == 0  # it counted leases the directory dropped
        assert shell.status().counters["leases_lost_total"] == held
        assert shell.core.has_hint("h1", "t")  # the hint goes on (best effort)
        assert shell.core.cancel_hint("h1", "t")
        await after_tick(shell)
        assert directory.released == []  # nothing left to give back

    asyncio.run(scenario())


def test_a_hint_days_ahead_is_held_at_most_the_hold_maximum(monkeypatch: pytest.MonkeyPatch) -> None:
    clock, directory, shell = setup(monkeypatch)

    async def scenario() -> None:
        reply = await shell._add(hint(NOW + 86_400_000))
        assert reply.status == "accepted"
        hold = shell.core.config.hint_hold_ms_max
        assert shell.core.hint_deadline("h1", "t") == NOW + hold == NOW + 300_000
        assert shell.status().counters["hints_deadline_capped_total"] == 1
        while shell.core.has_hint("h1", "t"):
            clock["ms"] += 1_000
            await after_tick(shell)
        assert clock["ms"] == NOW + hold and not shell._leases
        # renewed at each shard up to the capped deadline, where they expired with the hint
        assert {s for s, _ in directory.expiry} == {shard_of(g, SHARDS) for g in spread_prefix()}
        assert max(directory.expiry.values()) == NOW + hold and directory.released == []

    asyncio.run(scenario())
    assert all(now + r.lease_ttl_ms <= NOW + 300_000 for now, r in directory.renewals)


class SlowShardRouter(FakeRouter):
    """`SLOW_SHARD` answers each `lease_renew` `SLOW_RENEW_S` late; the other shards at once."""

    def __init__(self, answer: Any) -> None:
        super().__init__(answer)
        self.sent: list[tuple[int, int]] = []  # (shard, lease id) of each lease_renew sent

    async def ask(self, shard: int, verb: str, message: msgspec.Struct, timeout_s: float, **_: Any) -> Any:
        if verb == "lease_renew":
            assert isinstance(message, m.LeaseRenew)
            self.sent.append((shard, message.lease_id))
            if shard == SLOW_SHARD:
                await asyncio.sleep(SLOW_RENEW_S)
        return await super().ask(shard, verb, message, timeout_s)


def slow_shard_setup(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[
    dict[str, int], Directory, SlowShardRouter, PrefetchShell, list[tuple[int, int]], list[tuple[int, int]]
]:
    """40 leases on `SLOW_SHARD` for 10 s, due at 6.7 s, and 8 on shard 0 for 12 s, due at 8 s
    (their hints live for 2 minutes): (clock, directory, router, shell, slow leases, fast ones)."""
    clock = {"ms": NOW}
    monkeypatch.setattr(shell_module, "now_ms", lambda: clock["ms"])
    directory = Directory(clock)
    router = SlowShardRouter(directory.answer)
    shell = make_shell(router)
    monkeypatch.setattr(shell, "_hint_deadline", lambda named: NOW + 120_000)
    slow = [(SLOW_SHARD, 1000 + i) for i in range(40)]
    fast = [(0, 2000 + i) for i in range(8)]
    for leases, expires in ((slow, NOW + 10_000), (fast, NOW + 12_000)):
        for lease in leases:
            directory.expiry[lease] = expires
            shell._keeper.keep(("t", f"h{lease[1]}"), [lease], expires, NOW)
    return clock, directory, router, shell, slow, fast


def test_a_slow_shard_delays_no_other_shards_renewals(monkeypatch: pytest.MonkeyPatch) -> None:
    """Renewals went out in batches of 16 awaited whole: one shard whose leader hangs (each
    `lease_renew` its request timeout) held the other shards' renewals behind its own, past
    their renewal margin, and their leases lapsed (review, stop 71). The clock runs 5x: 2 s a
    slow answer is 10 s of lease time."""
    clock, directory, router, shell, slow, fast = slow_shard_setup(monkeypatch)

    async def scenario() -> None:
        for _ in range(70):  # 3.5 s, 17.5 s of lease time: past the fast leases' first expiry
            shell._renew_due()
            await asyncio.sleep(0.05)
            clock["ms"] += 250
            for lease in fast:  # held, at the directory and in the service's books
                assert directory.expiry[lease] > clock["ms"], f"{lease} lapsed at {clock['ms'] - NOW} ms"
                assert shell._keeper.expires_ms(lease) is not None, f"{lease} dropped"
        await shell.stop()

    asyncio.run(scenario())
    assert {lease for lease in router.sent if lease[0] == 0} == set(fast)
    assert shell.status().counters["leases_lost_total"] <= len(slow)  # only the slow shard's


def test_renewals_are_counted_when_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    """`lease_renewals_total` counted renewals when due: those still waiting at `stop` (or
    whose hint ended meanwhile) were counted, never sent (review, stop 71)."""
    clock, _, router, shell, slow, _ = slow_shard_setup(monkeypatch)

    async def scenario() -> None:
        clock["ms"] += 7_000  # the 40 slow ones due (a third of 10 s left): 16 sent, 24 waiting
        shell._renew_due()
        await asyncio.sleep(0.1)
        await shell.stop()

    asyncio.run(scenario())
    assert len(router.sent) == shell_module.RENEWALS_AT_ONCE and set(router.sent) <= set(slow)
    assert shell.status().counters["lease_renewals_total"] == len(router.sent)


@pytest.mark.parametrize("case", ["queued_nothing", "cancelled"])
def test_a_release_lives_to_the_latest_expiry_a_slow_lookup_may_have_given(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """Review of the change: a hint's leases were held, for their releases too, until the TTL
    from before its lookup was sent, while each shard grants it from when it answers: a lookup
    answered seconds later (here 1 s per shard) and a release failing until near that early
    bound was given up while the directory still held the lease. Now a release lives to the TTL
    from when the answer came (the early bound still times the renewals): a lease no hint kept
    (`queued_nothing`) and an ended hint's (`cancelled`)."""
    clock = {"ms": NOW}
    monkeypatch.setattr(shell_module, "now_ms", lambda: clock["ms"])
    directory = Directory(clock)
    failed: set[tuple[int, int]] = set()

    def answer(shard: int, verb: str, message: msgspec.Struct) -> Any:
        if verb == "lookup":
            clock["ms"] += 1_000  # each shard answers 1 s after the one before
        elif verb == "lease_release":
            assert isinstance(message, m.LeaseRelease)
            lease = (shard, message.lease_id)
            if lease not in failed:  # the first release of each fails just before the early bound
                failed.add(lease)
                clock["ms"] = max(clock["ms"], NOW + 29_500)
                return Unavailable("no leader")
        return directory.answer(shard, verb, message)

    shell = make_shell(FakeRouter(answer))
    groups = spread_prefix()
    target = "s1" if case == "queued_nothing" else "s2"  # s1 holds every object already

    async def scenario() -> None:
        reply = await shell._add(
            p.PrefetchHint(
                hint_id="h1", tenant="t", groups=groups, target_segment=target, deadline_ms=NOW + 60_000
            )
        )
        granted = set(directory.expiry)
        assert len(granted) > 1 and all(directory.expiry[lease] > NOW + 30_000 for lease in granted)
        if case == "cancelled":
            assert reply.status == "accepted" and reply.objects_queued > 0
            assert shell.core.cancel_hint("h1", "t")
            await after_tick(shell)
        else:
            assert reply.status == "accepted" and reply.objects_queued == 0
            await asyncio.gather(*shell._releases)
        assert failed == granted  # each failed once, at 29.5 s: retried at 30.5 s
        assert shell.status().counters["lease_releases_abandoned_total"] == 0
        clock["ms"] = NOW + 30_500  # past the early bound: the leases live on at the directory
        assert all(directory.expiry[lease] > clock["ms"] for lease in granted)
        await after_tick(shell)
        assert sorted(directory.released) == sorted(granted)
        assert shell.status().counters["lease_releases_abandoned_total"] == 0
        assert shell.status().gauges["lease_releases_pending"] == 0
        await shell.stop()

    asyncio.run(scenario())
