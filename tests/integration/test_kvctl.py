"""`kvctl` against a live local cluster (nats + directory + one segment as subprocesses): every
command in text and `--json`, and its errors (unknown group, directory down, undecodable key)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
from nats.aio.client import Client as NatsClient
from typer.testing import CliRunner, Result

from kvfabric.ctl.cli import app
from kvfabric.format.key import ChunkGroupId, KVKey
from kvfabric.proto import directory as m
from kvfabric.testing import NatsServer, ServiceProcess
from tests.integration.cluster import directory_call, directory_process, segment_process
from tests.integration.test_segment_service import put_and_commit
from tests.unit.core.dirkit import groups, key

pytestmark = pytest.mark.integration

SEGMENT = "seg-ctl"


@pytest.fixture
def cluster(nats_server: NatsServer) -> Iterator[ServiceProcess]:
    with (
        directory_process(nats_server),
        segment_process(nats_server, SEGMENT, 64 << 20, KVF_SEGMENT_UCX="0") as segment,
    ):
        yield segment


def kvctl(*args: str, url: str | None = None) -> Result:
    extra = ["--nats-url", url, "--timeout-s", "3"] if url is not None else []
    return CliRunner().invoke(app, [*args, *extra])


async def run(*args: str, url: str | None = None) -> Result:
    return await asyncio.to_thread(kvctl, *args, url=url)


async def ok_json(*args: str, url: str) -> Any:
    result = await run(*args, "--json", url=url)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


async def ok_text(*args: str, url: str) -> str:
    result = await run(*args, url=url)
    assert result.exit_code == 0, result.output
    return result.stdout


def test_key_decode_and_bad_key() -> None:
    (g,) = groups(1, seed=31)
    k = KVKey.from_bytes(key(g, rank=0))
    for form in (str(k), k.to_bytes().hex()):
        result = kvctl("key", "decode", form, "--json")
        assert result.exit_code == 0, result.output
        doc = json.loads(result.stdout)
        assert doc["kind"] == "key" and doc["readable"] == str(k) and doc["chunk_group"] == str(g)
        assert doc["chain_hash"] == g.chain_hash.hex() and doc["tp_rank"] == 0
    text = kvctl("key", "decode", str(g))
    assert text.exit_code == 0 and "chunk_group" in text.stdout and g.chain_hash.hex() in text.stdout
    for bad in ("kvf1:nonsense", "zz", "abcd"):
        result = kvctl("key", "decode", bad)
        assert result.exit_code == 2
        assert result.stderr.startswith("bad_request: ") and result.stderr.count("\n") == 1


async def test_every_command_against_a_live_cluster(
    nats_server: NatsServer, nats_client: NatsClient, cluster: ServiceProcess
) -> None:
    url = nats_server.url
    (g,) = groups(1, seed=32)
    data = os.urandom(4096)
    loc = await put_and_commit(nats_client, key(g), data)

    # status: the segment from list_segments and the services from $SRV.PING
    doc = await ok_json("status", url=url)
    (seg,) = doc["segments"]
    assert seg["segment_id"] == SEGMENT and seg["state"] == "up" and seg["capacity_bytes"] == 64 << 20
    assert {"directory", "segment"} <= {s["name"] for s in doc["services"]}
    text = await ok_text("status", url=url)
    assert SEGMENT in text and "directory" in text

    # objects ls / manifest show (read-only: no lease appears)
    doc = await ok_json("objects", "ls", url=url)
    (listed,) = doc["groups"]
    assert listed["readable"] == str(g) and listed["state"] == "published"
    domain = g.domain_digest.hex()
    assert len((await ok_json("objects", "ls", "--domain", domain, "--limit", "5", url=url))["groups"]) == 1
    assert (await ok_json("objects", "ls", "--domain", "00" * 16, url=url))["groups"] == []
    assert str(g) in await ok_text("objects", "ls", url=url)
    for form in (str(g), str(KVKey.from_bytes(key(g))), g.to_bytes().hex(), g.chain_hash.hex()):
        shown = await ok_json("manifest", "show", form, url=url)
        (obj,) = shown["objects"]
        assert obj["size_bytes"] == 4096 and obj["checksum"] == loc.checksum.hex()
        assert obj["replicas"][0]["segment_id"] == SEGMENT and obj["replicas"][0]["tier"] == "dram"
    text = await ok_text("manifest", "show", str(g), url=url)
    assert loc.checksum.hex() in text and SEGMENT in text and "dram slot" in text

    assert (await ok_json("leases", "ls", url=url))["leases"] == []

    # pins add / leases ls / pins rm
    pin = await ok_json("pins", "add", str(g), "--ttl-ms", "60000", "--holder", "ops", url=url)
    assert pin["pinned_groups"] == 1 and pin["pin_id"] > 0
    (lease,) = (await ok_json("leases", "ls", url=url))["leases"]
    assert lease["is_pin"] and lease["holder_id"] == "ops" and lease["lease_id"] == pin["pin_id"]
    assert "ops" in await ok_text("leases", "ls", url=url)
    (pinned,) = (await ok_json("pins", "ls", url=url))["pins"]
    assert pinned["lease_id"] == pin["pin_id"] and "ops" in await ok_text("pins", "ls", url=url)
    wrong = await run("pins", "rm", str(pin["pin_id"]), "--holder", "other", url=url)
    assert wrong.exit_code == 1 and ":" in wrong.stderr
    removed = await ok_text("pins", "rm", str(pin["pin_id"]), "--holder", "ops", url=url)
    assert "removed" in removed
    assert (await ok_json("leases", "ls", url=url))["leases"] == []
    assert (await ok_json("pins", "ls", url=url))["pins"] == []
    pin2 = await ok_text("pins", "add", g.to_bytes().hex(), "--holder", "ops", url=url)
    assert "1 group(s) pinned" in pin2

    # segment drain and undo
    drained = await ok_json("segment", "drain", SEGMENT, url=url)
    assert drained["draining"] is True and drained["segment_id"] == SEGMENT
    assert "accepting writes" in await ok_text("segment", "drain", SEGMENT, "--undo", url=url)
    missing = await run("segment", "drain", "no-such-seg", url=url)
    assert missing.exit_code == 1 and missing.stderr.startswith("unavailable: ")

    # events tail
    events = (await ok_json("events", "tail", "--n", "50", url=url))["events"]
    kinds = [e["kind"] for e in events]
    assert "SegmentUp" in kinds and "GroupsPublished" in kinds  # one event per put_commit
    published = next(e for e in events if e["kind"] == "GroupsPublished")
    assert [p["group"] for p in published["event"]["groups"]] == [g.chain_hash.hex()]
    assert len((await ok_json("events", "tail", "-n", "1", url=url))["events"]) == 1
    text = await ok_text("events", "tail", url=url)
    assert "SegmentUp" in text and "GroupsPublished" in text

    # unknown group: not_found, exit 1
    (other,) = groups(1, seed=33)
    result = await run("manifest", "show", str(other), url=url)
    assert result.exit_code == 1 and result.stderr == "not_found: no such chunk group\n"
    bad = await run("manifest", "show", "kvg1:bad", url=url)
    assert bad.exit_code == 2 and bad.stderr.startswith("bad_request: ")

    # read commands granted nothing: only the pin we placed is held
    reply = await directory_call(nats_client, "list_leases", m.ListLeases())
    assert isinstance(reply, m.LeaseList) and [x.is_pin for x in reply.leases] == [True]
    assert isinstance(ChunkGroupId.parse(listed["readable"]), ChunkGroupId)


async def test_directory_down_is_unavailable(nats_server: NatsServer) -> None:
    for args in (
        ("status",),
        ("objects", "ls"),
        ("manifest", "show", "00" * 32),
        ("leases", "ls"),
        ("pins", "ls"),
    ):
        result = await run(*args, url=nats_server.url)
        assert result.exit_code == 1, result.output
        assert result.stderr.startswith("unavailable: no responders on kvf.v1.directory."), result.stderr
        assert result.stderr.count("\n") == 1
    events = await run("events", "tail", url=nats_server.url)
    assert events.exit_code == 1 and events.stderr.startswith("unavailable: ")
