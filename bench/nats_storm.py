"""NATS connection storms (issue 21 row 8): does another tenant's lookup stay within 2x of its
baseline while someone opens NATS connections with wrong passwords, or opens 1,000 valid ones?

nats-server checks a password user's bcrypt hash on every connection attempt, right or wrong, on
its own cores: at cost 8 about 15 ms of CPU an attempt, so 121 wrong passwords a second took two
cores and alice's lookup p50 went from 0.62 to 24 ms. Candidates, each on a fresh secured cluster
(`kvctl auth init` users and permissions, nats-server, one directory) in one run:

| config | what changes |
|---|---|
| `bcrypt-<c>` | every user's password hash has cost c (8: the default before; 4: bcrypt's minimum) |
| `nkeys` | the storming tenant is an nkey user (Ed25519 challenge-response; no hash to check) |
| `max-conns-<n>` | bcrypt-8 + nats-server `max_connections: n` (the whole server's connections) |
| `tls-rate-<n>` | bcrypt-8 + TLS, nats-server's `tls { connection_rate_limit: n }` (new TLS connections/s) |

For each: the victim (tenant alice, connected before the storm) sends one lookup at a time (one
chunk group of her own domain, a miss: one request to one directory shard through
`DirectoryRouter`, `VICTIM_GAP_S` apart) for `--baseline-s`; then during (i) a wrong-password
storm by `bench/nats_storm_peer.py` (another process: `--rate` attempts/s for `--storm-s` as user
`tenant-bob` with a wrong password, or his nkey with a wrong signature) and (ii) bob opening
`--connections` valid connections at `--valid-rate`/s, all held until the last is answered. The
victim's samples are those taken between the storm's first attempt and its last answer.
Reported: p50/p99 and their ratio to the same config's baseline, the storm's achieved rate and
outcomes, and nats-server's CPU time per attempt (/proc; beyond its rate while serving the victim
alone at baseline).

Run: `.venv/bin/python -m bench.nats_storm [--configs bcrypt-8,bcrypt-4,...]` (~2 min on 2 cores).
Writes bench/results/nats_storm.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

import nats

from bench.nats_storm_peer import new_nkey
from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.cluster.natsauth import nats_auth_from_env
from kvfabric.ctl.auth import BCRYPT_COST, plan_auth, write_auth
from kvfabric.format.ids import GroupId
from kvfabric.format.key import ShareDomain, chunk_groups_for_prefix
from kvfabric.proto import directory as m
from kvfabric.proto.subjects import tenant_inbox_prefix
from kvfabric.testing import NatsServer
from kvfabric.testing.clientkit import SPEC, TOKENS_PER_CHUNK, prompt
from kvfabric.testing.cluster import directory_process

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
VICTIM_GAP_S: Final = 0.002
VICTIM_TIMEOUT_S: Final = 5.0
WARMUP_LOOKUPS: Final = 50
SETTLE_S: Final = 1.0
CLK_TCK: Final = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Config:
    name: str
    bcrypt_cost: int = BCRYPT_COST
    nkeys: bool = False
    tls: bool = False
    server_lines: tuple[str, ...] = ()  # appended to the nats-server config
    tls_lines: tuple[str, ...] = ()  # added to its tls block


def config_named(name: str) -> Config:
    if match := re.fullmatch(r"bcrypt-(\d+)", name):
        return Config(name, bcrypt_cost=int(match[1]))
    if name == "nkeys":
        return Config(name, nkeys=True)
    if match := re.fullmatch(r"max-conns-(\d+)", name):
        return Config(name, bcrypt_cost=8, server_lines=(f"max_connections: {match[1]}",))
    if match := re.fullmatch(r"tls-rate-(\d+)", name):
        return Config(name, bcrypt_cost=8, tls=True, tls_lines=(f"connection_rate_limit: {match[1]}",))
    raise SystemExit(f"unknown config {name!r}")


@dataclass
class Cluster:
    """One config's auth files and nats-server config."""

    config: Config
    doc: dict[str, Any]
    conf: Path
    bob_nkey_seed_hex: str = ""
    bob_nkey: str = ""
    bob_password: str = ""


def write_cluster(tmp: Path, config: Config) -> Cluster:
    """`kvctl auth init` files at the config's bcrypt cost, then the config's changes to the
    nats-server config: bob as an nkey user, extra server or TLS lines."""
    doc = write_auth(
        tmp / "auth", plan_auth(["alice", "bob"]), tls=config.tls, bcrypt_cost=config.bcrypt_cost
    )
    text = Path(doc["conf"]).read_text()
    cluster = Cluster(config, doc, tmp / "nats.conf")
    cluster.bob_password = Path(doc["users"]["tenant-bob"]["password_file"]).read_text().strip()
    if config.nkeys:
        seed, public = new_nkey()
        cluster.bob_nkey_seed_hex, cluster.bob_nkey = seed.hex(), public
        found = re.search(r"users = (\[.*?\n\])", text, flags=re.S)
        assert found is not None
        users = json.loads(found[1])
        for user in users:
            if user["user"] == "tenant-bob":
                del user["user"], user["password"]
                user["nkey"] = public
        text = text.replace(found[1], json.dumps(users, indent=2))
    if config.tls_lines:
        assert "  timeout: 2\n}" in text
        text = text.replace(
            "  timeout: 2\n}", "  timeout: 2\n" + "".join(f"  {x}\n" for x in config.tls_lines) + "}"
        )
    text += "".join(f"{line}\n" for line in config.server_lines)
    cluster.conf.write_text(text)
    return cluster


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def summary(samples: list[float]) -> dict[str, Any]:
    if not samples:
        return {"n": 0, "p50_ms": None, "p99_ms": None}
    return {
        "n": len(samples),
        "p50_ms": round(statistics.median(samples), 3),
        "p99_ms": round(quantile(samples, 0.99), 3),
    }


class Victim:
    """Alice's lookups, one at a time, timestamped (monotonic s at send, ms taken)."""

    def __init__(self, router: DirectoryRouter, group: GroupId) -> None:
        self.router = router
        self.group = group
        self.shard = router.shard_of(group)
        self.samples: list[tuple[float, float]] = []
        self.failures: list[float] = []  # monotonic s at send of each request that failed

    async def one(self) -> None:
        sent = time.monotonic()
        started = time.perf_counter()
        try:
            reply = await self.router.ask(
                self.shard, "lookup", m.Lookup(holder_id="victim", groups=[self.group]), VICTIM_TIMEOUT_S
            )
        except Exception:  # a timeout or refusal under the storm: counted, not a sample
            self.failures.append(sent)
            return
        assert isinstance(reply, m.LookupReply) and reply.hit_chunks == 0
        self.samples.append((sent, (time.perf_counter() - started) * 1000))

    async def run_until(self, done: asyncio.Future[Any] | float) -> None:
        while not (done.done() if isinstance(done, asyncio.Future) else time.monotonic() >= done):
            await self.one()
            await asyncio.sleep(VICTIM_GAP_S)

    def window(self, start_s: float, end_s: float) -> list[float]:
        return [ms for sent, ms in self.samples if start_s <= sent <= end_s]

    def failed(self, start_s: float, end_s: float) -> int:
        return sum(start_s <= sent <= end_s for sent in self.failures)


async def storm(spec: dict[str, Any]) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.nats_storm_peer",
        json.dumps(spec),
        stdout=asyncio.subprocess.PIPE,
        cwd=REPO,
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0, out
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


async def measure(cluster: Cluster, server: NatsServer, args: argparse.Namespace) -> dict[str, Any]:
    alice_env = cluster.doc["tenants"]["alice"]["env"]
    auth = replace(
        nats_auth_from_env(alice_env, prefix="KVF_CLIENT_NATS_"), inbox_prefix=tenant_inbox_prefix("alice")
    )
    nc = await nats.connect(server.url, **auth.connect_options())
    router = DirectoryRouter(nc, tenant="alice")
    domain = ShareDomain(
        alice_env["KVF_CLIENT_TENANT_ID"], bytes.fromhex(alice_env["KVF_CLIENT_DOMAIN_SALT_HEX"])
    )
    tokens = prompt(TOKENS_PER_CHUNK, seed=4242)
    group = chunk_groups_for_prefix(domain, SPEC.model, SPEC.layout, tokens)[0].group_id()
    try:
        await router.known_shards()
        victim = Victim(router, group)
        for _ in range(WARMUP_LOOKUPS):
            await victim.one()
        victim.samples.clear()
        pid = server.pid
        assert pid is not None
        row: dict[str, Any] = {"config": cluster.config.name}
        start, cpu_start = time.monotonic(), cpu_s(pid)
        await victim.run_until(start + args.baseline_s)
        idle_cpu_per_s = (cpu_s(pid) - cpu_start) / (time.monotonic() - start)  # serving the victim
        row["baseline"] = summary(victim.window(start, time.monotonic()))
        target: dict[str, Any] = {"host": "127.0.0.1", "port": server.port, "tls_ca": cluster.doc["tls_ca"]}
        if cluster.config.nkeys:
            target["nkey"] = cluster.bob_nkey
        else:
            target["user"] = "tenant-bob"
        phases = {
            "wrong": dict(
                target,
                mode="wrong",
                password="wrong-" + os.urandom(8).hex(),
                rate_per_s=args.rate,
                duration_s=args.storm_s,
            ),
            "valid": dict(
                target,
                mode="valid",
                password=cluster.bob_password,
                nkey_seed_hex=cluster.bob_nkey_seed_hex,
                rate_per_s=args.valid_rate,
                duration_s=args.valid_max_s,
                count=args.connections,
            ),
        }
        for phase, spec in phases.items():
            await asyncio.sleep(SETTLE_S)
            cpu_before = cpu_s(pid)
            task = asyncio.ensure_future(storm(spec))
            await victim.run_until(task)
            result = task.result()
            cpu = cpu_s(pid) - cpu_before - idle_cpu_per_s * (time.monotonic() - result["start_s"])
            during = summary(victim.window(result["start_s"], result["end_s"]))
            base = row["baseline"]
            row[phase] = {
                **during,
                "victim_failures": victim.failed(result["start_s"], result["end_s"]),
                "p50_ratio": round(during["p50_ms"] / base["p50_ms"], 2) if during["n"] else None,
                "p99_ratio": round(during["p99_ms"] / base["p99_ms"], 2) if during["n"] else None,
                "storm": {k: v for k, v in result.items() if k not in ("start_s", "end_s")},
                "server_cpu_ms_per_attempt": round(max(0.0, cpu) * 1000 / max(result["attempts"], 1), 3),
            }
            print(json.dumps({"config": cluster.config.name, "phase": phase, **row[phase]}), flush=True)
        row["victim_failures"] = len(victim.failures)
        return row
    finally:
        await nc.close()


def run_config(config: Config, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvf-storm-") as tmp:
        cluster = write_cluster(Path(tmp), config)
        with NatsServer(Path(tmp) / "nats", extra_args=["-c", str(cluster.conf)]) as server:
            env = dict(cluster.doc["users"]["svc-directory"]["env"], KVF_LOG_LEVEL="info")
            with directory_process(server, **env):
                row = asyncio.run(measure(cluster, server, args))
                print(json.dumps(row), flush=True)
                return row


def cell(phase: dict[str, Any]) -> str:
    failed = f", {phase['victim_failures']} lookups failed" if phase["victim_failures"] else ""
    if not phase["n"]:
        return f"no lookup answered{failed}"
    return f"{phase['p50_ms']} / {phase['p99_ms']} ms ({phase['p50_ratio']}x / {phase['p99_ratio']}x){failed}"


def write_results(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    command = "python -m bench.nats_storm " + " ".join(sys.argv[1:])
    result = {
        "machine": f"{platform.machine()} {platform.system()} {platform.release()}, {os.cpu_count()} cpus",
        "command": command.strip(),
        "date": time.strftime("%Y-%m-%d"),
        "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
        "wrong_rate_per_s": args.rate,
        "storm_s": args.storm_s,
        "connections": args.connections,
        "valid_rate_per_s": args.valid_rate,
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "nats_storm.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# NATS connection storms: another tenant's lookup latency (issue 21 row 8)",
        "",
        f"`{result['command']}` on {result['machine']}, {result['date']} (load {result['load_avg_1m_at_end']}"
        " at the end; attacker, victim, nats-server and directory share the cores).",
        f"Victim: one lookup at a time (a miss on one shard). Wrong passwords: {args.rate}/s for "
        f"{args.storm_s} s. Valid: {args.connections} connections at {args.valid_rate}/s, held.",
        "Cells: p50 / p99 (ratio to the same config's baseline).",
        "",
        "| config | baseline p50 / p99 | wrong-password storm | server CPU per wrong attempt "
        "| valid connections opening | server CPU per connection | storms' outcomes |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        outcomes = "; ".join(
            f"{phase}: {r[phase]['storm']['attempts']} in {r[phase]['storm']['elapsed_s']} s "
            + ", ".join(f"{k} {v}" for k, v in r[phase]["storm"]["outcomes"].items())
            for phase in ("wrong", "valid")
        )
        lines.append(
            f"| {r['config']} | {r['baseline']['p50_ms']} / {r['baseline']['p99_ms']} ms "
            f"| {cell(r['wrong'])} "
            f"| {r['wrong']['server_cpu_ms_per_attempt']} ms | {cell(r['valid'])} "
            f"| {r['valid']['server_cpu_ms_per_attempt']} ms | {outcomes} |"
        )
    (RESULTS / "nats_storm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", default="bcrypt-8,bcrypt-6,bcrypt-4,nkeys,max-conns-256,tls-rate-20")
    parser.add_argument("--baseline-s", type=float, default=3.0)
    parser.add_argument("--storm-s", type=float, default=4.0, help="wrong-password storm length")
    parser.add_argument("--rate", type=float, default=121.0, help="wrong-password attempts per second")
    parser.add_argument("--connections", type=int, default=1000, help="valid connections opened and held")
    parser.add_argument("--valid-rate", type=float, default=250.0, help="valid connections opened per second")
    parser.add_argument(
        "--valid-max-s", type=float, default=12.0, help="give up opening valid ones after this"
    )
    args = parser.parse_args()
    rows = [run_config(config_named(name), args) for name in args.configs.split(",") if name]
    write_results(rows, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
