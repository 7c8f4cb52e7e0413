"""A whole-cluster power cycle keeps the disk tier (issue 23 step 5, "Done when"): a local cluster
(`tools/localcluster.py up`, authenticated, one segment with a disk tier, the data folder of its
own) takes a tenant's saves; DRAM pressure makes the eviction policy demote most of them to disk;
then every process (supervisor, nats-server, directory, segment, services) is SIGKILLed (or
the cluster is stopped cleanly with `down`), and `up` on the same data folder brings it back:
the cluster secret and the tenant's salt are the data folder's (so the same keys), the segment
recovers its disk file, the directory adopts what it recovered, and >= 99 % of ALL the objects
that were on disk hit through the client's lookup and load with identical bytes.

A chunk is found only with its whole prefix (a lookup folds from chunk 0), and the arena is gone
after the cycle: the policy demotes tails first, so a prompt's head often stays in DRAM while its
tails are on disk. It copies such a head to disk too before the tails go (`keep_arena`: the arena
replica stays), so the disk tier holds whole prefixes. `shared` prompts share their first chunk
(a system prompt): that head never leaves DRAM (its tails keep it from being a leaf), so without
the copy not one of the disk objects would be found after the cycle."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from kvfabric.client import EngineSpec, KvClient, settings_from_env
from kvfabric.format.key import KVLayout, ModelFingerprint
from kvfabric.proto.segment import tier_of_slot
from kvfabric.testing import metric_value, scrape_metrics

pytestmark = pytest.mark.integration

TOOL = Path(__file__).resolve().parents[2] / "tools" / "localcluster.py"
ARENA_BYTES = 16 << 20
SSD_BYTES = 64 << 20
OBJECT_BYTES = 64 << 10
TOKENS_PER_CHUNK = 16
CHUNKS = 8  # per prompt
PROMPTS = 20  # 160 objects, 10 MiB: 62 % of the arena, past the 50 % watermark
POLICY_ENV = {
    "KVF_EVICTION_HIGH_WATERMARK_PCT": "50",
    "KVF_EVICTION_LOW_WATERMARK_PCT": "10",
    "KVF_EVICTION_TICK_MS": "50",
    "KVF_EVICTION_SEGMENTS_REFRESH_MS": "200",
}
HIT_SHARE_MIN = 0.99


def tool(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, **POLICY_ENV)
    return subprocess.run(
        [sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=300, env=env
    )


def tenant_client(run: Path) -> tuple[KvClient, str]:
    state = json.loads((run / "cluster.json").read_text())
    tenant_env: dict[str, str] = state["auth"]["tenants"]["demo"]
    settings = settings_from_env(tenant_env, nats_url=state["nats_url"])
    spec = EngineSpec(
        domain=settings.share_domain(),
        model=ModelFingerprint(
            model_id="power-cycle", weights_revision="1", kv_dtype="uint8", attn_config_digest="-"
        ),
        layout=KVLayout(
            tp_size=1,
            tp_rank=0,
            pp_stage=0,
            layer_group=0,
            layer_group_count=1,
            tokens_per_chunk=TOKENS_PER_CHUNK,
            tensor_layout="power-cycle-bytes",
        ),
    )
    return KvClient(settings, spec), tenant_env["KVF_CLIENT_DOMAIN_SALT_HEX"]


def prompt(i: int, shared: bool = False) -> list[int]:
    """Prompt i's tokens; `shared`: its first chunk is every prompt's (a system prompt)."""
    owner = [0 if shared and t < TOKENS_PER_CHUNK else i for t in range(CHUNKS * TOKENS_PER_CHUNK)]
    return [(owner[t] * 7919 + t * 31) % 50_000 for t in range(CHUNKS * TOKENS_PER_CHUNK)]


def payload(i: int, chunk: int, shared: bool = False) -> bytes:
    owner = 0 if shared and chunk == 0 else i
    return (owner * 1000 + chunk).to_bytes(4, "little") * (OBJECT_BYTES // 4)


def tiers(client: KvClient, tokens: list[int]) -> list[set[str]]:
    hit = client.lookup(tokens)
    try:
        return [{tier_of_slot(r.slot) for r in chunk[0].replicas} for chunk in hit.objects]
    finally:
        client.release(hit)


def identical_hits(client: KvClient, i: int, shared: bool) -> set[int]:
    """The chunks of prompt i looked up and loaded with identical bytes."""
    hit = client.lookup(prompt(i, shared))
    out = [[bytearray(OBJECT_BYTES)] for _ in range(hit.chunks)]
    result = client.load(hit, out)
    client.release(hit)
    loaded = range(result.tokens // TOKENS_PER_CHUNK)
    return {c for c in loaded if bytes(out[c][0]) == payload(i, c, shared)}


def disk_pool_bytes(run: Path, segment_id: str) -> float:
    """What the eviction policy counts in the segment's disk pool (its metrics)."""
    for line in (run / "logs" / "eviction.log").read_text().splitlines():
        if '"metrics_server_started"' in line:
            text = scrape_metrics(json.loads(line)["metrics_port"])
            return metric_value(text, "kvfabric_eviction_pool_used_bytes", segment=f"{segment_id}#ssd") or 0.0
    return 0.0


def kill_everything(run: Path) -> list[int]:
    """SIGKILL the supervisor first (it would restart its children), then every child."""
    state: dict[str, Any] = json.loads((run / "cluster.json").read_text())
    pids = [int((run / "supervisor.pid").read_text())] + [p for p in state["pids"].values() if p]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    for pid in pids:  # gone, zombies reaped too (`up` takes a live supervisor pid for a running cluster)
        while Path(f"/proc/{pid}").exists():
            assert time.monotonic() < deadline, f"pid {pid} outlived SIGKILL"
            time.sleep(0.05)
    return pids


# Pairwise: each stop mode and each head mode once (make test time; the arena is lost either way).
@pytest.mark.parametrize(("stop", "head"), [("sigkill", "own"), ("down", "shared")])
def test_every_process_stopped_then_up_on_the_same_data_folder_hits_the_disk_tier(
    tmp_path: Path, stop: str, head: str
) -> None:
    """`sigkill`: every process SIGKILLed (a power cycle); `down`: `make down` (a clean stop:
    the run folder goes, the data folder stays), then `up` again. `head`: each prompt its own
    first chunk, or one `shared` by all (a system prompt, never out of DRAM)."""
    shared = head == "shared"
    run, data, prefix = tmp_path / "run", tmp_path / "data", f"p{uuid.uuid4().hex[:6]}"
    up = [
        "up",
        "--run-dir",
        str(run),
        "--data-dir",
        str(data),
        "--ssd-bytes",
        str(SSD_BYTES),
        "--segments",
        "1",
        "--segment-bytes",
        str(ARENA_BYTES),
        "--segment-prefix",
        prefix,
        "--nats-port",
        "0",
    ]
    try:
        first = tool(*up)
        assert first.returncode == 0, first.stdout + first.stderr
        client, salt = tenant_client(run)
        try:
            for i in range(PROMPTS):
                saved = client.save(prompt(i, shared), [[payload(i, c, shared)] for c in range(CHUNKS)])
                assert saved.chunks_saved + saved.chunks_existing == CHUNKS, saved
            # The policy demotes down to the low watermark: wait until the disk share stops growing.
            on_disk, settled = -1, 0
            deadline = time.monotonic() + 60
            while settled < 3 and time.monotonic() < deadline:
                time.sleep(0.5)
                found = [tiers(client, prompt(i, shared)) for i in range(PROMPTS)]
                now = len({disk_object(i, c, shared) for i, p in enumerate(found) for c, t in enumerate(p)
                           if "ssd" in t})  # fmt: skip
                settled = settled + 1 if now == on_disk else 0
                on_disk = now
            assert all(len(p) == CHUNKS for p in found), "an object was dropped, not demoted"
        finally:
            client.close()
        # Every object with a disk replica, each once (a shared head is every prompt's chunk 0).
        disk = {disk_object(i, c, shared) for i, p in enumerate(found) for c, t in enumerate(p) if "ssd" in t}
        # Of those, the ones whose whole prefix has a disk replica too: findable after the cycle.
        findable = {
            disk_object(i, c, shared)
            for i, p in enumerate(found)
            for c in range(CHUNKS)
            if all("ssd" in t for t in p[: c + 1])
        }
        assert len(disk) >= 64, f"only {len(disk)} objects on disk"

        if stop == "sigkill":
            kill_everything(run)
        else:
            stopped = tool("down", "--run-dir", str(run))
            assert stopped.returncode == 0 and not run.exists(), stopped.stdout + stopped.stderr
        second = tool(*up)  # the run folder of the killed cluster is cleaned, the data folder kept
        assert second.returncode == 0, second.stdout + second.stderr
        assert "secret kept" in second.stdout and "auth plan kept" in second.stdout
        client, salt_after = tenant_client(run)
        try:
            assert salt_after == salt  # the same share domain: the same keys
            hit: set[tuple[int, int]] = set()
            deadline = time.monotonic() + 60  # the directory adopts as the segment registers
            while time.monotonic() < deadline:
                hit = {
                    disk_object(i, c, shared)
                    for i in range(PROMPTS)
                    for c in identical_hits(client, i, shared)
                }
                if disk <= hit:
                    break
                time.sleep(0.5)
        finally:
            client.close()
        share = len(disk & hit) / len(disk)  # over ALL the objects that were on disk
        # The restarted policy knows the adopted disk objects (republished by the rebuild): its
        # disk pool holds them, so its watermark can drop them when the disk fills.
        deadline = time.monotonic() + 30
        while disk_pool_bytes(run, f"{prefix}-1") < len(disk) * OBJECT_BYTES:
            assert time.monotonic() < deadline, disk_pool_bytes(run, f"{prefix}-1")
            time.sleep(0.5)
        print(
            f"power cycle ({stop}, {head} heads): {len(disk)} objects on disk, {len(findable & disk)}"
            f" with their whole prefix on disk, {len(disk & hit)} hit with identical bytes:"
            f" share {share:.3f} of all disk objects"
        )
        assert share >= HIT_SHARE_MIN, (sorted(disk - hit), len(disk))
    finally:
        tool("down", "--run-dir", str(run))


def disk_object(i: int, chunk: int, shared: bool) -> tuple[int, int]:
    """One object's identity across prompts: a shared head is one object, prompt 0's chunk 0."""
    return (0, 0) if shared and chunk == 0 else (i, chunk)
