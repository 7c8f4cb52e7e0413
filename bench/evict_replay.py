"""Live eviction replay (issue 25): the first requests of each shared trace, time-compressed,
through the public client against a local cluster whose segment holds a share of the replayed
unique blocks, next to the simulator's figure for the same requests.

    .venv/bin/python -m bench.evict_replay [--traces ../shared/traces/*.jsonl] [--requests 2000]
        [--speedup 10] [--capacity-pct 10] [--policies lru,density] [--out bench/results/eviction_replay]

- **Requests**: the first `--requests` of each trace, full 512-token blocks only (as
  `tools/evict_sim.py`). A trace block is one client chunk: `tokens_per_chunk` = 1 and the token
  is the block's hash id, so the client's chain hash of chunk i names exactly the trace's block i
  (a trace block always follows the same parent: its prefix is part of its id). One object of
  `--object-bytes` per chunk (bytes derived from the block id, compared after every load).
- **Cluster**: `tools/localcluster.py up` in a private temporary run folder (NATS on a free port,
  authenticated; segment ids `evr-<random>-1`: other clusters on this host keep theirs), one
  segment whose arena holds `--capacity-pct` % of the replayed unique blocks (at least the
  segment's 1 MiB floor), the eviction-policy service with `KVF_EVICTION_POLICY` = each policy,
  watermarks `--watermarks` (80 / 70 % unless given; the service's defaults are 90 / 80), ticks
  of `TICK_MS`, every service's request lane at its default (`--inflight-max N`: N instead); a
  fresh cluster per policy; `down` at the end, also on an error (a start that misses the ready
  timeout on a loaded host is tried again, `CLUSTER_STARTS_MAX` times).
- **Replay**: one engine (`KvClient`, the `demo` tenant), requests in trace order, each started
  at its timestamp / `--speedup` (late ones at once; the lag is reported): `lookup`, `load` of
  the hit (bytes compared), `release`, then `save` of the chunks past the loaded prefix (already
  stored ones are not rewritten: `chunks_existing`), waited for before the next request, so a
  request sees every earlier one's writes as the simulator does. Prefill tokens saved = loaded
  chunks x 512; bytes written = the saves' `bytes_written`.
- **Simulator** (same requests, timestamps compressed the same way, the production core):
  `sim (same watermarks)` = `evict_sim.simulate` with the segment's capacity in blocks and the
  service's watermarks; `sim (hard capacity)` = the simulator's own accounting (evict as soon as
  the capacity is exceeded); plus LRU, the offline reference and the infinite cache at the
  segment's capacity, for the gap. The service differs from the simulator where it cannot see
  what the simulator sees: it hears of accesses only for resident chunks (a lookup's misses
  raise no event), of a chunk's prompt length not at all (`density` classes by position), and
  it evicts on a tick after the fact, between the watermarks.

The service's default policy (`KVF_EVICTION_POLICY`'s, `density` since 2026-12-04; `lru`
before, when "default" and "LRU" were one row) is marked "(default)". Writes `--out`.json and
.md. Takes about (requests / speedup) x policies x traces of wall time plus a cluster start
each, more when the client cannot keep the compressed pace (lag).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from kvfabric.client import EngineSpec, KvClient, settings_from_env
from kvfabric.eviction_policy.settings import load_eviction_settings
from kvfabric.format.key import KVLayout, ModelFingerprint

REPO: Final = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from evict_sim import (  # type: ignore[import-not-found]  # noqa: E402
    BLOCK_TOKENS,
    POLICIES,
    full_chunks,
    gap_closed,
    load_trace,
    simulate,
    simulate_infinite,
    simulate_reference,
)

# The service's watermarks (% of the segment's capacity) in the replay unless --watermarks (the
# service's own defaults are 90 / 80)
WATERMARKS_PCT: Final = (80, 70)
TICK_MS: Final = 20  # the service checks watermarks this often
SEGMENTS_REFRESH_MS: Final = 1_000
SEGMENT_BYTES_MIN: Final = 1 << 20  # the segment's floor (KVF_SEGMENT_BYTES)
SEGMENT_ALIGNMENT_BYTES: Final = 64  # arena sizes are multiples of the slot alignment
CLUSTER_TIMEOUT_S: Final = 120.0
MODEL_ID: Final = "evict-replay"
# Every service's in-flight lane in the replay (`KVF_INFLIGHT_MAX`), 0: the services' own (64).
# Replays before 2026-12-04 ran at 1024: at 64 a segment refused most of the directory's frees,
# one request per evicted slot then, and the arena filled (`no_capacity`); batched since
# (docs/eviction-policy.md, "Live replay").
INFLIGHT_MAX: Final = 0
TENANT: Final = "demo"


# ---- pure parts ----------------------------------------------------------------------------


def replayed(trace: Path, requests_max: int) -> list[dict[str, Any]]:
    """The first `requests_max` requests of `trace` (0: all), full blocks only."""
    requests = load_trace(trace)
    out: list[dict[str, Any]] = full_chunks(requests[:requests_max] if requests_max else requests)
    return out


def unique_blocks(requests: Sequence[Mapping[str, Any]]) -> int:
    return len({b for r in requests for b in r["hash_ids"]})


def segment_bytes(unique: int, capacity_pct: float, object_bytes: int) -> int:
    """The arena that holds `capacity_pct` % of `unique` blocks of `object_bytes` (rounded up to
    the slot alignment, at least the segment's floor)."""
    want = math.ceil(unique * capacity_pct / 100) * object_bytes
    aligned = -(-want // SEGMENT_ALIGNMENT_BYTES) * SEGMENT_ALIGNMENT_BYTES
    return max(SEGMENT_BYTES_MIN, aligned)


def compressed(requests: Sequence[Mapping[str, Any]], speedup: float) -> list[dict[str, Any]]:
    """The requests on the replay's clock: ms since the first request, divided by `speedup`."""
    start = requests[0]["timestamp"] if requests else 0
    return [{**r, "timestamp": (r["timestamp"] - start) / speedup} for r in requests]


def block_object(block: int, object_bytes: int) -> bytes:
    """A chunk's bytes: its block id, repeated (a load is compared with this)."""
    return (block.to_bytes(8, "little") * (object_bytes // 8 + 1))[:object_bytes]


def engine_spec(client_env: Mapping[str, str], nats_url: str) -> EngineSpec:
    """One token a chunk: a trace block is one chunk, its token the block's hash id."""
    return EngineSpec(
        settings_from_env(client_env, nats_url=nats_url).share_domain(),
        ModelFingerprint(model_id=MODEL_ID, weights_revision="r1", kv_dtype="uint8", attn_config_digest="-"),
        KVLayout(
            tp_size=1,
            tp_rank=0,
            pp_stage=0,
            layer_group=0,
            layer_group_count=1,
            tokens_per_chunk=1,
            tensor_layout="evict-replay-bytes",
        ),
    )


@dataclass
class LiveRun:
    """What one replay through the client did."""

    requests: int = 0
    input_tokens: int = 0
    tokens_saved: int = 0  # loaded chunks x BLOCK_TOKENS
    chunks_hit: int = 0  # the lookups' prefixes
    chunks_loaded: int = 0
    load_mismatches: int = 0
    chunks_saved: int = 0
    chunks_existing: int = 0
    chunks_failed: int = 0
    bytes_written: int = 0
    failed_causes: dict[str, int] = field(default_factory=dict)
    lookup_causes: dict[str, int] = field(default_factory=dict)
    lag_ms: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        lags = sorted(self.lag_ms) or [0.0]
        out.pop("lag_ms")
        out["lag_ms_p50"] = statistics.median(lags)
        out["lag_ms_p99"] = lags[min(len(lags) - 1, int(0.99 * len(lags)))]
        out["lag_ms_max"] = lags[-1]
        out["prefill_saved_share"] = self.tokens_saved / self.input_tokens if self.input_tokens else 0.0
        return out


def replay(
    client: KvClient,
    requests: Sequence[Mapping[str, Any]],
    object_bytes: int,
    clock: Any = time.monotonic,
    sleep: Any = time.sleep,
) -> LiveRun:
    """Each request at its (compressed, ms) timestamp: lookup, load, release, save the rest."""
    run = LiveRun()
    started = clock()
    for request in requests:
        due = started + request["timestamp"] / 1000
        if (wait := due - clock()) > 0:
            sleep(wait)
        run.lag_ms.append(max(0.0, (clock() - due) * 1000))
        blocks: list[int] = list(request["hash_ids"])
        run.requests += 1
        run.input_tokens += request["input_length"]
        if not blocks:
            continue
        hit = client.lookup(blocks)
        if hit.cause:
            run.lookup_causes[hit.cause] = run.lookup_causes.get(hit.cause, 0) + 1
        loaded = 0
        if hit.chunks:
            run.chunks_hit += hit.chunks
            out = [[bytearray(object_bytes)] for _ in range(hit.chunks)]
            result = client.load(hit, out)
            client.release(hit)
            loaded = result.tokens  # one token a chunk
            for c in range(loaded):
                if bytes(out[c][0]) != block_object(blocks[c], object_bytes):
                    run.load_mismatches += 1
                    loaded = c
                    break
            run.chunks_loaded += loaded
        run.tokens_saved += min(loaded * BLOCK_TOKENS, request["input_length"])
        if loaded < len(blocks):
            saved = client.save(
                blocks, [[block_object(b, object_bytes)] for b in blocks[loaded:]], first_chunk=loaded
            )
            run.chunks_saved += saved.chunks_saved
            run.chunks_existing += saved.chunks_existing
            run.chunks_failed += saved.chunks_failed
            run.bytes_written += saved.bytes_written
            for cause, n in saved.causes.items():
                run.failed_causes[cause] = run.failed_causes.get(cause, 0) + n
    run.wall_s = clock() - started
    return run


def sim_rows(
    requests: Sequence[Mapping[str, Any]],
    capacity_blocks: int,
    policies: Sequence[str],
    watermarks_pct: tuple[int, int] = WATERMARKS_PCT,
) -> dict[str, dict[str, Any]]:
    """The simulator on the same (compressed) requests at the segment's capacity: each policy with
    the service's watermarks and with the simulator's hard capacity, LRU, reference, infinite."""
    reqs = list(requests)
    rows: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(["lru", *policies]):
        rows[f"{name} (same watermarks)"] = simulate(
            reqs,
            capacity_blocks,
            POLICIES[name],
            watermarks=(watermarks_pct[0] / 100, watermarks_pct[1] / 100),
        )
        rows[f"{name} (hard capacity)"] = simulate(reqs, capacity_blocks, POLICIES[name])
    rows["reference"] = simulate_reference(reqs, capacity_blocks)
    rows["infinite"] = simulate_infinite(reqs)
    return rows


def report(results: Sequence[Mapping[str, Any]], command: str) -> list[str]:
    """The markdown table: per trace and policy, live next to the simulator."""
    lines = [
        command,
        "",
        "Prefill tokens saved (share of the replayed input tokens) and chunks written (x object bytes"
        " = bytes written), live through the client and simulated on the same requests; gap = share"
        " of the LRU -> offline reference gap closed (simulator's LRU and reference at the same"
        " capacity, same watermarks).",
        "",
        "| trace | policy | live saved | live written (MiB) | live failed writes | sim, same watermarks:"
        " saved / written | sim, hard capacity: saved / written | live gap | sim gap | lag p50 / max (ms) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    default = load_eviction_settings({}).core.policy
    for res in results:
        sims = res["sim"]
        lru = sims["lru (same watermarks)"]["prefill_tokens_saved"]
        ref = sims["reference"]["prefill_tokens_saved"]
        for policy, live in res["live"].items():
            same, hard = sims[f"{policy} (same watermarks)"], sims[f"{policy} (hard capacity)"]
            live_gap = gap_closed(live["tokens_saved"], lru, ref)
            sim_gap = gap_closed(same["prefill_tokens_saved"], lru, ref)
            lines.append(
                f"| {res['trace']} | `{policy}`{' (default)' if policy == default else ''} "
                f"| {100 * live['prefill_saved_share']:.2f} % "
                f"| {live['chunks_saved']} ({live['bytes_written'] / 2**20:.1f}) "
                f"| {live['chunks_failed']} {_causes(live['failed_causes'])}"
                f"| {100 * same['prefill_saved_share']:.2f} % / {same['blocks_written']} "
                f"| {100 * hard['prefill_saved_share']:.2f} % / {hard['blocks_written']} "
                f"| {_pct(live_gap)} | {_pct(sim_gap)} "
                f"| {live['lag_ms_p50']:.0f} / {live['lag_ms_max']:.0f} |"
            )
        lines.append(
            f"| {res['trace']} | **reference** / **infinite** (sim) | | | "
            f"| {_saved_written(sims['reference'])} | {_saved_written(sims['infinite'])}"
            " | | | |"
        )
    lines += ["", "Per trace: requests, unique blocks, segment capacity:", ""]
    for res in results:
        lines.append(
            f"- {res['trace']}: {res['requests']} requests over {res['span_s']:.0f} s of trace"
            f" (replayed in {res['span_s'] / res['speedup']:.0f} s at x{res['speedup']:g}),"
            f" {res['unique_blocks']} unique blocks, segment {res['segment_bytes']} B ="
            f" {res['capacity_blocks']} chunks of {res['object_bytes']} B"
            f" ({100 * res['capacity_blocks'] / res['unique_blocks']:.1f} %), watermarks"
            f" {res['watermarks_pct'][0]} / {res['watermarks_pct'][1]} %"
        )
    return lines


def _saved_written(row: Mapping[str, Any]) -> str:
    return f"{100 * row['prefill_saved_share']:.2f} % / {row['blocks_written']}"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f} %"


def _causes(causes: Mapping[str, int]) -> str:
    return f"({', '.join(f'{k} {v}' for k, v in sorted(causes.items()))}) " if causes else ""


# ---- processes -----------------------------------------------------------------------------

CLUSTER_STARTS_MAX: Final = 3


class ClusterDown(RuntimeError):
    """`localcluster.py up` did not report the cluster ready."""


def read_env_file(path: Path) -> dict[str, str]:
    from kvfabric.ctl.auth import read_env_file as parse

    return parse(path.read_text())


@contextmanager
def local_cluster(
    run: Path,
    arena_bytes: int,
    policy: str,
    inflight_max: int = 0,
    watermarks_pct: tuple[int, int] = WATERMARKS_PCT,
) -> Iterator[dict[str, Any]]:
    """`tools/localcluster.py up` in `run` with one segment of `arena_bytes` (an id of its own)
    and the eviction service on `policy`; `down` however the block ends."""
    tool = [sys.executable, str(REPO / "tools" / "localcluster.py")]
    up = [*tool, "up", "--run-dir", str(run), "--nats-port", "0", "--segments", "1", "--tenants", TENANT]
    up += ["--segment-bytes", str(arena_bytes), "--segment-prefix", f"evr-{secrets.token_hex(3)}"]
    env = dict(
        os.environ,
        KVF_EVICTION_POLICY=policy,
        KVF_EVICTION_HIGH_WATERMARK_PCT=str(watermarks_pct[0]),
        KVF_EVICTION_LOW_WATERMARK_PCT=str(watermarks_pct[1]),
        KVF_EVICTION_TICK_MS=str(TICK_MS),
        KVF_EVICTION_SEGMENTS_REFRESH_MS=str(SEGMENTS_REFRESH_MS),
        KVF_EVICTION_DEMOTE="0",  # no disk tier here
    )
    if inflight_max:  # every service's in-flight lane (the segment's takes the directory's frees)
        env["KVF_INFLIGHT_MAX"] = str(inflight_max)
    try:
        proc = subprocess.run(
            up, capture_output=True, text=True, timeout=CLUSTER_TIMEOUT_S, cwd=REPO, env=env
        )
        state = json.loads((run / "cluster.json").read_text()) if (run / "cluster.json").exists() else {}
        if proc.returncode != 0 or not state.get("ready"):
            errors = [
                f"{log.name}: {line[:600]}"
                for log in sorted((run / "logs").glob("*.log"))
                for line in log.read_text(errors="replace").splitlines()[-200:]
                if '"error"' in line or "Traceback" in line
            ]
            raise ClusterDown(
                f"the local cluster did not start: {(proc.stdout + proc.stderr)[-2000:]}\n"
                + "\n".join(errors[-5:])
            )
        yield state
    finally:
        subprocess.run(
            [*tool, "down", "--run-dir", str(run)], capture_output=True, timeout=CLUSTER_TIMEOUT_S, cwd=REPO
        )


def live(
    requests: Sequence[Mapping[str, Any]],
    arena_bytes: int,
    policy: str,
    object_bytes: int,
    inflight_max: int = 0,
    watermarks_pct: tuple[int, int] = WATERMARKS_PCT,
) -> LiveRun:
    for attempt in range(CLUSTER_STARTS_MAX):
        try:
            return _live_once(requests, arena_bytes, policy, object_bytes, inflight_max, watermarks_pct)
        except ClusterDown as exc:  # a start on a loaded host can miss the ready timeout
            print(f"cluster start {attempt + 1} failed: {exc}", file=sys.stderr, flush=True)
    raise RuntimeError(f"the local cluster did not start {CLUSTER_STARTS_MAX} times")


def _live_once(
    requests: Sequence[Mapping[str, Any]],
    arena_bytes: int,
    policy: str,
    object_bytes: int,
    inflight_max: int,
    watermarks_pct: tuple[int, int],
) -> LiveRun:
    with (
        tempfile.TemporaryDirectory(prefix="kvf-evict-replay-") as tmp,
        local_cluster(Path(tmp) / "run", arena_bytes, policy, inflight_max, watermarks_pct) as state,
    ):
        client_env = read_env_file(Path(state["auth"]["dir"]) / "env" / f"tenant-{TENANT}.env")
        settings = settings_from_env(client_env, nats_url=state["nats_url"])
        with KvClient(settings, engine_spec(client_env, state["nats_url"])) as client:
            if not client.enabled:
                raise RuntimeError(f"the client could not reach the cluster: {client.status}")
            return replay(client, requests, object_bytes)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--traces",
        nargs="*",
        type=Path,
        default=sorted((REPO.parent / "shared" / "traces").glob("*.jsonl")),
    )
    parser.add_argument("--requests", type=int, default=2000, help="the first N requests of each trace")
    parser.add_argument("--speedup", type=float, default=3.0, help="trace time / replay time")
    parser.add_argument("--capacity-pct", type=float, default=10.0, help="%% of the replayed unique blocks")
    parser.add_argument(
        "--policies", default="lru,density", help="KVF_EVICTION_POLICY values, comma-separated"
    )
    parser.add_argument("--object-bytes", type=int, default=4096, help="one chunk's object (multiple of 64)")
    parser.add_argument(
        "--inflight-max",
        type=int,
        default=INFLIGHT_MAX,
        help="KVF_INFLIGHT_MAX of every service (0: their default, 64)",
    )
    parser.add_argument(
        "--watermarks",
        default=",".join(map(str, WATERMARKS_PCT)),
        help="the eviction service's high,low watermarks in %% (the simulator's 'same watermarks' too)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "eviction_replay")
    args = parser.parse_args(argv)
    try:
        high, low = (int(x) for x in args.watermarks.split(","))
    except ValueError:
        parser.error("--watermarks takes HIGH,LOW (integers)")
    if not 0 < low < high <= 100:
        parser.error("--watermarks: 0 < LOW < HIGH <= 100")
    watermarks_pct = (high, low)
    if not args.traces:
        print("no traces found", file=sys.stderr)
        return 2
    if args.object_bytes % SEGMENT_ALIGNMENT_BYTES:
        parser.error(f"--object-bytes must be a multiple of {SEGMENT_ALIGNMENT_BYTES}")
    policies = args.policies.split(",")
    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    for trace in args.traces:
        requests = compressed(replayed(trace, args.requests), args.speedup)
        unique = unique_blocks(requests)
        arena = segment_bytes(unique, args.capacity_pct, args.object_bytes)
        capacity_blocks = arena // args.object_bytes
        res: dict[str, Any] = {
            "trace": trace.stem,
            "requests": len(requests),
            "span_s": requests[-1]["timestamp"] * args.speedup / 1000,
            "speedup": args.speedup,
            "unique_blocks": unique,
            "object_bytes": args.object_bytes,
            "segment_bytes": arena,
            "capacity_blocks": capacity_blocks,
            "watermarks_pct": list(watermarks_pct),
            "inflight_max": args.inflight_max,
            "sim": sim_rows(requests, capacity_blocks, policies, watermarks_pct),
            "live": {},
        }
        for policy in policies:
            run = live(requests, arena, policy, args.object_bytes, args.inflight_max, watermarks_pct)
            res["live"][policy] = run.summary()
            print(
                f"{trace.stem} {policy}: live saved {100 * res['live'][policy]['prefill_saved_share']:.2f} %,"
                f" sim {100 * res['sim'][f'{policy} (same watermarks)']['prefill_saved_share']:.2f} %"
                f" ({run.wall_s:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
        results.append(res)
    flags = f" --requests {args.requests} --speedup {args.speedup:g} --capacity-pct {args.capacity_pct:g}"
    flags += f" --policies {args.policies}"
    if args.inflight_max != parser.get_default("inflight_max"):
        flags += f" --inflight-max {args.inflight_max}"
    if watermarks_pct != WATERMARKS_PCT:
        flags += f" --watermarks {high},{low}"
    if args.object_bytes != parser.get_default("object_bytes"):
        flags += f" --object-bytes {args.object_bytes}"
    command = (
        f"`.venv/bin/python -m bench.evict_replay{flags}` ({time.strftime('%Y-%m-%d', time.gmtime())},"
        f" {time.perf_counter() - started:.0f} s on a shared 2-core VM)"
    )
    lines = report(results, command)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(str(args.out) + ".md").write_text("\n".join(lines) + "\n")
    Path(str(args.out) + ".json").write_text(json.dumps({"command": command, "results": results}, indent=2))
    print("\n".join(lines))
    bad = [
        f"{r['trace']} {p}: {v['load_mismatches']} loads with wrong bytes"
        for r in results
        for p, v in r["live"].items()
        if v["load_mismatches"]
    ]
    for line in bad:
        print(line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
