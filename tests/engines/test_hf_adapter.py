"""HF transformers adapter end to end: a prompt run in one engine instance is saved; a fresh
instance loads the prefix from kvfabric, computes only the suffix, and produces identical greedy
output token ids to a run without kvfabric, also when a segment dies, a stored byte is corrupted
or the directory does not answer (then it recomputes), and when the cache cannot start at all
(a missing password file, NATS down: it runs uncached)."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvfabric.client import ClientSettings, KvClient
from kvfabric.client.save_memory import SaveSlots
from kvfabric.engines.hf import HfKvAdapter, hf_engine_spec
from kvfabric.format.key import ShareDomain
from kvfabric.testing import NatsServer, ServiceProcess
from tests.engines.tinymodel import build_tiny_llama, prompt_ids
from tests.integration.clientkit import corrupt_stored_byte
from tests.integration.cluster import directory_process, segment_process

pytestmark = [pytest.mark.integration, pytest.mark.engines]

TPC = 64
NEW_TOKENS = 12
DOMAIN = ShareDomain(tenant_id="tenant-hf", salt=b"hf-adapter-tests")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture
def cluster(nats_server: NatsServer) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    with directory_process(nats_server) as directory, segment_process(nats_server, "seg-hf") as segment:
        yield directory, segment


def load_model(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    model: torch.nn.Module = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.eval()


def engine(
    model_dir: Path, nats: NatsServer, dtype: torch.dtype = torch.float32, **settings: object
) -> HfKvAdapter:
    """A fresh engine instance: its own model object and its own client."""
    model = load_model(model_dir, dtype)
    client = KvClient(
        ClientSettings(nats_url=nats.url, **settings),  # type: ignore[arg-type]
        hf_engine_spec(model, DOMAIN, tokens_per_chunk=TPC, model_id="tiny-llama"),
    )
    return HfKvAdapter(model, client)


@torch.inference_mode()
def reference(model_dir: Path, ids: list[int]) -> list[int]:
    """Greedy tokens from transformers' own generate, without kvfabric."""
    model = load_model(model_dir)
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS
    )  # type: ignore[operator]
    return [int(t) for t in out[0, len(ids) :]]


def saved(adapter: HfKvAdapter, ids: list[int]) -> None:
    result = adapter.generate(ids, max_new_tokens=NEW_TOKENS)
    assert result.loaded_tokens == 0 and result.saving is not None
    outcome = result.saving.result(60)
    assert outcome.chunks_failed == 0 and outcome.chunks_saved == len(ids) // TPC


def test_fresh_engine_loads_the_prefix_and_outputs_identical_tokens(
    model_dir: Path, nats_server: NatsServer, cluster: object
) -> None:
    ids = prompt_ids(10 * TPC + 17, seed=1)
    expected = reference(model_dir, ids)
    first = engine(model_dir, nats_server)
    try:
        saved(first, ids)
        # gathered into the adapter's save memory, read by the co-located segment in place
        assert first.client.aio.pool.save_memory_puts == 10
        slots = first._save_slots
        assert isinstance(slots, SaveSlots)
        deadline = time.monotonic() + 5  # given back by the save future's callback, just after it
        while slots.free() < slots.count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert slots.free() == slots.count  # every slot back
    finally:
        first.client.close()
    assert slots.memory.closed  # nothing viewed it any more: the client's close closed it
    second = engine(model_dir, nats_server)
    try:
        result = second.generate(ids, max_new_tokens=NEW_TOKENS)
        assert result.loaded_tokens == 10 * TPC and result.computed_tokens == 17
        assert result.token_ids == expected
        # A prompt that extends a stored one loads the shared prefix and still matches.
        longer = ids[: 10 * TPC] + prompt_ids(3 * TPC + 5, seed=2)
        extended = second.generate(longer, max_new_tokens=NEW_TOKENS)
        assert extended.loaded_tokens == 10 * TPC and extended.computed_tokens == 3 * TPC + 5
        assert extended.token_ids == reference(model_dir, longer)
        # A prompt that is exactly whole chunks: the last token is never loaded (its logits are needed).
        exact = ids[: 10 * TPC]
        whole = second.generate(exact, max_new_tokens=NEW_TOKENS, save=False)
        assert whole.loaded_tokens == 9 * TPC and whole.token_ids == reference(model_dir, exact)
        assert second.client.aio._leases == {}  # every lease released
    finally:
        second.client.close()


def test_another_dtype_or_model_never_shares_kv(
    model_dir: Path, nats_server: NatsServer, cluster: object
) -> None:
    ids = prompt_ids(4 * TPC + 1, seed=3)
    first = engine(model_dir, nats_server)
    try:
        saved(first, ids)
    finally:
        first.client.close()
    bf16 = engine(model_dir, nats_server, dtype=torch.bfloat16)
    try:
        assert bf16.generate(ids, max_new_tokens=2, save=False).loaded_tokens == 0
    finally:
        bf16.client.close()
    other_dir = build_tiny_llama(model_dir.parent / "other-llama", seed=99)
    other = engine(other_dir, nats_server)
    try:
        assert other.generate(ids, max_new_tokens=2, save=False).loaded_tokens == 0
    finally:
        other.client.close()


def test_corrupted_byte_recomputes_from_the_bad_chunk_with_identical_output(
    model_dir: Path, nats_server: NatsServer, cluster: object
) -> None:
    ids = prompt_ids(6 * TPC + 9, seed=4)
    first = engine(model_dir, nats_server)
    try:
        saved(first, ids)
        hit = first.client.lookup(ids)
        corrupt_stored_byte(hit, 2)
        first.client.release(hit)
    finally:
        first.client.close()
    second = engine(model_dir, nats_server)
    try:
        result = second.generate(ids, max_new_tokens=NEW_TOKENS, save=False)
        assert result.loaded_tokens == 2 * TPC
        assert result.token_ids == reference(model_dir, ids)
    finally:
        second.client.close()


def test_dead_segment_or_silent_directory_recomputes_with_identical_output(
    model_dir: Path, nats_server: NatsServer, cluster: tuple[ServiceProcess, ServiceProcess]
) -> None:
    directory, segment = cluster
    ids = prompt_ids(5 * TPC + 3, seed=5)
    expected = reference(model_dir, ids)
    first = engine(model_dir, nats_server)
    try:
        saved(first, ids)
    finally:
        first.client.close()
    second = engine(model_dir, nats_server, lookup_timeout_ms=500, load_timeout_ms=2000)
    try:
        directory.send_signal(signal.SIGSTOP)
        try:
            silent = second.generate(ids, max_new_tokens=NEW_TOKENS, save=False)
        finally:
            directory.send_signal(signal.SIGCONT)
        assert silent.loaded_tokens == 0 and silent.token_ids == expected
        segment.send_signal(signal.SIGKILL)
        segment.wait(10.0)
        dead = second.generate(ids, max_new_tokens=NEW_TOKENS, save=False)
        assert dead.loaded_tokens == 0 and dead.token_ids == expected
        assert second.client.aio._leases == {}
    finally:
        second.client.close()


def test_a_cache_that_cannot_start_leaves_the_engine_generating_uncached(
    model_dir: Path, tmp_path: Path
) -> None:
    """Issue 22, item 3: before, `KvClient()` raised for a missing password file, so the engine
    could not be built."""
    from kvfabric.testing.ports import free_port

    ids = prompt_ids(4 * TPC + 9, seed=7)
    want = reference(model_dir, ids)
    url = f"nats://127.0.0.1:{free_port()}"
    for settings, cause in (
        ({"nats_password_file": str(tmp_path / "run" / "password")}, "config_error"),
        ({"connect_timeout_ms": 500}, "nats_unreachable"),
    ):
        adapter = HfKvAdapter(
            load_model(model_dir),
            KvClient(
                ClientSettings(nats_url=url, **settings),
                hf_engine_spec(load_model(model_dir), DOMAIN, tokens_per_chunk=TPC, model_id="tiny-llama"),
            ),
        )
        try:
            assert adapter.client.status.cause == cause
            result = adapter.generate(ids, max_new_tokens=NEW_TOKENS)
            assert result.token_ids == want
            assert result.loaded_tokens == 0 and result.computed_tokens == len(ids)
            assert result.saving is None  # dropped, counted
        finally:
            adapter.client.close()


def test_a_load_or_forward_that_raises_gives_the_lease_back_and_a_load_is_a_miss(model_dir: Path) -> None:
    """`load_prefix` never raises (a load that raises, an object of another size say, is a miss:
    its lease given back), and a forward that raises gives the hit's lease back before the error
    goes on (it was held to its TTL; review, 2026-12-05)."""
    from kvfabric.client import Hit
    from kvfabric.engines.hf import PrefixLoad

    released: list[Hit] = []
    hit = Hit(2 * TPC, TPC, (), (), objects=((),) * 2, lease_id=7)

    class Client:
        def lookup(self, *args: object, **kwargs: object) -> Hit:
            return hit

        def load(self, *args: object, **kwargs: object) -> object:
            raise ValueError("object size 4096 != destination size 8192")

        def release(self, h: Hit) -> None:
            released.append(h)

    model = load_model(model_dir)
    spec = hf_engine_spec(model, DOMAIN, tokens_per_chunk=TPC, model_id="tiny-llama")
    adapter = HfKvAdapter(model, KvClient.disabled(spec, "test", "unit"))
    real_client, adapter.client = adapter.client, Client()  # type: ignore[assignment]
    try:
        ids = prompt_ids(3 * TPC + 5, seed=9)
        loaded = adapter.load_prefix(ids)
        assert loaded.tokens == 0 and loaded.cache is None and released == [hit]
        released.clear()
        adapter.load_prefix = lambda *a, **k: PrefixLoad(None, 0, hit, 0.0)  # type: ignore[method-assign]

        def broken_forward(*args: object, **kwargs: object) -> object:
            raise RuntimeError("out of memory")

        adapter.model = broken_forward  # type: ignore[assignment]
        with pytest.raises(RuntimeError, match="out of memory"):
            adapter.generate(ids, max_new_tokens=1)
        assert released == [hit]
    finally:
        real_client.close()


@torch.inference_mode()
def test_a_save_that_raises_is_not_saved_and_a_save_carries_its_trace_id(model_dir: Path) -> None:
    """`save_prefix` never raises into the caller's generation: a save whose copy or start raises
    (save memory the client closed, a bug) is not saved, logged, and the slots it took go back.
    Its trace id goes with the save (`generate`'s lookup, load and save share one)."""
    from typing import Any

    from kvfabric.client.save_memory import SaveMemoryRegistry

    model = load_model(model_dir)
    spec = hf_engine_spec(model, DOMAIN, tokens_per_chunk=TPC, model_id="tiny-llama")
    adapter = HfKvAdapter(model, KvClient.disabled(spec, "test", "unit"))
    traces: list[str | None] = []

    class Client:
        settings = ClientSettings(
            nats_url="nats://127.0.0.1:1", save_inflight_bytes_max=4 * adapter.chunk_bytes
        )
        registry = SaveMemoryRegistry()
        metrics = adapter.client.metrics
        fail = False

        def save_memory(self, nbytes: int) -> Any:
            return self.registry.allocate(nbytes)

        def save_async(
            self, tokens: list[int], objects: Any, *, trace_id: str | None = None, **_: Any
        ) -> None:
            if self.fail:
                raise RuntimeError("the client's loop is gone")
            traces.append(trace_id)
            return None  # dropped: the slots come back at once

    real_client, adapter.client = adapter.client, Client()  # type: ignore[assignment]
    try:
        ids = prompt_ids(3 * TPC + 5, seed=10)
        cache = model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
        assert adapter.save_prefix(ids, cache, trace_id="req-7") is None
        assert traces == ["req-7"]
        slots = adapter._save_slots
        assert isinstance(slots, SaveSlots) and slots.free() == slots.count
        Client.fail = True
        assert adapter.save_prefix(ids, cache, trace_id="req-8") is None  # not raised
        assert slots.free() == slots.count and traces == ["req-7"]
    finally:
        Client.registry.close()
        real_client.close()


def test_a_cache_that_keeps_part_of_the_prompt_is_not_saved(model_dir: Path) -> None:
    """A sliding-window layer keeps the last tokens only: chunk 0 cut from it by position held
    other tokens' KV, saved under chunk 0's key (review, stop 66). Such a cache is not saved
    (logged); the model's own full cache is."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    from kvfabric.engines.hf import _cache_layers

    model = load_model(model_dir)
    ids = prompt_ids(3 * TPC + 5, seed=11)
    full = model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
    assert len(_cache_layers(full)) == len(full.layers)
    sliding = DynamicCache()
    sliding.layers = [DynamicSlidingWindowLayer(sliding_window=8), DynamicLayer()]  # type: ignore[no-untyped-call]
    with pytest.raises(ValueError, match="DynamicSlidingWindowLayer"):
        _cache_layers(sliding)
    spec = hf_engine_spec(model, DOMAIN, tokens_per_chunk=TPC, model_id="tiny-llama")
    adapter = HfKvAdapter(model, KvClient.disabled(spec, "test", "unit"))
    saved: list[int] = []

    class Recording:
        def save_async(self, tokens: list[int], objects: object, **_: object) -> None:
            saved.append(len(tokens))

    real_client, adapter.client = adapter.client, Recording()  # type: ignore[assignment]
    try:
        assert adapter.save_prefix(ids, sliding) is None and saved == []  # not saved, not raised
    finally:
        real_client.close()


# The tiny model's chunk object: 4 layers x K, V x 2 KV heads x 64 tokens x head_dim 64 x fp32.
CHUNK_BYTES = 4 * 2 * 2 * TPC * 64 * 4


def test_a_prompt_over_the_save_bound_is_saved_in_parts_and_loads_whole(
    model_dir: Path, nats_server: NatsServer, cluster: object
) -> None:
    """The client admits a save whole: a prompt whose KV was over `save_inflight_bytes_max` was
    dropped whole (`bytes`) and never stored (a Llama-3-8B bf16 prompt over ~4,096 tokens at the
    default 512 MiB; review, stop 71). Now it goes as saves of at most half the bound, head
    first, and a fresh engine loads all of it."""
    from typing import Any

    ids = prompt_ids(10 * TPC + 17, seed=12)
    bound: dict[str, Any] = {"save_inflight_bytes_max": 4 * CHUNK_BYTES}  # 10 chunks: 2.5 times the bound
    first = engine(model_dir, nats_server, **bound)
    assert first.chunk_bytes == CHUNK_BYTES
    sent: list[tuple[int, int]] = []
    real_save_async = first.client.save_async

    def recording(tokens: Any, objects: Any, **kwargs: Any) -> Any:
        sent.append((kwargs["first_chunk"], len(objects)))
        assert len(tokens) == (kwargs["first_chunk"] + len(objects)) * TPC
        return real_save_async(tokens, objects, **kwargs)

    first.client.save_async = recording  # type: ignore[method-assign]
    try:
        saved(first, ids)  # every chunk saved, one result for the prompt
        assert sent == [(0, 2), (2, 2), (4, 2), (6, 2), (8, 2)]  # head first, 2 chunks each
        slots = first._save_slots
        assert isinstance(slots, SaveSlots)
        deadline = time.monotonic() + 5
        while slots.free() < slots.count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert slots.free() == slots.count
    finally:
        first.client.close()
    second = engine(model_dir, nats_server, **bound)
    try:
        result = second.generate(ids, max_new_tokens=NEW_TOKENS, save=False)
        assert result.loaded_tokens == 10 * TPC and result.token_ids == reference(model_dir, ids)
    finally:
        second.client.close()


@torch.inference_mode()
def test_a_part_that_leaves_a_chunk_unstored_ends_the_prompts_save(model_dir: Path) -> None:
    """A lookup stops at the first chunk not stored: the parts after a part that left one
    unstored are not sent, each counted as a save dropped under that chunk's cause, their chunks
    failed in the prompt's one result. A chunk another writer is storing (`in_flight`) will be
    there: the chain goes on."""
    import concurrent.futures
    from typing import Any

    from kvfabric.client import SaveResult

    model = load_model(model_dir)
    spec = hf_engine_spec(model, DOMAIN, tokens_per_chunk=TPC, model_id="tiny-llama")
    real_client = KvClient.disabled(spec, "test", "unit")
    adapter = HfKvAdapter(model, real_client)
    ids = prompt_ids(7 * TPC + 5, seed=13)
    cache = model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values

    class Client:
        settings = ClientSettings(nats_url="nats://127.0.0.1:1", save_inflight_bytes_max=4 * CHUNK_BYTES)
        metrics = real_client.metrics

        def __init__(self) -> None:
            self.outcomes: list[dict[str, int]] = []  # per part: failed chunks by cause
            self.sent: list[tuple[int, int]] = []

        def save_memory(self, nbytes: int) -> Any:
            raise OSError("no save memory here")

        def save_async(
            self, tokens: list[int], objects: list[object], *, first_chunk: int, **_: Any
        ) -> concurrent.futures.Future[SaveResult]:
            self.sent.append((first_chunk, len(objects)))
            causes = self.outcomes[len(self.sent) - 1]
            failed = sum(causes.values())
            done: concurrent.futures.Future[SaveResult] = concurrent.futures.Future()
            done.set_result(SaveResult(len(objects) - failed, 0, failed, 0, dict(causes)))
            return done

    def dropped(cause: str) -> float:
        value = real_client.metrics.registry.get_sample_value(
            "kvfabric_client_saves_dropped_total", {"cause": cause}
        )
        return value or 0.0

    client = Client()
    adapter.client = client  # type: ignore[assignment]
    try:
        # parts of 2 chunks: (0, 2), (2, 2), (4, 2), (6, 1); the second leaves one not admitted
        client.outcomes = [{}, {"not_admitted": 1}, {}, {}]
        saving = adapter.save_prefix(ids, cache)
        assert saving is not None
        result = saving.result(5)
        assert client.sent == [(0, 2), (2, 2)]
        assert (result.chunks_saved, result.chunks_failed) == (3, 4)
        assert result.causes == {"not_admitted": 4} and dropped("not_admitted") == 2
        # a chunk in flight at another writer: every part sent, the chunk counted as it failed
        client.sent, client.outcomes = [], [{}, {"in_flight": 1}, {}, {}]
        result = adapter.save_prefix(ids, cache).result(5)  # type: ignore[union-attr]
        assert client.sent == [(0, 2), (2, 2), (4, 2), (6, 1)]
        assert (result.chunks_saved, result.chunks_failed, result.causes) == (6, 1, {"in_flight": 1})
        # the first part dropped whole by the client (over its bound): the rest not sent
        client.sent, client.outcomes = [], [{"bytes": 2}]
        result = adapter.save_prefix(ids, cache).result(5)  # type: ignore[union-attr]
        assert client.sent == [(0, 2)] and result.causes == {"bytes": 7} and dropped("bytes") == 3
    finally:
        real_client.close()


@torch.inference_mode()
def test_a_part_the_client_drops_itself_is_counted_once_and_the_rest_dropped(model_dir: Path) -> None:
    """The client turning off mid-chain drops the part it is given (`save_async` returns None,
    counted by the client under `closed`): that part was counted again under `dropped` with the
    parts after it, and when it was the first part the parts after it were not counted at all
    (review, stop 71). Each part not sent is counted once; the prompt's one result fails each
    chunk not stored once, under one cause."""
    import concurrent.futures
    from typing import Any

    from kvfabric.client import SaveResult

    model = load_model(model_dir)
    spec = hf_engine_spec(model, DOMAIN, tokens_per_chunk=TPC, model_id="tiny-llama")
    real_client = KvClient.disabled(spec, "test", "unit")
    adapter = HfKvAdapter(model, real_client)
    ids = prompt_ids(7 * TPC + 5, seed=14)
    cache = model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values

    class Client:
        settings = ClientSettings(nats_url="nats://127.0.0.1:1", save_inflight_bytes_max=4 * CHUNK_BYTES)
        metrics = real_client.metrics

        def __init__(self, off_from: int) -> None:
            self.off_from = off_from  # the part from which the client is off
            self.sent: list[int] = []

        def save_memory(self, nbytes: int) -> Any:
            raise OSError("no save memory here")

        def save_async(
            self, tokens: list[int], objects: list[object], *, first_chunk: int, **_: Any
        ) -> concurrent.futures.Future[SaveResult] | None:
            self.sent.append(first_chunk)
            if len(self.sent) > self.off_from:  # off: counted here, as `KvClient.save_async`
                self.metrics.saves_dropped.labels("closed").inc()
                return None
            done: concurrent.futures.Future[SaveResult] = concurrent.futures.Future()
            done.set_result(SaveResult(len(objects), 0, 0, 0, {}))
            return done

    def counts() -> dict[str, float]:
        return {
            cause: real_client.metrics.registry.get_sample_value(
                "kvfabric_client_saves_dropped_total", {"cause": cause}
            )
            or 0.0
            for cause in ("closed", "dropped")
        }

    try:
        # parts of 2 chunks: (0, 2), (2, 2), (4, 2), (6, 1); off from the second
        adapter.client = Client(off_from=1)  # type: ignore[assignment]
        before = counts()
        saving = adapter.save_prefix(ids, cache)
        assert saving is not None
        result = saving.result(5)
        assert adapter.client.sent == [0, 2]  # type: ignore[attr-defined]
        assert (result.chunks_saved, result.chunks_failed, result.causes) == (2, 5, {"dropped": 5})
        after = counts()
        assert after["closed"] - before["closed"] == 1  # the second part, by the client
        assert after["dropped"] - before["dropped"] == 2  # the third and fourth, once each
        # off from the first part: the three after it are counted too, never sent
        adapter.client = Client(off_from=0)  # type: ignore[assignment]
        before = counts()
        assert adapter.save_prefix(ids, cache) is None
        assert adapter.client.sent == [0]  # type: ignore[attr-defined]
        after = counts()
        assert (after["closed"] - before["closed"], after["dropped"] - before["dropped"]) == (1, 3)
        slots = adapter._save_slots
        assert not isinstance(slots, SaveSlots) or slots.free() == slots.count
    finally:
        real_client.close()
