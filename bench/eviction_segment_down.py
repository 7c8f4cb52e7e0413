"""What a segment lost costs the event followers' loops (eviction policy, router), whole and in steps.

Three layers, each with `--objects` groups of 4 KiB spread round robin over three segments' pools
(the service's default policy, `density`, and its GC policy installed; a collection and a freeze
after the fill, as in the service's steady state), then one segment lost (a third of the groups
go):
- `core`: `EvictionCore.drop_pool` in one call against `drop_pool_steps` (the loop would run
  between steps);
- `shell`: the policy service's `segment_down` (`GroupRecords.apply` whole against
  `apply_in_steps`: the core's drop plus the shell's records of each group);
- `router`: the router's `RoutingIndex` (`segment_down` walked whole against `apply` plus its
  follower's `sweep` slices: `sweep_per_apply` 0 for whole, the default after).
Per case: the whole call's ms, and for the stepped one its steps, the longest step and the sum
(the loop is stalled at most one step at a time). Rounds alternate whole / stepped on fresh
fills.

Run: `.venv/bin/python -m bench.eviction_segment_down [--objects 100000,300000] [--rounds 2]
[--layers core,shell,router] [--policy density]`. Prints a table; nothing written. Figures:
docs/eviction-policy.md, "Garbage collector" (core, shell); docs/router.md (router).
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable, Iterator

from kvfabric.core.eviction import EvictionCore
from kvfabric.core.eviction_model import EvictionConfig, PolicyName
from kvfabric.core.routing_index import RoutingIndex
from kvfabric.eviction_policy.shell import EvictionShell
from kvfabric.format.ids import ChainHash, Namespace
from kvfabric.proto import directory as m
from kvfabric.runtime import gcpolicy

POOLS = ("s1", "s2", "s3")
NAMESPACE = Namespace(bytes(4) + b"A" * 16 + bytes(34))
PUBLISH_BATCH = 256  # groups per GroupsPublished while filling the shell


def filled_core(objects: int, policy: PolicyName) -> EvictionCore:
    core = EvictionCore(EvictionConfig(policy=policy))
    for pool in POOLS:
        core.set_capacity(pool, 1 << 50)
    for i in range(objects):
        core.insert(i, tenant="t", pool=POOLS[i % 3], size=4096, parent=None, chunk_index=0, now_ms=1)
    return core


def filled_shell(objects: int, policy: PolicyName) -> EvictionShell:
    shell = EvictionShell(
        EvictionCore(EvictionConfig(policy=policy)),
        tick_ms=10,
        segments_refresh_ms=100,
        request_timeout_s=1.0,
    )
    for pool in POOLS:
        shell.apply(m.SegmentUp(segment_id=pool, incarnation=1, capacity_bytes=1 << 50), 0)
    for start in range(0, objects, PUBLISH_BATCH):
        shell.apply(m.GroupsPublished(groups=published_batch(start, objects)), 1)
    return shell


def published_batch(start: int, objects: int) -> list[m.GroupPublished]:
    """Groups `start`.. of `objects` (one put_commit's worth), group i on pool i % 3."""
    return [
        m.GroupPublished(
            group=ChainHash(i.to_bytes(32, "little")),
            chunk_index=0,
            members=1,
            namespace=NAMESPACE,
            parent=ChainHash(b""),
            placements=[m.SegmentBytes(POOLS[i % 3], 4096)],
        )
        for i in range(start, min(start + PUBLISH_BATCH, objects))
    ]


def filled_index(objects: int) -> RoutingIndex:
    index = RoutingIndex()
    seq = 0
    for pool in POOLS:
        seq += 1
        index.apply(seq, m.SegmentUp(segment_id=pool, incarnation=1, capacity_bytes=1 << 50))
    for start in range(0, objects, PUBLISH_BATCH):
        seq += 1
        index.apply(seq, m.GroupsPublished(groups=published_batch(start, objects)))
    return index


def index_whole(index: RoutingIndex, seq: int, lost: m.SegmentDown) -> None:
    """As before the sweep: the event applied and every group of the segment walked at once."""
    index.apply(seq, lost)
    index.sweep(len(index.groups))


def index_steps(index: RoutingIndex, seq: int, lost: m.SegmentDown) -> Iterator[None]:
    """The router follower's way: the event applied (its segment down at once), then `sweep`
    slices until none is left, the loop running between them."""
    index.apply(seq, lost)
    yield
    while index.sweep():
        yield


def timed_steps(steps: Iterator[object]) -> tuple[int, float, float]:
    """(steps, longest ms, sum ms) of running `steps` to its end."""
    count, longest, total = 0, 0.0, 0.0
    while True:
        started = time.perf_counter()
        done = next(steps, StopIteration) is StopIteration
        took = (time.perf_counter() - started) * 1000
        longest, total = max(longest, took), total + took
        if done:
            return count, longest, total
        count += 1


def one_round(layer: str, objects: int, stepped: bool, policy: PolicyName) -> tuple[int, float, float]:
    """(steps, longest ms, sum ms) of one segment lost; a whole call is one step."""
    lost = m.SegmentDown(segment_id="s1", incarnation=1, reason="heartbeat_timeout")
    whole: Callable[[], object]
    steps: Callable[[], Iterator[object]]
    if layer == "core":
        core = filled_core(objects, policy)
        whole, steps = (lambda: core.drop_pool("s1")), (lambda: core.drop_pool_steps("s1"))
    elif layer == "shell":
        shell = filled_shell(objects, policy)
        whole, steps = (lambda: shell.apply(lost, 2)), (lambda: shell.apply_in_steps(lost, 2))
    else:
        index = filled_index(objects)
        seq = index.last_seq + 1
        whole, steps = (lambda: index_whole(index, seq, lost)), (lambda: index_steps(index, seq, lost))
    gc.collect()
    gc.freeze()
    if stepped:
        result = timed_steps(steps())
    else:
        started = time.perf_counter()
        whole()
        took = (time.perf_counter() - started) * 1000
        result = (1, took, took)
    gc.unfreeze()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--objects", default="100000,300000")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", default="core,shell,router")
    parser.add_argument("--policy", default="density", help="the service's default")
    args = parser.parse_args()
    gcpolicy.install()
    print("| layer | groups followed | dropped with the segment | how | steps | longest step ms | sum ms |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for layer in args.layers.split(","):
        for objects in (int(x) for x in args.objects.split(",")):
            for r in range(args.rounds):
                for stepped in (False, True) if r % 2 == 0 else (True, False):
                    steps, longest, total = one_round(layer, objects, stepped, args.policy)
                    how = "in steps" if stepped else "whole"
                    print(
                        f"| {layer} | {objects:,} | {objects // 3:,} | {how} | {steps} | "
                        f"{longest:.1f} | {total:.0f} |",
                        flush=True,
                    )
                    gc.collect()
    gcpolicy.uninstall()


if __name__ == "__main__":
    main()
