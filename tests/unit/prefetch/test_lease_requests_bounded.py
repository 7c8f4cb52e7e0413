"""The prefetch shell's lease requests are bounded per tick and each goes on its own (review of
stop 71): ended hints' releases went in batches of 16 awaited whole (one release left unanswered
held the 15 others of its batch and every one queued behind, and a failed one was never retried:
the lease pinned its sources to its TTL), and thousands of renewals due on one shard were
thousands of tasks created in one tick, each waiting for one of the shard's 16 slots."""

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
from kvfabric.proto.shards import shard_of
from tests.unit.prefetch.test_lease_renewal import Directory
from tests.unit.prefetch.test_shell_shards import NOW, SHARDS, FakeRouter, make_shell, spread_prefix

HUNG_LEASE = (0, 1003)


class HangingRouter(FakeRouter):
    """Answers from a `Directory`; the first `lease_release` of `HUNG_LEASE` (or of any lease of
    `hung_shard`) is never answered (a request lost on the way, a leader that hangs), and
    `lease_renew`s wait for `gate`."""

    def __init__(self, directory: Directory) -> None:
        super().__init__(directory.answer)
        self.gate = asyncio.Event()
        self.gate.set()
        self.releases: list[tuple[int, int]] = []  # each lease_release sent
        self.renewals: list[tuple[int, int]] = []  # each lease_renew sent
        self.hung_shard: int | None = None

    async def ask(self, shard: int, verb: str, message: msgspec.Struct, timeout_s: float, **_: Any) -> Any:
        if verb == "lease_release":
            assert isinstance(message, m.LeaseRelease)
            lease = (shard, message.lease_id)
            self.releases.append(lease)
            hung = lease == HUNG_LEASE or shard == self.hung_shard
            if hung and self.releases.count(lease) == 1:
                await asyncio.Event().wait()  # never answered: only the shell's deadline ends it
        elif verb == "lease_renew":
            assert isinstance(message, m.LeaseRenew)
            self.renewals.append((shard, message.lease_id))
            await self.gate.wait()
        return await super().ask(shard, verb, message, timeout_s)


def setup(monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, int], Directory, HangingRouter, PrefetchShell]:
    clock = {"ms": NOW}
    monkeypatch.setattr(shell_module, "now_ms", lambda: clock["ms"])
    directory = Directory(clock)
    router = HangingRouter(directory)
    shell = make_shell(router)
    shell.request_timeout_s = 0.2  # a release's deadline: 0.7 s
    return clock, directory, router, shell


async def ticks(shell: PrefetchShell, clock: dict[str, int], n: int) -> None:
    """`n` ticks' after-work (`_release_ended`), 20 ms of real and lease time apart."""
    for _ in range(n):
        await shell._release_ended()
        await asyncio.sleep(0.02)
        clock["ms"] += 20


def test_a_release_that_hangs_holds_up_no_other(monkeypatch: pytest.MonkeyPatch) -> None:
    clock, directory, router, shell = setup(monkeypatch)
    leases = [(0, 1000 + i) for i in range(40)] + [(1, 2000 + i) for i in range(8)]
    for lease in leases:  # ended hints (not in the core), one lease each, held for 30 s
        directory.expiry[lease] = NOW + 30_000
        shell._keeper.keep(("t", f"h{lease[1]}"), [lease], NOW + 30_000, NOW)

    async def scenario() -> None:
        await ticks(shell, clock, 10)  # 0.2 s: far less than the hung release's deadline
        # every other release went and was answered; only the hung one is still out
        assert set(directory.released) == set(leases) - {HUNG_LEASE}
        assert HUNG_LEASE in router.releases and not shell._leases
        for _ in range(300):  # its deadline (0.7 s) passes: failed, counted, retried 1 s later
            await ticks(shell, clock, 1)
            if HUNG_LEASE in directory.released:
                break
        counters = shell.status().counters
        assert counters["lease_release_failed_total"] == 1
        assert counters["lease_releases_abandoned_total"] == 0
        assert shell.status().gauges["lease_releases_pending"] == 0
        await shell.stop()

    asyncio.run(scenario())
    assert sorted(directory.released) == sorted(leases)  # each once
    assert router.releases.count(HUNG_LEASE) == 2


def test_thousands_of_due_renewals_start_at_most_the_bound_per_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    """5 000 leases due on shard 0 and 500 on each of shards 1..3: a tick starts at most
    `RENEWALS_AT_ONCE` per shard, `REQUESTS_STARTED_PER_TICK_MAX` in all (a task each, none
    waiting); the rest go in later ticks, earliest expiry first, and none lapses."""
    clock, directory, router, shell = setup(monkeypatch)
    monkeypatch.setattr(shell, "_hint_deadline", lambda named: NOW + 120_000)
    monkeypatch.setattr(shell.core, "has_hint", lambda hint_id, tenant=None: True)  # all live
    per_shard = {0: 5_000, 1: 500, 2: 500, 3: 500}
    expiry: dict[tuple[int, int], int] = {}
    for shard, count in per_shard.items():
        for i in range(count):
            lease = (shard, 10_000 * (shard + 1) + i)
            expiry[lease] = NOW + 30_000 + (i * 7919) % 5_000  # due from 20 s to 25 s
            directory.expiry[lease] = expiry[lease]
            shell._keeper.keep(("t", f"h{lease[1]}"), [lease], expiry[lease], NOW)
    per_tick = shell_module.REQUESTS_STARTED_PER_TICK_MAX
    at_once = shell_module.RENEWALS_AT_ONCE

    async def scenario() -> None:
        router.gate.clear()  # the renewals sent are answered only when the gate opens
        clock["ms"] = NOW + 25_000  # every lease due
        tasks_before = len(asyncio.all_tasks())
        await shell._release_ended()
        await asyncio.sleep(0)  # the tasks started send their requests
        started = len(shell._renewals)
        assert started == len(router.renewals) == min(per_tick, at_once * len(per_shard)) == 64
        assert all(sum(s == shard for s, _ in router.renewals) <= at_once for shard in per_shard)
        assert len(asyncio.all_tasks()) - tasks_before == started  # one task per request, no more
        await shell._release_ended()  # a tick with every slot taken starts nothing
        assert len(shell._renewals) == len(router.renewals) == started
        assert shell.status().gauges["lease_renewals_queued"] == sum(per_shard.values()) - started
        router.gate.set()
        while shell._keeper.renewals_queued or shell._renewals:
            await asyncio.gather(*shell._renewals)
            clock["ms"] += 20
            await shell._release_ended()
            assert len(shell._renewals) <= per_tick
        # each renewed before its expiry (shard 0's 5 000 took 313 ticks, 6.3 s: the last
        # started at 31.3 s, their expiries spread to 35 s), and held at the directory
        assert all(directory.expiry[lease] > expires for lease, expires in expiry.items())
        await shell.stop()

    asyncio.run(scenario())
    assert sorted(router.renewals) == sorted(expiry)  # each once
    for shard in per_shard:  # each shard's in expiry order, tick by tick
        sent = [expiry[lease] for lease in router.renewals if lease[0] == shard]
        ticks_of = [sent[i : i + at_once] for i in range(0, len(sent), at_once)]
        assert all(max(a) <= min(b) for a, b in itertools.pairwise(ticks_of))
    counters = shell.status().counters
    assert counters["lease_renewals_late_total"] == counters["leases_lost_total"] == 0
    assert counters["lease_renewals_total"] == len(expiry)


def test_a_renewal_that_cannot_go_in_time_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard whose renewals are never answered: its 16 slots stay taken, and the leases due
    behind them lapse, each counted as late (and lost)."""
    clock, directory, router, shell = setup(monkeypatch)
    monkeypatch.setattr(shell, "_hint_deadline", lambda named: NOW + 120_000)
    monkeypatch.setattr(shell.core, "has_hint", lambda hint_id, tenant=None: True)  # all live
    leases = [(0, 100 + i) for i in range(40)]
    for lease in leases:
        directory.expiry[lease] = NOW + 30_000
        shell._keeper.keep(("t", f"h{lease[1]}"), [lease], NOW + 30_000, NOW)

    async def scenario() -> None:
        router.gate.clear()
        clock["ms"] = NOW + 29_900
        await shell._release_ended()
        await asyncio.sleep(0)
        assert len(router.renewals) == shell_module.RENEWALS_AT_ONCE
        clock["ms"] = NOW + 30_000
        await shell._release_ended()
        await shell.stop()

    asyncio.run(scenario())
    counters = shell.status().counters
    assert counters["lease_renewals_late_total"] == 40 - shell_module.RENEWALS_AT_ONCE
    assert counters["leases_lost_total"] == 40 - shell_module.RENEWALS_AT_ONCE


@pytest.mark.parametrize("case", ["queued_nothing", "found_nothing"])
def test_leases_no_hint_keeps_go_back_by_the_queue_not_in_the_hints_reply(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """Review of the change (stop 71): the leases of a hint that queued nothing (its target holds
    every object already), found no object, was busy or refused, were released inline, one at a
    time in the hint's reply path, never retried: one hung shard held the reply for its request
    timeout per lease. Now they are queued in `HintLeases` like an ended hint's: the reply comes
    at once, the hung release fails by its own deadline and is sent again, and every lease is
    given back."""
    clock, directory, router, shell = setup(monkeypatch)
    raws = spread_prefix()
    router.hung_shard = shard_of(raws[0], SHARDS)  # its lease_release hangs the first time
    target = "s2"
    if case == "queued_nothing":
        target = "s1"  # every object's replica is there already: nothing to copy
    else:  # the lookups hit, but list no object (the hint's members not held)
        answer = router.answer
        router.answer = lambda shard, verb, message: (
            msgspec.structs.replace(reply, objects=[])
            if isinstance(reply := answer(shard, verb, message), m.LookupReply)
            else reply
        )
    hint = p.PrefetchHint(
        hint_id="h1", tenant="t", groups=raws, target_segment=target, deadline_ms=NOW + 60_000
    )

    async def scenario() -> None:
        # (the old inline release never returned: the hung release has no answer, and the fake
        # router no timeout; a real one held the reply `request_timeout_s` per hung lease)
        reply = await asyncio.wait_for(shell._on_hint(hint, {}), 10.0)
        assert isinstance(reply, p.HintReply) and reply.status == "accepted" and reply.objects_queued == 0
        granted = set(directory.expiry) | set(directory.released)
        assert len({shard for shard, _ in granted}) > 1 and not shell._leases
        hung = next(lease for lease in granted if lease[0] == router.hung_shard)
        for _ in range(300):  # the hung release's deadline (0.7 s) passes: failed, retried 1 s later
            await ticks(shell, clock, 1)
            if hung in directory.released:
                break
        assert sorted(directory.released) == sorted(granted)  # each once
        assert router.releases.count(hung) == 2
        counters = shell.status().counters
        assert counters["lease_release_failed_total"] == 1
        assert counters["lease_releases_abandoned_total"] == 0
        assert shell.status().gauges["lease_releases_pending"] == 0
        await shell.stop()

    asyncio.run(scenario())
