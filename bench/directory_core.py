"""Directory core benchmark, in one process (issue: directory service).

Measures, on this machine:
- batched lookups/s: `Lookup` of 64 chunk groups per message against published groups;
- publishes/s: put_begin + replica confirm + put_commit per object, batched 256 objects a message;
- p50/p99 latency of single-object publishes and 64-group lookups at half of the measured peak
  rate (open loop: requests are issued on a fixed schedule, latency includes queueing behind the
  schedule);
- directory RAM per object with 1,000,000 published objects (RSS delta and tracemalloc-free:
  read from /proc/self/statm before and after filling).

Run: `.venv/bin/python bench/directory_core.py [--objects 1000000]` (or `make bench`).
Writes bench/results/directory_core.json and .md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from pathlib import Path

import xxhash

from kvfabric.core.directory import DirectoryConfig, DirectoryCore
from kvfabric.format.key import KVLayout, ModelFingerprint, ShareDomain, chunk_groups_for_prefix
from kvfabric.proto import directory as m

RESULTS = Path(__file__).resolve().parent / "results"
DOMAIN = ShareDomain(tenant_id="bench", salt=b"bench-salt-0123456789")
MODEL = ModelFingerprint(
    model_id="llama-bench", weights_revision="r1", kv_dtype="bfloat16", attn_config_digest="rope"
)
LAYOUT = KVLayout(
    tp_size=1,
    tp_rank=0,
    pp_stage=0,
    layer_group=0,
    layer_group_count=1,
    tokens_per_chunk=16,
    tensor_layout="bench",
)
SEGMENTS = 16
OBJECT_BYTES = 2 << 20


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_groups(n: int, seed: int) -> list[bytes]:
    """n chunk group ids: prefixes of 64 chunks each (chain-hashed like real prompts)."""
    out: list[bytes] = []
    prefix = 0
    while len(out) < n:
        chunks = min(64, n - len(out))
        tokens = [(seed * 7_919 + prefix * 104_729 + i) % 50_000 for i in range(16 * chunks)]
        out.extend(g.to_bytes() for g in chunk_groups_for_prefix(DOMAIN, MODEL, LAYOUT, tokens))
        prefix += 1
    return out


def new_core() -> DirectoryCore:
    core = DirectoryCore(
        DirectoryConfig(
            ticket_secret=b"bench-secret-0123456789",
            pending_objects_max=1 << 20,
            leases_max=1 << 20,
            heartbeat_timeout_ms=1 << 40,
        )
    )
    for i in range(SEGMENTS):
        core.handle(
            m.RegisterSegment(
                segment_id=f"seg{i}",
                incarnation=1,
                capacity_bytes=1 << 62,
                domain=m.FailureDomain(host=f"h{i}", rack=f"r{i % 4}"),
            ),
            0,
        )
    return core


def publish(core: DirectoryCore, group_ids: list[bytes], req: str, now: int = 0) -> None:
    keys = [g + b"\x00" * 6 for g in group_ids]  # member (0, 0, 0): KVKey bytes = group id + 3 × u16
    specs = [m.ObjectSpec(key=k, size_bytes=OBJECT_BYTES, checksum=xxhash.xxh3_128_digest(k)) for k in keys]
    begin = core.handle(
        m.PutBegin(writer_id="w", request_id=req, objects=specs, write_ttl_ms=1000), now
    ).reply
    assert isinstance(begin, m.PutBeginReply)
    by_segment: dict[tuple[str, int], list[m.ReplicaConfirm]] = {}
    for i, res in enumerate(begin.results):
        assert res.status == "placed", res.status
        for t in res.tickets:
            by_segment.setdefault((t.segment_id, t.incarnation), []).append(
                m.ReplicaConfirm(
                    ticket_id=t.ticket_id,
                    key=t.key,
                    slot=i,
                    slot_generation=1,
                    size_bytes=t.size_bytes,
                    checksum=t.checksum,
                )
            )
    for (sid, inc), confirms in by_segment.items():
        core.handle(m.ConfirmReplicas(segment_id=sid, incarnation=inc, confirms=confirms), now)
    commit = core.handle(m.PutCommit(writer_id="w", request_id=req + "c", keys=keys), now).reply
    assert isinstance(commit, m.PutCommitReply)
    assert all(r.status == "published" for r in commit.results)


def lookup(core: DirectoryCore, group_ids: list[bytes], now: int = 0) -> None:
    reply = core.handle(m.Lookup(holder_id="r", groups=group_ids, lease_ttl_ms=10_000), now).reply
    assert isinstance(reply, m.LookupReply) and reply.hit_chunks == len(group_ids)
    core.handle(m.LeaseRelease(holder_id="r", lease_id=reply.lease_id), now)


def peak_publishes(n: int) -> float:
    core = new_core()
    groups = make_groups(n, seed=1)
    batch = 256
    t0 = time.perf_counter()
    for i in range(0, n, batch):
        publish(core, groups[i : i + batch], f"p{i}")
    return n / (time.perf_counter() - t0)


def window(groups: list[bytes], start: int, n: int) -> list[bytes]:
    i = start % (len(groups) - n)
    return groups[i : i + n]


def peak_lookups(core: DirectoryCore, groups: list[bytes], n_msgs: int) -> float:
    batch = 64
    t0 = time.perf_counter()
    for j in range(n_msgs):
        i = (j * batch) % (len(groups) - batch)
        lookup(core, groups[i : i + batch])
    return n_msgs * batch / (time.perf_counter() - t0)


def open_loop(rate_per_s: float, n: int, op) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Issue op(i) on a fixed schedule at rate_per_s; latency = completion - scheduled start."""
    lat = []
    interval = 1.0 / rate_per_s
    start = time.perf_counter()
    for i in range(n):
        scheduled = start + i * interval
        while time.perf_counter() < scheduled:
            pass
        op(i)
        lat.append(time.perf_counter() - scheduled)
    lat.sort()
    return statistics.median(lat) * 1e3, lat[int(0.99 * (len(lat) - 1))] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--objects", type=int, default=1_000_000)
    args = parser.parse_args()

    publishes_per_s = peak_publishes(50_000)

    gc.collect()
    groups = make_groups(args.objects, seed=2)
    gc.collect()
    core = new_core()
    rss0 = rss_bytes()
    for step, i in enumerate(range(0, len(groups), 4096)):
        now = step * 100  # simulated time: write deadlines pass and ticks clear them, as in service
        publish(core, groups[i : i + 4096], f"f{i}", now)
        core.tick(now)
    gc.collect()
    ram_per_object = (rss_bytes() - rss0) / args.objects

    lookup_groups_per_s = peak_lookups(core, groups, 3000)
    lookup_msgs_per_s = lookup_groups_per_s / 64

    # Latency at half of peak: single-object publishes, 64-group lookups.
    lat_core = new_core()
    single = make_groups(20_000, seed=3)
    pub_p50, pub_p99 = open_loop(
        publishes_per_s / 2, 5_000, lambda i: publish(lat_core, [single[i]], f"s{i}")
    )
    look_p50, look_p99 = open_loop(
        lookup_msgs_per_s / 2, 2_000, lambda i: lookup(core, window(groups, i * 64, 64))
    )

    result = {
        "bench": "directory_core",
        "machine": f"{platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "objects": args.objects,
        "lookup_groups_per_s": round(lookup_groups_per_s),
        "publishes_per_s_batched": round(publishes_per_s),
        "publish_single_p50_ms_at_half_peak": round(pub_p50, 3),
        "publish_single_p99_ms_at_half_peak": round(pub_p99, 3),
        "lookup64_p50_ms_at_half_peak": round(look_p50, 3),
        "lookup64_p99_ms_at_half_peak": round(look_p99, 3),
        "ram_bytes_per_object": round(ram_per_object, 1),
        "targets": {
            "lookup_groups_per_s": 50_000,
            "publishes_per_s": 10_000,
            "p99_ms": 5,
            "ram_bytes_per_object": 300,
        },
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "directory_core.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [
        "| directory core (one process) | measured | target |",
        "|---|---:|---:|",
        f"| batched lookups (64 groups/msg), groups/s | {result['lookup_groups_per_s']:,} | ≥ 50,000 |",
        f"| publishes (begin+confirm+commit, 256/msg), objects/s | {publishes_per_s:,.0f} | ≥ 10,000 |",
        f"| single publish p50 / p99 at half peak, ms | {pub_p50:.3f} / {pub_p99:.3f} | p99 < 5 |",
        f"| 64-group lookup p50 / p99 at half peak, ms | {look_p50:.3f} / {look_p99:.3f} | p99 < 5 |",
        f"| RAM per published object at {args.objects:,} objects, bytes | {ram_per_object:.0f} | ≤ 300 |",
    ]
    (RESULTS / "directory_core.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
