"""The pure parts of `python -m bench.evict_replay`: the trace block -> client chunk mapping, the
segment's size, the replay loop's schedule and accounting (against a fake client), the simulator
rows (the live cluster itself is not started here)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.evict_replay import (
    SEGMENT_BYTES_MIN,
    block_object,
    compressed,
    engine_spec,
    replay,
    segment_bytes,
    sim_rows,
)
from kvfabric.client.hits import Hit, LoadResult, SaveResult
from kvfabric.format.key import chain_hashes

OBJECT = 64
BLOCK_TOKENS = 512  # a trace block's tokens (tools/evict_sim.py)


def test_a_trace_block_is_one_chunk_named_by_its_prefix() -> None:
    spec = engine_spec({}, "nats://127.0.0.1:4222")
    first = chain_hashes(spec.domain, spec.model, spec.layout, [0, 1, 2, 3])
    second = chain_hashes(spec.domain, spec.model, spec.layout, [0, 1, 7])
    other_start = chain_hashes(spec.domain, spec.model, spec.layout, [5, 1])
    assert len(first) == 4 and len(second) == 3  # one chunk a block
    assert first[:2] == second[:2] and first[2] != second[2]  # a shared prefix shares its chunks
    assert other_start[1] != first[1]  # block 1 after another head is another chunk


def test_the_segment_holds_the_share_of_unique_blocks_with_a_floor() -> None:
    assert segment_bytes(100_000, 10, 4096) == 10_000 * 4096
    assert segment_bytes(100_001, 10, 4096) == 10_001 * 4096  # rounded up
    assert segment_bytes(1_000, 10, 4096) == SEGMENT_BYTES_MIN


def test_timestamps_are_compressed_from_the_first_request() -> None:
    reqs = [{"timestamp": 1000, "hash_ids": []}, {"timestamp": 4000, "hash_ids": []}]
    assert [r["timestamp"] for r in compressed(reqs, 3)] == [0, 1000]


class FakeClient:
    """A store of chunks keyed by (prefix of blocks); lookups hit the longest stored prefix."""

    def __init__(self, corrupt: int | None = None) -> None:
        self.stored: set[tuple[int, ...]] = set()
        self.saves: list[tuple[int, int]] = []  # (first_chunk, chunks)
        self.released = 0
        self.corrupt = corrupt

    def lookup(self, tokens: Sequence[int]) -> Hit:
        n = 0
        while n < len(tokens) and tuple(tokens[: n + 1]) in self.stored:
            n += 1
        self._tokens = list(tokens)
        return Hit(n, 1, (), (), objects=tuple(((),) * n), lease_id=1 if n else 0)

    def load(self, hit: Hit, out: list[list[bytearray]]) -> LoadResult:
        for c in range(hit.chunks):
            block = self._tokens[c]
            out[c][0][:] = block_object(block + (block == self.corrupt), OBJECT)
        return LoadResult(hit.tokens, hit.chunks, hit.chunks * OBJECT)

    def release(self, hit: Hit) -> None:
        self.released += 1

    def save(self, tokens: Sequence[int], objects: list[list[bytes]], *, first_chunk: int = 0) -> SaveResult:
        self.saves.append((first_chunk, len(objects)))
        new = 0
        for i, row in enumerate(objects):
            c = first_chunk + i
            assert row[0] == block_object(tokens[c], OBJECT)
            new += tuple(tokens[: c + 1]) not in self.stored
            self.stored.add(tuple(tokens[: c + 1]))
        return SaveResult(chunks_saved=new, chunks_existing=len(objects) - new, bytes_written=new * OBJECT)


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def test_the_replay_loads_the_hit_saves_the_rest_and_keeps_the_schedule() -> None:
    requests: list[dict[str, Any]] = [
        {"timestamp": 0, "input_length": 3 * BLOCK_TOKENS, "hash_ids": [1, 2, 3]},
        {"timestamp": 500, "input_length": 3 * BLOCK_TOKENS + 100, "hash_ids": [1, 2, 4]},
        {"timestamp": 2000, "input_length": 2 * BLOCK_TOKENS, "hash_ids": [1, 2]},
    ]
    client, clock = FakeClient(), FakeClock()
    run = replay(client, requests, OBJECT, clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]
    assert clock.slept == [0.5, 1.5]  # each request at its (ms) timestamp
    assert run.lag_ms == [0.0, 0.0, 0.0]
    assert client.saves == [(0, 3), (2, 1)]  # the third request hits whole: nothing saved
    assert run.chunks_loaded == 4 and run.tokens_saved == 4 * BLOCK_TOKENS
    assert run.chunks_saved == 4 and run.bytes_written == 4 * OBJECT
    assert run.input_tokens == 8 * BLOCK_TOKENS + 100 and client.released == 2
    assert run.summary()["prefill_saved_share"] == 4 * BLOCK_TOKENS / (8 * BLOCK_TOKENS + 100)


def test_a_load_with_wrong_bytes_is_counted_and_not_credited() -> None:
    requests: list[dict[str, Any]] = [
        {"timestamp": 0, "input_length": 3 * BLOCK_TOKENS, "hash_ids": [1, 2, 3]},
        {"timestamp": 0, "input_length": 3 * BLOCK_TOKENS, "hash_ids": [1, 2, 3]},
    ]
    client, clock = FakeClient(corrupt=2), FakeClock()
    run = replay(client, requests, OBJECT, clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]
    assert run.load_mismatches == 1
    assert run.chunks_loaded == 1 and run.tokens_saved == BLOCK_TOKENS  # only chunk 0 verified
    assert client.saves == [(0, 3), (1, 2)]  # saved again from the first bad chunk (already stored)


def test_the_simulator_rows_cover_each_policy_both_ways_and_the_references() -> None:
    requests = [
        {"timestamp": i, "input_length": 2 * BLOCK_TOKENS, "hash_ids": [i % 3, 100 + i]} for i in range(30)
    ]
    rows = sim_rows(requests, 5, ["density"])
    assert set(rows) == {
        "lru (same watermarks)",
        "lru (hard capacity)",
        "density (same watermarks)",
        "density (hard capacity)",
        "reference",
        "infinite",
    }
    # the service's watermarks (80 / 70 %) keep less resident than the simulator's hard capacity
    assert rows["lru (same watermarks)"]["evictions"] > rows["lru (hard capacity)"]["evictions"]
    assert rows["infinite"]["prefill_tokens_saved"] >= rows["reference"]["prefill_tokens_saved"]
    assert rows["reference"]["prefill_tokens_saved"] >= rows["lru (hard capacity)"]["prefill_tokens_saved"]
