"""An engine's own prefix cache from its KV events (issue 24: vLLM's BlockStored / BlockRemoved /
AllBlocksCleared instead of the router's history): vLLM block hashes become the keys a prompt is
routed by, chained through parents; what cannot be keyed is skipped, never guessed; the map is
bounded and its counts exact; the router's estimate counts what the events say."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvfabric.core.routing import InstanceSpec, RoutingConfig, RoutingCore, chunk_keyer, prompt_keys
from kvfabric.core.routing_engine_cache import EngineCache
from kvfabric.core.routing_events import EngineCleared, EngineRemoved, EngineStored, FirstToken, Route
from kvfabric.core.routing_index import RoutingIndex
from kvfabric.format.key import KVLayout
from tests.unit.core.test_routing import DOMAIN, LAYOUT, MODEL, TPC

SMALL = KVLayout(
    tp_size=1,
    tp_rank=0,
    pp_stage=0,
    layer_group=0,
    layer_group_count=1,
    tokens_per_chunk=4,
    tensor_layout="x",
)
KEYER = chunk_keyer(DOMAIN, MODEL, SMALL)


def keys_of(tokens: list[int]) -> list[bytes]:
    return prompt_keys(DOMAIN, MODEL, SMALL, tokens)


def test_a_prompts_blocks_stored_in_pieces_map_to_its_keys() -> None:
    tokens = list(range(100, 116))  # four chunks of 4
    cache = EngineCache(KEYER, 4, 64)
    assert cache.stored([11, 12], None, tokens[:8], 4) == 2
    assert cache.stored([13, 14], 12, tokens[8:16], 4) == 2  # the next step, after block 12
    assert [cache.holds(k) for k in keys_of(tokens)] == [True] * 4
    assert cache.removed([13, 99]) == 1  # 99: never known
    assert [cache.holds(k) for k in keys_of(tokens)] == [True, True, False, True]
    cache.check_invariants()


def test_a_hash_in_two_physical_blocks_goes_with_the_last_and_a_failing_keyer_changes_nothing() -> None:
    tokens = list(range(8))
    cache = EngineCache(KEYER, 4, 64)
    cache.stored([31], None, tokens[:4], 4)
    cache.stored([31], None, tokens[:4], 4)  # vLLM holds the hash in a second block
    first = keys_of(tokens)[0]
    assert cache.removed([31]) == 1 and cache.holds(first)
    assert cache.removed([31]) == 1 and not cache.holds(first)

    def failing(prev: bytes | None, chunk: object) -> tuple[bytes, bytes]:
        if prev is not None:
            raise ValueError("a token id out of range")
        return KEYER(prev, chunk)  # type: ignore[arg-type]

    partial = EngineCache(failing, 4, 64)
    with pytest.raises(ValueError, match="out of range"):
        partial.stored([41, 42], None, tokens, 4)
    assert len(partial) == 0 and not partial.holds(first)
    partial.check_invariants()


def test_blocks_that_cannot_be_keyed_are_skipped() -> None:
    tokens = list(range(16))
    cache = EngineCache(KEYER, 4, 64)
    assert cache.stored([21], 777, tokens[4:8], 4) == 0  # its parent was never seen
    assert cache.stored([22], None, tokens[:8], 8) == 0  # another block size
    assert cache.stored([23, 24], None, tokens[:6], 4) == 0  # fewer tokens than its blocks
    assert cache.stored([26], None, tokens[:8], 4) == 0  # more (a sliding window's null block)
    assert cache.stored([25], None, tokens[:4], 4, plain=False) == 0  # LoRA / extra keys
    assert len(cache) == 0 and not any(cache.holds(k) for k in keys_of(tokens))
    assert cache.counters["skipped_unknown_parent"] == 1
    assert cache.counters["skipped_block_size"] == 4
    assert cache.counters["skipped_extra_keys"] == 1


def test_the_map_is_bounded_oldest_forgotten_and_two_hashes_of_one_chunk_count_twice() -> None:
    cache = EngineCache(KEYER, 4, 3)
    a = list(range(4))
    cache.stored([1], None, a, 4)
    cache.stored([2], None, a, 4)  # another vLLM hash of the same chunk (vLLM's extra inputs)
    assert cache.removed([1]) == 1 and cache.holds(keys_of(a)[0])  # still held by block 2
    for n, block in enumerate((3, 4, 5)):
        cache.stored([block], None, list(range(10 + 4 * n, 14 + 4 * n)), 4)
    assert len(cache) == 3 and not cache.holds(keys_of(a)[0])  # block 2 was the oldest
    assert cache.counters["blocks_forgotten"] == 1
    cache.clear()
    assert len(cache) == 0
    cache.check_invariants()


class EngineCacheMachine(RuleBasedStateMachine):
    """Any interleaving of stores (chained, after unknown parents, or of a hash it holds again:
    another physical block), removals and clears against a model: a key is held exactly when a
    known block whose physical blocks are not all removed maps to it."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = EngineCache(KEYER, 4, 12)
        # block -> [parent, tokens, chain, key, physical blocks] (insertion order = last stored)
        self.model: dict[int, list[object]] = {}
        self.next_block = 1

    @rule(parent=st.integers(0, 40), n=st.integers(1, 3), seed=st.integers(0, 3))
    def store(self, parent: int, n: int, seed: int) -> None:
        tokens = [random.Random(seed * 1000 + i).randrange(50) for i in range(4 * n)]
        blocks = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        parent_hash = None if parent == 0 else parent
        self.cache.stored(blocks, parent_hash, tokens, 4)
        if parent_hash is not None and parent_hash not in self.model:
            return
        prev = None if parent_hash is None else self.model[parent_hash][2]
        for i, block in enumerate(blocks):
            key, chain = KEYER(prev, tokens[4 * i : 4 * i + 4])  # type: ignore[arg-type]
            self.model[block] = [parent_hash, tokens[4 * i : 4 * i + 4], chain, key, 1]
            prev = chain
        self._trim()

    @rule(block=st.integers(1, 40))
    def store_again(self, block: int) -> None:
        entry = self.model.get(block)
        if entry is None:
            return
        parent, tokens = entry[0], entry[1]
        self.cache.stored([block], parent, tokens, 4)  # type: ignore[arg-type]
        if parent is not None and parent not in self.model:
            return  # its parent went meanwhile: the cache cannot key it again
        entry[4] = entry[4] + 1  # type: ignore[operator]
        self.model[block] = self.model.pop(block)  # the newest
        self._trim()

    def _trim(self) -> None:
        while len(self.model) > 12:
            del self.model[next(iter(self.model))]

    @rule(block=st.integers(1, 40))
    def remove(self, block: int) -> None:
        self.cache.removed([block])
        entry = self.model.get(block)
        if entry is not None:
            entry[4] = entry[4] - 1  # type: ignore[operator]
            if not entry[4]:
                del self.model[block]

    @rule()
    def clear(self) -> None:
        self.cache.clear()
        self.model.clear()

    @invariant()
    def matches(self) -> None:
        self.cache.check_invariants()
        held: set[bytes] = {e[3] for e in self.model.values()}  # type: ignore[misc]
        for key in {*held, *(KEYER(None, [t] * 4)[0] for t in range(3))}:
            assert self.cache.holds(key) == (key in held)


TestEngineCacheMachine = EngineCacheMachine.TestCase
TestEngineCacheMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def events_core() -> RoutingCore:
    specs = [
        InstanceSpec(instance_id="a", engine_cache_chunks_max=64, engine_events=True),
        InstanceSpec(instance_id="b", engine_cache_chunks_max=64),
    ]
    c = RoutingCore(
        RoutingConfig(tokens_per_chunk=TPC), specs, RoutingIndex(), chunk_keyer(DOMAIN, MODEL, LAYOUT)
    )
    for iid in c.instances:
        c.health(iid, True, 0)
    return c


def test_the_estimate_counts_what_the_engines_events_say_not_its_history() -> None:
    tokens = [7, *range(1, 4 * TPC)]  # four chunks; 3 usable (the last token is computed)
    keys = prompt_keys(DOMAIN, MODEL, LAYOUT, tokens)
    c = events_core()

    def engine_tokens(iid: str) -> int:
        return c.inputs_for(iid, keys, len(tokens), 0).engine_tokens

    (reply,) = c.step(Route("r1", "t", keys, len(tokens), exclude=("b",)), 1)
    assert reply.value.instance_id == "a"  # type: ignore[union-attr]
    c.step(FirstToken("r1"), 2)
    assert engine_tokens("a") == 0  # its history teaches nothing: only its events count
    c.step(EngineStored("a", [901, 902], None, tokens[: 2 * TPC], TPC), 3)
    c.step(EngineStored("a", [903], 902, tokens[2 * TPC : 3 * TPC], TPC), 4)
    assert engine_tokens("a") == 3 * TPC
    c.step(EngineRemoved("a", [902]), 5)  # vLLM evicted the second block: the run stops at it
    assert engine_tokens("a") == TPC
    c.step(EngineCleared("a"), 6)
    assert engine_tokens("a") == 0
    c.step(EngineStored("a", [911], None, tokens[:TPC], TPC), 7)
    c.health("a", False, 8)  # a late health check: its events say whether it restarted, not this
    assert engine_tokens("a") == TPC
    c.step(EngineStored("b", [921], None, tokens[:TPC], TPC), 9)  # b learns from history
    assert engine_tokens("b") == 0
    c.check_invariants()


@given(st.lists(st.integers(0, 1 << 20), min_size=TPC * 3, max_size=TPC * 3))
@settings(max_examples=20, deadline=None)
def test_keys_from_events_are_the_prompts_keys(tokens: list[int]) -> None:
    cache = EngineCache(chunk_keyer(DOMAIN, MODEL, LAYOUT), TPC, 16)
    cache.stored([1], None, tokens[:TPC], TPC)
    cache.stored([2, 3], 1, tokens[TPC:], TPC)
    assert all(cache.holds(k) for k in prompt_keys(DOMAIN, MODEL, LAYOUT, tokens))
