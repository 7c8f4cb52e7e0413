"""A whole-cluster power cycle keeps the disk tier (issue 23 step 5, "Done when"): a local cluster
(`tools/localcluster.py up`, authenticated, one segment with a disk tier, the data folder of its
own) takes a tenant's saves; DRAM pressure makes the eviction policy demote most of them to disk;
then every process (supervisor, nats-server, directory, segment, services) is SIGKILLed (or
the cluster is stopped cleanly with `down`), and `up` on the same data folder brings it back:
the cluster secret and the tenant's salt are the data folder's (so the same keys), the segment
recovers its disk file, the directory adopts what it recovered, and >= 99 % of the objects
that were on disk hit through the client's lookup and load with identical bytes.

A chunk is found only with its whole prefix (a lookup folds from chunk 0), and the arena is gone
after the cycle: the objects counted are those whose prefix was on disk too (the policy demotes
tails first, so a prompt whose head stayed in DRAM cannot be found again: counted and shown)."""

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


def prompt(i: int) -> list[int]:
    return [(i * 7919 + t * 31) % 50_000 for t in range(CHUNKS * TOKENS_PER_CHUNK)]


def payload(i: int, chunk: int) -> bytes:
    return (i * 1000 + chunk).to_bytes(4, "little") * (OBJECT_BYTES // 4)


def tiers(client: KvClient, tokens: list[int]) -> list[set[str]]:
    hit = client.lookup(tokens)
    try:
        return [{tier_of_slot(r.slot) for r in chunk[0].replicas} for chunk in hit.objects]
    finally:
        client.release(hit)


def identical_hits(client: KvClient, i: int) -> int:
    """Chunks of prompt i looked up and loaded with identical bytes."""
    hit = client.lookup(prompt(i))
    out = [[bytearray(OBJECT_BYTES)] for _ in range(hit.chunks)]
    result = client.load(hit, out)
    client.release(hit)
    return sum(bytes(out[c][0]) == payload(i, c) for c in range(result.tokens // TOKENS_PER_CHUNK))


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


@pytest.mark.parametrize("stop", ["sigkill", "down"])
def test_every_process_stopped_then_up_on_the_same_data_folder_hits_the_disk_tier(
    tmp_path: Path, stop: str
) -> None:
    """`sigkill`: every process SIGKILLed (a power cycle); `down`: `make down` (a clean stop:
    the run folder goes, the data folder stays), then `up` again."""
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
                saved = client.save(prompt(i), [[payload(i, c)] for c in range(CHUNKS)])
                assert saved.chunks_saved == CHUNKS, saved
            # The policy demotes down to the low watermark: wait until the disk share stops growing.
            on_disk, settled = -1, 0
            deadline = time.monotonic() + 60
            while settled < 3 and time.monotonic() < deadline:
                time.sleep(0.5)
                found = [tiers(client, prompt(i)) for i in range(PROMPTS)]
                now = sum("ssd" in t for p in found for t in p)
                settled = settled + 1 if now == on_disk else 0
                on_disk = now
            assert all(len(p) == CHUNKS for p in found), "an object was dropped, not demoted"
        finally:
            client.close()
        # Objects with a disk replica whose whole prefix has one too: findable after the cycle.
        findable = {i: 0 for i in range(PROMPTS)}
        for i, chunks in enumerate(found):
            while findable[i] < CHUNKS and "ssd" in chunks[findable[i]]:
                findable[i] += 1
        expected = sum(findable.values())
        assert expected >= 64, f"only {expected} of {on_disk} disk objects have their prefix on disk"

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
            hits: dict[int, int] = {}
            deadline = time.monotonic() + 60  # the directory adopts as the segment registers
            while time.monotonic() < deadline:
                hits = {i: identical_hits(client, i) for i in range(PROMPTS) if findable[i]}
                if sum(min(h, findable[i]) for i, h in hits.items()) >= expected:
                    break
                time.sleep(0.5)
        finally:
            client.close()
        share = sum(min(h, findable[i]) for i, h in hits.items()) / expected
        # The restarted policy knows the adopted disk objects (republished by the rebuild): its
        # disk pool holds them, so its watermark can drop them when the disk fills.
        deadline = time.monotonic() + 30
        while disk_pool_bytes(run, f"{prefix}-1") < on_disk * OBJECT_BYTES:
            assert time.monotonic() < deadline, disk_pool_bytes(run, f"{prefix}-1")
            time.sleep(0.5)
        print(f"power cycle ({stop}): {on_disk} objects on disk, {expected} findable, hit share {share:.3f}")
        assert share >= HIT_SHARE_MIN, (hits, findable)
    finally:
        tool("down", "--run-dir", str(run))
