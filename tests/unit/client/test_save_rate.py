"""An engine's save rate (issue 24, item 3: a recovered cache refills without a write storm):
`SaveRate`'s bound over any sequence of saves, leading chunks only, and the client keeping a
save's leading chunks the rate covers (the rest skipped, counted `save_rate`, never sent)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfabric.client import ClientSettings, SaveResult
from kvfabric.client.aio_saves import SAVE_RATE
from kvfabric.client.save_rate import SaveRate
from kvfabric.format.errors import BadRequest
from tests.unit.client.test_save_sharing import CHUNKS, SaveRouter, client, objects, prompt

CHUNK_BYTES = 128  # test_save_sharing's objects: 64 × 2 bytes


@given(
    rate=st.integers(1, 10_000),
    burst=st.integers(0, 50_000),
    saves=st.lists(st.tuples(st.floats(0, 5), st.lists(st.integers(0, 20_000), max_size=8)), max_size=40),
)
def test_bytes_admitted_never_exceed_burst_plus_rate_times_time_plus_one_chunk(
    rate: int, burst: int, saves: list[tuple[float, list[int]]]
) -> None:
    bucket = SaveRate(rate, burst, now_s=0.0)
    now = 0.0
    admitted_bytes = 0
    biggest = 0  # the largest chunk admitted so far: the most the debt can be
    for dt, sizes in saves:
        now += dt
        peeked = bucket.peek_leading(sizes, now)
        n = bucket.admit_leading(sizes, now)
        assert n == peeked  # the peek answers exactly what the admission then does
        admitted_bytes += sum(sizes[:n])
        biggest = max([biggest, *sizes[:n]])
        assert admitted_bytes <= bucket.burst_bytes + rate * now + biggest
        assert -biggest <= bucket.level <= bucket.burst_bytes
        if n < len(sizes):  # refused only when the budget is spent
            assert bucket.level <= 0


def test_a_tight_bound_over_a_long_run_of_equal_chunks() -> None:
    """Equal chunks asked every 10 ms for 100 s: the bytes admitted are the burst + rate × time,
    within one chunk."""
    rate, burst, chunk = 1_000_000, 2_000_000, 300_000
    bucket = SaveRate(rate, burst, now_s=0.0)
    admitted = sum(bucket.admit_leading([chunk] * 4, t / 100) * chunk for t in range(10_000))
    assert burst + rate * 99.99 - chunk <= admitted <= burst + rate * 99.99 + chunk


def test_leading_chunks_only_and_a_chunk_larger_than_the_burst_still_passes() -> None:
    bucket = SaveRate(100, 250, now_s=0.0)
    assert bucket.admit_leading([100, 100, 100, 100], 0.0) == 3  # 250 -> 150 -> 50 -> -50
    assert bucket.admit_leading([1], 0.0) == 0
    assert bucket.admit_leading([10_000], 0.6) == 1  # level 10 > 0: debt, so any size passes
    assert bucket.admit_leading([1], 50.0) == 0  # -9 990 + 5 000 is still in debt
    assert bucket.admit_leading([1], 101.0) == 1


def test_no_rate_admits_everything_and_the_burst_defaults_to_one_second() -> None:
    assert SaveRate(0, 0, now_s=0.0).admit_leading([1 << 40] * 100, 0.0) == 100
    assert SaveRate(500, 0, now_s=0.0).burst_bytes == 500


def test_a_clock_that_steps_back_refills_nothing() -> None:
    bucket = SaveRate(100, 100, now_s=10.0)
    assert bucket.admit_leading([150], 10.0) == 1
    assert bucket.admit_leading([1], 5.0) == 0
    assert bucket.admit_leading([1], 10.4) == 0  # -50 + 40
    assert bucket.admit_leading([1], 10.6) == 1


def test_negative_settings_are_refused() -> None:
    with pytest.raises(BadRequest):
        ClientSettings(nats_url="nats://x:1", save_bytes_per_s_max=-1)
    with pytest.raises(BadRequest):
        ClientSettings(nats_url="nats://x:1", save_burst_bytes=-1)
    with pytest.raises(BadRequest):
        SaveRate(-1, 0, now_s=0.0)


def test_a_save_past_the_rate_keeps_its_leading_chunks_and_sends_nothing_of_the_rest() -> None:
    router = SaveRouter()
    # a burst of 3 chunks less a byte: chunks 0..2 pass (the third into debt), 3.. are skipped
    kv, writes = client(router, save_bytes_per_s_max=1, save_burst_bytes=2 * CHUNK_BYTES + 1)
    kv._save_clock = lambda: 0.0  # no refill while it runs
    keys = [g.member_key(*kv.spec.required_members()[0]).to_bytes() for g in kv.chunk_groups(prompt(1))]

    async def run() -> tuple[SaveResult, SaveResult, int]:
        try:
            first = await kv.save(prompt(1), objects(1))
            second = await kv.save(prompt(2), objects(2))  # the budget is spent: skipped whole
            return first, second, kv.take_save_rate([CHUNK_BYTES])
        finally:
            await kv.close()

    first, second, after = asyncio.run(run())
    assert first.chunks_saved == 3 and first.chunks_failed == CHUNKS - 3
    assert first.causes == {SAVE_RATE: CHUNKS - 3}
    assert second.chunks_saved == 0 and second.causes == {SAVE_RATE: CHUNKS}
    assert after == 0
    begun = [k for verb, _, ks, _ in router.requests if verb == "put_begin" for k in ks]
    assert sorted(begun) == sorted(keys[:3])  # the leading chunks only, the rest never asked
    assert sorted(k for k, _, _ in writes) == sorted(keys[:3])
    registry = kv.metrics.registry
    assert registry.get_sample_value("kvfabric_client_save_failures_total", {"cause": SAVE_RATE}) == 5
    assert registry.get_sample_value("kvfabric_client_saves_dropped_total", {"cause": SAVE_RATE}) == 1


def test_the_rate_refills_with_time() -> None:
    router = SaveRouter()
    # one chunk a second; a burst of half a chunk: the first chunk leaves half a second of debt
    kv, _ = client(router, save_bytes_per_s_max=CHUNK_BYTES, save_burst_bytes=CHUNK_BYTES // 2)
    now = [0.0]
    kv._save_clock = lambda: now[0]
    kv._save_rate.at_s = 0.0  # the bucket's clock is the test's from here

    async def run() -> list[int]:
        try:
            saved = [(await kv.save(prompt(1), objects(1))).chunks_saved]  # the burst: one chunk
            now[0] = 0.49
            saved.append((await kv.save(prompt(2), objects(2))).chunks_saved)  # still in debt
            now[0] = 0.6  # the debt is paid, a tenth of a chunk to spare: one chunk
            saved.append((await kv.save(prompt(3), objects(3))).chunks_saved)
            return saved
        finally:
            await kv.close()

    assert asyncio.run(run()) == [1, 0, 1]


def test_a_save_the_rate_trims_is_admitted_by_its_trimmed_size_and_a_refused_one_takes_nothing() -> None:
    """The in-flight bound sees the bytes the save will write (the trimmed ones); a save the
    bound refuses leaves the rate's budget as it was."""
    router = SaveRouter()
    kv, _ = client(
        router,
        save_bytes_per_s_max=1,
        save_burst_bytes=2 * CHUNK_BYTES,  # two chunks
        save_inflight_bytes_max=3 * CHUNK_BYTES,  # a whole save (8 chunks) would not fit
    )
    kv._save_clock = lambda: 0.0

    async def run() -> tuple[SaveResult, SaveResult]:
        try:
            kv._save_bytes = 2 * CHUNK_BYTES  # another save's bytes in flight
            refused = await kv.save(prompt(1), objects(1))  # 2 chunks + 2 in flight > 3
            kv._save_bytes = 0
            trimmed = await kv.save(prompt(2), objects(2))  # its 2 chunks fit
            return refused, trimmed
        finally:
            await kv.close()

    refused, trimmed = asyncio.run(run())
    assert refused.causes == {"bytes": CHUNKS}
    assert trimmed.chunks_saved == 2 and trimmed.causes == {SAVE_RATE: CHUNKS - 2}


def test_chunks_whose_rate_the_engine_took_are_not_charged_again() -> None:
    router = SaveRouter()
    kv, _ = client(router, save_bytes_per_s_max=1, save_burst_bytes=2 * CHUNK_BYTES)
    kv._save_clock = lambda: 0.0
    assert kv.take_save_rate([CHUNK_BYTES] * CHUNKS) == 2

    async def run() -> tuple[SaveResult, SaveResult]:
        try:
            taken = await kv.save(prompt(1), objects(1)[:2], rate_taken=True)
            charged = await kv.save(prompt(2), objects(2))  # the budget went to the engine's take
            return taken, charged
        finally:
            await kv.close()

    taken, charged = asyncio.run(run())
    assert taken.chunks_saved == 2 and not taken.causes
    assert charged.chunks_saved == 0 and charged.causes == {SAVE_RATE: CHUNKS}


def test_no_rate_by_default() -> None:
    router = SaveRouter()
    kv, _ = client(router)

    async def run() -> list[int]:
        try:
            return [(await kv.save(prompt(n), objects(n))).chunks_saved for n in range(5)]
        finally:
            await kv.close()

    assert asyncio.run(run()) == [CHUNKS] * 5
    assert kv.take_save_rate([1 << 40] * 3) == 3


def test_peeking_at_the_save_rate_says_what_a_take_would_cover_and_takes_nothing() -> None:
    """An engine asks what the rate covers before asking whether those chunks' bytes fit
    (the vLLM connector: a save the rate trims to fit was refused for the bytes of all)."""
    kv, _ = client(SaveRouter(), save_bytes_per_s_max=1, save_burst_bytes=2 * CHUNK_BYTES)
    kv._save_clock = lambda: 0.0
    assert kv.peek_save_rate([CHUNK_BYTES] * CHUNKS) == 2
    assert kv.peek_save_rate([CHUNK_BYTES] * CHUNKS) == 2  # nothing was taken
    assert kv.take_save_rate([CHUNK_BYTES] * CHUNKS) == 2
    assert kv.peek_save_rate([CHUNK_BYTES] * CHUNKS) == 0  # the take did take
    asyncio.run(kv.close())
