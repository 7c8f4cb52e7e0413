"""`make chaos` / `make chaos-quick`: fault drills on a local cluster with a verifying workload.

    python tools/chaos.py [--quick] [--json out.json] [--env NAME=VALUE] [drill names...]

(`KVF_CHAOS_KEEP_LOGS=<folder>` keeps a copy of every child's log of each drill there.)

A drill (tests/drills/<name>.toml) names a topology, a workload, a fault schedule, a settle time
and expected bounds. The runner starts a supervised local cluster (tools/localcluster.py, its
own run folder; killed processes are restarted as in production), runs the workload while the
faults fire, settles, reads the final state (leases, per-segment allocated vs placed bytes) and
runs the checkers (tools/chaos_checks.py) on the recorded history.

The workload is engine-like and runs in rounds for `duration_s` (so faults land mid-traffic):
for each prefix, lookup → load → verify the loaded bytes against the payload derived from the
chunk's key (so any wrong byte an engine would consume is detected) →
save what was missing. Every request is recorded with start, end and outcome.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import msgspec
import xxhash

from kvfabric.testing.ports import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests.integration.clientkit

from chaos_checks import FinalState, Op, check_all, check_leadership_budget, check_retry_budget  # type: ignore[import-not-found]
from chaos_links import Links  # type: ignore[import-not-found]
from chaos_natscluster import NatsCluster  # type: ignore[import-not-found]
from chaos_skew import Skewed  # type: ignore[import-not-found]
from chaos_ssd import SsdDrill  # type: ignore[import-not-found]
from chaos_store import StoreDisk  # type: ignore[import-not-found]

REPO = Path(__file__).resolve().parents[1]
DRILLS = REPO / "tests" / "drills"
LOCALCLUSTER = REPO / "tools" / "localcluster.py"
TOKENS_PER_CHUNK = 16
# Prefixes new each round (`fresh_prefixes_per_round`) start here. `prompt(p)` starts at
# 3 p mod 50,000 (1,000,003 p mod 50,000), so this base keeps them apart from prefixes 0..n.
FRESH_PREFIX_BASE = 10_007
EVENTS_READ_ATTEMPTS = 10  # the checkers' read of the events stream, 1 s apart


def expected_payload(group_bytes: bytes, size: int) -> bytes:
    """The bytes a chunk must hold: derived from its key, so a mix-up is always visible."""
    seed = xxhash.xxh3_128_digest(group_bytes)
    return (seed * (size // len(seed) + 1))[:size]


def cluster_state(run: Path) -> dict[str, Any]:
    state: dict[str, Any] = json.loads((run / "cluster.json").read_text())
    return state


def fire(
    run: Path,
    fault: dict[str, Any],
    kv_factory: Any,
    links: Links | None = None,
    store: StoreDisk | None = None,
    natsc: NatsCluster | None = None,
    ssd: SsdDrill | None = None,
) -> str:
    action, target = fault["action"], fault.get("target", "")
    if action in ("kill_demoting", "power_cycle") and ssd is not None:  # the disk tier (issue 23)
        return str(ssd.fire(run, fault, kv_factory))
    if action in ("kill", "restart") and target.startswith("nats-") and natsc is not None:
        return str(natsc.fire(fault))  # a node of the drill's NATS cluster other than node 1
    if action == "stream_leader" and natsc is not None:  # a stream's leader onto a given node
        where = cluster_state(run)
        admin_env = (where.get("auth") or {}).get("admin_env", {})
        return str(natsc.move_leader(where["nats_url"], admin_env, fault))
    if action in ("link", "link_clear") and links is not None:  # a lossy link's schedule
        return str(links.fire(fault))
    if action in ("fill_store", "free_store") and store is not None:  # the JetStream store's disk
        return str(store.fire(fault))
    if action == "stick_kv" and store is not None:  # a KV bucket's append fails on the full store
        where = cluster_state(run)
        admin_env = (where.get("auth") or {}).get("admin_env", {})
        return str(store.stick_kv(where["nats_url"], admin_env, str(fault["bucket"])))
    if action in ("kill", "stop", "cont"):
        pid = cluster_state(run)["pids"].get(target)
        sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "cont": signal.SIGCONT}[action]
        if pid:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return f"{action} {target}: already gone"
        return f"{action} {target} (pid {pid})"
    if action in ("partition", "heal"):  # a segment in its own netns: its veth goes down / up
        link = cluster_state(run)["netns"][target]
        state = "down" if action == "partition" else "up"
        subprocess.run(["ip", "link", "set", link["host_if"], state], check=True, capture_output=True)
        return f"{action} {target} ({link['host_if']} {state})"
    if action == "corrupt":
        return corrupt_one(kv_factory, int(fault.get("prefix", 0)), int(fault.get("chunk", 1)))
    if action == "cancel_storm":
        return cancel_storm(kv_factory, int(fault.get("loads", 50)))
    if action == "qdisc":  # on loopback: every process of the drill sees it (root only)
        # e.g. "netem delay 50ms loss 5%" where the kernel has sch_netem; this machine's kernel
        # has no netem ("Specified qdisc kind is unknown"), so drills use tbf (rate + latency).
        args = str(fault.get("args", "tbf rate 100mbit burst 256kb latency 100ms")).split()
        subprocess.run(
            ["tc", "qdisc", "replace", "dev", "lo", "root", *args], check=True, capture_output=True
        )
        return f"qdisc {' '.join(args)}"
    if action == "qdisc_clear":
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=False, capture_output=True)
        return "qdisc cleared"
    raise ValueError(f"unknown fault action {action!r}")


def cancel_storm(kv_factory: Any, loads: int) -> str:
    """Many loads of stored prefixes that time out almost at once (1 ms): every one is cut off
    mid-transfer; their late completions must not leak staging, leases or wrong bytes."""
    import concurrent.futures

    with kv_factory(load_timeout_ms=1) as kv:
        hits = [kv.lookup(prompt(p % 4, 6 * TOKENS_PER_CHUNK + 1)) for p in range(4)]

        def one(i: int) -> int:
            hit = hits[i % len(hits)]
            tokens: int = kv.load(hit, [[bytearray(o[0].size_bytes)] for o in hit.objects]).tokens
            return tokens

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            loaded = list(pool.map(one, range(loads)))
        for hit in hits:
            kv.release(hit)
        table = kv.aio.table
        assert table.waiters_live == 0, "a cancelled load left a waiter"
    return f"cancel storm: {loads} loads at a 1 ms deadline, {sum(t == 0 for t in loaded)} cut to nothing"


def corrupt_one(kv_factory: Any, prefix: int, chunk: int) -> str:
    sys.path.insert(0, str(REPO))
    from kvfabric.testing.clientkit import corrupt_stored_byte

    with kv_factory() as kv:
        tokens = prompt(prefix)
        hit = kv.lookup(tokens)
        try:
            if hit.chunks <= chunk:
                return f"corrupt prefix {prefix}: only {hit.chunks} chunks stored"
            corrupt_stored_byte(hit, chunk)
            return f"corrupted prefix {prefix} chunk {chunk}"
        finally:
            kv.release(hit)


def prompt(prefix: int, n_tokens: int = 10_000) -> list[int]:
    return [(prefix * 1_000_003 + i * 7919) % 50_000 for i in range(n_tokens)]


def run_workload(kv: Any, wl: dict[str, Any], history: list[Op], started: float) -> None:
    chunks = int(wl.get("chunks_per_prefix", 8))
    size = int(wl.get("chunk_bytes", 64 << 10))
    duration_s = float(wl.get("duration_s", 12.0))
    rnd = 0
    while rnd < 2 or time.monotonic() - started < duration_s:  # rounds until the faults are over
        n_prefixes = int(wl.get("prefixes", 10))
        first = rnd * n_prefixes if wl.get("fresh_prefixes_each_round", False) else 0  # all puts
        # plus `fresh_prefixes_per_round` new ones (saves every round next to the hits)
        fresh = int(wl.get("fresh_prefixes_per_round", 0))
        fresh_first = FRESH_PREFIX_BASE + rnd * fresh
        for prefix in [*range(first, first + n_prefixes), *range(fresh_first, fresh_first + fresh)]:
            tokens = prompt(prefix, chunks * TOKENS_PER_CHUNK + 1)
            op = Op(prefix=prefix, round=rnd, start_s=time.monotonic() - started)
            history.append(op)
            try:
                hit = kv.lookup(tokens, max_tokens=len(tokens) - 1)
                op.hit_tokens = hit.tokens
                dests = [[bytearray(size)] for _ in range(hit.chunks)]
                load_started = time.monotonic()
                result = kv.load(hit, dests)
                if hit.chunks:
                    op.load_ms = round((time.monotonic() - load_started) * 1000.0, 1)
                kv.release(hit)
                loaded = result.tokens // TOKENS_PER_CHUNK
                groups = kv.aio.chunk_groups(tokens)
                op.wrong_chunks = sum(
                    bytes(dests[c][0]) != expected_payload(groups[c].to_bytes(), size) for c in range(loaded)
                )
                op.loaded_tokens = result.tokens
                op.cause = result.cause or hit.cause
                op.outcome = "hit" if loaded else "recompute"
                missing = [[expected_payload(groups[c].to_bytes(), size)] for c in range(loaded, chunks)]
                if missing:
                    saved = kv.save(tokens, missing, first_chunk=loaded)
                    op.saved_chunks = saved.chunks_saved
                    op.acked_chunks = chunks if saved.chunks_failed == 0 else 0
                else:
                    op.acked_chunks = chunks
            except Exception as exc:  # a bug: the client must never raise into the engine
                op.outcome, op.cause = "error", repr(exc)
            op.end_s = time.monotonic() - started
        rnd += 1
        time.sleep(float(wl.get("round_pause_s", 0.5)))


def final_state(nats_url: str, admin: dict[str, str]) -> FinalState:
    import asyncio

    import nats

    from kvfabric.cluster.natsauth import nats_auth_from_env
    from kvfabric.ctl import queries
    from kvfabric.proto import directory as m

    async def ask() -> FinalState:
        """Every directory shard's view, merged: leases of all shards, the segment table with
        placements summed over shards, every shard's published groups."""
        nc = await nats.connect(nats_url, **nats_auth_from_env(admin).connect_options())
        try:
            router = await queries.router(nc)
            leases = await queries.list_leases(router, m.LIST_LIMIT_MAX, 5)
            segs = await queries.list_segments(router, 5)
            groups = await router.list_groups(m.ListGroups(limit=1000, with_objects=True), 5, 100_000)
            # live replicas of every published object (for the repair checker)
            replicas = [len(o.replicas) for g in groups for o in g.objects]
        finally:
            await nc.close()
        return FinalState(
            read_leases=sum(not x.lease.is_pin for x in leases),
            segments=[
                {
                    "segment_id": s.segment_id,
                    "reserved_bytes": s.reserved_bytes,
                    "reported_used_bytes": s.reported_used_bytes,
                }
                for s in segs.segments
                if s.up
            ],
            object_replicas=replicas,
        )

    return asyncio.run(ask())


def evicted_groups(nats_url: str, admin: dict[str, str], kind: str = "evicted") -> set[bytes]:
    """Chain hashes of every group the directory evicted (its `evicted` events, whole stream;
    `kind="published"`: every group it published)."""
    import asyncio

    import nats
    import nats.errors
    import nats.js.errors
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    from kvfabric.cluster.natsauth import nats_auth_from_env
    from kvfabric.proto import directory as m
    from kvfabric.proto.subjects import Service, event_subject

    async def read() -> set[bytes]:
        nc = await nats.connect(nats_url, **nats_auth_from_env(admin).connect_options())
        out: set[bytes] = set()
        try:
            js = nc.jetstream(timeout=5.0)
            config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE)
            sub = await js.pull_subscribe(
                event_subject(Service.DIRECTORY, kind), stream="KVF_DIRECTORY_EVENTS", config=config
            )
            while True:
                try:
                    batch = await sub.fetch(1000, timeout=1.0)
                except TimeoutError:  # nats-py raises a bare asyncio one too (fetch deadline)
                    return out
                for msg in batch:
                    event = m.event_decoder.decode(msg.data)
                    if isinstance(event, m.GroupEvicted | m.GroupPublished):
                        out.add(event.group)
                    elif isinstance(event, m.GroupsPublished):  # one commit's groups
                        out.update(g.group for g in event.groups)
        finally:
            await nc.close()

    for attempt in range(EVENTS_READ_ATTEMPTS):  # a NATS cluster may still be electing its leader
        try:
            return asyncio.run(read())
        except nats.js.errors.ServiceUnavailableError:
            if attempt == EVENTS_READ_ATTEMPTS - 1:
                raise
            time.sleep(1.0)
    raise AssertionError("unreachable")


def recovery_s(history: list[Op], faults: list[dict[str, Any]]) -> float | None:
    """Seconds from the first fault to the first request started after it that hit the cache
    (None: no fault, or no hit afterwards)."""
    if not faults:
        return None
    at = min(float(f["at_s"]) for f in faults)
    after = [op.start_s for op in history if op.start_s >= at and op.outcome == "hit"]
    return round(min(after) - at, 2) if after else None


def lost_chunks(history: list[Op], final: FinalState) -> int:
    """Acknowledged chunks not served after settle and not evicted by the policy (reported even
    where the drill allows losses)."""
    acked: dict[int, int] = {}
    for op in history:
        acked[op.prefix] = max(acked.get(op.prefix, 0), op.acked_chunks)
    lost = 0
    for p, n in acked.items():
        served = final.served_chunks.get(p, 0)
        if served < n and served not in final.evicted_chunks.get(p, set()):  # not the policy's doing
            lost += n - served
    return lost


def load_p99_ms(history: list[Op]) -> float | None:
    """p99 of the loads that loaded something (the latency_budget checker's figure)."""
    loads = sorted(op.load_ms for op in history if op.outcome == "hit")
    return loads[min(len(loads) - 1, int(0.99 * len(loads)))] if loads else None


# Log events counted over every child's log after a drill (`log_counts` in the JSON): shard leader
# leases lost (`leadership_lost` with reason lease_expired or renew_failed: each moves a shard;
# handovers to a joining instance, reason handover or leaving, are counted apart), renewals
# unanswered or refused, the events publisher's retries and stuck streaks, the events stream
# recreated after a stuck append (kvfabric.directory.events), its followers resuming.
COUNTED_LOG_EVENTS = (
    "leadership_lost",
    "leadership_handover",
    "lease_renew_failed",
    "lease_renew_unanswered",
    "kv_bucket_open_retry",
    "event_publish_retry",
    "events_publish_stuck",
    "events_stream_recreated",
    "kv_stream_write_error",  # the directory's kv_doctor saw a lease (or member) bucket stuck
    "kv_stream_recreated",
    "events_follow_retry",  # a follower of the events stream (eviction policy, router): new consumer
    "events_gap",
    "demoted",  # the eviction policy moved victims to a segment's disk tier (issue 23)
    "demotion_stopped",  # a full disk tier stopped demotion (the policy's and the segment's line)
)
HANDOVER_REASONS = ("handover", "leaving")


def count_log_events(logs: Path) -> dict[str, int]:
    """How often each of `COUNTED_LOG_EVENTS` appears in the run's logs (rotated ones too)."""
    counts = dict.fromkeys(COUNTED_LOG_EVENTS, 0)
    for path in sorted(logs.glob("*.log*")) if logs.is_dir() else []:
        for line in path.read_text(errors="replace").splitlines():
            if "critical write error" in line:  # nats-server: a stream's store keeps a write error
                stream = line.split("'")[1].split(" > ")[-1] if line.count("'") >= 2 else "?"
                key = f"nats_write_error:{stream}"
                counts[key] = counts.get(key, 0) + 1
            if not line.startswith("{"):
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            event = record.get("event") if isinstance(record, dict) else None
            if event == "leadership_lost" and record.get("reason") in HANDOVER_REASONS:
                event = "leadership_handover"
            if event in counts:
                counts[event] += 1
    return counts


UP_FAILURE_CHARS = 2000


def first_start_errors(logs: Path) -> list[str]:
    """Error lines (JSON logs at level error) of every child so far: why a first `up` failed."""
    found = []
    for path in sorted(logs.glob("*.log")) if logs.is_dir() else []:
        for line in path.read_text(errors="replace").splitlines():
            if '"level": "error"' in line:
                found.append(f"{path.name}: {line[:400]}")
    return found[:20]


def run_drill(
    path: Path,
    *,
    verify: bool = True,
    workload_overrides: dict[str, Any] | None = None,
    env_overrides: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One drill. `verify=False` and `workload_overrides` (e.g. a load deadline far past the
    drill's latency budget) stand in for a broken client, `env_overrides` (the services'
    environment, e.g. the leader lease) for a broken service: its checkers must then fail."""
    from prometheus_client import generate_latest

    from kvfabric.client import KvClient, settings_from_env
    from kvfabric.format.key import chunk_groups_for_prefix
    from kvfabric.testing import metric_value
    from kvfabric.testing.clientkit import SPEC as TEST_SPEC

    drill = tomllib.loads(path.read_text())
    name = drill.get("name", path.stem)
    topo, wl, expect = drill.get("topology", {}), drill.get("workload", {}), drill.get("expect", {})
    wl = dict(wl, **(workload_overrides or {}))
    run = Path(tempfile.mkdtemp(prefix=f"kvf-chaos-{name}-"))
    links = Links()
    skewed = Skewed()
    store = StoreDisk()
    store.prepare(run, topo)  # the JetStream store on a small tmpfs, before nats-server starts
    env = dict(os.environ, KVF_DIRECTORY_REPLICAS_DEFAULT=str(topo.get("replicas", 1)))
    natsc = NatsCluster()
    env.update(natsc.env(topo))
    ssd = SsdDrill(name, topo)
    if topo.get("nats_store_bytes"):  # nats-server's /healthz for the directory's kv_doctor
        monitor_port = free_port()
        env["KVF_LOCALCLUSTER_NATS_MONITOR_PORT"] = str(monitor_port)
        env["KVF_DIRECTORY_NATS_MONITOR_URL"] = f"http://127.0.0.1:{monitor_port}"
    env.update({k: str(v) for k, v in drill.get("env", {}).items()})  # the drill's service settings
    env.update(env_overrides or {})
    try:
        natsc.prepare(run, topo)  # nodes 2..N of a NATS cluster that node 1 (localcluster's) joins
    except Exception:
        natsc.close()
        store.close(run)
        raise
    up_argv = [
        sys.executable,
        str(LOCALCLUSTER),
        "up",
        "--run-dir",
        str(run),
        "--nats-port",
        "0",
        "--segments",
        str(topo.get("segments", 3)),
        "--segment-bytes",
        str(topo.get("segment_bytes", 256 << 20)),
        "--directories",
        str(topo.get("directories", 1)),
        "--netns-segments",
        str(topo.get("netns_segments", 0)),
        "--segment-prefix",  # ids of this run only: other tests' clusters may run meanwhile
        f"c{links.tag}",
        *ssd.up_args(),  # a disk tier per segment, its data folder outside the run folder
    ]
    ssd.prepare(up_argv, env, wl, prompt, expected_payload, TOKENS_PER_CHUNK)
    up = subprocess.run(up_argv, env=env, capture_output=True, text=True)
    up_attempts = 1
    up_failures: list[str] = []  # why a first `up` failed (its output, the children's errors)
    if up.returncode != 0 and natsc.nodes > 1:
        # A directory's first start on a forming NATS cluster can fail creating its R3 buckets
        # (docs/chaos.md, nats-node-kill): `up` stopped everything but kept the run folder; start
        # again on it (same auth plan with the cluster block, node 1's store, nodes 2..N running).
        up_failures.append((up.stdout + up.stderr)[-UP_FAILURE_CHARS:])
        up_failures.extend(first_start_errors(run / "logs"))
        for stale in ("cluster.json", "supervisor.pid"):
            (run / stale).unlink(missing_ok=True)
        up = subprocess.run(up_argv, env=env, capture_output=True, text=True)
        up_attempts = 2
    if up.returncode != 0:
        natsc.close()
        store.close(run)
        ssd.close()  # its data folder
        raise RuntimeError(f"cluster for drill {name} did not come up: {up.stdout}{up.stderr}")
    state = cluster_state(run)
    nats_url = state["nats_url"]
    auth = state.get("auth") or {}
    admin: dict[str, str] = auth.get("admin_env", {})  # credentials for the checkers' own queries
    # A segment in its own network namespace stands for another host: its arena file is on this
    # filesystem all the same, so name the others as the local ones (only they are read through
    # shared memory), or a partitioned segment would keep serving local reads without a network.
    prefix, remote = state.get("segment_prefix", "seg"), set(state.get("netns") or {})
    segments = range(1, int(topo.get("segments", 3)) + 1)
    local = [f"{prefix}-{i}" for i in segments if f"segment-{i}" not in remote]
    if not wl.get("prefer_local", True):  # read replicas in the directory's order, local or not
        local = []
    client_nats_url = nats_url
    if topo.get("lossy_client", False):  # the client dials the host across its link
        client_nats_url = nats_url.replace("127.0.0.1", f"10.232.{links.client_subnet}.1")
    settings = settings_from_env(
        auth.get("tenants", {}).get("demo", {}),
        nats_url=client_nats_url,
        lookup_timeout_ms=int(wl.get("lookup_timeout_ms", 1000)),
        load_timeout_ms=int(wl.get("load_timeout_ms", 2000)),
        save_timeout_ms=int(wl.get("save_timeout_ms", 3000)),
        lease_ttl_ms=int(wl.get("lease_ttl_ms", 4000)),
        use_shm=bool(wl.get("use_shm", True)),
        local_segments=",".join(local) if remote and local else "",
        unsafe_skip_verification_for_tests=not verify,
    )
    SPEC = replace(TEST_SPEC, domain=settings.share_domain()) if auth else TEST_SPEC
    history: list[Op] = []
    final = FinalState(read_leases=0)
    final_error = ""
    retries = 0
    fired: list[str] = []
    fault_errors: list[str] = []
    left_behind: list[str] = []
    link_stats: dict[str, Any] = {}
    try:
        links.lay(state, topo, seed=name)
        nats_urls = {n: natsc.url(n) for n in natsc.client_ports}
        skewed.start(run, state, topo, env, nats_urls)  # extra children with a wall clock off (libfaketime)
        if skewed.described:
            fired.append(f"0.0s extra children: {', '.join(skewed.described)}")
        with links.client_side(), KvClient(settings, SPEC) as kv:  # client_side: its namespace, if any
            started = time.monotonic()

            def faults() -> None:
                for fault in drill.get("faults", []):
                    delay = float(fault["at_s"]) - (time.monotonic() - started)
                    if delay > 0:
                        time.sleep(delay)

                    def factory(**overrides: Any) -> Any:
                        return KvClient(msgspec.structs.replace(settings, **overrides), SPEC)

                    try:
                        with links.host_side():
                            what = fire(run, fault, factory, links, store, natsc, ssd)
                    except Exception as exc:  # a fault that could not be injected fails the drill
                        fault_errors.append(f"{fault['action']}: {exc!r}")
                        what = f"{fault['action']} FAILED: {exc!r}"
                    fired.append(f"{time.monotonic() - started:.1f}s {what}")

            injector = threading.Thread(target=faults, daemon=True)
            injector.start()
            run_workload(kv, wl, history, started)
            injector.join(timeout=60)
            retries = int(
                metric_value(
                    generate_latest(kv.metrics.registry).decode(), "kvfabric_client_replica_retries_total"
                )
                or 0
            )
        link_stats = links.stats()
        if any(f["action"] == "qdisc" for f in drill.get("faults", [])):
            subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=False)  # never leave it on
        time.sleep(float(drill.get("settle_s", 6.0)))
        try:  # a cluster that cannot be read after settle fails the drill, not the runner
            final = final_state(nats_url, admin)
            ssd.read_final(run, nats_url, admin)  # disk objects vs the directory's disk replicas
            evicted = evicted_groups(nats_url, admin)
            since_s = expect.get("events_published_after_s")
            published = evicted_groups(nats_url, admin, "published") if since_s is not None else set()
            with KvClient(settings, SPEC) as kv:  # what is still served, for the durability checker
                chunks = int(wl.get("chunks_per_prefix", 8))
                for prefix in sorted({op.prefix for op in history}):
                    tokens = prompt(prefix, chunks * TOKENS_PER_CHUNK + 1)
                    hit = kv.lookup(tokens, max_tokens=len(tokens) - 1)
                    final.served_chunks[prefix] = hit.chunks
                    kv.release(hit)
                    groups = chunk_groups_for_prefix(SPEC.domain, SPEC.model, SPEC.layout, tokens)
                    final.evicted_chunks[prefix] = {
                        g.chunk_index for g in groups if bytes(g.chain_hash) in evicted
                    }
                    saved_late = any(
                        op.prefix == prefix and op.saved_chunks and op.start_s >= float(since_s)
                        for op in history
                        if since_s is not None
                    )
                    if saved_late and any(bytes(g.chain_hash) not in published for g in groups):
                        final.unpublished_prefixes.append(prefix)
        except Exception as exc:
            final_error = repr(exc)
    finally:
        log_counts = count_log_events(run / "logs")  # before `down` removes the run folder
        keep = os.environ.get("KVF_CHAOS_KEEP_LOGS")  # a folder: every child's log copied there
        if keep and (run / "logs").is_dir():
            shutil.copytree(run / "logs", Path(keep) / f"{name}-{links.tag}", dirs_exist_ok=True)
        left_behind = skewed.close()
        left_behind += natsc.close()
        left_behind += links.close()  # before `down`: the segments' traffic goes back to their veths
        subprocess.run(
            [sys.executable, str(LOCALCLUSTER), "down", "--run-dir", str(run)], capture_output=True
        )
        left_behind += store.close(run)  # after `down`: nats-server no longer holds the mount
        ssd.close()
    violations = check_all(history, final, expect)
    if final_error:  # only the checkers of the history stand; the end state is unknown
        for key in ("no_leaks", "durability", "replicas_restored", "events_published"):
            violations[key] = []
        violations["final_state"] = [f"the cluster could not be read after settle: {final_error}"]
    violations["retry_budget"] = check_retry_budget(
        retries, len(history), expect.get("max_retries_per_request")
    )
    violations["faults_injected"] = fault_errors
    violations["leadership_budget"] = check_leadership_budget(
        log_counts.get("leadership_lost", 0), expect.get("max_leadership_lost")
    )
    violations["nothing_left_behind"] = [f"left behind: {x}" for x in left_behind]
    violations.update(ssd.violations(bool(final_error), log_counts, expect))  # the disk tier's checkers
    ended = [op for op in history if op.end_s is not None]
    return {
        "drill": name,
        "passed": not any(violations.values()),
        "requests": len(history),
        "hits": sum(op.outcome == "hit" for op in ended),
        "recomputes": sum(op.outcome == "recompute" for op in ended),
        "wrong_chunks": sum(op.wrong_chunks for op in history),
        "leases_after_settle": final.read_leases,
        "acked_chunks_lost": lost_chunks(history, final),
        "recovery_s": recovery_s(history, drill.get("faults", [])),
        "chunks_evicted": sum(len(v) for v in final.evicted_chunks.values()),
        "retries": retries,
        "load_p99_ms": load_p99_ms(history),
        "up_attempts": up_attempts,
        "up_failures": up_failures,
        "log_counts": log_counts,
        "extra_restarts": skewed.restarts,
        "links": link_stats,
        "ssd": ssd.summary(),
        "faults": fired,
        "violations": violations,
        "history": [asdict(op) for op in history],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("drills", nargs="*")
    parser.add_argument("--quick", action="store_true", help="only drills marked quick = true")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--workload",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a workload setting of every drill run (TOML value), e.g. load_timeout_ms=60000: "
        "a broken client the checkers must catch",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable of the drill's services, e.g. KVF_DIRECTORY_LEADER_LEASE_TTL_MS=3000: "
        "a broken service the checkers must catch",
    )
    args = parser.parse_args()
    overrides = {k: tomllib.loads(f"v = {v}")["v"] for k, v in (kv.split("=", 1) for kv in args.workload)}
    env_overrides = dict(kv.split("=", 1) for kv in args.env)
    paths = sorted(DRILLS.glob("*.toml"))
    if args.drills:
        paths = [p for p in paths if p.stem in args.drills]
    if args.quick:
        paths = [p for p in paths if tomllib.loads(p.read_text()).get("quick", False)]
    from rich.console import Console
    from rich.table import Table

    results = []
    for path in paths:
        t0 = time.monotonic()
        result = run_drill(path, workload_overrides=overrides, env_overrides=env_overrides)
        result["env_overrides"] = env_overrides
        result["duration_s"] = round(time.monotonic() - t0, 1)
        results.append(result)
        print(
            f"{result['drill']}: {'passed' if result['passed'] else 'FAILED'} in {result['duration_s']} s",
            file=sys.stderr,
        )
    table = Table(title="kvfabric chaos drills")
    for col in (
        "drill",
        "result",
        "requests",
        "hit",
        "recompute",
        "wrong chunks",
        "leases after settle",
        "acked lost",
        "recovery s",
        "retries",
        "load p99 ms",
        "faults",
        "violations",
    ):
        table.add_column(col)
    for r in results:
        table.add_row(
            r["drill"],
            "pass" if r["passed"] else "FAIL",
            str(r["requests"]),
            str(r["hits"]),
            str(r["recomputes"]),
            str(r["wrong_chunks"]),
            str(r["leases_after_settle"]),
            str(r["acked_chunks_lost"]),
            "-" if r["recovery_s"] is None else f"{r['recovery_s']:.2f}",
            str(r["retries"]),
            "-" if r["load_p99_ms"] is None else f"{r['load_p99_ms']:.0f}",
            "; ".join(r["faults"]) or "-",
            "; ".join(v for vs in r["violations"].values() for v in vs) or "-",
        )
    Console(width=200).print(table)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
