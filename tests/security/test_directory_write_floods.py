"""A victim tenant's lookups while another floods the directory with max-size write-path requests
(issue 21 item 2: "put_commit, evict and put_begin with 4,096 ids are not chunked").

On a real authenticated cluster (one directory shard, TLS; the directory pinned to CPU 0 and
bob's flood process to CPU 1, as `test_directory_fair_admission`), alice looks up her 8-group
prompt `ALICE_LOOKUPS` times alone, then as many times while bob, from `FLOOD_LOOPS` loops that
never back off, cycles through a put_begin of `BEGIN_OBJECTS` objects (never written) and its
put_abort, a put_commit of 4,096 keys he never began and an evict of 4,096 groups he does not
hold, over `KEY_SETS` key sets (past the directory's 4,096-key cache), under the directory's
default fair admission (8,192 ids/s a tenant: about two of his big requests a second;
`KVF_TEST_FLOOD_IDS_PER_S` raises it). Reported: alice's p50/p99/max alone and during the flood
and their ratios, her lookups over 10 ms, what bob got served (and his errors by verb and
code), the directory's longest core call (the stall metric), its core calls over 50 ms (wall,
CPU) and its warnings. `measure(tmp_path, slice_ids)` runs it once with
`KVF_DIRECTORY_WRITE_SLICE_IDS` at `slice_ids` (0: every request whole, the code before);
`python -m tests.security.test_directory_write_floods [rounds] [slices]` compares 0 and the
default (64), or the comma-separated `slices`, interleaved, one line a run (docs/security.md
quotes it). The test (marked `flood`: `make test-floods`) asserts what does not depend on the
machine's load: bob was served, alice never refused, the directory warned of nothing, and no
core call of the flood took a whole request's CPU.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import nats
import pytest

from kvfabric.client import ClientSettings
from kvfabric.directory.shell import WRITE_SLICE_IDS
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import Busy, KvfError
from kvfabric.format.ids import GroupId, ObjectKey, group_id_in_key
from kvfabric.proto import directory as m
from kvfabric.testing.probes import metric_value, scrape_metrics
from tests.integration.cluster import directory_router
from tests.security.test_directory_budgets import bob_keys, two_tenants
from tests.security.test_directory_fair_admission import alices_lookups, pin
from tests.security.test_directory_side_channels import (
    group_ids,
    quantile,
    save,
    slow_core_calls,
    tenant_router,
)

pytestmark = [pytest.mark.integration, pytest.mark.flood]

TIMEOUT_S = 10.0
FLOOD_LOOPS = 4
FLOOD_S = 15.0
ALICE_LOOKUPS = 1_000
ALICE_CHUNKS = 8
KEY_SETS = 6  # distinct 4,096-key sets bob cycles through (the directory remembers 4,096 keys)
BEGIN_OBJECTS = 1_500  # under what a put_begin's reply fits at one replica here
WHOLE_REQUEST_CPU_MS = 40.0
QUIET = ("core_call_slow", "request_handled")  # slow calls and slow requests: reported apart
FLOOD_ENV = (
    {"KVF_DIRECTORY_FAIR_TENANT_IDS_PER_S": os.environ["KVF_TEST_FLOOD_IDS_PER_S"]}
    if os.environ.get("KVF_TEST_FLOOD_IDS_PER_S")
    else {}
)


def flood(
    settings: ClientSettings,
    key_sets: list[list[ObjectKey]],
    seconds: float,
    out: multiprocessing.Queue[dict[str, int]],
) -> None:
    """Bob's flood, in a process of its own (module docstring)."""

    async def run() -> dict[str, int]:
        nc = await nats.connect(
            settings.nats_url, **settings.nats_auth().connect_options(), allow_reconnect=False
        )
        router = await directory_router(nc, "bob")
        counts = {"sent": 0, "served": 0, "busy": 0, "other": 0}
        deadline = time.monotonic() + seconds

        async def ask(verb: str, request: Any) -> None:
            counts["sent"] += 1
            try:
                await router.ask(0, verb, request, TIMEOUT_S)
                counts["served"] += 1
            except Busy:
                counts["busy"] += 1
            except KvfError as err:
                counts["other"] += 1
                counts[f"{verb}:{err.code}"] = counts.get(f"{verb}:{err.code}", 0) + 1

        async def one(loop: int) -> None:
            turn = loop
            while time.monotonic() < deadline:
                keys = key_sets[turn % len(key_sets)]
                turn += 1
                objects = [
                    m.ObjectSpec(key=k, size_bytes=1, checksum=checksum(k)) for k in keys[:BEGIN_OBJECTS]
                ]
                rid = f"f{loop}-{turn}"
                await ask("put_begin", m.PutBegin(writer_id=f"w{loop}", request_id=rid, objects=objects))
                await ask(
                    "put_abort", m.PutAbort(writer_id=f"w{loop}", request_id=rid, keys=keys[:BEGIN_OBJECTS])
                )
                other = key_sets[(turn + 2) % len(key_sets)]
                await ask("put_commit", m.PutCommit(writer_id=f"w{loop}", request_id=rid + "c", keys=other))
                missing = [group_id_in_key(k) for k in key_sets[(turn + 4) % len(key_sets)]]
                await ask("evict", m.Evict(groups=missing, reason="flood"))

        try:
            await asyncio.gather(*(one(i) for i in range(FLOOD_LOOPS)))
        finally:
            await nc.close()
        return counts

    pin(0, 1)
    out.put(asyncio.run(run()))


def measure(tmp_path: Path, slice_ids: int) -> dict[str, Any]:
    """One run (module docstring)."""
    env = {"KVF_LOG_LEVEL": "info", "KVF_DIRECTORY_WRITE_SLICE_IDS": str(slice_ids), **FLOOD_ENV}
    with two_tenants(tmp_path, arena_bytes=64 << 20, env=env) as (secure, directory):
        port = directory.wait_for_event("directory_started", 1.0)["metrics_port"]
        pin(directory.pid, 0)
        save(secure, "alice", ALICE_CHUNKS, seed=4, size=4096)
        alice: list[GroupId] = group_ids(secure, "alice", ALICE_CHUNKS, seed=4)
        key_sets = [bob_keys(secure, m.PUT_BATCH_OBJECTS_MAX, seed=100 + i) for i in range(KEY_SETS)]
        spawn = multiprocessing.get_context("spawn")
        out: multiprocessing.Queue[dict[str, int]] = spawn.Queue()
        attacker = spawn.Process(target=flood, args=(secure.client_settings("bob"), key_sets, FLOOD_S, out))
        longest_ms: list[float] = []

        async def run() -> tuple[list[float], int, list[float], int]:
            nc, router = await tenant_router(secure, "alice")
            try:
                baseline, base_misses = await alices_lookups(router, alice, ALICE_LOOKUPS)
                attacker.start()
                await asyncio.sleep(3.0)  # the flood under way (the child has connected)
                scrape_metrics(port)  # the longest core call since here
                during, misses = await alices_lookups(router, alice, ALICE_LOOKUPS)
                text = await asyncio.to_thread(scrape_metrics, port)
                longest_ms.append(
                    (metric_value(text, "kvfabric_directory_core_call_longest_seconds") or 0) * 1e3
                )
                return baseline, base_misses, during, misses
            finally:
                await nc.close()

        try:
            slow_before = len(slow_core_calls(directory))
            baseline, base_misses, during, misses = asyncio.run(run())
            slow = slow_core_calls(directory)[slow_before:]
            # what the directory warned of (a lost lease above all), slow calls and requests aside
            warned: dict[str, int] = {}
            for event in directory.events():
                if event.get("level") in ("warning", "error", "critical") and event.get("event") not in QUIET:
                    warned[str(event.get("event"))] = warned.get(str(event.get("event")), 0) + 1
            bob = out.get(timeout=FLOOD_S + 30)
        finally:
            if attacker.pid is not None:
                attacker.join(timeout=30)
                if attacker.is_alive():
                    attacker.kill()
    p50 = (statistics.median(baseline), statistics.median(during))
    p99 = (quantile(baseline, 0.99), quantile(during, 0.99))
    return {
        "write_slice_ids": slice_ids,
        "bob_ids_per_s": FLOOD_ENV.get("KVF_DIRECTORY_FAIR_TENANT_IDS_PER_S", "default"),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "load_average_1m": round(os.getloadavg()[0], 1),
        "alice_p50_ms_alone_flood": [round(x, 3) for x in p50],
        "alice_p99_ms_alone_flood": [round(x, 3) for x in p99],
        "alice_max_ms_alone_flood": [round(max(baseline), 1), round(max(during), 1)],
        "alice_over_10_ms_alone_flood": [sum(x > 10 for x in baseline), sum(x > 10 for x in during)],
        "p50_ratio": round(p50[1] / p50[0], 2),
        "p99_ratio": round(p99[1] / p99[0], 2),
        "alice_misses_alone_flood": [base_misses, misses],
        "bob_per_s": {k: round(v / FLOOD_S, 1) for k, v in bob.items()},
        "longest_core_call_ms_during": round(longest_ms[0], 1),
        "core_calls_over_50_ms_wall_cpu": slow,
        "directory_warnings": warned,
    }


def test_bobs_max_size_writes_run_in_slices_while_alice_looks_up(tmp_path: Path) -> None:
    """With the default slices: bob's big requests were served, alice was never refused, the
    directory warned of nothing (its lease kept), and none of its core calls over 50 ms (logged
    with their CPU time) took `WHOLE_REQUEST_CPU_MS` of CPU: whole, every run of this flood had
    core calls of 46-63 ms of CPU (docs/security.md); a step takes 1-5 ms, 21 ms at most seen
    at load average 15, so one that long is a whole request (a call preempted for 50 ms but short
    of CPU is the machine's load).
    Alice's latency is reported, not asserted (it depends on the machine's load)."""
    result = measure(tmp_path, WRITE_SLICE_IDS)
    print(json.dumps(result))
    assert result["bob_per_s"]["served"] > 0
    assert result["alice_misses_alone_flood"] == [0, 0]
    assert not result["directory_warnings"], result
    assert not [c for c in result["core_calls_over_50_ms_wall_cpu"] if (c[2] or 0) >= WHOLE_REQUEST_CPU_MS], (
        result
    )


def compare(rounds: int, slices: tuple[int, ...] = (0, WRITE_SLICE_IDS)) -> None:
    """`measure` at each of `slices` (0: the request whole; the default: in steps), interleaved
    (the order reversed every other round)."""
    import tempfile

    for r in range(rounds):
        for slice_ids in slices if r % 2 == 0 else tuple(reversed(slices)):
            with tempfile.TemporaryDirectory(prefix="kvf-write-floods-") as tmp:
                print(json.dumps(measure(Path(tmp), slice_ids)), flush=True)


if __name__ == "__main__":
    compare(
        int(sys.argv[1]) if len(sys.argv) > 1 else 2,
        tuple(int(x) for x in sys.argv[2].split(",")) if len(sys.argv) > 2 else (0, WRITE_SLICE_IDS),
    )
