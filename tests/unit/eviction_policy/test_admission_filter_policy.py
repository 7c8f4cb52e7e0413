"""The policy's side of live admission (issue 25 item 4): settings, and the filter it publishes
(decodable, bounded, pools past the low watermark only), in status."""

from __future__ import annotations

import asyncio

import pytest

from kvfabric.core.eviction import EvictionConfig, EvictionCore, TenantQuota
from kvfabric.core.eviction_admission import ADMISSION_BLOOM_IDS_MAX, bloom_has
from kvfabric.eviction_policy.settings import load_eviction_settings
from kvfabric.eviction_policy.shell import EvictionShell
from kvfabric.format.ids import ChainHash, Namespace
from kvfabric.proto import directory as m
from kvfabric.proto import eviction as e
from kvfabric.runtime.config import SettingsError

NAMESPACE = Namespace(bytes(4) + b"A" * 16 + bytes(34))


def test_admission_is_off_by_default_and_predicted_needs_density() -> None:
    assert not load_eviction_settings({}).admission
    on = load_eviction_settings({"KVF_EVICTION_ADMISSION": "predicted"})  # the default policy: density
    assert on.admission and on.admission_publish_ms == 1_000 and on.core.policy == "density"
    with pytest.raises(SettingsError):
        load_eviction_settings({"KVF_EVICTION_POLICY": "lru", "KVF_EVICTION_ADMISSION": "predicted"})
    with pytest.raises(SettingsError):
        load_eviction_settings({"KVF_EVICTION_POLICY": "density", "KVF_EVICTION_ADMISSION": "second_hit"})


def pressed_shell(monkeypatch: pytest.MonkeyPatch) -> tuple[EvictionCore, EvictionShell]:
    """A density core whose pool s1 is pressed (s2 has room), with a frontier that bites."""
    core = EvictionCore(
        EvictionConfig(policy="density", high_watermark=0.9, low_watermark=0.5, density_recompute_every=4),
        {b"B" * 16: TenantQuota(guaranteed_bytes=100)},
    )
    shell = EvictionShell(
        core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0, admission_publish_ms=50
    )
    shell.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=100), 0)
    shell.apply(m.SegmentUp(segment_id="s2", incarnation=1, capacity_bytes=10_000), 0)
    for i in range(12):
        shell.apply(
            m.GroupPublished(
                group=ChainHash(i.to_bytes(32, "little")),
                chunk_index=0,
                members=1,
                namespace=NAMESPACE,
                placements=[m.SegmentBytes("s1", 6), m.SegmentBytes("s2", 6)],
            ),
            1_000 * i,
        )
    shell.last_seq = 12
    # A frontier that bites (this history leaves a leaf of density 0: no limit would bite).
    monkeypatch.setattr(core, "_density_frontier", lambda _now_ms: 1e9)
    return core, shell


async def test_the_published_filter_decodes_and_lists_pressed_pools_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _core, shell = pressed_shell(monkeypatch)
    message = e.eviction_decoder.decode(await shell.admission_filter(20_000))
    assert isinstance(message, e.AdmissionFilter)
    assert message.policy == "density" and message.events_seq == 12 and message.generated_ms == 20_000
    # s1 holds 72 of 100 bytes (past 50 %), s2 72 of 10 000: only s1 can refuse.
    assert [p.segment_id for p in message.pools] == ["s1"]
    for pool in message.pools:
        assert len(pool.group_bytes_max) == e.ADMISSION_LENGTH_CLASSES
    assert message.protected_domains == [b"B" * 16]
    status = shell.status()
    assert status.counters["admission_filter_bytes"] == shell.admission_filter_bytes > 0


async def test_the_loop_keeps_running_while_the_bloom_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bloom of the ghost's 65,536 most recent ids (100-440 ms of hashing) is built off the
    event loop: a task on the loop gets turns meanwhile (none when it was built on the loop)."""
    core, shell = pressed_shell(monkeypatch)
    density = core._density
    assert density is not None
    for i in range(ADMISSION_BLOOM_IDS_MAX):
        density._ghost[(1_000 + i).to_bytes(32, "little")] = 0  # (any packed entry)
    turns = 0
    building = True

    async def other_work() -> None:
        nonlocal turns
        while building:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(other_work())
    await asyncio.sleep(0)
    before = turns
    data = await shell.admission_filter(20_000)
    during = turns - before
    building = False
    await task
    message = e.eviction_decoder.decode(data)
    assert isinstance(message, e.AdmissionFilter) and message.pools
    assert bloom_has(message.seen_bloom, message.seen_bloom_hashes, (1_000).to_bytes(32, "little"))
    assert during > 0
