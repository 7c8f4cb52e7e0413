"""The vLLM connector's scheduler side, without an engine running (vLLM imported for its config
and connector base): a prompt whose blocks vLLM's own prefix cache already has, and whose
lookup found them in kvfabric, is not saved again (issue 20, the hit floor: before, every such
request copied its whole prompt out of vLLM's cache in its first step, 4-12 MiB on vLLM's thread
for 1-3K tokens of the tiny Llama, and saved it again beside the forward; bench.hit_floor).
Blocks kvfabric does not have are still saved."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvfabric.client import ClientMetrics, Hit
from kvfabric.client.hits import SaveResult
from kvfabric.format.clock import now_ms
from tests.engines.tinymodel import build_tiny_llama, prompt_ids

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

BLOCK = 128  # vLLM's CPU block size


class FakeClient:
    """Answers every lookup with a hit of `chunks` chunks (already back: no wait)."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks
        self.released: list[Hit] = []
        self.metrics = ClientMetrics()
        self.lease_left_ms = 60_000

    def lookup_async(self, tokens: list[int], **_: Any) -> concurrent.futures.Future[Hit]:
        self.lookups_asked = getattr(self, "lookups_asked", 0) + 1
        done: concurrent.futures.Future[Hit] = concurrent.futures.Future()
        expires = now_ms() + self.lease_left_ms
        hit = Hit(
            self.chunks * BLOCK,
            BLOCK,
            (),
            (),
            objects=((),) * self.chunks,
            lease_id=9,
            lease_expires_ms=expires,
        )
        done.set_result(hit)
        return done

    def release(self, hit: Hit) -> None:
        self.released.append(hit)

    def close(self) -> None:
        return None


@pytest.fixture(scope="module")
def engine_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    model_dir: Path = build_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")
    return EngineArgs(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=True,
        max_model_len=8192,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvfabricConnector",
            kv_connector_module_path="kvfabric.engines.vllm_connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            # a client that never starts (no cluster here): replaced by FakeClient below
            kv_connector_extra_config={"nats_url": "nats://127.0.0.1:1", "connect_timeout_ms": 1},
        ),
    ).create_engine_config()


@pytest.fixture(scope="module")
def scheduler_side(engine_config: Any) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvfabric.engines.vllm_connector import KvfabricConnector

    config = engine_config

    def make(chunks: int) -> Any:
        connector = KvfabricConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config=None)
        connector.client.close()
        connector.client = FakeClient(chunks)  # type: ignore[assignment]
        return connector

    return make


def schedule(
    connector: Any,
    rid: str,
    tokens: list[int],
    local_tokens: int,
    blocks_given: int = -1,
    first_block: int = 100,
) -> Any:
    """vLLM's scheduler: asks the connector with `local_tokens` of the prompt in its own prefix
    cache, then schedules the rest of the prompt in one step; the step's connector metadata. The
    request's blocks are `first_block`, `first_block` + 1, ... (requests given the same ones
    share them, as through vLLM's own prefix cache)."""
    request = SimpleNamespace(request_id=rid, prompt_token_ids=tokens)
    external, load_async = connector.get_num_new_matched_tokens(request, local_tokens)
    assert external is not None and not load_async
    if external == 0:
        connector.update_state_after_alloc(request, None, 0)
    blocks = list(range(first_block, first_block + (len(tokens) + BLOCK - 1) // BLOCK))
    if blocks_given >= 0:  # a block list shorter than vLLM's (the mismatch vLLM should never make)
        blocks = blocks[:blocks_given]
    new = SimpleNamespace(
        req_id=rid, prompt_token_ids=tokens, block_ids=(blocks,), num_computed_tokens=local_tokens + external
    )
    output = SimpleNamespace(
        scheduled_new_reqs=[new],
        num_scheduled_tokens={rid: len(tokens) - local_tokens - external},
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
        ),
    )
    connector._policy_checked = True  # the policy check reads vLLM's scheduler frame
    return connector.build_connector_meta(output)


def test_a_hit_vllms_prefix_cache_covers_is_not_saved_again(scheduler_side: Any) -> None:
    tokens = prompt_ids(3 * BLOCK + 1, seed=11)
    connector = scheduler_side(3)  # kvfabric has the 3 full blocks
    meta = schedule(connector, "r1", tokens, local_tokens=3 * BLOCK)  # vLLM has them too
    assert meta.loads == [] and meta.saves == []


def test_blocks_kvfabric_lacks_are_saved_after_a_local_hit(scheduler_side: Any) -> None:
    tokens = prompt_ids(3 * BLOCK + 1, seed=12)
    connector = scheduler_side(1)  # kvfabric has only the first block
    meta = schedule(connector, "r2", tokens, local_tokens=3 * BLOCK)
    assert meta.loads == []
    assert [(s.first_chunk, s.block_ids) for s in meta.saves] == [(1, [101, 102])]


def test_a_miss_saves_every_full_block(scheduler_side: Any) -> None:
    tokens = prompt_ids(3 * BLOCK + 1, seed=13)
    connector = scheduler_side(0)
    meta = schedule(connector, "r3", tokens, local_tokens=0)
    assert meta.loads == []
    assert [(s.first_chunk, s.block_ids) for s in meta.saves] == [(0, [100, 101, 102])]


def test_a_hit_whose_blocks_cannot_all_be_loaded_saves_nothing(scheduler_side: Any) -> None:
    """A block list that does not cover the hit: its blocks are load errors (vLLM recomputes
    them), and the request saves nothing, now or in a later step: this step's forward computes
    the chunks past the hit over blocks nobody wrote, and saved they would be wrong KV under the
    right keys for good (review, 2026-12-05)."""
    tokens = prompt_ids(6 * BLOCK + 1, seed=14)
    connector = scheduler_side(3)
    meta = schedule(connector, "r4", tokens, local_tokens=0, blocks_given=2)
    assert meta.loads == [] and meta.load_errors and meta.saves == []
    later = SimpleNamespace(  # its next step: the rest of its blocks, the prompt computed
        scheduled_new_reqs=[],
        num_scheduled_tokens={"r4": 1},
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=["r4"],
            new_block_ids=[([102, 103, 104, 105],)],
            resumed_req_ids=set(),
            num_computed_tokens=[6 * BLOCK],
        ),
    )
    assert connector.build_connector_meta(later).saves == []
    intact = schedule(connector, "r5", prompt_ids(6 * BLOCK + 1, seed=15), local_tokens=0)
    assert [(s.first_chunk, s.block_ids) for s in intact.saves] == [(3, [103, 104, 105])]


def test_a_hit_vllm_could_not_allocate_for_is_answered_again_without_a_new_lookup(
    scheduler_side: Any,
) -> None:
    """vLLM asks again when it could not allocate the request's blocks (memory pressure): the
    same answer under the lease already held, not a release and a new lookup every step (the
    scheduler waited on the directory each time; review, 2026-12-05)."""
    tokens = prompt_ids(4 * BLOCK + 1, seed=17)
    connector = scheduler_side(3)
    request = SimpleNamespace(request_id="r8", prompt_token_ids=tokens)
    assert connector.get_num_new_matched_tokens(request, 0) == (3 * BLOCK, False)
    for _ in range(3):  # allocation failed: asked again, nothing changed
        assert connector.get_num_new_matched_tokens(request, 0) == (3 * BLOCK, False)
    assert connector.client.lookups_asked == 1 and connector.client.released == []
    assert connector.get_num_new_matched_tokens(request, BLOCK) == (2 * BLOCK, False)  # it changed
    assert connector.client.lookups_asked == 2
    connector.client.lease_left_ms = 5_000  # a lease with too little time left for the load
    other = SimpleNamespace(request_id="r9", prompt_token_ids=tokens)
    assert connector.get_num_new_matched_tokens(other, 0) == (3 * BLOCK, False)
    assert connector.get_num_new_matched_tokens(other, 0) == (3 * BLOCK, False)
    assert connector.client.lookups_asked == 4  # looked up again, its old lease released


class SlowClient(FakeClient):
    """Lookups that come back only when the test says (`back`)."""

    def __init__(self) -> None:
        super().__init__(0)
        self.lookups: list[concurrent.futures.Future[Hit]] = []

    def lookup_async(self, tokens: list[int], **_: Any) -> concurrent.futures.Future[Hit]:
        self.lookups.append(concurrent.futures.Future())
        return self.lookups[-1]

    def back(self, chunks: int) -> Hit:
        hit = Hit(chunks * BLOCK, BLOCK, (), (), objects=((),) * chunks, lease_id=7 if chunks else 0)
        self.lookups[-1].set_result(hit)
        return hit


def next_step(connector: Any, rid: str, computed: int) -> Any:
    """A later scheduler step of running request `rid` (one decode token), `computed` tokens done."""
    output = SimpleNamespace(
        scheduled_new_reqs=[],
        num_scheduled_tokens={rid: 1},
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[rid], new_block_ids=[None], resumed_req_ids=set(), num_computed_tokens=[computed]
        ),
    )
    return connector.build_connector_meta(output)


def test_a_prompt_vllms_cache_covers_is_answered_at_once_and_backfilled_when_its_lookup_is_back(
    scheduler_side: Any,
) -> None:
    """vLLM's own cache holds every chunk kvfabric could add: the connector does not wait for the
    lookup (it used to, up to `lookup_wait_ms`: the full-hit floor over vLLM's own cache); the
    lookup only says which blocks kvfabric lacks, saved at a step after it is back."""
    tokens = prompt_ids(3 * BLOCK + 1, seed=14)
    connector = scheduler_side(0)
    client = connector.client = SlowClient()
    meta = schedule(connector, "r4", tokens, local_tokens=3 * BLOCK)  # asserts an answer, not None
    assert meta.loads == [] and meta.saves == [] and len(client.lookups) == 1
    assert next_step(connector, "r4", len(tokens)).saves == []  # still out: nothing saved yet
    hit = client.back(1)  # kvfabric has only the first block
    meta = next_step(connector, "r4", len(tokens) + 1)
    assert [(s.first_chunk, s.block_ids) for s in meta.saves] == [(1, [101, 102])]
    assert client.released == [hit]  # its lease given back at once: nothing to load
    assert next_step(connector, "r4", len(tokens) + 2).saves == []  # saved once


def test_a_request_that_ends_before_its_backfill_lookup_releases_it_when_back(scheduler_side: Any) -> None:
    tokens = prompt_ids(3 * BLOCK + 1, seed=15)
    connector = scheduler_side(0)
    client = connector.client = SlowClient()
    schedule(connector, "r5", tokens, local_tokens=3 * BLOCK)
    connector.request_finished(SimpleNamespace(request_id="r5"), [])
    assert client.released == []
    hit = client.back(3)
    assert client.released == [hit] and connector._requests == {}


def test_one_backfill_lookup_while_vllm_asks_again_and_an_abort_releases_it(scheduler_side: Any) -> None:
    """vLLM asks again at every step for a request it cannot schedule yet: one lookup, not one
    per ask; aborted before it was scheduled, the lookup's lease goes back once it is in."""
    tokens = prompt_ids(3 * BLOCK + 1, seed=16)
    connector = scheduler_side(0)
    client = connector.client = SlowClient()
    request = SimpleNamespace(request_id="r6", prompt_token_ids=tokens)
    for _ in range(3):
        assert connector.get_num_new_matched_tokens(request, 3 * BLOCK) == (0, False)
    assert len(client.lookups) == 1
    connector.request_finished(request, [])
    hit = client.back(3)
    assert client.released == [hit] and connector._backfills == {}


def test_a_local_hit_one_block_short_still_waits_for_its_lookup(scheduler_side: Any) -> None:
    tokens = prompt_ids(3 * BLOCK + 1, seed=17)
    connector = scheduler_side(3)  # kvfabric has all three full blocks, vLLM two
    meta = schedule(connector, "r7", tokens, local_tokens=2 * BLOCK)
    assert [(load.first_chunk, load.block_ids) for load in meta.loads] == [(2, [102])]


def test_a_lookup_cancelled_by_a_closing_client_is_saved_as_after_a_miss(scheduler_side: Any) -> None:
    tokens = prompt_ids(3 * BLOCK + 1, seed=18)
    connector = scheduler_side(0)
    client = connector.client = SlowClient()
    schedule(connector, "r8", tokens, local_tokens=3 * BLOCK)
    client.lookups[-1].cancel()
    meta = next_step(connector, "r8", len(tokens) + 1)
    assert [(s.first_chunk, s.block_ids) for s in meta.saves] == [(0, [100, 101, 102])]
    assert client.released == []


def test_a_lookup_cancelled_while_vllm_waits_for_it_is_a_miss(scheduler_side: Any) -> None:
    """A closing client cancels its lookups: the scheduler's next ask gets 0 (recompute), not a
    `CancelledError` raised into vLLM's step."""
    tokens = prompt_ids(3 * BLOCK + 1, seed=19)
    connector = scheduler_side(0)
    connector._lookup_wait_s = 0  # answered "ask again" while the lookup is out
    client = connector.client = SlowClient()
    request = SimpleNamespace(request_id="r9", prompt_token_ids=tokens)
    assert connector.get_num_new_matched_tokens(request, 0) == (None, False)
    client.lookups[-1].cancel()
    assert connector.get_num_new_matched_tokens(request, 0) == (0, False)


class FakeSaveClient:
    """Records `save_async` calls (objects, and a future the test finishes); real save memory
    (none with `save_memory=False`: the worker gathers blocks into plain copies)."""

    def __init__(self, inflight_bytes: int, *, save_memory: bool = True, track_handed: bool = False) -> None:
        from kvfabric.client.save_memory import SaveMemoryRegistry

        self.settings = SimpleNamespace(
            save_inflight_bytes_max=inflight_bytes, saves_queued_max=64, load_timeout_ms=10_000
        )
        self.save_memory_registry = SaveMemoryRegistry()
        self.saves: list[tuple[list[list[memoryview]], concurrent.futures.Future[Any] | None]] = []
        self.drop = False
        self.rate_admits: int | None = None  # the save rate's leading chunks; None: no limit
        self.rate_asks: list[list[int]] = []
        self.rate_taken: list[bool] = []
        self.saved_for: list[str | None] = []
        self.metrics = ClientMetrics()
        self.enabled = True
        self.has_save_memory = save_memory
        # Other saves handed to the client's loop and not ended there, and their bytes, as a test
        # sets them (the saves this fake records are not counted, unless `track_handed`: then
        # each is counted from its hand-off until its future is done, as the real client counts
        # them): the real client's rule on them, `handed_refusal`, refuses a save in the
        # caller's thread (`queue_full`, `bytes`).
        self.track_handed = track_handed
        self.handed_saves = 0
        self.handed_bytes = 0
        self.refusal_asks: list[tuple[int, bool]] = []

    def off_cause(self) -> str:
        return "starting"

    def _refusal(self, nbytes: int, rate_taken: bool) -> str | None:
        from kvfabric.client.sync import handed_refusal

        if not self.enabled:
            return self.off_cause()
        settings: Any = self.settings
        return handed_refusal(self.handed_saves, self.handed_bytes, nbytes, settings, rate_taken=rate_taken)

    def save_async_refusal(self, nbytes: int, *, rate_taken: bool = False) -> str | None:
        self.refusal_asks.append((nbytes, rate_taken))
        return self._refusal(nbytes, rate_taken)

    def peek_save_rate(self, chunk_sizes: list[int]) -> int:
        return len(chunk_sizes) if self.rate_admits is None else min(self.rate_admits, len(chunk_sizes))

    def take_save_rate(self, chunk_sizes: list[int]) -> int:
        self.rate_asks.append(list(chunk_sizes))
        return len(chunk_sizes) if self.rate_admits is None else min(self.rate_admits, len(chunk_sizes))

    def save_memory(self, nbytes: int) -> Any:
        if not self.has_save_memory:
            raise OSError("no save memory here (the test's)")
        return self.save_memory_registry.allocate(nbytes)

    def save_async(
        self,
        tokens: list[int],
        objects: list[list[memoryview]],
        *,
        rate_taken: bool = False,
        trace_id: str | None = None,
        **_: Any,
    ) -> Any:
        nbytes = sum(o.nbytes for row in objects for o in row)
        refused = self._refusal(nbytes, rate_taken)
        if refused is not None:  # as the client: done at once, counted, the buffers given back
            self.metrics.saves_dropped.labels(refused).inc()
            done: concurrent.futures.Future[Any] = concurrent.futures.Future()
            done.set_result(SaveResult(chunks_failed=len(objects), causes={refused: len(objects)}))
            return done
        self.rate_taken.append(rate_taken)
        self.saved_for.append(trace_id)  # the request id: the connector's trace id
        future: concurrent.futures.Future[Any] | None = None if self.drop else concurrent.futures.Future()
        self.saves.append((objects, future))
        if self.track_handed and future is not None:
            self.handed_saves += 1
            self.handed_bytes += nbytes
            future.add_done_callback(lambda _: self._ended(nbytes))
        return future

    def _ended(self, nbytes: int) -> None:
        self.handed_saves -= 1
        self.handed_bytes -= nbytes

    def close(self) -> None:
        self.save_memory_registry.close()


def test_the_worker_gathers_blocks_into_save_memory_and_gives_slots_back(engine_config: Any) -> None:
    """A block of every layer is gathered into a slot of the client's save memory (a co-located
    segment reads it in place); the slot goes back when its save is done, or at once when the
    save was dropped; with no slot free a block is gathered into memory of its own."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvfabric.client.save_memory import SaveSlots
    from kvfabric.engines.vllm_connector import KvfabricConnector, KvfabricMetadata, SaveSpec

    connector = KvfabricConnector(engine_config, KVConnectorRole.WORKER, kv_cache_config=None)
    connector.client.close()
    layers = [torch.arange(6 * 64, dtype=torch.float32).reshape(6, 64) + 1000 * i for i in range(2)]
    object_bytes = sum(layer[0].numel() * 4 for layer in layers)
    client = FakeSaveClient(inflight_bytes=4 * object_bytes)  # four slots; a save of two blocks at most
    connector.client = client  # type: ignore[assignment]
    connector.register_kv_caches({f"layer{i}": kv for i, kv in enumerate(layers)})

    def save(blocks: list[int]) -> None:
        meta = KvfabricMetadata(saves=[SaveSpec("r", list(range(BLOCK * len(blocks))), 0, blocks)])
        connector.bind_connector_metadata(meta)
        connector.wait_for_save()
        connector.clear_connector_metadata()

    def expected(block: int) -> bytes:
        return b"".join(layer[block].numpy().tobytes() for layer in layers)

    try:
        save([1, 4])
        ((objects, future),) = client.saves
        assert [bytes(o[0]) for o in objects] == [expected(1), expected(4)]
        registry = client.save_memory_registry
        assert all(registry.staged(o[0]) is not None for o in objects)  # in save memory
        slots = connector._save_slots
        assert isinstance(slots, SaveSlots) and slots.free() == 2
        save([5])
        assert slots.free() == 1
        save([2, 3])  # one slot left: the second block is gathered elsewhere
        (second, _) = client.saves[2]
        assert registry.staged(second[0][0]) is not None and registry.staged(second[1][0]) is None
        assert bytes(second[1][0]) == expected(3)
        assert future is not None
        future.set_result(None)  # the first save is done: its two slots come back
        assert slots.free() == 2
        client.drop = True
        save([5])  # dropped by the client (over its limits): the slot comes back at once
        assert slots.free() == 2
    finally:
        client.saves.clear()  # the views of save memory the fake client kept, and ours
        objects = second = []
        connector.shutdown()
    assert isinstance(slots, SaveSlots) and slots.memory.closed


def test_a_client_still_starting_copies_no_block_out(
    engine_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that is off (still starting, or the cluster never answered) drops a save before
    any block is copied out of vLLM's cache: it dropped it after copying every block, 4-12 MiB a
    prompt on vLLM's thread (review, stop 68). Counted as the client counts it; the request cut."""
    import numpy as np
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvfabric.engines.vllm_connector import KvfabricConnector, KvfabricMetadata, SaveSpec

    connector = KvfabricConnector(engine_config, KVConnectorRole.WORKER, kv_cache_config=None)
    connector.client.close()
    layers = [torch.zeros(6, 64, dtype=torch.float32) for _ in range(2)]
    client = FakeSaveClient(inflight_bytes=1 << 20)
    client.enabled = False
    connector.client = client  # type: ignore[assignment]
    connector.register_kv_caches({f"layer{i}": kv for i, kv in enumerate(layers)})
    copies: list[int] = []
    real = np.concatenate

    def counted(*args: Any, **kwargs: Any) -> Any:
        copies.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(np, "concatenate", counted)
    try:
        meta = KvfabricMetadata(saves=[SaveSpec("r", list(range(2 * BLOCK)), 0, [1, 2])])
        connector.bind_connector_metadata(meta)
        connector.wait_for_save()
        connector.clear_connector_metadata()
        assert copies == [] and client.saves == []
        assert dropped_saves(client, "starting") == 1
        assert connector._cut_cause("r") is not None
    finally:
        connector.shutdown()


def test_blocks_past_the_engines_save_rate_are_not_copied_and_a_cut_request_saves_no_more(
    engine_config: Any,
) -> None:
    """The worker takes the client's save rate before it copies a save's blocks out of vLLM's
    cache (issue 24, item 3): only the leading blocks it covers are copied and saved (the rate
    not charged again), the rest counted `save_rate`; a save it covers none of is not copied at
    all (a dropped save); and a request cut once saves nothing more (its later chunks would sit
    behind the missing ones, where no lookup reaches), while other requests go on."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvfabric.engines.vllm_connector import KvfabricConnector, KvfabricMetadata, SaveSpec

    connector = KvfabricConnector(engine_config, KVConnectorRole.WORKER, kv_cache_config=None)
    connector.client.close()
    layers = [torch.arange(6 * 64, dtype=torch.float32).reshape(6, 64) + 1000 * i for i in range(2)]
    object_bytes = sum(layer[0].numel() * 4 for layer in layers)
    client = FakeSaveClient(inflight_bytes=8 * object_bytes)
    connector.client = client  # type: ignore[assignment]
    connector.register_kv_caches({f"layer{i}": kv for i, kv in enumerate(layers)})

    def save(req: str, first: int, blocks: list[int]) -> None:
        tokens = list(range(BLOCK * (first + len(blocks))))
        meta = KvfabricMetadata(saves=[SaveSpec(req, tokens, first, blocks)])
        connector.bind_connector_metadata(meta)
        connector.wait_for_save()
        connector.clear_connector_metadata()

    def counted(name: str) -> float:
        return client.metrics.registry.get_sample_value(name, {"cause": "save_rate"}) or 0.0

    try:
        client.rate_admits = 2
        save("r1", 0, [1, 4, 2, 3])
        assert client.rate_asks == [[object_bytes] * 4]
        ((objects, _),) = client.saves
        assert [bytes(o[0]) for o in objects] == [
            b"".join(layer[b].numpy().tobytes() for layer in layers) for b in (1, 4)
        ]
        assert client.rate_taken == [True]
        assert counted("kvfabric_client_save_failures_total") == 2
        client.rate_admits = None  # the rate has room again, but r1 was cut: its next chunks wait
        save("r1", 4, [5])
        assert len(client.saves) == 1 and counted("kvfabric_client_saves_dropped_total") == 1
        client.rate_admits = 0
        save("r2", 0, [5, 2])
        assert len(client.saves) == 1  # nothing copied, nothing saved
        assert counted("kvfabric_client_saves_dropped_total") == 2
        client.rate_admits = None
        save("r3", 0, [5])
        assert len(client.saves) == 2
    finally:
        client.saves.clear()
        objects = []
        connector.shutdown()


def test_a_save_the_client_would_refuse_is_not_copied_and_takes_no_rate(
    engine_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save the client would refuse in the engine's thread (`save_async_refusal`: its handed
    saves at `saves_queued_max`, or their bytes with this one's past `save_inflight_bytes_max`)
    is not copied out of vLLM's cache: every block was copied and then refused, the copying spent
    exactly when the client was overloaded. Asked before the rate is taken, for the save's blocks
    under the cap: refused whatever its size (`queue_full`), or because its blocks do not fit
    beside a save handed (`bytes`, though one block would), it takes no rate (asked after the take,
    a refused save had spent the rate of every block) and nothing is copied. Counted as the client
    counts a refused save, its request cut under that cause; a save whose blocks fit is copied and
    saved, as far as the rate covers it."""
    import numpy as np
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvfabric.engines.vllm_connector import KvfabricConnector, KvfabricMetadata, SaveSpec

    connector = KvfabricConnector(engine_config, KVConnectorRole.WORKER, kv_cache_config=None)
    connector.client.close()
    layers = [torch.arange(6 * 64, dtype=torch.float32).reshape(6, 64) + 1000 * i for i in range(2)]
    object_bytes = sum(layer[0].numel() * 4 for layer in layers)
    client = FakeSaveClient(inflight_bytes=512 << 20, save_memory=False)  # plain copies
    connector.client = client  # type: ignore[assignment]
    connector.register_kv_caches({f"layer{i}": kv for i, kv in enumerate(layers)})
    copies: list[int] = []
    real = np.concatenate

    def counted(*args: Any, **kwargs: Any) -> Any:
        copies.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(np, "concatenate", counted)

    def save(req: str, blocks: list[int]) -> None:
        meta = KvfabricMetadata(saves=[SaveSpec(req, list(range(BLOCK * len(blocks))), 0, blocks)])
        connector.bind_connector_metadata(meta)
        connector.wait_for_save()
        connector.clear_connector_metadata()

    bound = client.settings.save_inflight_bytes_max
    try:
        client.handed_saves = client.settings.saves_queued_max  # as many handed as it queues
        save("r1", [1, 2])
        assert copies == [] and client.saves == [] and client.rate_asks == []
        assert dropped_saves(client, "queue_full") == 1 and connector._cut_cause("r1") == "queue_full"
        # One save handed, with room for two more blocks beside it: one block fits, three not.
        client.handed_saves, client.handed_bytes = 1, bound - 2 * object_bytes
        save("r2", [1, 2, 3])
        assert copies == [] and client.saves == [] and client.rate_asks == []  # no rate taken
        assert client.refusal_asks[-1] == (3 * object_bytes, True)
        assert dropped_saves(client, "bytes") == 1 and connector._cut_cause("r2") == "bytes"
        client.handed_bytes = bound - 4 * object_bytes  # room for four
        client.rate_admits = 2
        save("r3", [1, 2, 3, 4])  # they fit; the rate covers two of them
        assert client.refusal_asks[-1] == (2 * object_bytes, True)  # (those the rate covers)
        assert client.rate_asks == [[object_bytes] * 4]
        assert len(copies) == 2 and len(client.saves) == 1 and client.saved_for == ["r3"]
        assert dropped_saves(client, "bytes") == 1
        # Room for two beside the saves handed, the rate covering two of four: the two it covers
        # are asked about (they fit) and saved, the request cut under `save_rate` only (asked
        # about all four, the save was refused `bytes` and its request cut).
        client.handed_bytes = bound - 2 * object_bytes
        save("r4", [1, 2, 3, 4])
        assert client.refusal_asks[-1] == (2 * object_bytes, True)
        assert len(copies) == 4 and client.saved_for == ["r3", "r4"]
        assert dropped_saves(client, "bytes") == 1 and connector._cut_cause("r4") == "save_rate"
    finally:
        client.saves.clear()
        connector.shutdown()


def test_a_save_past_the_clients_bytes_bound_by_itself_saves_the_prefix_that_fits(
    engine_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client refuses any save past `save_inflight_bytes_max`, alone or not (the loop's
    `save_admission`; the rate taken, `save_async` itself): a long prefill (8192 tokens of 2 MiB
    blocks, 1 GiB, against the default 512 MiB) was copied out whole and refused, every time, so
    long prompts were never saved. Now only the leading blocks that fit in half the bound (the
    cap, as HF's parts and SGLang's batches) are copied and saved (a prefix: each keeps its
    head), the rest counted `save_failures_total{cause="bytes"}`, and the
    request is cut under `bytes`: a later step's blocks would follow the gap. A block past the
    bound by itself is not copied at all (`saves_dropped_total{cause="bytes"}`)."""
    import numpy as np
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvfabric.engines.vllm_connector import KvfabricConnector, KvfabricMetadata, SaveSpec

    connector = KvfabricConnector(engine_config, KVConnectorRole.WORKER, kv_cache_config=None)
    connector.client.close()
    layers = [torch.arange(8 * 64, dtype=torch.float32).reshape(8, 64) + 1000 * i for i in range(2)]
    object_bytes = sum(layer[0].numel() * 4 for layer in layers)
    client = FakeSaveClient(inflight_bytes=7 * object_bytes + object_bytes // 2, save_memory=False)
    connector.client = client  # type: ignore[assignment]
    connector.register_kv_caches({f"layer{i}": kv for i, kv in enumerate(layers)})
    copies: list[int] = []
    real = np.concatenate

    def counted(*args: Any, **kwargs: Any) -> Any:
        copies.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(np, "concatenate", counted)

    def save(req: str, first: int, blocks: list[int]) -> None:
        tokens = list(range(BLOCK * (first + len(blocks))))
        connector.bind_connector_metadata(KvfabricMetadata(saves=[SaveSpec(req, tokens, first, blocks)]))
        connector.wait_for_save()
        connector.clear_connector_metadata()

    def failed_chunks(cause: str) -> float:
        value = client.metrics.registry.get_sample_value(
            "kvfabric_client_save_failures_total", {"cause": cause}
        )
        return float(value or 0.0)

    try:
        save("r1", 0, [1, 2, 3, 4, 5])  # 5 blocks, the cap (half the bound) 3 and three quarters
        assert client.rate_asks == [[object_bytes] * 3]  # the rate asked for those that fit only
        assert len(copies) == 3  # no block past them copied
        ((objects, _),) = client.saves
        assert [bytes(o[0]) for o in objects] == [
            b"".join(layer[b].numpy().tobytes() for layer in layers) for b in (1, 2, 3)
        ]
        assert client.rate_taken == [True] and client.saved_for == ["r1"]
        assert failed_chunks("bytes") == 2 and dropped_saves(client, "bytes") == 0
        assert connector._cut_cause("r1") == "bytes"
        save("r1", 5, [6])  # its next step: after the gap, not saved
        assert len(client.saves) == 1 and len(copies) == 3 and dropped_saves(client, "bytes") == 1
        save("r2", 0, [6, 7, 1])  # a save that fits whole is saved whole, its request not cut
        assert len(client.saves) == 2 and len(client.saves[1][0]) == 3 and len(copies) == 6
        assert connector._cut_cause("r2") is None and failed_chunks("bytes") == 2
        client.settings.save_inflight_bytes_max = object_bytes - 1  # one block is past it
        save("r3", 0, [1, 2])
        assert len(client.saves) == 2 and len(copies) == 6 and len(client.rate_asks) == 2
        assert dropped_saves(client, "bytes") == 2 and connector._cut_cause("r3") == "bytes"
    finally:
        client.saves.clear()
        objects = []
        connector.shutdown()


def test_a_capped_prefix_save_leaves_room_for_another_requests_save(engine_config: Any) -> None:
    """A long prefill's save is capped at half of `save_inflight_bytes_max`, not the whole bound:
    capped at the whole bound (8192 tokens of 2 MiB blocks: 512 MiB), the prefix, while handed,
    left no room beside it, so every other request's save was refused `bytes` in the engine's
    thread and its request cut for good. With the client counting the saves handed and their
    bytes (as `handed_refusal` does), another request's save is handed beside the capped prefix
    and its request is not cut."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvfabric.engines.vllm_connector import KvfabricConnector, KvfabricMetadata, SaveSpec

    connector = KvfabricConnector(engine_config, KVConnectorRole.WORKER, kv_cache_config=None)
    connector.client.close()
    layers = [torch.arange(12 * 64, dtype=torch.float32).reshape(12, 64) + 1000 * i for i in range(2)]
    object_bytes = sum(layer[0].numel() * 4 for layer in layers)
    client = FakeSaveClient(inflight_bytes=8 * object_bytes, save_memory=False, track_handed=True)
    connector.client = client  # type: ignore[assignment]
    connector.register_kv_caches({f"layer{i}": kv for i, kv in enumerate(layers)})

    def save(req: str, blocks: list[int]) -> None:
        meta = KvfabricMetadata(saves=[SaveSpec(req, list(range(BLOCK * len(blocks))), 0, blocks)])
        connector.bind_connector_metadata(meta)
        connector.wait_for_save()
        connector.clear_connector_metadata()

    try:
        save("long", list(range(1, 11)))  # ten blocks, the bound eight: four saved (half)
        ((objects, long_future),) = client.saves
        assert len(objects) == 4 and connector._cut_cause("long") == "bytes"
        assert client.handed_saves == 1 and client.handed_bytes == 4 * object_bytes
        save("short", [11])  # while the prefix is handed
        assert client.saved_for == ["long", "short"] and connector._cut_cause("short") is None
        assert dropped_saves(client, "bytes") == 0
        assert long_future is not None
        long_future.set_result(None)
        assert client.handed_saves == 1 and client.handed_bytes == object_bytes
    finally:
        client.saves.clear()
        objects = []
        connector.shutdown()


def test_a_request_whose_save_left_a_chunk_unstored_saves_no_more(engine_config: Any) -> None:
    """A save done with a chunk not stored (the admission filter's `not_admitted`, say: the
    client stops that save at the first one) cuts its request: its next saves (chunked prefill
    saves a request in steps) would store chunks behind the missing one, where no lookup
    reaches; counted under the failure's cause. So does a save the client dropped whole. A save
    done whole cuts nothing. A request vLLM said finished is forgotten, and a save of it done
    later does not cut it again."""
    from unittest.mock import patch

    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvfabric.engines import vllm_connector
    from kvfabric.engines.vllm_connector import KvfabricConnector, KvfabricMetadata, SaveSpec

    connector = KvfabricConnector(engine_config, KVConnectorRole.WORKER, kv_cache_config=None)
    connector.client.close()
    layers = [torch.arange(6 * 64, dtype=torch.float32).reshape(6, 64) + 1000 * i for i in range(2)]
    client = FakeSaveClient(inflight_bytes=512 << 20, save_memory=False)  # plain copies
    connector.client = client  # type: ignore[assignment]
    connector.register_kv_caches({f"layer{i}": kv for i, kv in enumerate(layers)})

    def save(req: str, first: int, blocks: list[int]) -> concurrent.futures.Future[Any] | None:
        tokens = list(range(BLOCK * (first + len(blocks))))
        connector.bind_connector_metadata(KvfabricMetadata(saves=[SaveSpec(req, tokens, first, blocks)]))
        connector.wait_for_save()
        connector.clear_connector_metadata()
        return client.saves[-1][1]

    def dropped(cause: str) -> float:
        return (
            client.metrics.registry.get_sample_value("kvfabric_client_saves_dropped_total", {"cause": cause})
            or 0.0
        )

    try:
        first = save("r1", 0, [1, 2])
        assert first is not None
        first.set_result(SaveResult(chunks_saved=1, chunks_failed=1, causes={"not_admitted": 1}))
        ok = save("r2", 0, [3])
        assert ok is not None
        ok.set_result(SaveResult(chunks_saved=1))
        saves = len(client.saves)
        save("r1", 2, [4])  # behind r1's missing chunk: not saved
        assert len(client.saves) == saves and dropped("not_admitted") == 1
        save("r2", 1, [5])  # r2 was saved whole: it goes on
        assert len(client.saves) == saves + 1
        client.drop = True
        save("r3", 0, [1])  # dropped whole by the client
        client.drop = False
        saves = len(client.saves)
        save("r3", 1, [2])
        assert len(client.saves) == saves and dropped("dropped") == 1
        # a chunk another writer is storing (`in_flight`: a request sharing the prefix) will be
        # there: no cut
        shared = save("r4", 0, [1, 2])
        assert shared is not None
        shared.set_result(SaveResult(chunks_saved=1, chunks_failed=1, causes={"in_flight": 1}))
        saves = len(client.saves)
        save("r4", 2, [3])
        assert len(client.saves) == saves + 1
        # finished requests are forgotten as cut
        assert set(connector._cut) == {"r1", "r3"}
        last = save("r5", 0, [1])  # its save is done only after vLLM said it finished
        assert last is not None
        assert connector.get_finished({"r1", "r3", "r4", "r5"}) == (None, None)
        assert not connector._cut
        last.set_result(SaveResult(chunks_failed=1, causes={"not_admitted": 1}))
        assert not connector._cut  # not cut again: nothing would forget it
        # both bounded: the oldest forgotten first
        with patch.object(vllm_connector, "CUT_REQUESTS_MAX", 3):
            connector.get_finished({f"f{n}" for n in range(5)})
            assert len(connector._finished) == 3
            for n in range(5):
                connector._cut_request(f"c{n}", "not_admitted")
            assert list(connector._cut) == ["c2", "c3", "c4"]
    finally:
        client.saves.clear()
        connector.shutdown()


class FailingLoadClient(FakeSaveClient):
    """`load` verifies `good` chunks of the hit (the rest failing with `cause`), or raises when
    `good` is None; `loads` counts the calls."""

    def __init__(self, good: int | None, cause: str = "checksum") -> None:
        super().__init__(inflight_bytes=512 << 20, save_memory=False)
        self.good = good
        self.cause = cause
        self.loads = 0

    def load(self, hit: Hit, dests: list[Any], *, first_chunk: int = 0, **_: Any) -> Any:
        from kvfabric.client.hits import LoadResult

        self.loads += 1
        if self.good is None:
            raise ValueError("object size 4096 != destination size 8192")
        asked = len(hit.objects) - first_chunk
        failed = tuple(range(first_chunk + self.good, len(hit.objects)))
        cause = self.cause if self.good < asked else ""
        return LoadResult((first_chunk + self.good) * BLOCK, self.good, 0, failed, cause)


@pytest.mark.parametrize("good", [1, None])
def test_a_request_whose_load_failed_saves_nothing_past_it(engine_config: Any, good: int | None) -> None:
    """A load that verified only part of the hit (a busy segment, a checksum), or that raised
    (a size mismatch: never an error in vLLM's step), reports the blocks past what it verified
    as load errors, and its request saves nothing: not the chunks this step computes past the
    hit over the unwritten blocks (the same step's save), nor any later. Other requests save."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvfabric.engines.vllm_connector import KvfabricConnector, KvfabricMetadata, LoadSpec, SaveSpec

    connector = KvfabricConnector(engine_config, KVConnectorRole.WORKER, kv_cache_config=None)
    connector.client.close()
    layers = [torch.zeros(8, 64, dtype=torch.float32) for _ in range(2)]
    client = FailingLoadClient(good)
    connector.client = client  # type: ignore[assignment]
    connector.register_kv_caches({f"layer{i}": kv for i, kv in enumerate(layers)})
    hit = Hit(3 * BLOCK, BLOCK, (), (), objects=((),) * 3)
    tokens = list(range(5 * BLOCK))
    try:
        meta = KvfabricMetadata(
            loads=[LoadSpec("r1", hit, 0, [1, 2, 3])],
            saves=[SaveSpec("r1", tokens, 3, [4, 5]), SaveSpec("r2", tokens, 0, [6])],
        )
        connector.bind_connector_metadata(meta)
        connector.start_load_kv(None)
        connector.wait_for_save()
        connector.clear_connector_metadata()
        assert connector.get_block_ids_with_load_errors() == ({2, 3} if good == 1 else {1, 2, 3})
        assert [len(objects) for objects, _ in client.saves] == [1]  # r2's only
        connector.bind_connector_metadata(KvfabricMetadata(saves=[SaveSpec("r1", tokens + tokens, 5, [7])]))
        connector.wait_for_save()
        connector.clear_connector_metadata()
        assert len(client.saves) == 1
        dropped = client.metrics.registry.get_sample_value(
            "kvfabric_client_saves_dropped_total", {"cause": "load_failed"}
        )
        assert dropped == 2
    finally:
        client.saves.clear()
        connector.shutdown()


def test_a_request_holding_a_failed_loads_blocks_saves_nothing_once_vllm_says_so(scheduler_side: Any) -> None:
    """Async scheduling: S, sharing A's blocks through vLLM's prefix cache, was scheduled before
    vLLM saw A's load fail; the step's output names A's unwritten blocks, and S saves nothing
    more, whenever its next full block comes (review, stop 66: after the worker's two-step
    window it was saved, computed partly over those blocks). Other requests save."""
    from vllm.v1.outputs import KVConnectorOutput

    from kvfabric.engines.vllm_connector import KvfabricMetadata, _Request

    connector = scheduler_side(0)
    tokens = list(range(4 * BLOCK))
    connector._requests["S"] = _Request(tokens, [100, 101, 102, 300], 0)
    connector._requests["T"] = _Request(tokens, [200, 201], 0)
    connector.update_connector_output(KVConnectorOutput())  # nothing failed: nothing changes
    assert not connector._requests["S"].saves_off
    connector.update_connector_output(KVConnectorOutput(invalid_block_ids={101, 102}))
    assert connector._requests["S"].saves_off and not connector._requests["T"].saves_off
    registry = connector.client.metrics.registry
    # per request, under its own cause: the worker counts the saves it drops as `load_failed`
    # (one failure was counted twice under that cause across the two sides; review, stop 71)
    for cause, count in (("saves_off_load_failed", 1.0), ("load_failed", None)):
        assert registry.get_sample_value("kvfabric_client_saves_dropped_total", {"cause": cause}) == count
    meta = KvfabricMetadata()
    for req_id in ("S", "T"):
        connector._plan_save(meta, req_id, connector._requests[req_id], 4 * BLOCK)
    assert [save.req_id for save in meta.saves] == ["T"]


def test_a_failed_loads_blocks_leave_vllms_prefix_cache(scheduler_side: Any) -> None:
    """Under "recompute" vLLM keeps a failed load's blocks in its prefix cache for the loading
    request to recompute in place; aborted or preempted first, it never does, and a later prompt
    was served them unwritten from vLLM's own cache (review, stop 68). They and the blocks after
    them are evicted from the prefix cache (the hash only: a request holding them keeps them)."""
    from vllm.v1.outputs import KVConnectorOutput

    from kvfabric.engines.vllm_connector import _Request

    connector = scheduler_side(0)
    evicted: list[set[int]] = []
    connector._kv_cache_manager = SimpleNamespace(evict_blocks=evicted.append)
    tokens = list(range(4 * BLOCK))
    connector._requests["A"] = _Request(tokens, [5, 6, 7, 8], 0)
    connector._requests["B"] = _Request(tokens, [9, 10], 0)
    connector._requests["P"] = _Request(tokens, [1, 6, 2, 3], 0)  # preempted: a stale list
    connector._scheduled_now = {"A", "B"}
    connector.update_connector_output(KVConnectorOutput())
    assert evicted == []
    connector.update_connector_output(KVConnectorOutput(invalid_block_ids={6}))
    assert evicted == [{6, 7, 8}]  # the failed block and the ones after it; not B's, not P's 2, 3


@pytest.mark.parametrize("cause", ["timeout", "slow", "early_timeout"])
def test_a_steps_loads_share_one_timeout(
    engine_config: Any, monkeypatch: pytest.MonkeyPatch, cause: str
) -> None:
    """Once the step has spent one load's timeout (a load that waited it out on a segment frozen
    after granting its leases, or loads slow one after another), its other loads are not tried:
    recomputed, their requests cut, counted. Each had its own 10 s before, one after another,
    while every running request's decode waited (review, stop 66)."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvfabric.engines import vllm_connector
    from kvfabric.engines.vllm_connector import KvfabricConnector, KvfabricMetadata, LoadSpec

    connector = KvfabricConnector(engine_config, KVConnectorRole.WORKER, kv_cache_config=None)
    connector.client.close()
    layers = [torch.zeros(16, 64, dtype=torch.float32) for _ in range(2)]
    client = FailingLoadClient(2) if cause == "slow" else FailingLoadClient(0, cause="timeout")
    connector.client = client  # type: ignore[assignment]
    connector.register_kv_caches({f"layer{i}": kv for i, kv in enumerate(layers)})
    # "timeout": the first load waits out the whole 10 s; "slow": each takes 4 of them
    # "early_timeout": a replica's early cut, a second each: budget left, every load tried
    times = {
        "timeout": [0.0, 0.0, 10.0, 10.0],
        "slow": [0.0, 0.0, 4.0, 8.0, 12.0, 12.0],
        "early_timeout": [0.0, *(t for n in range(5) for t in (float(n), n + 1.0))],
    }[cause]
    clock = iter(times)
    monkeypatch.setattr(vllm_connector, "_step_clock", lambda: next(clock))
    hit = Hit(2 * BLOCK, BLOCK, (), (), objects=((),) * 2)
    loads = [LoadSpec(f"r{n}", hit, 0, [2 * n + 1, 2 * n + 2]) for n in range(5)]
    try:
        connector.bind_connector_metadata(KvfabricMetadata(loads=loads))
        connector.start_load_kv(None)
        connector.clear_connector_metadata()
        errors = connector.get_block_ids_with_load_errors()
    finally:
        connector.shutdown()
    tried = {"timeout": 1, "slow": 3, "early_timeout": 5}[cause]  # slow: at 0, 4, 8 s; 12 s is over
    assert client.loads == tried
    failed_loads = {"timeout": loads[:1], "slow": [], "early_timeout": loads}[cause]
    assert errors == {b for load in [*failed_loads, *loads[tried:]] for b in load.block_ids}
    skipped = client.metrics.registry.get_sample_value(
        "kvfabric_client_fallbacks_total", {"cause": "vllm_step_load_budget"}
    )
    assert (skipped or 0) == 5 - tried
    assert set(connector._cut) >= {load.req_id for load in loads[tried:]}


@pytest.mark.parametrize(
    "extra",
    [
        {"lora_request": SimpleNamespace(lora_name="a", lora_int_id=1)},
        {"mm_features": [object()]},
        {"prompt_embeds": object()},
        {"cache_salt": "user-7"},
    ],
    ids=["lora", "multimodal", "prompt_embeds", "cache_salt"],
)
def test_a_request_keyed_by_more_than_its_tokens_is_neither_looked_up_nor_saved(
    scheduler_side: Any, extra: dict[str, Any]
) -> None:
    """kvfabric's keys are made of token ids only: a LoRA request, an image prompt, prompt
    embeddings or a cache salt would load KV made with another adapter, image, embedding or salt
    (review, 2026-12-05). Such a request gets no external tokens and nothing of it is saved;
    the same prompt without them is served as before."""
    tokens = prompt_ids(3 * BLOCK + 1, seed=16)
    connector = scheduler_side(2)
    request = SimpleNamespace(request_id="r6", prompt_token_ids=tokens, **extra)
    assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
    assert connector.get_num_new_matched_tokens(request, 0) == (0, False)  # asked again
    new = SimpleNamespace(
        req_id="r6",
        prompt_token_ids=tokens,
        block_ids=([100, 101, 102, 103],),
        num_computed_tokens=0,
        **{k: v for k, v in extra.items() if k != "cache_salt"},  # vLLM's NewRequestData has no salt
    )
    output = SimpleNamespace(
        scheduled_new_reqs=[new],
        num_scheduled_tokens={"r6": len(tokens)},
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
        ),
    )
    connector._policy_checked = True
    meta = connector.build_connector_meta(output)
    assert meta.loads == [] and meta.saves == [] and not connector._keyed_beyond
    counted = connector.client.metrics.registry.get_sample_value(
        "kvfabric_client_fallbacks_total", {"cause": "vllm_keyed_beyond_tokens"}
    )
    assert counted == 1
    plain = schedule(connector, "r7", tokens, local_tokens=0)
    assert [(load.first_chunk, load.block_ids) for load in plain.loads] == [(0, [100, 101])]


def test_the_key_space_names_what_makes_the_kv(engine_config: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights quantized at load (`--quantization`) are other weights: their revision says so;
    random weights (`load_format=dummy`) are not cached at all (keyed as the real files they
    would poison their key space); a branch name is no revision (it moves); layers whose KV is
    not quantized change the layout (review, 2026-12-05)."""
    from kvfabric.engines.vllm_connector import _pinned_revision, engine_spec

    plain = engine_spec(engine_config, {})
    monkeypatch.setattr(engine_config.model_config, "quantization", "fp8")
    quantized = engine_spec(engine_config, {})
    assert quantized.model.weights_revision == f"{plain.model.weights_revision}+q:fp8"
    monkeypatch.setattr(engine_config.cache_config, "kv_cache_dtype_skip_layers", ["0", "sliding_window"])
    assert engine_spec(engine_config, {}).layout.tensor_layout.endswith(":skip0,sliding_window")
    monkeypatch.setattr(engine_config.load_config, "load_format", "dummy")
    with pytest.raises(ValueError, match="dummy"):
        engine_spec(engine_config, {})
    assert _pinned_revision("main") == "" and _pinned_revision("v1.0") == ""
    assert _pinned_revision("a" * 40) == "a" * 40


def test_hosts_whose_cpu_attention_lays_blocks_out_apart_do_not_share_keys(
    engine_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's CPU attention writes bf16 blocks in AMX tiles where the host has AMX ("amx") and
    plainly where it has not ("vec"); both hosts report capability AVX512. The layout names the
    ISA vLLM chose, so the two never read each other's bytes as their own (review, stop 66:
    same keys, other bytes, a wrong hit saved on under the right keys)."""
    import torch

    from kvfabric.engines.vllm_connector import cpu_attention_isa, engine_spec

    for amx, isa in ((True, "amx"), (False, "vec")):
        with monkeypatch.context() as patched:
            patched.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
            assert cpu_attention_isa(torch.bfloat16, 128, 64, "auto").endswith(f"-{isa}")
    monkeypatch.setattr(engine_config.model_config, "dtype", torch.bfloat16)  # (the tiny model: float32)
    assert engine_config.cache_config.block_size % 32 == 0
    layouts = []
    for amx in (True, False):
        with monkeypatch.context() as patched:
            patched.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
            layouts.append(engine_spec(engine_config, {}).layout.tensor_layout)
    assert "-amx:" in layouts[0] and "-vec:" in layouts[1], layouts


def worker_side(engine_config: Any, client: Any, caches: dict[str, Any]) -> Any:
    """A worker-side connector over `client` (a fake) and the KV cache tensors `caches`."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvfabric.engines.vllm_connector import KvfabricConnector

    connector = KvfabricConnector(engine_config, KVConnectorRole.WORKER, kv_cache_config=None)
    connector.client.close()
    connector.client = client
    connector.register_kv_caches(caches)
    return connector


def worker_step(connector: Any, meta: Any, drain_errors_first: bool = False) -> set[int]:
    """One step of vLLM's model runner on the worker side: the load, the forward, the saves; the
    blocks reported as load errors. `drain_errors_first`: vLLM asks for the load errors before
    `wait_for_save` (a deferred finalize: speculative decoding with a draft model)."""
    connector.bind_connector_metadata(meta)
    connector.start_load_kv(None)
    errors: set[int] = connector.get_block_ids_with_load_errors() if drain_errors_first else set()
    connector.wait_for_save()
    errors |= connector.get_block_ids_with_load_errors()
    connector.clear_connector_metadata()
    return errors


def dropped_saves(client: Any, cause: str) -> float:
    value = client.metrics.registry.get_sample_value("kvfabric_client_saves_dropped_total", {"cause": cause})
    return float(value or 0.0)


@pytest.mark.parametrize("case", ["load_failed_part_way", "own_lookup_missed", "block_mismatch"])
def test_a_request_computed_over_another_requests_failed_load_saves_nothing(
    scheduler_side: Any, engine_config: Any, case: str
) -> None:
    """A has a kvfabric hit; vLLM registers A's new blocks in its own prefix cache when it
    allocates them, and B, sharing A's prefix and scheduled in the same step, gets a local hit
    on them and saves its chunks past them, computed over them. When A's load verifies only
    part of its hit (or A's blocks could not be planned: load errors of the step's metadata),
    B's KV is wrong: saved, it was stored under B's right keys, checksummed, and served for good
    (review, 2026-12-06). B saves nothing, now or later; nor does a B whose own lookup missed and
    so saves A's blocks themselves. A request none of whose blocks failed saves."""
    import torch

    from kvfabric.engines.vllm_connector import KvfabricMetadata, SaveSpec

    sched = scheduler_side(3)
    prefix = prompt_ids(3 * BLOCK, seed=50)
    a_tokens = prefix + prompt_ids(BLOCK + 1, seed=51)
    a = schedule(sched, "A", a_tokens, local_tokens=0, blocks_given=2 if case == "block_mismatch" else -1)
    if case == "own_lookup_missed":
        sched.client.chunks = 0
    b_tokens = prefix + prompt_ids(2 * BLOCK + 1, seed=52)
    b = schedule(sched, "B", b_tokens, local_tokens=3 * BLOCK)  # vLLM's cache: A's blocks 100..102
    sched.client.chunks = 0
    c = schedule(sched, "C", prompt_ids(2 * BLOCK + 1, seed=53), local_tokens=0, first_block=200)
    expected_b = (0, [100, 101, 102, 103, 104]) if case == "own_lookup_missed" else (3, [103, 104])
    assert [(s.first_chunk, s.block_ids) for s in b.saves] == [expected_b]
    assert [s.block_ids for s in c.saves] == [[200, 201]]
    client = FailingLoadClient(1)  # A's load verifies its first chunk only
    worker = worker_side(engine_config, client, {f"l{i}": torch.zeros(210, 64) for i in range(2)})
    try:
        meta = KvfabricMetadata(
            loads=a.loads + b.loads + c.loads,
            saves=a.saves + b.saves + c.saves,
            load_errors=a.load_errors + b.load_errors + c.load_errors,
        )
        errors = worker_step(worker, meta)
        assert errors == ({100, 101} if case == "block_mismatch" else {101, 102})
        assert client.saved_for == ["C"]
        assert worker._cut_cause("B") == "load_failed"
        assert dropped_saves(client, "load_failed") == len(a.saves) + 1  # A's own (cut) and B's
        later = SaveSpec("B", b_tokens + b_tokens, 5, [105], [100, 101, 102, 103, 104])
        worker_step(worker, KvfabricMetadata(saves=[later]))
        assert client.saved_for == ["C"] and dropped_saves(client, "load_failed") == len(a.saves) + 2
    finally:
        client.saves.clear()
        worker.shutdown()


def test_a_save_over_blocks_a_load_left_unwritten_is_dropped_in_that_step_and_the_next(
    engine_config: Any,
) -> None:
    """The step's failed blocks are kept apart from what vLLM drains: a deferred finalize
    (speculative decoding with a draft model) asks for the load errors before `wait_for_save`.
    And they are kept one step more: under async scheduling vLLM plans the next step before it
    has seen this one's errors, so a request can be computed over them then too. Two steps on,
    vLLM has recomputed them: a save over them is made."""
    import torch

    from kvfabric.engines.vllm_connector import KvfabricMetadata, LoadSpec, SaveSpec

    client = FailingLoadClient(1)
    worker = worker_side(engine_config, client, {f"l{i}": torch.zeros(8, 64) for i in range(2)})
    hit = Hit(3 * BLOCK, BLOCK, (), (), objects=((),) * 3)
    tokens = list(range(4 * BLOCK))
    try:
        meta = KvfabricMetadata(
            loads=[LoadSpec("A", hit, 0, [1, 2, 3])], saves=[SaveSpec("B", tokens, 3, [4], [1, 2, 3])]
        )
        assert worker_step(worker, meta, drain_errors_first=True) == {2, 3}
        assert client.saved_for == []
        worker_step(worker, KvfabricMetadata(saves=[SaveSpec("D", tokens, 3, [5], [1, 2, 3])]))
        assert client.saved_for == [] and dropped_saves(client, "load_failed") == 2
        worker_step(worker, KvfabricMetadata(saves=[SaveSpec("E", tokens, 3, [5], [1, 2, 3])]))
        assert client.saved_for == ["E"]
    finally:
        client.saves.clear()
        worker.shutdown()


def test_a_save_that_raises_is_dropped_never_raised_into_vllms_step(engine_config: Any) -> None:
    """A cache tensor numpy cannot view (a CUDA tensor on a GPU build; here a non-contiguous CPU
    one) raised out of `wait_for_save` into vLLM's step, at the first save: the engine died. So
    did a save after the client closed its save memory (a slot is still taken, its array
    raises). Now the save is dropped (`saves_dropped_total{cause="vllm_save_error"}`), its
    request cut, and every slot it took given back."""
    import torch

    from kvfabric.client.save_memory import SaveSlots
    from kvfabric.engines.vllm_connector import KvfabricMetadata, SaveSpec

    tokens = list(range(2 * BLOCK))
    client = FakeSaveClient(inflight_bytes=1 << 20)
    worker = worker_side(engine_config, client, {"l0": torch.zeros(64, 8).t()})  # [8 blocks, 64]
    try:
        worker_step(worker, KvfabricMetadata(saves=[SaveSpec("r1", tokens, 0, [1, 2])]))
        assert client.saves == [] and worker._cut_cause("r1") == "vllm_save_error"
        assert dropped_saves(client, "vllm_save_error") == 1
    finally:
        worker.shutdown()

    layers = [torch.zeros(8, 64) for _ in range(2)]
    object_bytes = sum(layer[0].numel() * 4 for layer in layers)
    client = FakeSaveClient(inflight_bytes=4 * object_bytes)
    worker = worker_side(engine_config, client, {f"l{i}": kv for i, kv in enumerate(layers)})
    try:
        slots = worker._slots(object_bytes)
        assert isinstance(slots, SaveSlots)
        client.close()  # the client closes its save memory (vLLM shutting down, say)
        assert slots.memory.closed
        worker_step(worker, KvfabricMetadata(saves=[SaveSpec("r2", tokens, 0, [1, 2])]))
        assert client.saves == [] and worker._cut_cause("r2") == "vllm_save_error"
        assert slots.free() == slots.count  # no slot leaked
    finally:
        worker.shutdown()


def test_weight_files_that_cannot_be_read_leave_the_connector_uncached(
    engine_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The weights revision defaults to a digest of the model directory's weight files: one
    that cannot be read (permissions, removed under the engine) raised `OSError` out of the
    connector's constructor, and vLLM did not start. Now the client is disabled
    (`config_error`) and vLLM serves uncached."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvfabric.engines import vllm_connector

    def unreadable(path: str) -> str:
        raise PermissionError(13, "Permission denied", f"{path}/model.safetensors")

    monkeypatch.setattr(vllm_connector, "weights_digest_of_dir", unreadable)
    connector = vllm_connector.KvfabricConnector(engine_config, KVConnectorRole.WORKER, kv_cache_config=None)
    try:
        status = connector.client.status
        assert (status.state, status.cause) == ("disabled", "config_error")
        assert "Permission denied" in status.detail
    finally:
        connector.shutdown()


def test_a_request_scheduled_as_new_again_keeps_what_it_knew(scheduler_side: Any) -> None:
    """vLLM's V2 model runner folds a resumed request into the new ones, and a streaming-input
    session's next chunk comes as new under the same id: its first state was replaced, so its
    backfill lookup was dropped (the lease held to its TTL, never released) and the chunks it
    had saved were saved again. Now the lookup is carried over and what was stored stays known."""
    tokens = prompt_ids(3 * BLOCK + 1, seed=40)
    connector = scheduler_side(0)
    client = connector.client = SlowClient()
    schedule(connector, "r", tokens, local_tokens=3 * BLOCK)  # its backfill lookup goes out
    schedule(connector, "r", tokens, local_tokens=3 * BLOCK)  # new again: no second lookup
    assert len(client.lookups) == 1
    hit = client.back(3)
    connector.request_finished(SimpleNamespace(request_id="r"), [])
    assert client.released == [hit]

    connector = scheduler_side(0)
    first = schedule(connector, "s", tokens, local_tokens=0)  # a miss: its three blocks saved
    assert [(s.first_chunk, s.block_ids) for s in first.saves] == [(0, [100, 101, 102])]
    assert schedule(connector, "s", tokens, local_tokens=3 * BLOCK).saves == []


def _two_free_ports() -> int:
    """A port P with P + 1 free too (checked, not reserved: another process may take them)."""
    import socket

    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return int(port)
    raise AssertionError("no two consecutive free ports")


def test_a_fixed_metrics_port_is_the_schedulers_and_the_worker_serves_on_the_next(engine_config: Any) -> None:
    """Both sides' clients run on one host: with the same fixed port the second to bind it ran
    without the cache (`config_error`; review, stop 69)."""
    import copy
    import time
    import urllib.request

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvfabric.engines.vllm_connector import make_client

    port = _two_free_ports()
    config = copy.deepcopy(engine_config)
    config.kv_transfer_config.kv_connector_extra_config = {
        **config.kv_transfer_config.kv_connector_extra_config,
        "metrics_port": port,
    }
    clients = [make_client(config, KVConnectorRole.SCHEDULER), make_client(config, KVConnectorRole.WORKER)]
    try:
        deadline = time.monotonic() + 30
        while any(c.status.state == "starting" for c in clients) and time.monotonic() < deadline:
            time.sleep(0.05)  # no cluster here: each start ends `nats_unreachable`, its metrics served
        assert [c.status.cause for c in clients] == ["nats_unreachable", "nats_unreachable"]
        for served in (port, port + 1):
            with urllib.request.urlopen(f"http://127.0.0.1:{served}/metrics", timeout=10) as reply:
                assert b"kvfabric_client_fallbacks_total" in reply.read()
    finally:
        for client in clients:
            client.close()


def test_a_worker_has_no_port_after_65535() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvfabric.client import ClientSettings
    from kvfabric.engines.vllm_connector import worker_metrics_port

    settings = ClientSettings(nats_url="nats://127.0.0.1:1", metrics_port=65535)
    assert worker_metrics_port(settings, KVConnectorRole.SCHEDULER).metrics_port == 65535
    with pytest.raises(ValueError, match="would be 65536"):
        worker_metrics_port(settings, KVConnectorRole.WORKER)
    # data parallel: two ports per rank on the host (they bound P and P + 1 twice; stop 70)
    fixed = ClientSettings(nats_url="nats://127.0.0.1:1", metrics_port=9000)
    ports = [
        worker_metrics_port(fixed, role, rank).metrics_port
        for rank in range(3)
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER)
    ]
    assert ports == list(range(9000, 9006))
    for port in (0, -1):
        unchanged = ClientSettings(nats_url="nats://127.0.0.1:1", metrics_port=port)
        assert worker_metrics_port(unchanged, KVConnectorRole.WORKER).metrics_port == port


def test_a_longrope_models_key_follows_which_factors_vllm_rotates_with(engine_config: Any) -> None:
    """LongRoPE (Phi-3): vLLM rotates with the long factors when max_model_len exceeds
    `original_max_position_embeddings`, the short ones otherwise: other KV, so another key
    (stop 70). A model without LongRoPE keys alike whatever its max_model_len."""
    import copy

    from kvfabric.engines.vllm_connector import engine_spec

    def digest(max_model_len: int, longrope: bool) -> str:
        config = copy.deepcopy(engine_config)
        config.model_config.max_model_len = max_model_len
        if longrope:
            hf = config.model_config.hf_config
            hf.original_max_position_embeddings = 4096
            hf.rope_scaling = {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}
        spec = engine_spec(config, {"weights_revision": "r"})
        return str(spec.model.attn_config_digest)

    assert digest(2048, longrope=False) == digest(8192, longrope=False)
    assert digest(2048, longrope=True) != digest(8192, longrope=True)
    assert digest(2048, longrope=True) == digest(4096, longrope=True)  # short factors both


def test_only_a_kv_cache_of_full_attention_is_cached() -> None:
    """A sliding-window model's blocks before the window are vLLM's shared null block (id 0),
    freed and reused as the window moves: saved, block 0 went under the prompt's real keys; a
    hybrid model has one block table per group and the connector moves group 0's only (review,
    stop 71). Either runs the client disabled (`config_error`)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    from kvfabric.engines.vllm_connector import unsupported_kv_cache

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=256
    )

    def config(*specs: Any) -> KVCacheConfig:
        groups = [KVCacheGroupSpec([f"layers.{i}"], spec) for i, spec in enumerate(specs)]
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)

    assert unsupported_kv_cache(None) is None
    assert unsupported_kv_cache(config(full)) is None
    assert "SlidingWindowSpec" in (unsupported_kv_cache(config(window)) or "")
    assert "2 KV cache groups" in (unsupported_kv_cache(config(full, window)) or "")
    prefix_lm = dataclasses.replace(full, non_causal=True)  # a chunk's KV depends on later tokens
    assert "non-causal" in (unsupported_kv_cache(config(prefix_lm)) or "")
    # one group of several layers: its first layer's spec decides, as the scheduler side sees it
    uniform = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"l0": full, "l1": full})
    assert unsupported_kv_cache(config(uniform)) is None


def test_a_sliding_window_model_runs_the_client_disabled(engine_config: Any) -> None:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    from kvfabric.engines.vllm_connector import make_client

    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=256
    )
    kv_cache = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], window)]
    )
    client = make_client(engine_config, KVConnectorRole.SCHEDULER, kv_cache)
    try:
        assert client.status.state == "disabled" and client.status.cause == "config_error"
        assert "SlidingWindowSpec" in client.status.detail
    finally:
        client.close()


def test_the_metrics_ports_follow_the_global_data_parallel_rank(engine_config: Any) -> None:
    """External load balancing (one process per rank) leaves the rank local to the host unset:
    every rank on a host took P and P + 1 (review, stop 71)."""
    import copy

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvfabric.engines.vllm_connector import make_client

    config = copy.deepcopy(engine_config)
    config.kv_transfer_config.kv_connector_extra_config = {
        **config.kv_transfer_config.kv_connector_extra_config,
        "metrics_port": 9100,
        "nats_url": "nats://127.0.0.1:1",
        "connect_timeout_ms": 200,
    }
    config.parallel_config.data_parallel_rank = 1
    config.parallel_config.data_parallel_index = 1
    config.parallel_config.data_parallel_rank_local = None
    # a dense model's engine core resets the rank to 0; the index keeps it (review, stop 71)
    config.parallel_config.reconfigure_for_independent_dp_rank()
    assert config.parallel_config.data_parallel_rank == 0
    clients = [make_client(config, KVConnectorRole.SCHEDULER), make_client(config, KVConnectorRole.WORKER)]
    try:
        assert [c.settings.metrics_port for c in clients] == [9102, 9103]
    finally:
        for client in clients:
            client.close()


class LateLookups(FakeClient):
    """Lookups that are not back when first asked; `answer` ends the last one with a lease of
    `lease_left_ms` left."""

    def __init__(self, chunks: int) -> None:
        super().__init__(chunks)
        self.pending: list[concurrent.futures.Future[Hit]] = []

    def lookup_async(self, tokens: list[int], **_: Any) -> concurrent.futures.Future[Hit]:
        self.lookups_asked = getattr(self, "lookups_asked", 0) + 1
        future: concurrent.futures.Future[Hit] = concurrent.futures.Future()
        self.pending.append(future)
        return future

    def answer(self) -> Hit:
        hit = Hit(
            self.chunks * BLOCK,
            BLOCK,
            (),
            (),
            objects=((),) * self.chunks,
            lease_id=9,
            lease_expires_ms=now_ms() + self.lease_left_ms,
        )
        self.pending[-1].set_result(hit)
        return hit


def test_a_lookup_back_long_ago_is_looked_up_again_before_a_load_is_planned(scheduler_side: Any) -> None:
    """A lookup that came back while vLLM could not schedule its request, asked for only when its
    lease is about to lapse: given back and looked up again, never planned (its load would fail
    and be recomputed)."""
    tokens = prompt_ids(3 * BLOCK + 1, seed=12)
    connector = scheduler_side(3)
    client = LateLookups(3)
    connector.client = client
    connector._lookups_fast = False  # not waited for: the first ask is "ask again"
    request = SimpleNamespace(request_id="late", prompt_token_ids=tokens)
    assert connector.get_num_new_matched_tokens(request, 0) == (None, False)
    client.lease_left_ms = 2_000  # back, but asked for only when 2 s of its lease are left
    stale = client.answer()
    assert connector.get_num_new_matched_tokens(request, 0) == (None, False)  # a new lookup
    assert client.released == [stale] and client.lookups_asked == 2
    client.lease_left_ms = 60_000
    client.answer()
    assert connector.get_num_new_matched_tokens(request, 0) == (3 * BLOCK, False)
    assert client.lookups_asked == 2


class DelayedLookups(FakeClient):
    """Lookups that come back `delay_s` after they start (a directory answering in that time),
    each with a hit of `chunks` chunks under a lease."""

    def __init__(self, chunks: int, delay_s: float) -> None:
        super().__init__(chunks)
        self.delay_s = delay_s
        self.pending: list[concurrent.futures.Future[Hit]] = []

    def lookup_async(self, tokens: list[int], **_: Any) -> concurrent.futures.Future[Hit]:
        self.lookups_asked = getattr(self, "lookups_asked", 0) + 1
        future: concurrent.futures.Future[Hit] = concurrent.futures.Future()
        hit = Hit(
            self.chunks * BLOCK,
            BLOCK,
            (),
            (),
            objects=((),) * self.chunks,
            lease_id=len(self.pending) + 1,
            lease_expires_ms=now_ms() + self.lease_left_ms,
        )
        timer = threading.Timer(self.delay_s, future.set_result, (hit,))
        timer.daemon = True
        timer.start()
        self.pending.append(future)
        return future


def step_ends(connector: Any) -> Any:
    """The end of a `schedule()` that scheduled nothing the test follows (vLLM builds the step's
    connector metadata once, at the end of every `schedule()`)."""
    output = SimpleNamespace(
        scheduled_new_reqs=[],
        num_scheduled_tokens={},
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
        ),
    )
    connector._policy_checked = True  # the policy check reads vLLM's scheduler frame
    return connector.build_connector_meta(output)


def test_a_steps_new_requests_share_one_wait_for_their_lookups(scheduler_side: Any) -> None:
    """vLLM asks for the requests it admits one after another within one `schedule()`: their
    waits share one `lookup_wait_ms`. Before, each request waited for its own lookup, so 16 new
    requests and a directory answering in 5 ms blocked that step (every running request's
    decode) 80 ms. The requests past the step's wait start their lookups at once and answer
    "ask again"; in the next step their lookups are back and they are answered without a new
    lookup, and every lease is given back when the requests end. (Real time: a wait of 0.4 s,
    lookups back in 0.1 s, 16 requests: 1.6 s blocked before, at most ~0.4 s now.)"""
    wait_s, delay_s, count = 0.4, 0.1, 16
    connector = scheduler_side(3)
    client = connector.client = DelayedLookups(3, delay_s)
    connector._lookup_wait_s = wait_s
    step_ends(connector)  # a fresh step
    requests = [
        SimpleNamespace(request_id=f"burst{i}", prompt_token_ids=prompt_ids(4 * BLOCK + 1, seed=100 + i))
        for i in range(count)
    ]
    answers = []
    blocked = 0.0
    for request in requests:  # one `schedule()` admitting them all
        began = time.monotonic()
        answers.append(connector.get_num_new_matched_tokens(request, 0))
        blocked += time.monotonic() - began
    answered = sum(1 for answer in answers if answer != (None, False))
    # those answered first (each waited ~delay_s of the step's wait), then "ask again"
    assert answers == [(3 * BLOCK, False)] * answered + [(None, False)] * (count - answered)
    assert answered <= count // 2, answers  # (~wait_s / delay_s: 4 or 5)
    assert blocked < 1.0, f"the step blocked {blocked:.2f} s"  # one wait (0.4 s), not 16 (1.6 s)
    assert client.lookups_asked == count  # every lookup started in this step
    step_ends(connector)
    done, _ = concurrent.futures.wait(client.pending, timeout=30)
    assert len(done) == count
    for request in requests[answered:]:  # the next step: back, answered at once
        assert connector.get_num_new_matched_tokens(request, 0) == (3 * BLOCK, False)
    assert client.lookups_asked == count and client.released == []
    for request in requests:
        connector.request_finished(request, [])
    assert sorted(hit.lease_id for hit in client.released) == list(range(1, count + 1))


def test_a_wait_the_steps_earlier_requests_cut_short_does_not_stop_the_waiting(scheduler_side: Any) -> None:
    """Waiting for lookups stops after a lookup given the whole `lookup_wait_ms` is not back (a
    slow or silent directory), not after one whose wait was what the step's earlier requests
    left of it: that says nothing of the directory."""
    tokens = prompt_ids(3 * BLOCK + 1, seed=21)
    connector = scheduler_side(0)
    client = connector.client = SlowClient()
    connector._lookup_wait_s = 0.05
    step_ends(connector)
    connector._step_wait_left_s = 0.001  # the step's earlier requests waited all but 1 ms
    first = SimpleNamespace(request_id="cut", prompt_token_ids=tokens)
    assert connector.get_num_new_matched_tokens(first, 0) == (None, False)
    assert connector._lookups_fast and len(client.lookups) == 1
    step_ends(connector)  # the next step waits afresh: the whole wait, and it runs out
    second = SimpleNamespace(request_id="whole", prompt_token_ids=tokens)
    assert connector.get_num_new_matched_tokens(second, 0) == (None, False)
    assert not connector._lookups_fast and len(client.lookups) == 2
    for lookup in client.lookups:  # both back (misses): answered when asked again
        lookup.set_result(Hit(0, BLOCK, (), (), objects=(), lease_id=0))
    assert connector.get_num_new_matched_tokens(first, 0) == (0, False)
    assert connector.get_num_new_matched_tokens(second, 0) == (0, False)


def test_a_request_is_looked_up_again_for_an_old_lease_once_at_most(scheduler_side: Any) -> None:
    """A directory granting leases shorter than the margin (or a clock ahead of it) makes every
    answer look old: looked up again once, then the answer is planned whatever its age (review:
    the request asked again for ever, a lookup and a release each step)."""
    tokens = prompt_ids(3 * BLOCK + 1, seed=13)
    connector = scheduler_side(3)
    client = LateLookups(3)
    connector.client = client
    connector._lookups_fast = False
    client.lease_left_ms = 2_000  # every lease granted short
    request = SimpleNamespace(request_id="short", prompt_token_ids=tokens)
    assert connector.get_num_new_matched_tokens(request, 0) == (None, False)
    client.answer()
    assert connector.get_num_new_matched_tokens(request, 0) == (None, False)  # looked up again
    client.answer()
    assert connector.get_num_new_matched_tokens(request, 0) == (3 * BLOCK, False)  # planned
    assert client.lookups_asked == 2 and len(client.released) == 1
    connector.request_finished(request, [])
    assert "short" not in connector._relooked
