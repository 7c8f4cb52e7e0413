"""The directory's tarpit on a real authenticated cluster (TLS, tenant credentials; issue 21 row 2,
docs/security.md "The tarpit"): bob, refused by his fair-admission budget again and again from
32 loops that never back off, is tarpitted within a second — his lookups then go unanswered
(the directory never receives most of them) while alice's are answered and his give-backs still
are — and the tarpit shows in the directory's metrics. The `make test-floods` case measures
alice's latency under the max-size flood with and without it
(`python -m tests.security.test_directory_fair_admission N tarpit`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest

from kvfabric.format.errors import KvfError, NotFound
from kvfabric.proto import directory as m
from kvfabric.testing.probes import metric_value, scrape_metrics
from tests.security.test_directory_budgets import two_tenants
from tests.security.test_directory_side_channels import group_ids, save, tenant_router

pytestmark = pytest.mark.integration

# bob's budget: nothing past the smallest burst allowed, so each of his lookups is refused (held, then busy)
STARVED = {"KVF_DIRECTORY_FAIR_TENANT_IDS_PER_S": "1", "KVF_DIRECTORY_FAIR_TENANT_BURST_IDS": "4112"}
LOOPS = 32


def tarpitted(port: int) -> bool:
    """The directory tarpitted a tenant and has its link up."""
    metrics = scrape_metrics(port)
    held = metric_value(metrics, "kvfabric_directory_tenants_tarpitted") or 0
    return held >= 1 and (metric_value(metrics, "kvfabric_directory_tarpit_links_total") or 0) >= 1


def test_a_tenant_refused_again_and_again_is_tarpitted_and_the_others_are_not(tmp_path: Path) -> None:
    with two_tenants(tmp_path, env=STARVED) as (secure, directory):
        port = directory.wait_for_event("directory_started", 1.0)["metrics_port"]
        save(secure, "alice", 4, seed=1, size=4096)
        alice_groups = group_ids(secure, "alice", 4, seed=1)
        bob_groups = group_ids(secure, "bob", 4, seed=2)

        async def run() -> tuple[list[str], list[str], list[str]]:
            nc_bob, bob = await tenant_router(secure, "bob")
            nc_alice, alice = await tenant_router(secure, "alice")
            try:

                async def flood() -> None:
                    while True:
                        with contextlib.suppress(KvfError):
                            await bob.ask(0, "lookup", m.Lookup(holder_id="f", groups=bob_groups), 0.5)

                loops = [asyncio.create_task(flood()) for _ in range(LOOPS)]
                try:  # until the directory says he is tarpitted (within a second or two)
                    deadline = time.monotonic() + 15.0
                    while not await asyncio.to_thread(tarpitted, port):
                        assert time.monotonic() < deadline, "bob was never tarpitted"
                        await asyncio.sleep(0.05)
                finally:
                    for loop in loops:
                        loop.cancel()
                    await asyncio.gather(*loops, return_exceptions=True)

                async def bob_asks() -> str:
                    try:
                        await bob.ask(0, "lookup", m.Lookup(holder_id="f", groups=bob_groups), 1.0)
                    except KvfError as err:
                        return err.code
                    return "ok"

                bobs = await asyncio.gather(*(bob_asks() for _ in range(16)))
                alices = []
                for _ in range(10):
                    reply = await alice.ask(0, "lookup", m.Lookup(holder_id="a", groups=alice_groups), 5.0)
                    assert isinstance(reply, m.LookupReply)
                    alices.append("hit" if reply.lease_id else "miss")
                    release = m.LeaseRelease(holder_id="a", lease_id=reply.lease_id)
                    await alice.ask(0, "lease_release", release, 5.0)
                gives = []
                for _ in range(5):  # a give-back of his is still answered (an unknown lease: not_found)
                    try:
                        unknown = m.LeaseRelease(holder_id="f", lease_id=987654321)
                        await bob.ask(0, "lease_release", unknown, 2.0)
                        gives.append("ok")
                    except NotFound:
                        gives.append("not_found")
                return list(bobs), alices, gives
            finally:
                await nc_bob.close()
                await nc_alice.close()

        bobs, alices, gives = asyncio.run(run())
        metrics = scrape_metrics(port)
        assert (metric_value(metrics, "kvfabric_directory_tenant_tarpits_total") or 0) >= 1, metrics
        assert (metric_value(metrics, "kvfabric_directory_tarpit_links_total") or 0) >= 1
        assert (metric_value(metrics, "kvfabric_directory_tarpit_link_failures_total") or 0) == 0
        # asked at once, within his first tarpit (2 s): 63 in 64 of his lookups never reach the
        # directory, they time out
        assert bobs.count("indeterminate") >= 10, bobs  # no reply in time
        assert alices == ["hit"] * 10
        assert gives == ["not_found"] * 5
