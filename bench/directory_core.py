"""Directory core benchmark, in one process (issue: directory service).

Measures, on this machine:
- batched lookups/s: `Lookup` of 64 chunk groups per message against published groups;
- publishes/s: put_begin + replica confirm + put_commit per object, batched 256 objects a message
  (both: the best of 3 runs, each started once the machine is idle);
- p50/p99 latency of single-object publishes and 64-group lookups at half of the measured peak
  rate (open loop: requests are issued on a fixed schedule, latency includes queueing behind the
  schedule);
- directory RAM per object with 1,000,000 published objects (RSS delta and tracemalloc-free:
  read from /proc/self/statm before and after filling);
- the longest synchronous core calls against that core (`core_calls`): listings (a tenant's
  empty domain, a page of the filled domain, an admin page, a filtered repair page), showing a
  group by chain hash and by id, a 4,096-group lookup (a hit in one call, the first 128-group
  slice the service runs it in, a miss), a put_commit and an evict of 4,096 ids, a lease
  listing, a tick: each one stalls a directory's event loop for as long as it runs (issue 21
  item 2).

The process is set up like a directory service: it imports the service's modules (their
objects are what the cyclic GC walks besides the core's state) and applies the service's GC
policy from `kvfabric.runtime.gcpolicy` (the same `install` the service CLI calls, and the
`freeze_long_lived` a shard start calls after its rebuild, here after the fill). The latency
figures are measured against the 1,000,000-object core, after single publishes have filled its
reply cache as in steady state; the GC pauses seen during each latency run are reported.
`--gc interpreter` runs with CPython's default GC instead (the comparison in docs/directory.md).
The benchmark's own copy of the keys is one flat `bytes` (not a list of a million objects the GC
would walk: the service holds no such list).

Run: `.venv/bin/python bench/directory_core.py [--objects 1000000] [--gc service|interpreter]`
(or `make bench`). Writes bench/results/directory_core.json and .md (`--gc service` only).
`--ram-only` fills the core, prints the RAM per object and the core calls, and writes nothing
(a short run: no peaks, no timed rounds).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import itertools
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import overload

import xxhash

from kvfabric.core.directory import DirectoryConfig, DirectoryCore
from kvfabric.core.directory.keys import GROUP_KEY_BYTES
from kvfabric.format.ids import (
    DomainDigest,
    GroupId,
    GroupKey,
    chain_in_id,
    domain_in_id,
    group_key_of_id,
    pack_object_key,
)
from kvfabric.format.key import KVLayout, ModelFingerprint, ShareDomain, chunk_groups_for_prefix
from kvfabric.proto import directory as m
from kvfabric.runtime import gcpolicy

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
GROUP_ID_BYTES = GROUP_KEY_BYTES + 42  # ChunkGroupId.to_bytes(): namespace, chunk index, chain hash
SERVICE_MODULE = "kvfabric.directory.__main__"
FILL_BATCH = 1024  # objects a put_begin while filling
IDLE_THRESHOLD = 0.85  # a timed round starts once the machine was this idle over 0.5 s
CPU_SHARE_MIN = 0.97  # a timed round in which the timing thread got less of its core is rerun


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Groups(Sequence[GroupId]):
    """Chunk group ids of a fixed size, kept as one `bytes` (untracked by the GC)."""

    def __init__(self, ids: list[GroupId]) -> None:
        assert all(len(g) == GROUP_ID_BYTES for g in ids)
        self._blob = b"".join(ids)
        self._n = len(ids)

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> GroupId: ...

    @overload
    def __getitem__(self, i: slice) -> list[GroupId]: ...

    def __getitem__(self, i: int | slice) -> GroupId | list[GroupId]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if not -self._n <= i < self._n:
            raise IndexError(i)
        i %= self._n
        return GroupId(self._blob[i * GROUP_ID_BYTES : (i + 1) * GROUP_ID_BYTES])


def make_groups(n: int, seed: int) -> Groups:
    """n chunk group ids: prefixes of 64 chunks each (chain-hashed like real prompts)."""
    out: list[GroupId] = []
    prefix = 0
    while len(out) < n:
        chunks = min(64, n - len(out))
        tokens = [(seed * 7_919 + prefix * 104_729 + i) % 50_000 for i in range(16 * chunks)]
        tokens[:3] = [seed, prefix % 50_000, prefix // 50_000]  # no two (seed, prefix) share a group
        out.extend(g.group_id() for g in chunk_groups_for_prefix(DOMAIN, MODEL, LAYOUT, tokens))
        prefix += 1
    return Groups(out)


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


def publish(core: DirectoryCore, group_ids: Sequence[GroupId], req: str, now: int = 0) -> None:
    keys = [pack_object_key(g, 0, 0, 0) for g in group_ids]  # member (0, 0, 0)
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


def lookup(core: DirectoryCore, group_ids: Sequence[GroupId], now: int = 0) -> None:
    reply = core.handle(m.Lookup(holder_id="r", groups=list(group_ids), lease_ttl_ms=10_000), now).reply
    assert isinstance(reply, m.LookupReply) and reply.hit_chunks == len(group_ids)
    core.handle(m.LeaseRelease(holder_id="r", lease_id=reply.lease_id), now)


def peak_publishes(n: int, runs: int) -> float:
    """Objects/s, the best of `runs` runs of n objects each, every one once the machine is idle
    (the least disturbed run is the closest to the peak)."""
    core = new_core()
    groups = make_groups(n * runs, seed=1)
    batch = 256
    best = 0.0
    for r in range(runs):
        wait_idle()
        t0 = time.perf_counter()
        end = (r + 1) * n
        for i in range(r * n, end, batch):
            publish(core, groups[i : min(i + batch, end)], f"p{i}")
        best = max(best, n / (time.perf_counter() - t0))
    return best


def window(groups: Groups, start: int, n: int) -> list[GroupId]:
    i = start % (len(groups) - n)
    return groups[i : i + n]


def peak_lookups(core: DirectoryCore, groups: Groups, n_msgs: int, now: int, runs: int) -> float:
    """Groups/s in 64-group lookups, the best of `runs` runs of n_msgs, each once idle."""
    batch = 64
    best = 0.0
    for r in range(runs):
        wait_idle()
        t0 = time.perf_counter()
        for j in range(r * n_msgs, (r + 1) * n_msgs):
            i = (j * batch) % (len(groups) - batch)
            lookup(core, groups[i : i + batch], now)
        best = max(best, n_msgs * batch / (time.perf_counter() - t0))
    return best


def _slowest_ms(call: Callable[[], object], runs: int = 3) -> float:
    """The slowest of `runs` calls, ms (each call is one synchronous stretch of the loop)."""
    worst = 0.0
    for _ in range(runs):
        began = time.perf_counter()
        call()
        worst = max(worst, time.perf_counter() - began)
    return round(worst * 1e3, 3)


def core_calls(core: DirectoryCore, groups: Groups, now: int) -> dict[str, float]:
    """How long one call of each potentially heavy kind runs against the filled core (ms, the
    slowest of 3): what it stalls the directory's event loop for."""
    middle = groups[len(groups) // 2]
    domain = domain_in_id(GroupId(middle))
    group_key = group_key_of_id(GroupId(middle))
    big = groups[: m.LOOKUP_BATCH_GROUPS_MAX]
    missing = make_groups(m.LOOKUP_BATCH_GROUPS_MAX, seed=99)[:]

    def lookup_hit(groups_max: int | None = None) -> None:
        request = m.Lookup(holder_id="r", groups=big, lease_ttl_ms=10_000)
        reply = core.handle(request, now, groups_max=groups_max).reply
        assert isinstance(reply, m.LookupReply) and reply.hit_chunks > 0
        core.handle(m.LeaseRelease(holder_id="r", lease_id=reply.lease_id), now)

    never_begun = [pack_object_key(g, 0, 0, 0) for g in missing]  # keys nobody began: not_found each

    def repair_pass(walk_every_group: bool = False) -> None:
        """What the repair service asks every `KVF_REPAIR_SCAN_MS` (2 s): every page of the
        groups below target. `walk_every_group`: as before the `short` index (every group
        examined a pass), for the comparison."""
        covers = core.published_table.short_covers_below_target
        if walk_every_group:
            core.published_table.short_covers_below_target = lambda: False  # type: ignore[method-assign]
        try:
            after = GroupKey(b"")
            while True:
                page = core.handle(
                    m.ListGroups(limit=1000, below_target=True, with_objects=True, after=after), now
                )
                assert isinstance(page.reply, m.GroupList)
                if not page.reply.next_after:
                    return
                after = page.reply.next_after
        finally:
            core.published_table.short_covers_below_target = covers  # type: ignore[method-assign]

    calls: dict[str, Callable[[], object]] = {
        "list_groups_empty_domain_limit_100": lambda: core.handle(
            m.ListGroups(domain_digest=DomainDigest(b"\x01" * 16), limit=100), now
        ),
        "list_groups_domain_page_1000": lambda: core.handle(
            m.ListGroups(domain_digest=domain, after=group_key, limit=1000), now
        ),
        "list_groups_admin_page_1000_with_objects": lambda: core.handle(
            m.ListGroups(after=group_key, limit=1000, with_objects=True), now
        ),
        "list_groups_below_target_page_1000": lambda: core.handle(
            m.ListGroups(limit=1000, below_target=True, with_objects=True), now
        ),
        "show_group_by_chain_hash": lambda: core.handle(m.ShowGroup(group=chain_in_id(GroupId(middle))), now),
        "show_group_by_id": lambda: core.handle(m.ShowGroup(group=middle), now),
        "lookup_4096_groups_hit_one_call": lookup_hit,
        "lookup_4096_groups_hit_first_slice_of_128": lambda: lookup_hit(128),
        "lookup_4096_groups_miss": lambda: core.handle(
            m.Lookup(holder_id="r", groups=missing, lease_ttl_ms=10_000), now
        ),
        "put_commit_4096_keys_never_begun": lambda: core.handle(
            m.PutCommit(writer_id="w", request_id="never", keys=never_begun), now
        ),
        "evict_4096_missing_groups": lambda: core.handle(m.Evict(groups=missing, reason="bench"), now),
        "list_leases_100": lambda: core.handle(m.ListLeases(limit=100), now),
        "repair_pass_below_target_all_pages": repair_pass,
        "repair_pass_below_target_all_pages_walking_every_group": lambda: repair_pass(walk_every_group=True),
        "tick": lambda: core.tick(now),
    }
    return {name: _slowest_ms(call) for name, call in calls.items()}


class PauseLog:
    """Every collection's (generation, pause seconds), in order (a `gc.callbacks` hook)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._started = 0.0

    def callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._started))

    def summary(self, since: int) -> dict[str, dict[str, float]]:
        """Per generation: collections since index `since`, and the longest pause in ms."""
        out: dict[str, dict[str, float]] = {}
        for gen in range(3):
            times = [p for g, p in self.pauses[since:] if g == gen]
            out[str(gen)] = {"count": len(times), "max_ms": round(max(times, default=0.0) * 1e3, 3)}
        return out


def _cpu_times() -> tuple[int, int]:
    """(idle, total) jiffies of all CPUs, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields[:8])


def wait_idle(threshold: float = IDLE_THRESHOLD, window_s: float = 0.5, max_wait_s: float = 20.0) -> float:
    """Wait until the machine was ≥ `threshold` idle over `window_s` (other jobs share this VM's
    cores), at most `max_wait_s`. Returns the seconds waited beyond the first window."""
    start = time.monotonic()
    while True:
        idle0, total0 = _cpu_times()
        time.sleep(window_s)
        idle1, total1 = _cpu_times()
        if total1 == total0 or (idle1 - idle0) / (total1 - total0) >= threshold:
            break
        if time.monotonic() - start > max_wait_s:
            break
    return max(0.0, time.monotonic() - start - window_s)


@dataclass
class Timed:
    """Open-loop latencies of one operation over rounds, each started once the machine is idle."""

    latencies_s: list[float] = field(default_factory=list)
    round_p99_ms: list[float] = field(default_factory=list)
    # CPU time this thread got / wall time, per round: the loop spins between requests, so it
    # wants all of one core; below CPU_SHARE_MIN another job took the core away meanwhile. The
    # collector runs on this thread, so its pauses do not lower the share.
    round_cpu_share: list[float] = field(default_factory=list)
    rerun: list[tuple[float, float]] = field(default_factory=list)  # (p99 ms, share) of rounds rerun
    waited_s: float = 0.0

    def p(self, q: float) -> float:
        lat = sorted(self.latencies_s)
        return lat[int(q * (len(lat) - 1))] * 1e3

    def rounds(self) -> str:
        kept = zip(self.round_p99_ms, self.round_cpu_share, strict=True)
        return ", ".join(f"{p:.2f} ({c:.2f})" for p, c in kept)

    def reruns(self) -> str:
        return ", ".join(f"{p:.2f} ({c:.2f})" for p, c in self.rerun) or "none"

    def summary(self) -> dict[str, object]:
        return {
            "round_p99_ms": [round(x, 3) for x in self.round_p99_ms],
            "round_cpu_share": [round(x, 3) for x in self.round_cpu_share],
            "rounds_rerun_p99_ms_and_cpu_share": [(round(p, 3), round(c, 3)) for p, c in self.rerun],
            "waited_for_idle_s": round(self.waited_s, 1),
        }


def open_loop(rate_per_s: float, n: int, op: Callable[[int], None], rounds: int, attempts: int) -> Timed:
    """Issue op(0), op(1), ... on a fixed schedule at rate_per_s, n of them in `rounds` rounds;
    latency = completion - scheduled start. A round during which another job took the core (CPU share below
    CPU_SHARE_MIN) is run again, up to `attempts` times (the last one is kept); reported."""
    timed = Timed()
    interval = 1.0 / rate_per_s
    per_round = -(-n // rounds)
    seq = itertools.count()  # op(i) never gets the same i twice (a rerun publishes new keys)
    for first in range(0, n, per_round):
        for attempt in range(1, attempts + 1):
            timed.waited_s += wait_idle()
            lat = []
            start = time.perf_counter()
            cpu0 = time.thread_time()
            for k in range(min(per_round, n - first)):
                scheduled = start + k * interval
                while time.perf_counter() < scheduled:
                    pass
                op(next(seq))
                lat.append(time.perf_counter() - scheduled)
            share = (time.thread_time() - cpu0) / (time.perf_counter() - start)
            lat.sort()
            p99 = lat[int(0.99 * (len(lat) - 1))] * 1e3
            if share >= CPU_SHARE_MIN or attempt == attempts:
                break
            timed.rerun.append((p99, share))
        timed.round_cpu_share.append(share)
        timed.round_p99_ms.append(p99)
        timed.latencies_s.extend(lat)
    return timed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--objects", type=int, default=1_000_000)
    parser.add_argument(
        "--gc",
        choices=("service", "interpreter"),
        default="service",
        help="service: kvfabric.runtime.gcpolicy as the service applies it (results written); "
        "interpreter: CPython's defaults (printed only, for comparison)",
    )
    parser.add_argument("--publishes", type=int, default=5_000, help="single publishes timed")
    parser.add_argument("--lookups", type=int, default=2_000, help="64-group lookups timed")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds, each once the machine is idle")
    parser.add_argument("--attempts", type=int, default=6, help="runs of a round disturbed by other jobs")
    parser.add_argument(
        "--ram-only",
        action="store_true",
        help="fill, print the RAM per object and the core calls (ms), write nothing",
    )
    args = parser.parse_args()

    importlib.import_module(SERVICE_MODULE)  # the service's modules: part of what its GC walks
    if args.gc == "service":
        gcpolicy.install()  # what service_cli does before the service starts
    log = PauseLog()
    gc.callbacks.append(log.callback)

    publishes_per_s = 0.0 if args.ram_only else peak_publishes(20_000, runs=3)

    gc.collect()
    groups = make_groups(args.objects, seed=2)
    single = make_groups(args.publishes * args.attempts, seed=3)  # reruns publish new keys
    gc.collect()
    core = new_core()
    rss0 = rss_bytes()
    now = 0
    # 1,024 a put_begin: a reply for 4,096 could exceed the max payload (the core refuses it).
    for i in range(0, len(groups), FILL_BATCH):
        now = i // 4096 * 100  # simulated time: write deadlines pass and ticks clear them, as in service
        publish(core, groups[i : i + FILL_BATCH], f"f{i}", now)
        core.tick(now)
    gc.collect()
    ram_per_object = (rss_bytes() - rss0) / args.objects
    tracked_after_fill = len(gc.get_objects())
    # What a shard start does once its rebuild is done (a no-op under --gc interpreter).
    freeze_s = gcpolicy.freeze_long_lived("bench_filled")
    calls_ms = core_calls(core, groups, now)
    if args.ram_only:
        print(
            json.dumps(
                {
                    "objects": args.objects,
                    "gc": args.gc,
                    "ram_bytes_per_object": round(ram_per_object, 1),
                    "core_calls_ms": calls_ms,
                },
                indent=2,
            )
        )
        return
    # Traffic after the start: single-object publishes until the reply cache holds what it holds
    # in steady state (reply_cache_objects_max objects), not the fill's few big replies.
    warm = make_groups(core.config.reply_cache_objects_max, seed=4)
    for i in range(len(warm)):
        publish(core, [warm[i]], f"w{i}", now)
    gc.collect()
    tracked_walked = len(gc.get_objects())  # the permanent generation is not listed (nor walked)

    lookup_groups_per_s = peak_lookups(core, groups, 1000, now, runs=3)
    lookup_msgs_per_s = lookup_groups_per_s / 64

    # Latency at half of peak, against the 1,000,000-object core: single-object publishes of
    # new groups, 64-group lookups of published ones.
    mark = len(log.pauses)
    pub = open_loop(
        publishes_per_s / 2,
        args.publishes,
        lambda i: publish(core, [single[i]], f"s{i}", now),
        args.rounds,
        args.attempts,
    )
    publish_pauses = log.summary(mark)
    mark = len(log.pauses)
    look = open_loop(
        lookup_msgs_per_s / 2,
        args.lookups,
        lambda i: lookup(core, window(groups, i * 64, 64), now),
        args.rounds,
        args.attempts,
    )
    lookup_pauses = log.summary(mark)
    pub_p50, pub_p99 = pub.p(0.5), pub.p(0.99)
    # What a full collection costs now (steady state): the pause that comes whenever enough
    # objects have survived into the oldest generation, in or out of a timed window.
    full_ms = []
    for _ in range(5):
        began = time.perf_counter()
        gc.collect()
        full_ms.append((time.perf_counter() - began) * 1e3)
    full_collection_ms = sorted(full_ms)[2]
    look_p50, look_p99 = look.p(0.5), look.p(0.99)

    result = {
        "bench": "directory_core",
        "machine": f"{platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "objects": args.objects,
        "gc": args.gc,
        "gc_thresholds": list(gc.get_threshold()),
        "gc_freeze_after_fill_ms": None if freeze_s is None else round(freeze_s * 1e3, 1),
        "gc_tracked_objects_after_fill": tracked_after_fill,
        "gc_tracked_objects_walked_in_steady_state": tracked_walked,
        "gc_full_collection_ms_in_steady_state": round(full_collection_ms, 2),
        "lookup_groups_per_s": round(lookup_groups_per_s),
        "publishes_per_s_batched": round(publishes_per_s),
        "publish_single_p50_ms_at_half_peak": round(pub_p50, 3),
        "publish_single_p99_ms_at_half_peak": round(pub_p99, 3),
        "lookup64_p50_ms_at_half_peak": round(look_p50, 3),
        "lookup64_p99_ms_at_half_peak": round(look_p99, 3),
        "gc_pauses_during_publishes": publish_pauses,
        "gc_pauses_during_lookups": lookup_pauses,
        "publish_rounds": pub.summary(),
        "lookup_rounds": look.summary(),
        "ram_bytes_per_object": round(ram_per_object, 1),
        "core_calls_ms": calls_ms,
        "longest_core_call_ms": max(calls_ms.values()),
        "targets": {
            "lookup_groups_per_s": 50_000,
            "publishes_per_s": 10_000,
            "p99_ms": 5,
            "ram_bytes_per_object": 300,
        },
    }

    def pauses(summary: dict[str, dict[str, float]]) -> str:
        return ", ".join(f"gen{g} {v['count']:.0f} (max {v['max_ms']:.1f} ms)" for g, v in summary.items())

    md = [
        f"| directory core (one process, GC: {args.gc}) | measured | target |",
        "|---|---:|---:|",
        f"| batched lookups (64 groups/msg), groups/s | {result['lookup_groups_per_s']:,} | ≥ 50,000 |",
        f"| publishes (begin+confirm+commit, 256/msg), objects/s | {publishes_per_s:,.0f} | ≥ 10,000 |",
        f"| single publish p50 / p99 at half peak, ms | {pub_p50:.3f} / {pub_p99:.3f} | p99 < 5 |",
        f"| 64-group lookup p50 / p99 at half peak, ms | {look_p50:.3f} / {look_p99:.3f} | p99 < 5 |",
        f"| RAM per published object at {args.objects:,} objects, bytes | {ram_per_object:.0f} | ≤ 300 |",
        "",
        "Longest synchronous core calls at this size (ms, the slowest of 3; each stalls the event "
        "loop for that long): " + ", ".join(f"{k} {v:.2f}" for k, v in calls_ms.items()) + ".",
        "",
        f"GC thresholds {tuple(gc.get_threshold())}; objects tracked after the fill: {tracked_after_fill:,}"
        + (f", frozen in {freeze_s * 1e3:.0f} ms" if freeze_s is not None else " (not frozen)")
        + f"; walked by a full collection after {core.config.reply_cache_objects_max:,} single "
        f"publishes more: {tracked_walked:,}, in {full_collection_ms:.1f} ms (median of 5)"
        + f". Collections while timing publishes: {pauses(publish_pauses)}; "
        f"lookups: {pauses(lookup_pauses)}.",
        "",
        f"Timed in {args.rounds} rounds each, every round once the machine was ≥ {IDLE_THRESHOLD:.0%} "
        f"idle over 0.5 s (waited {pub.waited_s:.0f} s and {look.waited_s:.0f} s); a round in which "
        f"the timing thread got < {CPU_SHARE_MIN} of its core (another job took it; GC pauses run "
        "on that thread and do not lower it) is run again, up to "
        f"{args.attempts} times. p99 ms (CPU share) per round kept: publishes {pub.rounds()}; "
        f"lookups {look.rounds()}. Rounds run again: publishes {pub.reruns()}; lookups {look.reruns()}.",
    ]
    print("\n".join(md))
    if args.gc != "service":
        print(json.dumps(result, indent=2))
        return
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "directory_core.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "directory_core.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
