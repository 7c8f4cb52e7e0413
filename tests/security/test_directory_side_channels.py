"""Hostile tenant vs the directory's event loop and its side channels (issue 21 rows 1, 2, 9, 10),
on a real authenticated cluster (one directory shard, TLS).

- Rows 1 and 10: bob's listings and shows of his own (empty) domain cost the same whether alice
  holds 20,000 groups or none (before: every call scanned every tenant's groups, 62.6 vs 0.96 ms:
  alice's volume leaked, and a flood of them took the directory's lease).
- Row 9: bob's `show_group` of alice's real group and of a missing one are not separable by
  timing (before: the core built the real group's summary first, +31.6 us, z = 11.5).
- Row 2: bob's max-size lookups (4,096 of his own groups, 16 in flight, never backing off) while
  he has a request rate: each costs 64 tokens, not 1, so he is refused before the directory
  does his work, and alice's lookups keep their latency.

Each test prints what it measured (`-s`); docs/security.md quotes the figures.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import msgspec
import nats
import pytest
from nats.aio.client import Client as NatsClient

from kvfabric.client import ClientSettings
from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.ctl.auth import plan_auth, write_auth
from kvfabric.format.errors import Busy, KvfError, NotFound, RateLimited
from kvfabric.format.ids import GroupId
from kvfabric.format.key import chunk_groups_for_prefix
from kvfabric.proto import directory as m
from kvfabric.testing import NatsServer, ServiceProcess
from kvfabric.testing.probes import metric_value, scrape_metrics
from kvfabric.testing.tenants import Secure
from tests.integration.clientkit import TOKENS_PER_CHUNK, prompt
from tests.integration.cluster import directory_process, directory_router, segment_process
from tests.security.test_directory_budgets import two_tenants

pytestmark = pytest.mark.integration

ALICE_GROUPS = 20_000
TIMEOUT_S = 10.0


def group_ids(secure: Secure, tenant: str, n: int, seed: int) -> list[GroupId]:
    spec = secure.spec(tenant)
    tokens = prompt(n * spec.layout.tokens_per_chunk, seed=seed)
    return [g.group_id() for g in chunk_groups_for_prefix(spec.domain, spec.model, spec.layout, tokens)]


def save(secure: Secure, tenant: str, chunks: int, seed: int, size: int = 256) -> None:
    """`tenant` saves a prompt of `chunks` chunks, `size` bytes each, through the client."""
    tokens = prompt(chunks * TOKENS_PER_CHUNK, seed=seed)
    with secure.client(tenant) as client:
        result = client.save(tokens, [[bytes([i % 251]) * size] for i in range(chunks)])
        assert result.chunks_saved == chunks and not result.causes, result


async def tenant_router(secure: Secure, tenant: str) -> tuple[NatsClient, DirectoryRouter]:
    nc = await secure.connect(secure.tenant_auth(tenant))
    return nc, await directory_router(nc, tenant)


async def timed_ms(router: DirectoryRouter, verb: str, message: msgspec.Struct) -> float:
    """One request's round trip, ms (a `not_found` answer is an answer)."""
    began = time.perf_counter()
    with suppress(NotFound):
        await router.ask(0, verb, message, TIMEOUT_S)
    return (time.perf_counter() - began) * 1e3


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def longest_core_call_ms(directory_metrics_port: int) -> float:
    value = metric_value(
        scrape_metrics(directory_metrics_port), "kvfabric_directory_core_call_longest_seconds"
    )
    assert value is not None
    return value * 1e3


# ---- rows 1 and 10 -------------------------------------------------------------------------


async def bobs_own_queries(secure: Secure, n: int) -> dict[str, list[float]]:
    """Bob lists his own (empty) domain and shows a missing group of his, `n` times each
    (alternating), ms per call."""
    nc, bob = await tenant_router(secure, "bob")
    digest = secure.spec("bob").domain.digest()
    missing = group_ids(secure, "bob", 1, seed=99)[0]
    out: dict[str, list[float]] = {"list_groups": [], "show_group": [], "lookup": []}
    try:
        for _ in range(n):
            # limit 1: a listing costs the groups it may examine at fair admission (1,016 tokens
            # at limit 1,000: 300 of them within bob's budget no more); the scan of everyone's
            # groups that rows 1 and 10 found ran whatever the limit (bob's domain is empty)
            listing = m.ListGroups(domain_digest=digest, limit=1)
            out["list_groups"].append(await timed_ms(bob, "list_groups", listing))
            out["show_group"].append(await timed_ms(bob, "show_group", m.ShowGroup(group=missing)))
            # the control: a one-group lookup (a miss) costs the same whatever anyone holds; it
            # shares the directory's loop and the machine with the two above, so a loaded
            # machine or a busy loop (alice's 20,000 events still being published) slows it too
            out["lookup"].append(await timed_ms(bob, "lookup", m.Lookup(holder_id="b", groups=[missing])))
    finally:
        await nc.close()
    return out


def test_bobs_listings_cost_the_same_whatever_alice_holds(tmp_path: Path) -> None:
    """Rows 1 and 10: bob's list_groups and show_group of his own empty domain, 300 each, with
    alice holding no group and then 20,000: each median over that of a one-group lookup timed
    beside it (the control) stays within 2x (+0.5). Before the per-domain index: 0.96 vs 62.6 ms
    (a ratio to the control of ~2 vs ~100). The control, not the raw medians: on a loaded CI
    machine everything on the directory slowed ~4x between the two phases (0.54 -> 2.20 ms, the
    core calls themselves 0.14 ms at most), which said nothing about alice's data."""
    info = {"KVF_LOG_LEVEL": "info"}  # the slow-call warnings, not a debug line per request
    with two_tenants(tmp_path, arena_bytes=64 << 20, env=info) as (secure, directory):
        port = directory.wait_for_event("directory_started", 1.0)["metrics_port"]
        without = asyncio.run(bobs_own_queries(secure, 300))
        began = time.perf_counter()
        save(secure, "alice", ALICE_GROUPS, seed=1)
        save_s = time.perf_counter() - began
        longest_ms = longest_core_call_ms(port)  # during alice's save, bob's queries before it
        slow_before = len(slow_core_calls(directory))
        with_alice = asyncio.run(bobs_own_queries(secure, 300))
        slow_during = slow_core_calls(directory)[slow_before:]
        longest_after_ms = longest_core_call_ms(port)
        report = {
            verb: {
                "p50_ms_alice_none": round(statistics.median(without[verb]), 3),
                "p50_ms_alice_20k": round(statistics.median(with_alice[verb]), 3),
                "p99_ms_alice_none": round(quantile(without[verb], 0.99), 3),
                "p99_ms_alice_20k": round(quantile(with_alice[verb], 0.99), 3),
            }
            for verb in without
        }
        print(
            "\nrows 1/10:",
            json.dumps(
                {
                    **report,
                    "alice_save_s": round(save_s, 1),
                    "longest_core_call_ms_during_save": round(longest_ms, 2),
                    "longest_core_call_ms_during_bobs_queries": round(longest_after_ms, 2),
                    "core_calls_over_50_ms": [
                        (e["what"], e["ms"], e["cpu_ms"])
                        for e in directory.events()
                        if e.get("event") == "core_call_slow"
                    ],
                }
            ),
        )
        control = report["lookup"]
        for verb, row in report.items():
            if verb == "lookup":
                continue
            ratio_none = row["p50_ms_alice_none"] / control["p50_ms_alice_none"]
            ratio_20k = row["p50_ms_alice_20k"] / control["p50_ms_alice_20k"]
            assert ratio_20k < 2 * ratio_none + 0.5, (verb, row, control)
        # CPU, not wall time (a preempted or GC-paused call on a loaded host is not a listing's
        # cost): no core call of 50 ms CPU while bob listed (each over 50 ms wall is logged).
        held = [call for call in slow_during if call[2] >= 50]
        assert not held, ("a listing of an empty domain held the event loop", held, longest_after_ms)


# ---- row 9 ---------------------------------------------------------------------------------


def sign_test_z(pairs: list[tuple[float, float]]) -> float:
    """z of the sign test that the first of each pair is slower as often as the second (ties
    dropped): |z| > 3 would say the two are told apart."""
    wins = sum(a > b for a, b in pairs)
    n = sum(a != b for a, b in pairs)
    return (wins - n / 2) / math.sqrt(n / 4) if n else 0.0


def welch_z(a: list[float], b: list[float]) -> float:
    """Difference of means over its standard error (large samples: a z)."""
    se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
    return (statistics.fmean(a) - statistics.fmean(b)) / se


def test_show_group_of_alices_real_and_missing_groups_take_the_same_time(tmp_path: Path) -> None:
    """Row 9: 2,000 pairs of bob's show_group of alice's real group and of a missing id of
    alice's, alternating which goes first; the answers are the same NotFound and the sign test
    does not tell them apart (|z| < 5: p = 6e-7 by chance; the old code gave 7.7). Before: the
    real group's summary was built first."""
    with two_tenants(tmp_path) as (secure, _):
        save(secure, "alice", 8, seed=2, size=4096)
        real = group_ids(secure, "alice", 8, seed=2)[3]
        missing = group_ids(secure, "alice", 1, seed=3)[0]

        async def probe() -> list[tuple[float, float]]:
            nc, bob = await tenant_router(secure, "bob")
            pairs = []
            try:
                for g in (real, missing):  # the same answer for both
                    with pytest.raises(NotFound) as caught:
                        await bob.ask(0, "show_group", m.ShowGroup(group=g), TIMEOUT_S)
                    assert caught.value.message == "no such chunk group"
                for _ in range(50):  # warm up
                    await timed_ms(bob, "show_group", m.ShowGroup(group=real))
                for i in range(2_000):
                    order = (real, missing) if i % 2 else (missing, real)
                    times = {g: await timed_ms(bob, "show_group", m.ShowGroup(group=g)) for g in order}
                    pairs.append((times[real], times[missing]))
            finally:
                await nc.close()
            return pairs

        pairs = asyncio.run(probe())
        real_ms = [a for a, _ in pairs]
        missing_ms = [b for _, b in pairs]
        z = sign_test_z(pairs)
        report = {
            "pairs": len(pairs),
            "real_p50_us": round(statistics.median(real_ms) * 1e3, 1),
            "missing_p50_us": round(statistics.median(missing_ms) * 1e3, 1),
            "median_difference_us": round(statistics.median(a - b for a, b in pairs) * 1e3, 1),
            "sign_test_z": round(z, 2),
            "welch_z": round(welch_z(real_ms, missing_ms), 2),
        }
        print("\nrow 9:", json.dumps(report))
        assert abs(z) < 5, report


# ---- row 2 ---------------------------------------------------------------------------------

BOB_GROUPS = 4_096
BOB_RATE_PER_S = 256  # bob's request rate (tokens/s): a max-size lookup costs 64 of them
FLOOD_CONCURRENT = 16


def flood(
    settings: ClientSettings,
    groups: list[GroupId],
    seconds: float,
    out: multiprocessing.Queue[tuple[int, int, int]],
) -> None:
    """Bob's flood, in a process of its own: FLOOD_CONCURRENT lookups of all his groups in
    flight, each sent again at once whatever the answer. Puts (admitted, refused: rate_limited
    or busy, other)."""

    async def run() -> tuple[int, int, int]:
        auth = settings.nats_auth()
        nc = await nats.connect(settings.nats_url, **auth.connect_options(), allow_reconnect=False)
        router = await directory_router(nc, "bob")
        counts = [0, 0, 0]
        deadline = time.monotonic() + seconds

        async def one() -> None:
            while time.monotonic() < deadline:
                try:
                    reply = await router.ask(0, "lookup", m.Lookup(holder_id="f", groups=groups), TIMEOUT_S)
                    assert isinstance(reply, m.LookupReply)
                    counts[0] += 1
                    if reply.lease_id:
                        release = m.LeaseRelease(holder_id="f", lease_id=reply.lease_id)
                        await router.ask(0, "lease_release", release, TIMEOUT_S)
                except (RateLimited, Busy):  # his quota's rate, or fair admission's bucket
                    counts[1] += 1
                except KvfError:
                    counts[2] += 1

        try:
            await asyncio.gather(*(one() for _ in range(FLOOD_CONCURRENT)))
        finally:
            await nc.close()
        return counts[0], counts[1], counts[2]

    out.put(asyncio.run(run()))


async def alices_lookups(alice: DirectoryRouter, groups: list[GroupId], n: int) -> list[float]:
    """Alice looks up her prompt `n` times (each hit's lease given back, untimed): ms each."""
    out = []
    for _ in range(n):
        began = time.perf_counter()
        reply = await alice.ask(0, "lookup", m.Lookup(holder_id="a", groups=groups), TIMEOUT_S)
        out.append((time.perf_counter() - began) * 1e3)
        assert isinstance(reply, m.LookupReply) and reply.hit_chunks == len(groups)
        release = m.LeaseRelease(holder_id="a", lease_id=reply.lease_id)
        await alice.ask(0, "lease_release", release, TIMEOUT_S)
    return out


@contextmanager
def bob_rate_limited(tmp_path: Path) -> Iterator[tuple[Secure, ServiceProcess]]:
    """Alice and bob on one authenticated cluster (one directory shard, TLS); bob has a request
    rate of BOB_RATE_PER_S (his digest is known once the credentials are written)."""
    doc = write_auth(tmp_path / "auth", plan_auth(["alice", "bob"]), tls=True)
    with NatsServer(tmp_path / "nats", extra_args=["-c", doc["conf"]]) as server:
        secure = Secure(server, doc)
        bob = bytes(secure.spec("bob").domain.digest()).hex()
        quotas = {bob: {"requests_per_s": BOB_RATE_PER_S, "burst": BOB_RATE_PER_S}}
        with (
            directory_process(
                server,
                **secure.env("svc-directory"),
                KVF_DIRECTORY_SHARDS="1",
                KVF_DIRECTORY_TENANT_QUOTAS=json.dumps(quotas),
                KVF_LOG_LEVEL="info",
            ) as directory,
            segment_process(server, f"sc-{os.getpid()}", 64 << 20, **secure.env("svc-segment")),
        ):
            yield secure, directory


def slow_core_calls(directory: ServiceProcess) -> list[tuple[str, float, float]]:
    """The directory's `core_call_slow` warnings: (what, wall ms, CPU ms)."""
    return [
        (e["what"], e["ms"], e["cpu_ms"]) for e in directory.events() if e.get("event") == "core_call_slow"
    ]


@pytest.mark.parametrize("judge", ["work", pytest.param("latency", marks=pytest.mark.flood)])
def test_max_size_lookups_cost_their_size_and_stall_no_one(tmp_path: Path, judge: str) -> None:
    """Row 2: bob (256 requests/s) floods lookups of his 4,096 groups, 16 in flight, never
    backing off. Each costs 64 tokens, not 1: at most about 4 a second are served (before: as
    many as the directory could, ~10 here); fair admission also runs one of his at a time and
    charges it 4,112 of his 8,192 ids a second (`kvfabric.directory.fair`), so the rest wait
    for their turns or are refused before any work (`rate_limited` or `busy`). A served one is folded
    128 groups a core call (before: one call of ~100-250 ms): no core call takes 50 ms of CPU.
    Alice's lookup p50 stays within 2x of her baseline (judged in the `latency` case only, a
    `flood` one: four busy processes on two shared cores moved it past 2x in one fresh-clone CI
    run, 3.5 vs 2.7 ms); her p99 is printed (docs/security.md: not within 2x on this 2-core
    machine). The `work` case, in `make test`, judges what does not depend on the machine's load:
    how much of bob's work was admitted and the CPU of the longest core call."""
    with bob_rate_limited(tmp_path) as (secure, directory):
        port = directory.wait_for_event("directory_started", 1.0)["metrics_port"]
        save(secure, "alice", 8, seed=4, size=4096)
        alice = group_ids(secure, "alice", 8, seed=4)
        save(secure, "bob", BOB_GROUPS, seed=5)  # 16 put_begins and commits: 128 tokens of his 256
        bob = group_ids(secure, "bob", BOB_GROUPS, seed=5)
        seconds = 15.0
        spawn = multiprocessing.get_context("spawn")
        out: multiprocessing.Queue[tuple[int, int, int]] = spawn.Queue()
        attacker = spawn.Process(target=flood, args=(secure.client_settings("bob"), bob, seconds, out))

        async def measure() -> tuple[list[float], list[float]]:
            nc, router = await tenant_router(secure, "alice")  # connected before the flood
            try:
                baseline = await alices_lookups(router, alice, 300)
                longest_core_call_ms(port)  # from now on
                attacker.start()
                await asyncio.sleep(3.0)  # the flood under way (the child has connected)
                return baseline, await alices_lookups(router, alice, 300)
            finally:
                await nc.close()

        slow_before = len(slow_core_calls(directory))
        try:
            baseline, during = asyncio.run(measure())
            admitted, refused, failed = out.get(timeout=seconds + 30)
        finally:
            if attacker.pid is not None:
                attacker.join(timeout=30)
                if attacker.is_alive():
                    attacker.kill()
        slow = slow_core_calls(directory)[slow_before:]
        p50 = (statistics.median(baseline), statistics.median(during))
        p99 = (quantile(baseline, 0.99), quantile(during, 0.99))
        report = {
            "alice_p50_ms_baseline_flood": [round(x, 3) for x in p50],
            "alice_p99_ms_baseline_flood": [round(x, 3) for x in p99],
            "p50_ratio": round(p50[1] / p50[0], 2),
            "p99_ratio": round(p99[1] / p99[0], 2),
            "bob_lookups_served_per_s": round(admitted / seconds, 1),
            "bob_lookups_refused_per_s": round(refused / seconds, 1),
            "bob_other_errors": failed,
            "longest_core_call_ms_during_flood": round(longest_core_call_ms(port), 2),
            "core_calls_over_50_ms_wall_cpu": slow,
        }
        print("\nrow 2:", json.dumps(report))
        # His rate allows 256 / 64 = 4 max-size lookups a second (+ a burst of 4; the flood's
        # last requests end after its `seconds`).
        assert admitted <= (BOB_RATE_PER_S / 64) * (seconds + 5) + BOB_RATE_PER_S / 64, report
        assert not [call for call in slow if call[2] >= 50], report  # CPU: preemption is not a stall
        if judge == "latency":
            assert p50[1] < 2 * p50[0] + 0.5, report
