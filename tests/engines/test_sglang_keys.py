"""The SGLang backend's functional core (`kvfabric.engines.sglang_keys`), without SGLang: page
words, chains, the held-hit table (every hit leaves it once, bounded, matched by chain), and the
key space an SGLang worker derives (tenant, model revision, dtype, page format, TP/MLA)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.client import ClientSettings, Hit, SaveResult
from kvfabric.engines import sglang_keys
from kvfabric.engines.sglang_keys import (
    PAGE_WORDS,
    HeldHits,
    PoolGeometry,
    StorageIdentity,
    chain_words,
    chained_pages_stored,
    engine_spec,
    new_pages,
    page_words,
)
from kvfabric.format.key import chunk_groups_for_prefix
from kvfabric.proto.directory import Member, ObjectLocation

DEFAULTS = ClientSettings(nats_url="nats://127.0.0.1:1")
WHO = StorageIdentity(tp_rank=1, tp_size=2, pp_rank=0, pp_size=1, is_mla_model=False, model_name="tiny")
POOL = PoolGeometry(
    pool_kind="MHATokenToKVPoolHost",
    layout="page_first",
    page_size=16,
    layer_num=4,
    head_num=2,
    head_dim=64,
    dtype="float32",
    region_bytes=(32768, 32768),
    sglang_version="0.5.23",
)
EXTRA = {"weights_revision": "rev-a", "tenant_id": "t1", "domain_salt_hex": "11" * 16}
KEYS = [f"{i:064x}" for i in range(1, 9)]


def spec_for(**extra: object):  # type: ignore[no-untyped-def]
    return engine_spec(WHO, POOL, {**EXTRA, **extra}, DEFAULTS)


def hit_of(pages: list[str], chunks: int, lease_id: int = 7) -> Hit:
    spec = spec_for()
    groups = chunk_groups_for_prefix(spec.domain, spec.model, spec.layout, chain_words([], pages))
    loc = ObjectLocation(chunk_index=0, member=Member(0, 0, 0), size_bytes=1, checksum=b"", replicas=[])
    return Hit(chunks * PAGE_WORDS, PAGE_WORDS, tuple(groups), ((0, 0, 0),), ((loc,),) * chunks, lease_id)  # type: ignore[arg-type]


def chain_of(pages: list[str]) -> list[bytes]:
    return [bytes(g.chain_hash) for g in hit_of(pages, 0).groups]


def test_page_words_are_eight_stable_words_per_key() -> None:
    a = page_words(KEYS[0])
    assert a.dtype.str == "<u4" and len(a) == PAGE_WORDS
    assert (page_words(KEYS[0]) == a).all() and not (page_words(KEYS[1]) == a).all()
    assert len(chain_words(KEYS[:2], KEYS[2:5])) == 5 * PAGE_WORDS
    assert (chain_words(KEYS[:2], KEYS[2:5]) == chain_words([], KEYS[:5])).all()
    assert len(chain_words([], [])) == 0


def test_new_pages_counts_only_the_calls_own_pages() -> None:
    assert new_pages(hit_chunks=5, prefix_pages=3, pages=4) == 2
    assert new_pages(hit_chunks=2, prefix_pages=3, pages=4) == 0  # a hole in the prefix: nothing
    assert new_pages(hit_chunks=9, prefix_pages=3, pages=4) == 4


def test_held_hit_covers_a_get_on_its_chain_and_leaves_once() -> None:
    table = HeldHits(hold_ms=1000, held_max=4)
    short, long = hit_of(KEYS[:4], 4), hit_of(KEYS, 8)
    assert table.hold(long, now_ms=0) == [] and table.hold(short, now_ms=0) == []
    chain = chain_of(KEYS)
    assert table.covering(chain[:4], 4) is short  # the shortest covering hit
    assert table.covering(chain, 8) is long
    assert table.covering(chain_of(["other", *KEYS[1:]]), 4) is None  # another chain
    assert table.covering(chain, 9) is None  # nothing covers past the stored pages
    table.done_with(short)
    table.done_with(long)
    assert table.finished(chain[:4], 4) == [short]  # the get reached its end
    assert table.finished(chain[:4], 4) == []  # once only
    assert table.drain() == [long] and len(table) == 0


def test_a_batch_of_per_page_hits_is_held_whole_by_default() -> None:
    """Per-page keys hold one hit a page, and SGLang checks 128 pages a `batch_exists`
    (`STORAGE_BATCH_SIZE`): the default table keeps 64 batches (64 hits gave the batch's first
    leases back within the call, review, stop 66; 1,024 a request's first pages past eight)."""
    table = HeldHits()
    pages = [f"{i:064x}" for i in range(1, 64 * 128 + 1)]
    given_back = [h for page in pages for h in table.hold(hit_of([page], 1), now_ms=0)]
    assert given_back == [] and len(table) == 64 * 128
    assert table.hold(hit_of(["ff" * 32], 1), now_ms=0) != []  # past 64 batches: the oldest


def test_a_per_page_get_looks_only_at_its_own_pages_hits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A per-page get's `covering` and `finished` look at the hits of its own page (and the few
    longer ones), not the whole table: each scanned every held hit, ~2.7 ms a page with 8,192
    held under the backend's lock (review, stop 66)."""
    table = HeldHits()
    pages = [f"{i:064x}" for i in range(1, 2049)]
    hits = [hit_of([page], 1) for page in pages]
    for hit in hits:
        assert table.hold(hit, now_ms=0) == []
    assert table.hold(hit_of(KEYS, 8), now_ms=0) == []  # a chained hit is scanned
    looked: list[Hit] = []
    real = sglang_keys._on_chain

    def counted(hit: Hit, chain: Sequence[bytes]) -> bool:
        looked.append(hit)
        return real(hit, chain)

    monkeypatch.setattr(sglang_keys, "_on_chain", counted)
    chain = chain_of([pages[1000]])
    assert table.covering(chain, 1) is hits[1000]
    table.done_with(hits[1000])
    assert table.finished(chain, 1) == [hits[1000]]
    assert len(looked) <= 4 and len(table) == 2048
    assert table.covering(chain, 1) is None  # given back: gone from the index too


@dataclass
class _Entry:
    hit: Hit
    held_ms: int
    users: int = 0
    drained: bool = False


class _ListHeldHits:
    """The table as it was before the index (stop 66): one list, scanned by every call. The
    model `HeldHits` must agree with."""

    def __init__(self, hold_ms: int, held_max: int) -> None:
        self.hold_ms, self.held_max = hold_ms, held_max
        self.held: list[_Entry] = []  # oldest first

    def hold(self, hit: Hit, now_ms: int) -> list[Hit]:
        if hit.chunks == 0:
            return [hit] if hit.lease_id else []
        self.held.append(_Entry(hit, now_ms))
        over = len(self.held) - self.held_max
        return self._drop([h for h in self.held if not h.users][:over]) if over > 0 else []

    def covering(self, chain: list[bytes], end: int) -> Hit | None:
        best: _Entry | None = None
        for held in self.held:
            hit = held.hit
            if (
                hit.chunks >= end
                and not held.drained
                and on_chain(hit, chain[:end])
                and (best is None or hit.chunks < best.hit.chunks)
            ):
                best = held
        if best is None:
            return None
        best.users += 1
        return best.hit

    def done_with(self, hit: Hit) -> list[Hit]:
        for held in self.held:
            if held.hit is hit and held.users:
                held.users -= 1
                return self._drop([held]) if held.drained and not held.users else []
        return []

    def drain(self) -> list[Hit]:
        for held in self.held:
            held.drained = True
        return self._drop([h for h in self.held if not h.users])

    def finished(self, chain: list[bytes], end: int) -> list[Hit]:
        return self._drop(
            [h for h in self.held if not h.users and h.hit.chunks <= end and on_chain(h.hit, chain)]
        )

    def expired(self, now_ms: int) -> list[Hit]:
        return self._drop([h for h in self.held if not h.users and now_ms - h.held_ms >= self.hold_ms])

    def _drop(self, gone: list[_Entry]) -> list[Hit]:
        self.held = [h for h in self.held if all(h is not g for g in gone)]
        return [h.hit for h in gone]


def on_chain(hit: Hit, chain: list[bytes]) -> bool:
    at = min(hit.chunks, len(chain)) - 1
    return at >= 0 and bytes(hit.groups[at].chain_hash) == chain[at]


_SEQUENCES = [KEYS[:4], ["aa" * 32, *KEYS[1:4]], ["bb" * 32]]  # share pages, not chains (but the 1st)
_OPS = st.lists(
    st.tuples(
        st.sampled_from(["hold"] * 6 + ["get"] * 6 + ["expire"] * 2 + ["drain"]),
        st.integers(0, 2),  # which sequence
        st.integers(0, 4),  # chunks held / pages a get reaches
        st.sampled_from([0, 0, 1, 5, 20]),  # ms the clock moves on first
        st.booleans(),  # a get that covered ends (done_with, finished) now or later
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=_OPS, held_max=st.integers(1, 6))
def test_the_indexed_table_agrees_with_the_scanned_one(
    ops: list[tuple[str, int, int, int, bool]], held_max: int
) -> None:
    """Any interleaving of holds (one-chunk and longer hits of chains that share pages), gets
    (covering .. done_with .. finished, some still loading while others run), expiries and
    drains: the indexed table gives back the same hits in the same order as the list it replaced,
    and every hit held leaves it exactly once."""
    hits = {
        (i, n): hit_of(pages[:n], n)
        for i, pages in enumerate(_SEQUENCES)
        for n in range(0, 5)
        if n <= len(pages)
    }
    table, model = HeldHits(hold_ms=50, held_max=held_max), _ListHeldHits(50, held_max)
    now, entered = 0, 0
    loading: list[tuple[Hit | None, list[bytes]]] = []
    left: list[Hit] = []
    for op, which, n, step, end_now in ops:
        now += step
        pages = _SEQUENCES[which]
        n = min(n, len(pages))
        if op == "hold":
            new = replace(hits[(which, n)])  # a lookup's own Hit object each time
            entered += new.chunks > 0
            got = table.hold(new, now)
            assert got == model.hold(new, now)
            left += [h for h in got if h.chunks]
        elif op == "get":
            chain = chain_of(pages[: max(n, 1)])
            covering = table.covering(chain, len(chain))
            assert covering is model.covering(chain, len(chain))
            loading.append((covering, chain))
        elif op == "expire":
            got = table.expired(now)
            assert got == model.expired(now)
            left += got
        else:
            got = table.drain()
            assert got == model.drain()
            left += got
        while loading and (end_now or len(loading) > 2):
            used, chain = loading.pop(0)
            if used is not None:
                got = table.done_with(used)
                assert got == model.done_with(used)
                left += got
            got = table.finished(chain, len(chain))
            assert got == model.finished(chain, len(chain))
            left += got
        assert len(table) == len(model.held) <= max(held_max, len(loading))
    left += table.drain()  # those gets still load under stay ...
    for used, _ in loading:
        left += table.done_with(used) if used is not None else []  # ... and leave with the last
    assert len(table) == 0
    assert len(left) == entered and len({id(h) for h in left}) == entered  # each once


def test_a_held_hit_a_get_loads_under_is_never_given_back_meanwhile() -> None:
    """While a get loads under a held hit's lease (`covering` .. `done_with`), neither its
    expiry, nor newer hits crowding the table, nor another get's `finished` give the lease back
    (each did: the load ran without the lease it relied on; review, 2026-12-05); after, they do."""
    table = HeldHits(hold_ms=100, held_max=1)
    chain = chain_of(KEYS)
    long = hit_of(KEYS, 8)
    assert table.hold(long, 0) == []
    assert table.covering(chain, 8) is long  # a get loads under it
    assert table.expired(500) == []
    newer = hit_of(KEYS[:2], 2)
    assert table.hold(newer, 10) == [newer]  # crowded out: the newer one, not the one in use
    assert table.finished(chain, 8) == []  # another get of the chain ended
    table.done_with(long)
    assert table.expired(500) == [long] and len(table) == 0


def test_a_drain_while_a_get_loads_keeps_that_hit_until_the_get_is_done() -> None:
    """`clear` drains the table while another thread's get loads under a held hit: that lease
    is given back when the get is done, not under the load (review, stop 69), and no new get
    takes the drained hit."""
    table = HeldHits(hold_ms=100, held_max=4)
    chain = chain_of(KEYS)
    long, other = hit_of(KEYS, 8), hit_of(["aa" * 32], 1)
    table.hold(long, 0)
    table.hold(other, 0)
    assert table.covering(chain, 8) is long  # a get loads under it
    assert table.drain() == [other]  # the one in use stays
    assert table.covering(chain, 8) is None  # drained: no new get takes it
    assert table.finished(chain, 8) == [] and table.expired(500) == []
    assert table.done_with(long) == [long] and len(table) == 0  # the get's end gives it back


def test_held_hits_are_bounded_and_expire() -> None:
    table = HeldHits(hold_ms=100, held_max=2)
    a, b, c = (hit_of([k], 1) for k in KEYS[:3])
    assert table.hold(a, 0) == [] and table.hold(b, 50) == []
    assert table.hold(c, 60) == [a]  # the oldest over held_max comes back at once
    assert table.expired(149) == [] and table.expired(150) == [b] and table.expired(160) == [c]
    assert len(table) == 0
    miss = hit_of([KEYS[0]], 0)
    assert table.hold(miss, 0) == [miss] and len(table) == 0  # nothing to hold: release it
    with pytest.raises(ValueError, match="held_max"):
        HeldHits(hold_ms=10, held_max=0)


def test_engine_spec_names_tenant_revision_dtype_and_page_format() -> None:
    base = spec_for()
    assert (
        base.layout.tokens_per_chunk == PAGE_WORDS and base.layout.tp_size == 2 and base.layout.tp_rank == 1
    )
    assert "page16" in base.layout.tensor_layout and "page_first" in base.layout.tensor_layout
    assert base.model.kv_dtype == "float32" and base.model.weights_revision == "rev-a"

    def root(spec) -> bytes:  # type: ignore[no-untyped-def]
        return bytes(
            chunk_groups_for_prefix(spec.domain, spec.model, spec.layout, chain_words([], KEYS[:1]))[
                0
            ].chain_hash
        )

    others = [
        spec_for(tenant_id="t2"),
        spec_for(domain_salt_hex="22" * 16),
        spec_for(weights_revision="rev-b"),
        engine_spec(WHO, replace(POOL, dtype="bfloat16"), EXTRA, DEFAULTS),
        engine_spec(WHO, replace(POOL, page_size=32), EXTRA, DEFAULTS),
        engine_spec(WHO, replace(POOL, layout="layer_first"), EXTRA, DEFAULTS),
        engine_spec(replace(WHO, tp_rank=0, tp_size=1), POOL, EXTRA, DEFAULTS),
    ]
    # Every one a key space of its own (the same rank of another TP size too).
    assert len({root(base), *(root(s) for s in others)}) == 1 + len(others)


def test_what_changes_the_kv_but_not_the_pool_is_in_the_key() -> None:
    """An fp8 KV cache lives in a uint8 pool whatever its format: e4m3 and e5m2 pages looked alike
    and shared keys (review, stop 66), so such a pool needs the KV cache dtype (SGLang's server
    args, else the extra config) or it is refused. Weights quantized at load, config overrides
    and a pipeline stage's first layer change the key too; an unquantized pool's key is as
    before."""
    fp8 = replace(POOL, dtype="uint8", region_bytes=(8192, 8192))
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        engine_spec(WHO, fp8, EXTRA, DEFAULTS)
    auto = engine_spec(replace(WHO, kv_cache_dtype="auto", model_dtype="bfloat16"), fp8, EXTRA, DEFAULTS)
    assert auto.model.kv_dtype == "auto-uint8/bfloat16"  # chosen by the checkpoint: its own keys
    e4m3 = engine_spec(replace(WHO, kv_cache_dtype="fp8_e4m3", model_dtype="bfloat16"), fp8, EXTRA, DEFAULTS)
    assert e4m3.model.kv_dtype == "fp8_e4m3/bfloat16"
    assert (
        engine_spec(WHO, fp8, {**EXTRA, "kv_cache_dtype": "fp8_e4m3"}, DEFAULTS).model.kv_dtype
        == "fp8_e4m3/?"
    )
    others = [
        engine_spec(replace(WHO, kv_cache_dtype="fp8_e5m2", model_dtype="bfloat16"), fp8, EXTRA, DEFAULTS),
        engine_spec(replace(WHO, kv_cache_dtype="fp8_e4m3", model_dtype="float16"), fp8, EXTRA, DEFAULTS),
    ]
    assert len({auto.model, e4m3.model, *(o.model for o in others)}) == 4
    base = spec_for()
    assert (
        engine_spec(replace(WHO, kv_cache_dtype="auto", model_dtype="float32"), POOL, EXTRA, DEFAULTS) == base
    )
    quantized = engine_spec(replace(WHO, quantization="fp8"), POOL, EXTRA, DEFAULTS)
    assert quantized.model.weights_revision == "rev-a+q:fp8"
    overridden = engine_spec(replace(WHO, model_overrides='{"rope_theta": 5e5}'), POOL, EXTRA, DEFAULTS)
    assert overridden.model.attn_config_digest != base.model.attn_config_digest
    assert engine_spec(replace(WHO, model_overrides="{}"), POOL, EXTRA, DEFAULTS) == base
    stage = engine_spec(replace(WHO, pp_rank=1, pp_size=3), replace(POOL, start_layer=2), EXTRA, DEFAULTS)
    later = engine_spec(replace(WHO, pp_rank=1, pp_size=3), replace(POOL, start_layer=6), EXTRA, DEFAULTS)
    assert stage.layout.tensor_layout != later.layout.tensor_layout
    assert "@" not in base.layout.tensor_layout  # a first stage's (or no pipeline's) key as before


def test_mla_pages_are_shared_by_every_tp_rank() -> None:
    mla = StorageIdentity(tp_rank=3, tp_size=4, pp_rank=0, pp_size=1, is_mla_model=True, model_name="m")
    spec = engine_spec(mla, POOL, EXTRA, DEFAULTS)
    assert (spec.layout.tp_size, spec.layout.tp_rank) == (1, 0)


def test_engine_spec_refuses_what_it_cannot_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="weights_revision"):
        engine_spec(WHO, POOL, {}, DEFAULTS)  # "tiny" is no directory: the revision is unknown
    with pytest.raises(ValueError, match="context parallel"):
        engine_spec(StorageIdentity(0, 1, 0, 1, False, "m", attn_cp_size=2), POOL, EXTRA, DEFAULTS)
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 4}')
    local = StorageIdentity(0, 1, 0, 1, False, str(tmp_path))
    spec = engine_spec(local, POOL, {}, DEFAULTS)
    assert spec.model.weights_revision.startswith("xxh3:")
    (tmp_path / "model.safetensors").write_bytes(b"other weights")
    assert engine_spec(local, POOL, {}, DEFAULTS).model.weights_revision != spec.model.weights_revision
    # LongRoPE (Phi-3): SGLang rotates a whole batch with the long factors when any position in
    # it passes original_max_position_embeddings, so a prefix's KV depends on the batch (stop 70)
    (tmp_path / "config.json").write_text(
        '{"original_max_position_embeddings": 4096, "rope_scaling": {"type": "longrope",'
        ' "short_factor": [1.0], "long_factor": [2.0]}}'
    )
    with pytest.raises(ValueError, match="LongRoPE"):
        engine_spec(local, POOL, {}, DEFAULTS)


def test_a_chained_batch_is_all_or_nothing_but_for_the_save_rates_skipped_tail() -> None:
    assert chained_pages_stored(3, SaveResult(chunks_saved=2, chunks_existing=1)) == [True] * 3
    broken = SaveResult(chunks_saved=2, chunks_failed=1, causes={"segment_unreachable": 1})
    assert chained_pages_stored(3, broken) == [False] * 3
    rate = SaveResult(chunks_saved=1, chunks_failed=2, causes={"save_rate": 2})
    assert chained_pages_stored(3, rate) == [True, False, False]
    mixed = SaveResult(chunks_saved=0, chunks_failed=3, causes={"save_rate": 2, "no_capacity": 1})
    assert chained_pages_stored(3, mixed) == [False] * 3
