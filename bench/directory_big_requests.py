"""How long one max-size write-path request holds a directory's event loop (issue 21 item 2).

A `DirectoryShell` (no NATS: its events kept in its outbox, its frees dropped) around a core of
`--groups` published groups on 16 segments, one replica. Each case runs one request through the
shell's `handle` while a victim coroutine on the same event loop looks up 4 published groups
every 2 ms until it is answered (open loop: a lookup's latency counts from when it was due, so
one due while the loop is held waits for it: what another tenant's lookup waits on that loop):

- `put_begin_placed`: a put_begin of as many objects as its reply fits (1,927 at one replica);
- `put_abort_begun`: the put_abort of those objects (a give-back: every reservation released);
- `put_begin_4096_refused`: a put_begin of 4,096 objects (refused `batch_too_large`);
- `put_commit_4096_receipts`: a put_commit of 4,096 begun keys with a receipt each (every group
  published: the heaviest commit);
- `put_commit_4096_never_begun`: a put_commit of 4,096 keys nobody began;
- `evict_4096_published`: an evict of the 4,096 groups just published (every replica freed);
- `evict_4096_missing`: an evict of 4,096 groups that do not exist.

Each case runs with the shell's `write_slice_ids` at 0 (the request whole, one core call) and at
`--slice` (the service default, 64), alternating which goes first, `--runs` times each, in one
process: reported per case and mode, the median over the runs of: the request's handler time
and the process's CPU time meanwhile, its longest core call in CPU and in wall time (what the
loop was held for at once: `kvfabric.directory.stalls`; wall time adds preemption on a loaded
machine), the victim's longest, p99 and p50 lookup while the request ran, and the longest GC
pause in the case (ms). The process runs the service's GC policy (`kvfabric.runtime.gcpolicy`,
the filled core frozen as after a shard's rebuild).

Run: `.venv/bin/python -m bench.directory_big_requests [--groups 20000] [--runs 3] [--slice 64]
[--out bench/results/directory_big_requests.json]` (prints one JSON object).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import xxhash

from bench.directory_core import OBJECT_BYTES, make_groups, new_core, publish
from kvfabric.core.directory import DirectoryCore, FreeSlots
from kvfabric.directory.shell import DirectoryShell
from kvfabric.directory.stalls import CORE_CALLS
from kvfabric.format.errors import BatchTooLarge
from kvfabric.format.ids import GroupId, ObjectKey, pack_object_key
from kvfabric.proto import directory as m
from kvfabric.proto.tickets import write_receipt
from kvfabric.runtime import gcpolicy

BIG = m.PUT_BATCH_OBJECTS_MAX  # 4,096
VICTIM_EVERY_S = 0.002
T = TypeVar("T")


class BenchShell(DirectoryShell):
    """A shell without NATS: frees are dropped (the core retries them on a tick, never run here)."""

    async def _free(self, effect: FreeSlots) -> None:
        return None


def spec(key: ObjectKey) -> m.ObjectSpec:
    return m.ObjectSpec(key=key, size_bytes=OBJECT_BYTES, checksum=xxhash.xxh3_128_digest(key))


def keys_of(groups: list[GroupId]) -> list[ObjectKey]:
    return [pack_object_key(g, 0, 0, 0) for g in groups]


def begin_fits(core: DirectoryCore) -> int:
    """How many objects a put_begin's reply fits (the core says so when refusing 4,096)."""
    objects = [spec(k) for k in keys_of(make_groups(BIG, seed=77)[:])]
    try:
        core.handle(m.PutBegin(writer_id="w", request_id="fit", objects=objects, write_ttl_ms=1000), 0)
    except BatchTooLarge as err:
        return int(err.details["limit"])
    return BIG


def begun_with_receipts(core: DirectoryCore, groups: list[GroupId], rid: str) -> m.PutCommit:
    """`groups` begun (256 a request, untimed) and the put_commit of them all carrying a valid
    receipt a replica (what a client sends once it wrote them)."""
    keys = keys_of(groups)
    receipts: list[m.WriteReceipt] = []
    secret = core.config.ticket_secret
    for i in range(0, len(keys), 256):
        objects = [spec(k) for k in keys[i : i + 256]]
        begin = m.PutBegin(writer_id="w", request_id=f"{rid}-{i}", objects=objects, write_ttl_ms=600_000)
        reply = core.handle(begin, 0).reply
        assert isinstance(reply, m.PutBeginReply)
        for j, res in enumerate(reply.results):
            assert res.status == "placed", res.status
            for t in res.tickets:
                receipts.append(m.WriteReceipt(t.ticket_id, i + j, 1, write_receipt(secret, t, i + j, 1)))
    return m.PutCommit(writer_id="w", request_id=rid + "c", keys=keys, receipts=receipts)


class CallTimes:
    """Every core call's wall and CPU time (a wrapper of `CORE_CALLS.timed`): CPU time is what
    the call itself took, wall time adds whatever preempted the process meanwhile."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, float]] = []
        inner = CORE_CALLS.timed

        def timed(what: str, call: Callable[[], T]) -> T:
            began, began_cpu = time.perf_counter(), time.thread_time()
            try:
                return inner(what, call)
            finally:
                self.calls.append((time.perf_counter() - began, time.thread_time() - began_cpu))

        CORE_CALLS.timed = timed  # type: ignore[method-assign]


async def run_case(
    shell: DirectoryShell, request: msgspec.Struct, victim: list[GroupId], times: CallTimes
) -> dict[str, float]:
    """`request` through the shell while the victim's lookups arrive every `VICTIM_EVERY_S`
    (open loop: a lookup's latency runs from when it was due, so one due while the loop is
    held waits for it) until the request is answered."""
    waits: list[float] = []
    done = asyncio.Event()
    loop = asyncio.get_running_loop()

    async def victim_loop() -> None:
        due = loop.time()
        while not done.is_set():
            due += VICTIM_EVERY_S
            await asyncio.sleep(max(0.0, due - loop.time()))
            reply = await shell.handle(m.Lookup(holder_id="v", groups=victim))
            waits.append((loop.time() - due) * 1e3)
            assert isinstance(reply, m.LookupReply) and reply.hit_chunks == len(victim)
            await shell.handle(m.LeaseRelease(holder_id="v", lease_id=reply.lease_id))

    task = asyncio.create_task(victim_loop())
    await asyncio.sleep(2 * VICTIM_EVERY_S)  # the victim's lookups under way
    times.calls.clear()
    began, began_cpu = time.perf_counter(), time.thread_time()
    with contextlib.suppress(BatchTooLarge):  # the refused put_begin
        await shell.handle(request)
    handler_ms = (time.perf_counter() - began) * 1e3
    cpu_ms = (time.thread_time() - began_cpu) * 1e3
    calls = list(times.calls)
    done.set()
    await task
    while not shell._outbox.empty():  # events: nobody publishes them here
        shell._outbox.get_nowait()
    waits.sort()
    return {
        "handler_ms": handler_ms,
        "process_cpu_ms": cpu_ms,  # the request and the victim's lookups meanwhile
        "longest_core_call_cpu_ms": max(c for _, c in calls) * 1e3,
        "longest_core_call_wall_ms": max(w for w, _ in calls) * 1e3,
        "victim_longest_ms": waits[-1],
        "victim_p99_ms": waits[min(len(waits) - 1, int(0.99 * len(waits)))],
        "victim_p50_ms": statistics.median(waits),
        "victim_lookups": float(len(waits)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--slice", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    gcpolicy.install()  # the service's GC policy (service_cli does this before it starts)
    pauses: list[float] = []
    began_gc: list[float] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began_gc[:] = [time.perf_counter()]
        elif began_gc:
            pauses.append(time.perf_counter() - began_gc[0])

    gc.callbacks.append(on_gc)
    core = new_core()
    filled = make_groups(args.groups, seed=1)
    for i in range(0, len(filled), 256):
        publish(core, filled[i : min(i + 256, len(filled))], f"p{i}")
    gcpolicy.freeze_long_lived("bench_filled")  # as a shard start does after its rebuild
    victim = filled[100:104]
    fits = begin_fits(core)
    shell = BenchShell(core, tick_ms=100, events_outbox_max=1 << 20, events_max_age_s=60, free_timeout_s=1)
    figures: dict[str, dict[str, list[dict[str, float]]]] = {}
    times = CallTimes()
    seed = 1_000
    load_before = os.getloadavg()[0]
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())

    def abort(keys: list[ObjectKey], request_id: str) -> None:
        core.handle(m.PutAbort(writer_id="w", request_id=request_id, keys=keys), 0)

    def case(name: str, request: msgspec.Struct, mode: int) -> None:
        shell.write_slice_ids = mode
        pauses.clear()
        result = asyncio.run(run_case(shell, request, victim, times))
        result["longest_gc_pause_ms"] = max(pauses, default=0.0) * 1e3
        figures.setdefault(name, {}).setdefault(str(mode), []).append(result)

    for run in range(args.runs):
        modes = [0, args.slice] if run % 2 == 0 else [args.slice, 0]
        for mode in modes:
            seed += 10
            fresh = keys_of(make_groups(BIG, seed=seed)[:])
            objects = [spec(k) for k in fresh]
            begin = m.PutBegin(
                writer_id="w", request_id=f"b{seed}", objects=objects[:fits], write_ttl_ms=60_000
            )
            case(f"put_begin_{fits}_placed", begin, mode)
            case(
                f"put_abort_{fits}_begun",
                m.PutAbort(writer_id="w", request_id=f"a{seed}", keys=fresh[:fits]),
                mode,
            )
            refused = m.PutBegin(writer_id="w", request_id=f"r{seed}", objects=objects, write_ttl_ms=60_000)
            case("put_begin_4096_refused", refused, mode)
            published = make_groups(BIG, seed=seed + 1)[:]
            case("put_commit_4096_receipts", begun_with_receipts(core, published, f"c{seed}"), mode)
            never = keys_of(make_groups(BIG, seed=seed + 2)[:])
            case(
                "put_commit_4096_never_begun",
                m.PutCommit(writer_id="w", request_id=f"n{seed}", keys=never),
                mode,
            )
            case("evict_4096_published", m.Evict(groups=published, reason="bench"), mode)
            missing = make_groups(BIG, seed=seed + 3)[:]
            case("evict_4096_missing", m.Evict(groups=missing, reason="bench"), mode)
    # (no check_invariants: `publish` of bench.directory_core reuses slot numbers across batches)

    def median(runs: list[dict[str, float]]) -> dict[str, float]:
        return {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}

    out: dict[str, Any] = {
        "date_utc": started,
        "load_average_1m": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        "groups_published": args.groups,
        "runs": args.runs,
        "slice_ids": args.slice,
        "median_of_runs": {
            name: {
                ("whole" if mode == "0" else f"slices_of_{mode}"): median(runs)
                for mode, runs in by_mode.items()
            }
            for name, by_mode in figures.items()
        },
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
