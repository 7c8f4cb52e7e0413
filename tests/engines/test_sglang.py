"""kvfabric as SGLang's HiCache L3 storage, driven through SGLang 0.5.23's own classes on CPU:
the backend is loaded by module path (`StorageBackendFactory`, backend "dynamic"), pages live in
SGLang's host pool (`MHATokenToKVPoolHost` over its CPU device pool), page keys are SGLang's
hashes, and the calls follow SGLang's controller (`sglangkit.prefetch` / `backup`).

Pages written by another process's backend are read byte-identical (chained and per-page keys,
page_first and layer_first); under SGLang's failure injector every page reported loaded is still
identical; a corrupted stored byte, a dead segment and a silent directory give a shorter hit or a
miss, never wrong bytes or an exception; another tenant or model revision sees nothing; leases
taken by `batch_exists` are given back after the get (or `exists_hold_ms`); a cache that cannot
start misses.

Needs SGLang (.venv-sglang, `make test-engines`); deselected from `make test`.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvfabric.proto import directory as m
from kvfabric.testing import NatsServer, ServiceProcess
from kvfabric.testing import sglangkit as kit
from kvfabric.testing.ports import free_port
from tests.integration.clientkit import corrupt_stored_byte
from tests.integration.cluster import directory_call, directory_process, segment_process

pytestmark = [pytest.mark.integration, pytest.mark.sglang, pytest.mark.timeout(300)]

PAGES = 40  # per prompt: two host-pool "nodes" of 24 and 16 pages


@pytest.fixture
def cluster(nats_server: NatsServer) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    with (
        directory_process(nats_server) as directory,
        # No scrubbing: a corrupted byte must reach a load, not be dropped by a scrub pass first.
        segment_process(nats_server, "seg-sglang", KVF_SEGMENT_SCRUB_BYTES_PER_S="0") as segment,
    ):
        yield directory, segment


def leases_held(nats: NatsServer) -> list[int]:
    """Group counts of the read leases the directory holds (every shard's)."""

    async def ask() -> list[int]:
        import nats as nats_py

        nc = await nats_py.connect(nats.url)
        try:
            reply = await directory_call(nc, "list_leases", m.ListLeases())
            assert isinstance(reply, m.LeaseList)
            return [lease.groups for lease in reply.leases if not lease.is_pin]
        finally:
            await nc.close()

    return asyncio.run(ask())


def leases_left(nats: NatsServer, within_s: float = 5.0) -> list[int]:
    """The read leases still held after the client's gathered releases had time to go back
    (`KvClient.release` does not wait: leases go back within `RELEASE_GATHER_MS`, 20 ms, and a
    request; docs/engines.md)."""
    deadline = time.monotonic() + within_s
    while (held := leases_held(nats)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return held


def write_elsewhere(nats: NatsServer, pages: int, *args: str) -> int:
    """Pages written by a backend in another process (SGLang's classes there too)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvfabric.testing.sglangkit",
            "write",
            "--nats",
            nats.url,
            "--pages",
            str(pages),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    stored: int = json.loads(out.stdout.strip().splitlines()[-1])["stored"]
    return stored


def reader(nats: NatsServer, layout: str = "page_first", **extra: Any) -> tuple[Any, Any]:
    pool = kit.host_pool(layout)
    return kit.backend(kit.extra_config(nats.url, **extra), pool, layout=layout), pool


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_pages_written_by_one_process_are_read_identical_by_another(
    nats_server: NatsServer, cluster: object, layout: str
) -> None:
    from kvfabric.engines.sglang import KvfabricStorage

    assert write_elsewhere(nats_server, PAGES, "--split", "24", "--layout", layout) == PAGES
    storage, pool = reader(nats_server, layout)
    assert isinstance(storage, KvfabricStorage)  # loaded by module path, no injector asked for
    keys = kit.page_keys(PAGES)
    at = kit.alloc_pages(pool, PAGES + 8)
    kit.scramble(pool, keys, at)
    # A prompt longer than what is stored: the stored pages, then a miss.
    longer = keys + kit.page_keys(PAGES + 8)[PAGES:]
    assert longer[:PAGES] == keys
    assert kit.prefetch(storage, longer, at, prefix=[]) == (PAGES, PAGES)
    assert all(kit.identical_pages(pool, keys, at))
    # A prefetch that starts past what the host already has (SGLang's usual case).
    kit.scramble(pool, keys, at)
    assert kit.prefetch(storage, keys[10:], at, prefix=keys[:10]) == (PAGES - 10, PAGES - 10)
    assert all(kit.identical_pages(pool, keys[10:], at))
    assert leases_left(nats_server) == []  # every exists lease given back after its get
    stats = storage.get_stats()
    assert sum(stats.prefetch_pgs) == 2 * PAGES - 10 and stats.prefetch_bandwidth
    storage.close()


def test_per_page_keys_without_prefix_keys(nats_server: NatsServer, cluster: object) -> None:
    """Without SGLang's `hicache_storage_pass_prefix_keys` each page is its own chain: found by
    any call, wherever it starts."""
    assert write_elsewhere(nats_server, 12, "--per-page", "--seed", "3") == 12
    storage, pool = reader(nats_server)
    keys = kit.page_keys(12, seed=3)
    at = kit.alloc_pages(pool, 12)
    kit.scramble(pool, keys, at)
    assert kit.prefetch(storage, keys[5:], at, prefix=None) == (7, 7)
    assert all(kit.identical_pages(pool, keys[5:], at))
    # Chained keys name every page after the first differently (the first page's chain is the
    # same one-page chain in both modes): a chained reader finds only that one.
    assert kit.prefetch(storage, keys, at, prefix=[]) == (1, 1)
    assert leases_left(nats_server) == []
    storage.close()


def test_a_hybrid_controllers_root_query_without_prefix_keys_finds_every_page(
    nats_server: NatsServer, cluster: object
) -> None:
    """SGLang 0.5.23's hybrid controller (plain MHA/MLA models) sends `prefix_keys=None` on an
    exists query whose prefix is empty (a request with nothing cached on the engine itself),
    while its gets and backups send `[]`. With chained keys in use (configured `chained_keys`,
    or learnt from any call that carried prefix keys) such a query is one at the sequence's
    start: every stored page is found, not only the first (review, 2026-12-05: a cold instance
    got at most one page, below SGLang's prefetch threshold)."""
    assert write_elsewhere(nats_server, 12, "--seed", "4") == 12
    keys = kit.page_keys(12, seed=4)
    configured, pool = reader(nats_server, chained_keys=True)
    at = kit.alloc_pages(pool, 12)
    assert kit.prefetch(configured, keys, at, prefix=[], hybrid=True) == (12, 12)
    assert all(kit.identical_pages(pool, keys, at))
    configured.close()
    learning, pool = reader(nats_server)
    at = kit.alloc_pages(pool, 12)
    assert kit.prefetch(learning, keys[:4], at, prefix=[]) == (4, 4)  # a call with prefix keys
    kit.scramble(pool, keys, at)
    assert kit.prefetch(learning, keys, at, prefix=[], hybrid=True) == (12, 12)
    assert all(kit.identical_pages(pool, keys, at))
    assert leases_left(nats_server) == []
    learning.close()


def test_failure_injector_never_yields_wrong_bytes(
    nats_server: NatsServer, cluster: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang's own `HiCacheStorageFailureInjector` around the backend (random failures and
    delays in every call): SGLang sees fewer pages, and every page it is told loaded is right."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector

    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.25")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.005")
    storage, pool = reader(nats_server)
    assert isinstance(storage, HiCacheStorageFailureInjector)
    outcomes: list[tuple[int, int, int]] = []

    def seen_both() -> bool:  # a clean round through the wrapper, and a round with an injected failure
        return any(o[2] == 10 for o in outcomes) and any(o[0] < 10 or o[2] < 10 for o in outcomes)

    # A round is clean with p = 0.75^3 (set, exists, get): twelve rounds missed one in ~1/700 runs
    # (CI, stop 61). Go on past twelve until both outcomes were seen: 60 rounds miss in ~1e-14.
    for seed in range(60):
        if seed >= 12 and seen_both():
            break
        keys = kit.page_keys(10, seed=100 + seed)
        src = kit.alloc_pages(pool, 10)
        kit.fill(pool, keys, src)
        stored = kit.backup(storage, keys, src, prefix=[])
        dst = kit.alloc_pages(pool, 10)
        kit.scramble(pool, keys, dst)
        found, loaded = kit.prefetch(storage, keys, dst, prefix=[])
        assert loaded <= found <= 10
        assert all(kit.identical_pages(pool, keys[:loaded], dst)), (
            f"round {seed}: wrong bytes reported loaded"
        )
        outcomes.append((stored, found, loaded))
        pool.free(src)
        pool.free(dst)
    assert seen_both(), outcomes  # the path works through the wrapper, and failures were injected
    kit.kvfabric_of(storage).close()
    deadline = time.monotonic() + 5
    while leases_held(nats_server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leases_held(nats_server) == []


def test_corrupted_byte_is_a_shorter_hit_never_wrong_bytes(nats_server: NatsServer, cluster: object) -> None:
    assert write_elsewhere(nats_server, 12, "--seed", "7") == 12
    storage, pool = reader(nats_server)
    keys = kit.page_keys(12, seed=7)
    inner = kit.kvfabric_of(storage)
    hit = inner.client.lookup(kit_chain(keys))
    assert hit.chunks == 12
    corrupt_stored_byte(hit, 5)
    inner.client.release(hit)
    at = kit.alloc_pages(pool, 12)
    kit.scramble(pool, keys, at)
    found, loaded = kit.prefetch(storage, keys, at, prefix=[])
    assert loaded == 5 and found in (5, 12)  # the bad page and those after it: SGLang recomputes
    assert all(kit.identical_pages(pool, keys[:5], at))
    assert inner.client.metrics.fallbacks.labels("checksum")._value.get() >= 1
    storage.close()


def kit_chain(keys: list[str]) -> Any:
    from kvfabric.engines.sglang_keys import chain_words

    return chain_words([], keys)


def test_dead_segment_and_silent_directory_miss_in_bounded_time(
    nats_server: NatsServer, cluster: tuple[ServiceProcess, ServiceProcess]
) -> None:
    directory, segment = cluster
    assert write_elsewhere(nats_server, 8, "--seed", "11") == 8
    storage, pool = reader(nats_server, lookup_timeout_ms=500, load_timeout_ms=2000)
    keys = kit.page_keys(8, seed=11)
    at = kit.alloc_pages(pool, 8)
    # Silent directory: a miss within the lookup timeout.
    directory.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert kit.prefetch(storage, keys, at, prefix=[]) == (0, 0)
        assert time.monotonic() - started < 3.0
    finally:
        directory.send_signal(signal.SIGCONT)
    # Dead segment: whatever the directory still says, nothing wrong is reported loaded.
    kit.scramble(pool, keys, at)
    segment.send_signal(signal.SIGKILL)
    segment.wait(10)
    started = time.monotonic()
    _found, loaded = kit.prefetch(storage, keys, at, prefix=[])
    assert loaded == 0 and time.monotonic() - started < 10.0
    storage.close()


def test_batches_past_the_clients_save_bounds_are_stored_whole(
    nats_server: NatsServer, cluster: object
) -> None:
    """The client admits a save whole and drops one past `save_inflight_bytes_max`, and drops
    saves past `saves_queued_max` in flight: a chained batch over the byte bound (128 pages of
    8 MiB) and a per-page batch of more pages than the queue were never stored (review, stop
    68). A chained batch goes as saves of at most half the byte bound, one after another; a
    per-page batch at most half the queue at a time."""
    pool = kit.host_pool()
    page_bytes = kit.page_tensor(pool, "x").numel() * kit.page_tensor(pool, "x").element_size()
    chained = kit.backend(kit.extra_config(nats_server.url, save_inflight_bytes_max=3 * page_bytes), pool)
    keys = kit.page_keys(8, seed=41)
    at = kit.alloc_pages(pool, 8)
    kit.fill(pool, keys, at)
    assert kit.backup(chained, keys, at, prefix=[]) == 8  # was 0: dropped whole (`bytes`)
    kit.scramble(pool, keys, at)
    assert kit.prefetch(chained, keys, at, prefix=[]) == (8, 8)
    assert all(kit.identical_pages(pool, keys, at))
    chained.close()
    per_page = kit.backend(kit.extra_config(nats_server.url, saves_queued_max=4), pool)
    keys = kit.page_keys(12, seed=43)
    at = kit.alloc_pages(pool, 12)
    kit.fill(pool, keys, at)
    assert kit.backup(per_page, keys, at, prefix=None) == 12  # was cut past the queue
    kit.scramble(pool, keys, at)
    assert kit.prefetch(per_page, keys, at, prefix=None) == (12, 12)
    assert all(kit.identical_pages(pool, keys, at))
    per_page.close()


def test_other_tenant_or_revision_sees_nothing(nats_server: NatsServer, cluster: object) -> None:
    assert write_elsewhere(nats_server, 6, "--seed", "13") == 6
    keys = kit.page_keys(6, seed=13)
    for extra in ({"tenant_id": "tenant-other"}, {"weights_revision": "tiny-sglang-rev-2"}):
        storage, pool = reader(nats_server, **extra)
        at = kit.alloc_pages(pool, 6)
        assert kit.prefetch(storage, keys, at, prefix=[]) == (0, 0)
        storage.close()
    storage, pool = reader(nats_server)  # the writer's own key space does
    assert kit.prefetch(storage, keys, kit.alloc_pages(pool, 6), prefix=[]) == (6, 6)
    storage.close()


def test_exists_lease_given_back_when_no_get_comes(nats_server: NatsServer, cluster: object) -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo, PoolTransfer

    assert write_elsewhere(nats_server, 4, "--seed", "17") == 4
    storage, _pool = reader(nats_server, exists_hold_ms=300)
    keys = kit.page_keys(4, seed=17)
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    assert storage.batch_exists(keys, info) == 4
    assert leases_held(nats_server) != []  # held for the get
    time.sleep(0.4)
    assert storage.batch_exists(keys[:1], info) == 1  # any later call gives back expired holds
    time.sleep(0.3)
    storage.clear()  # clear gives back the rest; nothing stored is deleted
    deadline = time.monotonic() + 5
    while leases_held(nats_server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leases_held(nats_server) == []
    # v2 without side pools is v1; a side pool is not stored: no hit (SGLang recomputes).
    result = storage.batch_exists_v2(keys, None, info)
    assert result.kv_hit_pages == 4 and result.restorable_prefix_pages == [1, 2, 3, 4]
    side = PoolTransfer(name="mamba", keys=keys[-1:])
    assert storage.batch_exists_v2(keys, [side], info).kv_hit_pages == 0
    storage.clear()
    # The legacy calls miss (SGLang uses the zero-copy path).
    assert storage.batch_get(keys, [None] * 4) == [None] * 4 and not storage.exists(keys[0])
    assert storage.batch_exists(keys, info) == 4
    storage.close()


def test_a_cache_that_cannot_start_misses(nats_server: NatsServer) -> None:
    pool = kit.host_pool()
    keys = kit.page_keys(4, seed=19)
    at = kit.alloc_pages(pool, 4)
    kit.fill(pool, keys, at)
    down = kit.backend(kit.extra_config(f"nats://127.0.0.1:{free_port()}"), pool)
    assert kit.kvfabric_of(down).client.status.cause == "nats_unreachable"
    unnamed = kit.backend({**kit.extra_config(nats_server.url), "weights_revision": ""}, pool)
    assert kit.kvfabric_of(unnamed).client.status.cause == "config_error"  # "tiny-sglang" is no directory
    for storage in (down, unnamed):
        assert kit.backup(storage, keys, at, prefix=[]) == 0
        assert kit.prefetch(storage, keys, at, prefix=[]) == (0, 0)
        storage.close()


def test_random_weights_or_an_unreadable_kv_scales_file_leave_the_cache_disabled(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """SGLang's server args as the backend reads them (`get_server_args`): `--load-format dummy`
    (random weights) and, with `--kv-cache-dtype fp8_e4m3`, a `--quantization-param-path` that
    cannot be read leave the cache disabled (`config_error`: misses), never stored under the
    real model's key (review, stop 71); a readable scales file is in the key. With another KV
    dtype SGLang never reads the file: not refused, not keyed (review, stop 71)."""
    import sglang.srt.runtime_context as runtime

    pool = kit.host_pool()
    extra = kit.extra_config(f"nats://127.0.0.1:{free_port()}")
    served = {
        "kv_cache_dtype": "auto",
        "dtype": "float32",
        "quantization": None,
        "json_model_override_args": "{}",
        "load_format": "auto",
        "quantization_param_path": None,
    }

    def started_with(**args: Any) -> Any:
        monkeypatch.setattr(runtime, "get_server_args", lambda: SimpleNamespace(**{**served, **args}))
        return kit.kvfabric_of(kit.backend(extra, pool, wait_s=0))

    missing = str(tmp_path / "missing.json")
    e4m3 = "fp8_e4m3"
    for args in ({"load_format": "dummy"}, {"quantization_param_path": missing, "kv_cache_dtype": e4m3}):
        refused = started_with(**args)
        assert refused.client.status.cause == "config_error", args
        refused.close()
    ignored = started_with(quantization_param_path=missing)  # "auto" KV: SGLang never reads it
    assert ignored.client.status.cause != "config_error"
    assert ignored.spec is not None and ignored.spec.model.kv_quant == "none"
    ignored.close()
    (tmp_path / "scales.json").write_text('{"kv_cache": {"scaling_factor": {"0": {"0": 0.5}}}}')
    scaled = started_with(quantization_param_path=str(tmp_path / "scales.json"), kv_cache_dtype=e4m3)
    assert scaled.spec is not None and scaled.spec.model.kv_quant.startswith("scales-sha256:")
    scaled.close()


def test_a_save_past_its_first_deadline_is_waited_for_until_it_no_longer_reads_its_pages(
    nats_server: NatsServer,
) -> None:
    """A one-region page is read in place: `batch_set_v1` returns only once the save no longer
    reads it. A save still running at its first deadline is waited for (it returned False at
    once, and its writes read a page SGLang had reused; review, stop 66); one that never ends
    is given up after a bounded wait."""
    import concurrent.futures
    import threading
    from types import SimpleNamespace

    from kvfabric.client import SaveResult

    pool = kit.host_pool()
    storage = kit.backend(kit.extra_config(f"nats://127.0.0.1:{free_port()}"), pool)
    backend = kit.kvfabric_of(storage)
    client = SimpleNamespace(settings=SimpleNamespace(save_timeout_ms=20))  # first wait 60 ms
    try:
        late: concurrent.futures.Future[SaveResult] = concurrent.futures.Future()
        threading.Timer(0.15, late.set_result, (SaveResult(chunks_saved=1),)).start()
        assert backend._saved(client, late) == SaveResult(chunks_saved=1)
        hung: concurrent.futures.Future[SaveResult] = concurrent.futures.Future()
        began = time.monotonic()
        assert backend._saved(client, hung) is None
        assert time.monotonic() - began < 0.06 * 2 + 5.0 + 2.0  # bounded
        began = time.monotonic()  # a batch of them: one deadline for all, not one each
        assert backend._saved_all(client, [hung, None, late, hung]) == [
            None,
            None,
            SaveResult(chunks_saved=1),
            None,
        ]
        assert time.monotonic() - began < 0.06 * 2 + 5.0 + 2.0
    finally:
        storage.close()


def keyed_for_served_version(storage: Any) -> Any:
    """Our backend once a call has read the served weight version (the first call after a
    change re-keys; the new client starts in the background: waited for)."""
    inner = kit.kvfabric_of(storage)
    inner._serving()
    deadline = time.monotonic() + 10
    while (
        inner.client is not None and inner.client.status.state == "starting" and time.monotonic() < deadline
    ):
        time.sleep(0.02)
    return inner


def test_pages_follow_the_weight_version_sglang_serves(nats_server: NatsServer, cluster: object) -> None:
    """Weights changed in place (`update_weights_from_*` with a `weight_version`: RL loops) are
    recorded by SGLang's scheduler in its runtime context (`record_weight_version_change`, run
    here as SGLang's own code). The backend follows it: a page saved under the weights it
    started with is no longer found (it was: the old weights' KV loaded after the update,
    silently), the lease it held for a get is given back, and a page saved after the update is
    found by every backend at that version, not by one still on its starting weights. An update
    that names no version is not seen."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
    from sglang.srt.runtime_context import get_context

    idle = SimpleNamespace(
        collect_inflight_reqs=set, waiting_queue=[], chunked_req=None, hisparse_coordinator=None
    )

    def weights_updated(version: str | None) -> None:  # what every `update_weights_from_*` ends with
        Scheduler.record_weight_version_change(idle, new_version=version)

    before, after = kit.page_keys(8, seed=61), kit.page_keys(8, seed=62)
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    with get_context().override_server_args():  # the scheduler process's published config
        a, pool = reader(nats_server)
        b, pool_b = reader(nats_server)
        inner = kit.kvfabric_of(a)
        at = kit.alloc_pages(pool, 8)
        kit.fill(pool, before, at)
        assert kit.backup(a, before, at, prefix=[]) == 8
        weights_updated(None)  # no version named: unchanged, the same keys
        assert kit.prefetch(a, before, at, prefix=[]) == (8, 8)
        assert a.batch_exists(before, info) == 8  # leased for a get that never comes
        assert leases_held(nats_server) != []
        weights_updated("rl-step-1")
        keyed_for_served_version(a)
        kit.scramble(pool, before, at)
        assert kit.prefetch(a, before, at, prefix=[]) == (0, 0)  # the old weights' pages: gone
        assert leases_left(nats_server) == []  # the held hit went back with the old keys
        assert inner.rekeys == 1 and inner.weight_version == "rl-step-1"  # from SGLang's "default"
        assert inner.spec.model.weights_revision == "tiny-sglang-rev-1+version:rl-step-1"
        kit.fill(pool, after, at)
        assert kit.backup(a, after, at, prefix=[]) == 8
        keyed_for_served_version(b)
        at_b = kit.alloc_pages(pool_b, 8)
        assert kit.prefetch(b, after, at_b, prefix=[]) == (8, 8)  # shared at the same version
        assert all(kit.identical_pages(pool_b, after, at_b))
        assert kit.prefetch(b, before, at_b, prefix=[]) == (0, 0)
        assert leases_left(nats_server) == []
        a.close()
        b.close()
    started, pool = reader(nats_server)  # no version change seen: the starting weights' keys
    at = kit.alloc_pages(pool, 8)
    assert kit.prefetch(started, before, at, prefix=[]) == (8, 8)
    assert kit.prefetch(started, after, at, prefix=[]) == (0, 0)
    started.close()


def served_versions(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The weight version SGLang serves, as the backend reads it (`served_weight_version`):
    "default" (SGLang's, unless `--weight-version`) until a test names another."""
    import kvfabric.engines.sglang as sglang_backend

    served = {"version": "default"}
    monkeypatch.setattr(sglang_backend, "served_weight_version", lambda: served["version"])
    return served


def closing_slowly(monkeypatch: pytest.MonkeyPatch, client: Any) -> tuple[Any, Any, Any]:
    """`client.close` held until the second event is set (a backlog of saves, a slow directory):
    (entered, let go, ended)."""
    import threading

    entered, let_go, ended = threading.Event(), threading.Event(), threading.Event()
    real_close = client.close

    def close() -> None:
        entered.set()
        let_go.wait(120)
        real_close()
        ended.set()

    monkeypatch.setattr(client, "close", close)
    return entered, let_go, ended


def test_a_rekey_returns_while_the_old_client_still_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang records a new weight version and flushes its cache at once: the flush joins each
    storage thread for 10 s and fails the weight update if one is still alive. The call that
    re-keys returns while the replaced client still closes (a close waits for its saves in
    flight: up to ~172 s by default; it was closed in the call: review, 2026-12-07); the new
    client serves the metrics the old one served (the old one's close leaves the server up),
    and the backend's `close` waits for a replaced client's close to end."""
    import threading

    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    served = served_versions(monkeypatch)
    pool = kit.host_pool()
    storage = kit.backend(kit.extra_config(f"nats://127.0.0.1:{free_port()}", metrics_port=0), pool)
    inner = kit.kvfabric_of(storage)
    keys, info = kit.page_keys(4, seed=71), HiCacheStorageExtraInfo(prefix_keys=[])
    answers: list[int] = []

    def rekeyed_promptly(version: str) -> None:
        served["version"] = version
        call = threading.Thread(target=lambda: answers.append(storage.batch_exists(keys, info)), daemon=True)
        call.start()
        call.join(10)  # SGLang's flush waits 10 s for a storage thread
        assert not call.is_alive(), "the re-keying call waited for the old client's close"
        assert answers.pop() == 0 and inner.weight_version == version

    first = inner.client
    assert first is not None and first.metrics._server is not None  # its start served them
    entered, let_go, ended = closing_slowly(monkeypatch, first)
    try:
        rekeyed_promptly("rl-step-1")
        second = inner.client
        assert second is not first and inner.rekeys == 1
        assert entered.wait(10) and not ended.is_set()  # closing in a thread of its own
        assert keyed_for_served_version(storage).client is second and second.metrics is first.metrics
    finally:
        let_go.set()
    assert ended.wait(60)
    assert first.metrics._server is not None  # the old client's close left the new one's server up
    entered, let_go, ended = closing_slowly(monkeypatch, second)
    shutdown = threading.Thread(target=storage.close, daemon=True)
    try:
        rekeyed_promptly("rl-step-2")
        assert inner.client is not second and inner.rekeys == 2 and entered.wait(10)
        third = keyed_for_served_version(storage).client
        _, third_let_go, third_ended = closing_slowly(monkeypatch, third)
        third_let_go.set()
        shutdown.start()
        assert third_ended.wait(60)  # the serving client closed: then the replaced one's close
        shutdown.join(1.0)
        assert shutdown.is_alive()  # the backend's close waits for the replaced client's
    finally:
        let_go.set()
    shutdown.join(60)
    assert not shutdown.is_alive() and ended.is_set() and inner._replaced == set()
    assert first.metrics._server is None  # stopped by the client that served it last


def test_a_replaced_clients_late_start_leaves_the_metrics_served_for_the_newest_client(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The old client's background start had not reached `metrics.serve` when a re-key handed
    its metrics to the new client: it served them afterwards (taking the server back, as the
    one whose close stops it), and its close stopped the server the new client served: no
    metrics for good. Once that close has ended the newest client serves them again,
    and stops them at the backend's `close()`."""
    import threading
    import urllib.request

    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    from kvfabric.client.aio import AsyncKvClient

    served = served_versions(monkeypatch)
    gate, gated = threading.Event(), list[AsyncKvClient]()
    real_start = AsyncKvClient.start

    async def start(self: AsyncKvClient) -> None:
        if not gated:  # the first client's start: held before it serves the metrics
            gated.append(self)
            await asyncio.to_thread(gate.wait, 60)
        await real_start(self)

    monkeypatch.setattr(AsyncKvClient, "start", start)
    pool = kit.host_pool()
    storage = kit.backend(kit.extra_config(f"nats://127.0.0.1:{free_port()}", metrics_port=0), pool)
    inner = kit.kvfabric_of(storage)
    first = inner.client
    assert first is not None and gated == [first.aio] and first.metrics._server is None
    metrics = first.metrics
    entered, let_go, ended = closing_slowly(monkeypatch, first)
    keys, info = kit.page_keys(4, seed=74), HiCacheStorageExtraInfo(prefix_keys=[])
    try:
        served["version"] = "rl-step-1"
        assert storage.batch_exists(keys, info) == 0 and inner.rekeys == 1
        second = inner.client
        assert second is not None and second is not first and second.metrics is metrics
        assert entered.wait(10)  # the first client's close started, held
        deadline = time.monotonic() + 30
        while metrics._server is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert metrics._server is not None  # the new client's start served them
        gate.set()  # now the first client's start reaches `metrics.serve` (and fails: no NATS)
        deadline = time.monotonic() + 30
        while first.status.state == "starting" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert first.status.state == "disabled"
    finally:
        gate.set()
        let_go.set()
    assert ended.wait(60)  # its close stopped the server it took back
    deadline = time.monotonic() + 10
    while metrics._server is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metrics._server is not None and inner.client is second  # served for the newest
    port = metrics._server.port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert b"kvfabric_client_fallbacks_total" in reply.read()
    storage.close()
    assert metrics._server is None  # stopped by the client that served them last


def test_serving_the_metrics_for_the_newest_client_never_holds_the_batch_calls_lock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`_run_close`'s serve for the newest client (`_serve_metrics_for_newest`: a socket bind, a
    host name, a thread start) ran under `_lock` as well as `_rekey_lock`, and every batch call,
    `clear` and `get_stats` wait on `_lock`: a slow serve stalled SGLang's storage threads. Now
    it holds `_rekey_lock` alone (which guards `_closed` and every swap of `client`)."""
    import threading

    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    served_versions(monkeypatch)
    pool = kit.host_pool()
    storage = kit.backend(kit.extra_config(f"nats://127.0.0.1:{free_port()}", metrics_port=0), pool)
    inner = kit.kvfabric_of(storage)
    client = inner.client
    assert client is not None
    metrics = client.metrics
    entered, let_go = threading.Event(), threading.Event()
    real_serve = metrics.serve

    def serve(port: int, host: str = "127.0.0.1") -> int:
        if threading.current_thread().name == "test-run-close":  # the re-serve only: held
            entered.set()
            let_go.wait(60)
        return int(real_serve(port, host))

    monkeypatch.setattr(metrics, "serve", serve)

    class Replaced:  # a replaced client whose late start took the metrics back, now closed
        def __init__(self) -> None:
            self.aio = SimpleNamespace(serves_metrics=True)
            self.metrics = metrics

        def close(self) -> None:
            return None

    closer = threading.Thread(
        target=inner._run_close, args=(Replaced(),), kwargs={"hand_metrics": True}, name="test-run-close"
    )
    keys, info = kit.page_keys(4, seed=75), HiCacheStorageExtraInfo(prefix_keys=[])
    answers: list[object] = []

    def batch_calls() -> None:
        answers.append(storage.batch_exists(keys, info))
        inner.clear()
        answers.append(inner.get_stats())

    calls = threading.Thread(target=batch_calls)
    try:
        closer.start()
        assert entered.wait(10)  # the serve for the newest client has begun, held
        calls.start()
        calls.join(10)
        assert not calls.is_alive() and len(answers) == 2 and answers[0] == 0  # not waiting on it
    finally:
        let_go.set()
        closer.join(30)
        calls.join(30)
    assert not closer.is_alive() and client.aio.serves_metrics and metrics._server is not None
    storage.close()
    assert metrics._server is None


def test_a_rekey_that_cannot_make_its_client_leaves_the_cache_disabled_saying_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A re-key whose new client cannot be made (here: its constructor raises) leaves a disabled
    client saying why and closes the old one; the cache stays off, never on the old keys, until
    the next version re-keys again. (The client was left None: the next call took that for
    nothing keyed, adopted the version and kept the cache off for good, unlogged, the old client
    never closed; review, 2026-12-07.)"""
    import threading

    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    import kvfabric.engines.sglang as sglang_backend
    from kvfabric.client import KvClient

    served = served_versions(monkeypatch)
    pool = kit.host_pool()
    storage = kit.backend(kit.extra_config(f"nats://127.0.0.1:{free_port()}"), pool)
    inner = kit.kvfabric_of(storage)
    old = inner.client
    assert old is not None
    closed = threading.Event()
    real_close = old.close

    def close() -> None:
        real_close()
        closed.set()

    monkeypatch.setattr(old, "close", close)

    class Unmade(KvClient):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(sglang_backend, "KvClient", Unmade)
    keys, info = kit.page_keys(4, seed=72), HiCacheStorageExtraInfo(prefix_keys=[])
    try:
        served["version"] = "rl-step-1"
        for _ in range(2):  # and the next call: still off, saying why
            assert storage.batch_exists(keys, info) == 0
            assert inner.client is not None and inner.client.status.state == "disabled"
            assert inner.client.status.cause == "client_error"
            assert "rl-step-1" in inner.client.status.detail
            assert "RuntimeError: can't start new thread" in inner.client.status.detail
            assert inner.weight_version == "rl-step-1" and inner.spec is None and inner.rekeys == 0
        assert closed.wait(30)  # the old client closed
        monkeypatch.setattr(sglang_backend, "KvClient", KvClient)
        served["version"] = "rl-step-2"  # the next version: keyed again
        assert keyed_for_served_version(storage).rekeys == 1
        assert inner.spec.model.weights_revision == "tiny-sglang-rev-1+version:rl-step-2"
        assert inner.client.status.cause != "client_error"
    finally:
        storage.close()


def test_replaced_clients_still_closing_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each re-key's replaced client lives until its close ends (up to ~172 s): weight updates
    every few seconds kept one more each (review of the change). At `REPLACED_CLOSING_MAX` still
    closing, a new version's calls miss without a re-key until one close ends."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    import kvfabric.engines.sglang as sglang_backend

    served = served_versions(monkeypatch)
    pool = kit.host_pool()
    storage = kit.backend(kit.extra_config(f"nats://127.0.0.1:{free_port()}"), pool)
    inner = kit.kvfabric_of(storage)
    keys, info = kit.page_keys(4, seed=73), HiCacheStorageExtraInfo(prefix_keys=[])
    gates = []
    try:
        for step in range(sglang_backend.REPLACED_CLOSING_MAX):
            client = inner.client
            assert client is not None
            gates.append(closing_slowly(monkeypatch, client))
            served["version"] = f"rl-step-{step + 1}"
            assert storage.batch_exists(keys, info) == 0 and inner.rekeys == step + 1
            assert gates[-1][0].wait(10)  # its close started, held
        capped = inner.client
        served["version"] = "rl-step-next"
        assert storage.batch_exists(keys, info) == 0  # a miss, no re-key
        assert inner.client is capped and inner.rekeys == sglang_backend.REPLACED_CLOSING_MAX
        assert len(inner._replaced) == sglang_backend.REPLACED_CLOSING_MAX
        gates[0][1].set()
        assert gates[0][2].wait(60)
        storage.batch_exists(keys, info)  # a close ended: this call re-keys
        assert inner.rekeys == sglang_backend.REPLACED_CLOSING_MAX + 1
        assert inner.weight_version == "rl-step-next"
    finally:
        for _, let_go, _ in gates:
            let_go.set()
        storage.close()
