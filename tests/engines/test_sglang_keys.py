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
    versioned_spec,
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
    assert table.hold(long, now_ms=0) == [] and table.hold(short, now_ms=0) == []  # covers no held one
    chain = chain_of(KEYS)
    assert table.covering(chain[:4], 4) is short  # the shortest covering hit
    assert table.covering(chain, 8) is long
    assert table.covering(chain_of(["other", *KEYS[1:]]), 4) is None  # another chain
    assert table.covering(chain, 9) is None  # nothing covers past the stored pages
    assert table.finished(short, 4) == [short]  # its one claim used up
    assert table.finished(short, 4) == []  # once only
    assert table.drain() == []  # a get still loads under the long one ...
    assert table.finished(long, 8) == [long] and len(table) == 0  # ... which gives it back


def test_a_requests_batches_hold_one_hit_not_one_a_batch() -> None:
    """SGLang checks a request's pages batch by batch, each lookup leasing the chain from chunk
    0: keeping every batch's hit until its get held |P| + 128k groups for batch k, ~67k group
    leases for a 4,096-page request instead of 4,096, and filled the directory's per-tenant
    lease bound (review, stop 71). A hit that covers held ones on its chain replaces them (their
    claims move to it): one hit a request, given back by the get of its last batch."""
    batch, batches = 4, 16
    pages = [f"{i:064x}" for i in range(1, batch * batches + 1)]
    chain = chain_of(pages)
    table = HeldHits()
    held: list[Hit] = []
    for k in range(1, batches + 1):  # batch_exists of batch k: the chain up to its end
        hit = hit_of(pages[: batch * k], batch * k)
        given_back = table.hold(hit, now_ms=k)
        held = [h for h in held if all(h is not g for g in given_back)] + [hit]
        assert len(table) == 1 and sum(h.chunks for h in held) == batch * k  # not the sum of all
    for k in range(1, batches + 1):  # batch_get_v1 of each batch, in order
        used = table.covering(chain[: batch * k], batch * k)
        assert used is held[0]
        assert table.finished(used, batch * k) == ([used] if k == batches else [])
    assert len(table) == 0


def test_a_hit_a_get_loads_under_is_not_replaced() -> None:
    """A get loads under the hit `covering` gave it until `finished`: a newer hit that covers it
    does not replace it then (its lease would go back under the load)."""
    table = HeldHits(hold_ms=1000, held_max=8)
    chain = chain_of(KEYS)
    short = hit_of(KEYS[:4], 4)
    table.hold(short, 0)
    assert table.covering(chain[:4], 4) is short  # a get loads under it
    long = hit_of(KEYS, 8)
    assert table.hold(long, 1) == [] and len(table) == 2  # the short one stays
    assert table.finished(short, 4) == [short]
    again = hit_of(KEYS, 8)
    assert table.hold(again, 2) == [long]  # the same chain and length: replaced, claim moved
    assert table.covering(chain, 8) is again
    assert table.finished(again, 8) == []  # one claim left (long's)
    assert table.covering(chain, 8) is again and table.finished(again, 8) == [again]


def test_one_requests_get_leaves_another_requests_hit_on_a_shared_prefix() -> None:
    """Request B's `batch_exists` found a shared system prompt; request A's found the prompt and
    more. A's get gave back every hit of the chain it reached the end of, B's too, so B's get
    looked the prompt up again (a miss if evicted meanwhile; review, stop 71). Now A's hit
    stands for both answers: A's get uses up its own claim, B's get the other."""
    table = HeldHits(hold_ms=1000, held_max=8)
    prompt, longer = KEYS[:4], KEYS
    b_hit, a_hit = hit_of(prompt, 4), hit_of(longer, 8)
    assert table.hold(b_hit, 0) == []
    assert table.hold(a_hit, 1) == [b_hit]  # covered: its lease back, its claim moved
    a_used = table.covering(chain_of(longer), 8)
    assert a_used is a_hit and table.finished(a_used, 8) == []  # B's claim keeps it held
    b_used = table.covering(chain_of(prompt), 4)
    assert b_used is a_hit  # B's get finds its pages still leased
    assert table.finished(b_used, 4) == [a_hit] and len(table) == 0


def test_a_claim_older_than_the_hold_is_not_moved() -> None:
    """A prefetch SGLang gave up on never gets: its claim ends with its hold, not carried from
    hit to hit (a hot prefix's hit would never be given back)."""
    table = HeldHits(hold_ms=100, held_max=8)
    chain = chain_of(KEYS[:1])
    first = hit_of(KEYS[:1], 1)
    table.hold(first, 0)
    second = hit_of(KEYS[:1], 1)
    assert table.hold(second, 99) == [first]  # young: its claim moves
    third = hit_of(KEYS[:1], 1)
    assert table.hold(third, 150) == [second]  # the first claim is 150 ms old: dropped
    assert table.covering(chain, 1) is third and table.finished(third, 1) == []
    assert table.covering(chain, 1) is third and table.finished(third, 1) == [third]


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
    assert table.hold(hit_of(["aa" * 32, *KEYS[1:]], 8), now_ms=0) == []  # a chained hit is scanned
    looked: list[Hit] = []
    real = sglang_keys._on_chain

    def counted(hit: Hit, chain: Sequence[bytes]) -> bool:
        looked.append(hit)
        return real(hit, chain)

    monkeypatch.setattr(sglang_keys, "_on_chain", counted)
    chain = chain_of([pages[1000]])
    assert table.covering(chain, 1) is hits[1000]
    assert table.finished(hits[1000], 1) == [hits[1000]]
    assert len(looked) <= 4 and len(table) == 2048
    assert table.covering(chain, 1) is None  # given back: gone from the index too


@dataclass
class _Entry:
    hit: Hit
    held_ms: int
    claims: list[tuple[int, int]]
    users: int = 0
    drained: bool = False


class _ListHeldHits:
    """The table's rules as one list, scanned by every call (the table before its index, stop
    66, with stop 71's replaced hits and claims). The model `HeldHits` must agree with."""

    def __init__(self, hold_ms: int, held_max: int) -> None:
        self.hold_ms, self.held_max = hold_ms, held_max
        self.held: list[_Entry] = []  # oldest first

    def hold(self, hit: Hit, now_ms: int) -> list[Hit]:
        if hit.chunks == 0:
            return [hit] if hit.lease_id else []
        chain = [bytes(g.chain_hash) for g in hit.groups[: hit.chunks]]
        covered = [
            h
            for h in self.held
            if not h.users and h.hit is not hit and h.hit.chunks <= hit.chunks and on_chain(h.hit, chain)
        ]
        claims = [c for h in covered for c in h.claims if now_ms - c[1] < self.hold_ms]
        replaced = self._drop(covered)
        self.held.append(_Entry(hit, now_ms, sorted([*claims, (hit.chunks, now_ms)])))
        over = len(self.held) - self.held_max
        return replaced + (self._drop([h for h in self.held if not h.users][:over]) if over > 0 else [])

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

    def finished(self, hit: Hit, end: int) -> list[Hit]:
        for held in self.held:
            if held.hit is hit and held.users:
                held.users -= 1
                if not held.drained:
                    mine = [i for i, (reached, _) in enumerate(held.claims) if reached >= end]
                    if mine:
                        del held.claims[mine[0]]
                    held.drained = not held.claims
                return self._drop([held]) if held.drained and not held.users else []
        return []

    def drain(self) -> list[Hit]:
        for held in self.held:
            held.drained = True
        return self._drop([h for h in self.held if not h.users])

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
    """Any interleaving of holds (one-chunk and longer hits of chains that share pages, some
    replacing others), gets (covering .. finished, some still loading while others run),
    expiries and drains: the indexed table gives back the same hits in the same order as the
    scanned list, and every hit held leaves it exactly once."""
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
                got = table.finished(used, len(chain))
                assert got == model.finished(used, len(chain))
                left += got
        assert len(table) == len(model.held) <= max(held_max, len(loading))
    left += table.drain()  # those gets still load under stay ...
    for used, chain in loading:
        left += table.finished(used, len(chain)) if used is not None else []  # ... and leave with the last
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
    again = hit_of(KEYS, 8)
    assert table.hold(again, 20) == [again]  # covers it, but does not replace it in use
    assert table.covering(chain, 8) is long  # a second get
    assert table.finished(long, 8) == []  # its claim is used up, the other get still loads
    assert table.covering(chain, 8) is None  # no claim left: no new get takes it
    assert table.finished(long, 8) == [long] and len(table) == 0


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
    assert table.expired(500) == []
    assert table.finished(long, 8) == [long] and len(table) == 0  # the get's end gives it back


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


def test_a_weight_version_set_after_start_is_a_key_space_of_its_own() -> None:
    """Weights changed in place (SGLang's `update_weights_from_*` with a `weight_version`) key as
    the starting revision `+version:<v>`: every version apart from the starting weights and
    from each other, the same version the same key on every worker; a long revision is hashed
    with the version, never cut off before it (two versions then shared a key)."""
    start = spec_for()

    def root(spec) -> bytes:  # type: ignore[no-untyped-def]
        groups = chunk_groups_for_prefix(spec.domain, spec.model, spec.layout, chain_words([], KEYS[:1]))
        return bytes(groups[0].chain_hash)

    v1, v2 = versioned_spec(start, "step-1"), versioned_spec(start, "step-2")
    assert v1.model.weights_revision == "rev-a+version:step-1"
    assert v1.domain == start.domain and v1.layout == start.layout
    assert replace(v1, model=start.model) == start  # the weights revision alone changes
    assert root(versioned_spec(spec_for(), "step-1")) == root(v1)  # another worker, same version
    # the starting label again after an update is not the starting weights
    assert len({root(start), root(v1), root(v2), root(versioned_spec(start, "default"))}) == 4
    long = spec_for(weights_revision="r" * 200)
    l1, l2 = versioned_spec(long, "step-1"), versioned_spec(long, "step-2")
    assert l1.model.weights_revision.startswith("sha256:") and len(l1.model.weights_revision) <= 200
    assert root(l1) != root(l2) and root(l1) != root(long)
    with pytest.raises(ValueError, match=r"(?i)utf-8"):
        versioned_spec(start, "bad\udc80")  # not UTF-8: refused, never keyed as another version


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


def test_random_weights_are_refused_and_other_load_formats_keyed() -> None:
    """`--load-format dummy` fills the weights with random values: its pages were stored under
    the real model's key (the revision digests the weight files; review, stop 71). Refused, as
    the vLLM connector does. Formats that read the checkpoint files as they are share the key:
    `layered` (SGLang's default loader layer by layer) and `mistral` (the default loader on the
    consolidated files) were keyed as other weights (review, stop 71); any other (bitsandbytes,
    flash_rl quantize at load; presharded reads other files; remote ones fetch the weights) is
    a key space of its own."""
    with pytest.raises(ValueError, match="dummy"):
        engine_spec(replace(WHO, load_format="dummy"), POOL, EXTRA, DEFAULTS)
    base = spec_for()
    for same in ("auto", "safetensors", "pt", "layered", "mistral"):
        assert engine_spec(replace(WHO, load_format=same), POOL, EXTRA, DEFAULTS) == base, same
    quantized = engine_spec(replace(WHO, quantization="fp8"), POOL, EXTRA, DEFAULTS)
    assert (
        engine_spec(replace(WHO, quantization="fp8", load_format="layered"), POOL, EXTRA, DEFAULTS)
        == quantized
    )
    bnb = engine_spec(replace(WHO, load_format="bitsandbytes"), POOL, EXTRA, DEFAULTS)
    assert bnb.model.weights_revision == "rev-a+load:bitsandbytes"
    for other in ("presharded", "remote_instance", "runai_streamer", "ipc_cache"):
        keyed = engine_spec(replace(WHO, load_format=other), POOL, EXTRA, DEFAULTS)
        assert keyed.model.weights_revision == f"rev-a+load:{other}"
    # torchao quantization at load (SGLang versions with `--torchao-config`: the layered loader
    # applies it per layer) is other weights, whatever the format (review of the change, stop 71)
    for fmt in ("auto", "layered"):
        torchao = engine_spec(
            replace(WHO, load_format=fmt, torchao_config="int4wo-128"), POOL, EXTRA, DEFAULTS
        )
        assert torchao.model.weights_revision == "rev-a+torchao:int4wo-128"


def test_the_fp8_kv_scales_file_is_in_the_key(tmp_path: Path) -> None:
    """With `--kv-cache-dtype fp8_e4m3 --quantization-param-path scales.json` SGLang divides K
    and V by the file's per-layer scales before storing them: pages of other scales shared a
    key (review, stop 71). Its contents are in the key (`kv_quant`), not its path; a file that
    cannot be read is refused (the backend runs disabled, `config_error`)."""
    fp8 = replace(POOL, dtype="uint8", region_bytes=(8192, 8192))
    who = replace(WHO, kv_cache_dtype="fp8_e4m3", model_dtype="bfloat16")
    plain = engine_spec(who, fp8, EXTRA, DEFAULTS)
    assert plain.model.kv_quant == "none"
    (tmp_path / "a.json").write_text('{"kv_cache": {"scaling_factor": {"0": {"0": 0.5}}}}')
    (tmp_path / "b.json").write_text('{"kv_cache": {"scaling_factor": {"0": {"0": 0.25}}}}')
    (tmp_path / "copy.json").write_text((tmp_path / "a.json").read_text())
    a, b, copy = (
        engine_spec(replace(who, kv_scales_path=str(tmp_path / n)), fp8, EXTRA, DEFAULTS)
        for n in ("a.json", "b.json", "copy.json")
    )
    assert len({plain.model, a.model, b.model}) == 3 and copy == a
    with pytest.raises(ValueError, match="quantization-param-path"):
        engine_spec(replace(who, kv_scales_path=str(tmp_path / "missing.json")), fp8, EXTRA, DEFAULTS)
    with pytest.raises(ValueError, match="quantization-param-path"):  # e4m3 named by the extra config
        engine_spec(
            replace(WHO, kv_scales_path=str(tmp_path / "missing.json")),
            fp8,
            {**EXTRA, "kv_cache_dtype": "fp8_e4m3"},
            DEFAULTS,
        )


def test_a_kv_scales_file_sglang_ignores_is_not_keyed(tmp_path: Path) -> None:
    """SGLang reads `--quantization-param-path` only for an fp8_e4m3 KV cache
    (`load_kv_cache_scales`): with bf16, fp8_e5m2 or "auto" KV the file was still read and keyed,
    so an unreadable path disabled kvfabric for nothing and engines that differ only in an
    ignored file did not share (review, stop 71). Such a file is not read: keyed as no file."""
    (tmp_path / "a.json").write_text('{"kv_cache": {"scaling_factor": {"0": {"0": 0.5}}}}')
    fp8 = replace(POOL, dtype="uint8", region_bytes=(8192, 8192))
    for kv_cache_dtype, pool in (
        ("", POOL),
        ("auto", POOL),
        ("bfloat16", POOL),
        ("fp8_e5m2", fp8),
        ("auto", fp8),
    ):
        who = replace(WHO, kv_cache_dtype=kv_cache_dtype, model_dtype="bfloat16")
        plain = engine_spec(who, pool, EXTRA, DEFAULTS)
        for path in (tmp_path / "missing.json", tmp_path / "a.json"):
            ignored = engine_spec(replace(who, kv_scales_path=str(path)), pool, EXTRA, DEFAULTS)
            assert ignored == plain and ignored.model.kv_quant == "none", (kv_cache_dtype, path)
    # the extra config's KV cache dtype wins over the server args', as for the page format
    who = replace(WHO, kv_cache_dtype="fp8_e4m3", kv_scales_path=str(tmp_path / "missing.json"))
    assert engine_spec(who, fp8, {**EXTRA, "kv_cache_dtype": "fp8_e5m2"}, DEFAULTS).model.kv_quant == "none"


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
