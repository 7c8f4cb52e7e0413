"""The directory's events stream has a size bound (`KVF_DIRECTORY_EVENTS_MAX_BYTES`, 1 GiB by
default, oldest events dropped first). Review, 2026-12-06: bounded by age only (24 h), a tenant's
lookups alone grew it ~0.4 MB/s (`accessed` events) in the JetStream store the leader leases need.
A store too small to reserve the bound (nats-server reserves `max_bytes` of its
`max_file_store`) gets the stream bounded by age only, with a warning, rather than no stream."""

from __future__ import annotations

from pathlib import Path

import nats
import pytest
from nats.js.api import DiscardPolicy, StreamConfig

from kvfabric.directory.events import EVENTS_STREAM, EventsStream
from kvfabric.directory.settings import EVENTS_MAX_BYTES_DEFAULT, load_directory_settings
from kvfabric.directory.shell import DirectoryShell
from kvfabric.testing import NatsServer
from tests.unit.core.dirkit import new_core

pytestmark = pytest.mark.integration


def shell_config(max_bytes: int) -> StreamConfig:
    shell = DirectoryShell(
        new_core(), tick_ms=100, events_outbox_max=8, events_max_age_s=60, free_timeout_s=1.0,
        events_max_bytes=max_bytes,
    )  # fmt: skip
    return shell.events_config()


def test_the_bound_is_on_by_default() -> None:
    env = {"KVF_CLUSTER_SECRET": "s" * 32}
    assert load_directory_settings(env).events_max_bytes == EVENTS_MAX_BYTES_DEFAULT == 1 << 30


async def test_the_stream_is_bounded_and_drops_its_oldest(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        await EventsStream(nc, shell_config(1 << 20)).ensure()
        info = await nc.jetstream().stream_info(EVENTS_STREAM)
        assert info.config.max_bytes == 1 << 20 and info.config.discard == DiscardPolicy.OLD
    finally:
        await nc.close()


@pytest.mark.parametrize("step", ["ensure", "recreate"])
async def test_a_store_too_small_for_the_bound_gets_the_stream_bounded_by_age(
    tmp_path: Path, step: str
) -> None:
    """At start (`ensure`) and when the directory's repair recreates a stuck stream: on a store
    that cannot reserve the bound the recreate failed every time, where before the bound it
    succeeded (review of the day, 2026-12-06)."""
    conf = tmp_path / "small.conf"
    conf.write_text("jetstream { max_file_store: 64MB }\n")
    with NatsServer(tmp_path / "store", extra_args=["-c", str(conf)]) as small:
        nc = await nats.connect(small.url)
        try:
            stream = EventsStream(nc, shell_config(1 << 30))
            if step == "ensure":
                await stream.ensure()
            else:
                assert await stream._add(nc.jetstream(), "recreated", missing=True) == "recreated"
            info = await nc.jetstream().stream_info(EVENTS_STREAM)
            assert info.config.max_bytes in (-1, None) and stream.config.max_bytes == -1
        finally:
            await nc.close()
