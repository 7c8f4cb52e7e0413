"""Checkers for `make chaos`: pure functions over a drill's recorded history and the cluster's
final state. Each returns a list of violations (empty = the invariant held). Unit tests feed
each one a history that breaks its invariant, so none of them is a checker that cannot fail.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["FinalState", "Op", "check_all", "check_latency_budget", "check_retry_budget"]


@dataclass(slots=True)
class Op:
    """One engine request of the verifying workload (Jepsen-style history entry)."""

    prefix: int
    round: int
    start_s: float
    end_s: float | None = None
    outcome: str = ""  # "hit" (some tokens loaded), "recompute" (none), "error" (raised: a bug)
    hit_tokens: int = 0  # what lookup promised
    loaded_tokens: int = 0  # what load verified and the engine consumed
    wrong_chunks: int = 0  # consumed chunks whose bytes differ from the expected payload
    cause: str = ""
    saved_chunks: int = 0
    acked_chunks: int = 0  # after this request, the store acknowledged chunks 0..acked-1 as published
    load_ms: float = 0.0  # how long the load took (when the lookup found something to load)


@dataclass(slots=True)
class FinalState:
    """The cluster after settle."""

    read_leases: int
    segments: list[dict[str, Any]] = field(default_factory=list)  # up segments: reserved, used
    served_chunks: dict[int, int] = field(default_factory=dict)  # prefix -> chunks a lookup finds now
    # prefix -> chunk indices the eviction policy evicted (directory `evicted` events)
    evicted_chunks: dict[int, set[int]] = field(default_factory=dict)
    object_replicas: list[int] = field(default_factory=list)  # live replicas of each published object
    # prefixes saved after the drill's `events_published_after_s` with a chunk whose `published`
    # event is not in the directory's events stream after settle
    unpublished_prefixes: list[int] = field(default_factory=list)


def check_wrong_bytes(history: list[Op]) -> list[str]:
    return [
        f"prefix {op.prefix} round {op.round}: {op.wrong_chunks} wrong chunk(s) consumed"
        for op in history
        if op.wrong_chunks
    ]


def check_all_ended(history: list[Op]) -> list[str]:
    return [
        f"prefix {op.prefix} round {op.round}: {'never ended' if op.end_s is None else 'raised ' + op.cause}"
        for op in history
        if op.end_s is None or op.outcome == "error"
    ]


def check_recompute_budget(history: list[Op], max_recompute_rate: float) -> list[str]:
    ended = [op for op in history if op.end_s is not None and op.round > 0]  # round 0 fills the cache
    if not ended:
        return []
    rate = sum(op.outcome == "recompute" for op in ended) / len(ended)
    if rate > max_recompute_rate:
        return [f"recompute rate {rate:.2f} over the budget {max_recompute_rate:.2f}"]
    return []


def check_serving_after_recovery(history: list[Op], min_hit_rate_last_round: float) -> list[str]:
    last = max((op.round for op in history), default=0)
    ops = [op for op in history if op.round == last and op.end_s is not None]
    if not ops or last == 0:
        return []
    rate = sum(op.outcome == "hit" for op in ops) / len(ops)
    if rate < min_hit_rate_last_round:
        return [f"hit rate {rate:.2f} in the last round, expected at least {min_hit_rate_last_round:.2f}"]
    return []


def check_no_leaks(final: FinalState) -> list[str]:
    problems = []
    if final.read_leases:
        problems.append(f"{final.read_leases} read lease(s) still held after settle")
    for seg in final.segments:
        if seg["reported_used_bytes"] != seg["reserved_bytes"]:
            problems.append(
                f"segment {seg['segment_id']}: {seg['reported_used_bytes']} bytes allocated, "
                f"{seg['reserved_bytes']} placed by the directory"
            )
    return problems


def check_durability(history: list[Op], final: FinalState, may_lose: bool) -> list[str]:
    """Every chunk the store acknowledged is still served after settle, unless the drill killed
    what may hold its only copy (`may_lose`: a segment with one replica, or the directory), or
    the eviction policy evicted it: a prefix served short is explained only when its first
    missing chunk is one the policy evicted (the directory said so in an `evicted` event)."""
    if may_lose:
        return []
    acked: dict[int, int] = {}
    for op in history:
        acked[op.prefix] = max(acked.get(op.prefix, 0), op.acked_chunks)
    problems = []
    for prefix, n in sorted(acked.items()):
        served = final.served_chunks.get(prefix, 0)
        if n and served < n and served not in final.evicted_chunks.get(prefix, set()):
            problems.append(f"prefix {prefix}: {n} chunk(s) acknowledged, {served} served later")
    return problems


def check_replicas_restored(final: FinalState, target: int) -> list[str]:
    """After settle every published object is back at its replica target (repair did its job)."""
    if target <= 1:
        return []
    short = [n for n in final.object_replicas if n < target]
    return (
        [f"{len(short)} of {len(final.object_replicas)} objects below {target} replicas after settle"]
        if short
        else []
    )


def check_retry_budget(retries: int, requests: int, per_request_max: float | None) -> list[str]:
    """Reads retried on another replica stayed within the drill's budget (per request, average)."""
    if per_request_max is None or requests == 0:
        return []
    rate = retries / requests
    if rate > float(per_request_max):
        return [
            f"{retries} replica retries over {requests} requests: {rate:.2f} per request > {per_request_max}"
        ]
    return []


def check_latency_budget(history: list[Op], load_p99_ms_max: float | None) -> list[str]:
    """(drills with `load_p99_ms_max`) the p99 of the loads that succeeded (loaded something) stays
    within the budget: a slow link may cost fallbacks, not loads that hang past their deadline."""
    if load_p99_ms_max is None:
        return []
    loads = sorted(op.load_ms for op in history if op.outcome == "hit" and op.end_s is not None)
    if not loads:
        return []
    p99 = loads[min(len(loads) - 1, int(0.99 * len(loads)))]
    if p99 > float(load_p99_ms_max):
        return [f"p99 of {len(loads)} successful loads {p99:.0f} ms > budget {float(load_p99_ms_max):.0f} ms"]
    return []


def check_events_published(final: FinalState, since_s: float | None) -> list[str]:
    """(drills with `events_published_after_s`) every chunk saved after that time has its
    `published` event in the directory's JetStream stream after settle: the event path recovered
    (the eviction policy and the router follow that stream)."""
    if since_s is None or not final.unpublished_prefixes:
        return []
    return [
        f"{len(final.unpublished_prefixes)} prefix(es) saved after {since_s} s have no published event "
        f"after settle (first: prefix {final.unpublished_prefixes[0]})"
    ]


def check_leadership_budget(lost: int, budget: int | None) -> list[str]:
    """(drills with `max_leadership_lost`) shard leader leases lost during the drill (each
    `leadership_lost` line in the directory logs: a shard that stops being served and moves, its
    index rebuilt under a new epoch) stay within the budget: a fault that leaves every directory
    instance alive (a NATS node lost) must not move shards."""
    if budget is None or lost <= int(budget):
        return []
    return [
        f"{lost} shard leader lease(s) lost (leadership_lost in the directory logs) > budget {int(budget)}"
    ]


def check_all(history: list[Op], final: FinalState, expect: dict[str, Any]) -> dict[str, list[str]]:
    return {
        "wrong_bytes": check_wrong_bytes(history),
        "all_ended": check_all_ended(history),
        "recompute_budget": check_recompute_budget(history, float(expect.get("max_recompute_rate", 1.0))),
        "serving": check_serving_after_recovery(history, float(expect.get("min_hit_rate_last_round", 0.0))),
        "no_leaks": check_no_leaks(final),
        "durability": check_durability(history, final, bool(expect.get("may_lose_acknowledged", False))),
        "replicas_restored": check_replicas_restored(final, int(expect.get("replicas_restored", 0))),
        "latency_budget": check_latency_budget(history, expect.get("load_p99_ms_max")),
        "events_published": check_events_published(final, expect.get("events_published_after_s")),
    }


def check_disk_tier(disk: list[dict[str, Any]]) -> list[str]:
    """(drills with a disk tier) after settle each live segment's disk holds exactly the disk
    replicas the directory lists on it, objects and bytes (no leaked space: an object recovered
    after a kill is adopted or freed, never left behind), and no disk read failed its checksum
    (no torn object read back)."""
    problems = []
    for seg in disk:
        if (seg["ssd_objects"], seg["ssd_bytes"]) != (seg["listed_objects"], seg["listed_bytes"]):
            problems.append(
                f"segment {seg['segment_id']}: {seg['ssd_objects']:.0f} objects / "
                f"{seg['ssd_bytes']:.0f} bytes on disk, the directory lists {seg['listed_objects']} / "
                f"{seg['listed_bytes']}"
            )
        if seg.get("ssd_read_corrupt", 0):
            problems.append(f"segment {seg['segment_id']}: {seg['ssd_read_corrupt']:.0f} corrupt disk reads")
    return problems


def check_demotion(
    disk: list[dict[str, Any]], log_counts: dict[str, int], expect: dict[str, Any]
) -> list[str]:
    """(drills with `min_demoted`, `min_demotion_stopped`, `min_demote_no_capacity`) the eviction
    policy demoted (its `demoted` log lines), a full disk stopped demotion (`demotion_stopped`
    log lines) and the live segments counted it (`demote_no_capacity`)."""
    problems = []
    for key, have in (
        ("min_demoted", log_counts.get("demoted", 0)),
        ("min_demotion_stopped", log_counts.get("demotion_stopped", 0)),
        ("min_demote_no_capacity", int(sum(seg.get("demote_no_capacity", 0) for seg in disk))),
    ):
        if key in expect and have < int(expect[key]):
            problems.append(f"{key.removeprefix('min_')}: {have} < {int(expect[key])}")
    return problems


def check_power_cycle(cycle: dict[str, Any], share_min: float | None, findable_min: int = 1) -> list[str]:
    """(drills with `power_cycle_share_min`) of the chunks findable on disk before the power
    cycle (a disk replica for the chunk and every chunk before it), at least that share has the
    same disk replica listed again after `up` (adopted, not demoted anew) and loads with identical
    bytes; and at least `findable_min` were findable (a cache with nothing on disk proves nothing)."""
    if share_min is None:
        return []
    findable, hit = int(cycle.get("findable_before", 0)), int(cycle.get("hit_after", 0))
    if findable < findable_min:
        return [f"{findable} chunk(s) findable on disk before the power cycle, expected >= {findable_min}"]
    if hit / findable < float(share_min):
        return [
            f"{hit} of {findable} chunks findable on disk before the power cycle hit from disk after it "
            f"({hit / findable:.3f} < {float(share_min):.2f})"
        ]
    return []
