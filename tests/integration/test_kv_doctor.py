"""The directory's lease bucket after a full disk (kvfabric.directory.kv_doctor): a real
nats-server with its store on an 8 MiB tmpfs (root); the lease bucket's store keeps a write error
(`/healthz` names it), the space comes back, renewals and acquisitions still get no answer. The
instance that claims the stuck incarnation first (a create in the config bucket) recreates the
bucket once the lease TTL has passed, its revisions (the shards' epochs) continued; another
instance's claim loses and it deletes nothing."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.js.api import KeyValueConfig, StorageType

from kvfabric.directory import kv_buckets
from kvfabric.directory.kv_doctor import KvDoctor, stream_write_errors
from kvfabric.testing.nats_server import NatsServer
from tests.unit.tools.toolkit import load_tool

pytestmark = [pytest.mark.timeout(120)]

cs = load_tool("chaos_store")
LEADERS = "KVF_DIRECTORY_LEADERS"
STREAM = f"KV_{LEADERS}"
BIG = b"v" * (128 << 10)


def test_a_stuck_lease_bucket_is_recreated_by_one_instance_with_its_revisions_continued() -> None:
    asyncio.run(_stuck_bucket())


async def _stuck_bucket() -> None:
    run = Path(tempfile.mkdtemp(prefix="kvf-kv-doctor-test-"))
    store = cs.StoreDisk()
    store.prepare(run, {"nats_store_bytes": 8 << 20})
    server = NatsServer(run / "nats")
    try:
        server.start()
        nc = await nats.connect(server.url)
        js = nc.jetstream(timeout=2.0)
        await js.create_key_value(KeyValueConfig(bucket=kv_buckets.CONFIG_BUCKET, history=1))
        leases = await js.create_key_value(
            KeyValueConfig(bucket=LEADERS, history=1, ttl=1.0, storage=StorageType.FILE)
        )
        first = await leases.create("shard-0", b"a")
        store.fire({"action": "fill_store"})
        for _ in range(40):
            if STREAM in await stream_write_errors(server.monitor_url):
                break
            with contextlib.suppress(TimeoutError, nats.errors.Error):
                await leases.put("filler", BIG)
        assert STREAM in await stream_write_errors(server.monitor_url)
        clock = [0.0]
        doctors = [
            KvDoctor(
                nc,
                server.monitor_url,
                name,
                {STREAM: 1.5},
                config_bucket="KVF_DIRECTORY_CONFIG",
                clock=lambda: clock[0],
            )
            for name in ("a", "b")
        ]
        assert await doctors[0].check_once() == []  # first seen: wait the TTL + margin
        clock[0] = 1.0
        assert await doctors[0].check_once() == []
        assert await doctors[1].check_once() == []
        clock[0] = 1.6  # long enough, but the disk is still full: nothing is deleted
        assert await doctors[0].check_once() == [] and (await js.stream_info(STREAM)).state.last_seq
        store.fire({"action": "free_store"})
        last = (await js.stream_info(STREAM)).state.last_seq
        with pytest.raises((TimeoutError, nats.errors.Error)):  # sticky: nobody can renew or win
            await leases.update("shard-0", b"a", last=first)
        clock[0] = 2.0  # both at once: exactly one claims the stuck incarnation and recreates it
        done = await asyncio.gather(*(d.check_once() for d in doctors))
        assert sorted(done) == [[], [STREAM]]
        assert sum(d.recreated for d in doctors) == 1 and sum(d.failed for d in doctors) == 0
        assert STREAM not in await stream_write_errors(server.monitor_url)
        # Had the add after the delete failed, the bucket would be missing: an instance that
        # starts then makes it from the claimed floor, never from revision 1.
        await js.delete_stream(STREAM)
        leases = await kv_buckets.open_bucket(nc, LEADERS, 1.0)
        revision = await leases.create("shard-0", b"c")  # a new term, its epoch above every old one
        assert revision == last + 1
        clock[0] = 4.0  # healed: nobody deletes the new incarnation
        assert [await d.check_once() for d in doctors] == [[], []]
        assert (await leases.get("shard-0")).value == b"c"
        await nc.close()
    finally:
        server.stop()
        assert store.close(run) == []
