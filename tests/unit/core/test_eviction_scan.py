"""Scan pollution (issue 25, item 5): one tenant streams prompts nobody asks for again; another
re-reads a small working set. With a guaranteed share for the reader (or a hard quota for the
scanner) the reader's hit rate holds under every policy and admission mode; without either, the
recency policies (LRU, GDSF, SIEVE) let the scan flush it (the control: the scenario does pollute)."""

from __future__ import annotations

from collections.abc import Hashable

import pytest

from kvfabric.core.eviction import (
    AdmissionName,
    Admitted,
    EvictBatch,
    EvictionConfig,
    EvictionCore,
    PolicyName,
    TenantQuota,
)

CAPACITY = 200  # one pool, in chunks of 1 byte
READER_PROMPTS, READER_CHUNKS = 10, 4  # the reader's working set: 40 chunks, a fifth of the pool
SCAN_CHUNKS = 24  # each step the scanner writes a prompt of 24 new chunks
STEPS = 300
STEP_MS = 10
GUARANTEED = READER_PROMPTS * READER_CHUNKS + 8  # the reader's guaranteed share: its working set fits
SCANNER_HARD = CAPACITY // 2

POLICIES: list[tuple[PolicyName, AdmissionName]] = [
    ("lru", "always"),
    ("lru", "second_hit"),
    ("gdsf", "always"),
    ("lru2", "always"),
    ("sieve", "always"),
    ("s3fifo", "always"),
    ("wtinylfu", "always"),
    ("reuse", "always"),
    ("reuse", "predicted"),
    ("density", "always"),
    ("density", "predicted"),
]


def request(core: EvictionCore, tenant: str, blocks: list[str], now: int) -> int:
    """One request as the simulator plays it (tools/evict_sim.py): the resident prefix is hit and
    accessed, the rest inserted (admission may refuse), then victims go. Returns chunks hit."""
    hit = 0
    for block in blocks:
        if block in core and not core.is_evicting(block):
            hit += 1
        else:
            break
    for block in blocks:
        core.seen(block)
    for i, block in enumerate(blocks):
        if i < hit:
            core.access(block, now)
            continue
        effects = core.insert(
            block,
            tenant=tenant,
            pool="pool",
            size=1,
            parent=blocks[i - 1] if i else None,
            chunk_index=i,
            now_ms=now,
            prompt_chunks=len(blocks),
        )
        assert len(effects) == 1
    for effect in core.tick(now):
        assert isinstance(effect, EvictBatch)
        for victim in effect.victims:
            core.removed(victim)
    return hit


def reader_hit_rate(
    policy: PolicyName, admission: AdmissionName, quotas: dict[Hashable, TenantQuota]
) -> float:
    """The reader's share of chunks hit over the second half of the run (after warm-up)."""
    core = EvictionCore(
        EvictionConfig(
            policy=policy,
            admission=admission,
            high_watermark=0.95,
            low_watermark=0.9,
            batch_max=256,
        ),
        quotas,
    )
    core.set_capacity("pool", CAPACITY)
    hit = asked = 0
    for step in range(STEPS):
        now = step * STEP_MS
        scan = [f"scan-{step}-{i}" for i in range(SCAN_CHUNKS)]
        request(core, "scanner", scan, now)
        prompt = step % READER_PROMPTS
        reads = [f"read-{prompt}-{i}" for i in range(READER_CHUNKS)]
        got = request(core, "reader", reads, now)
        if step >= STEPS // 2:
            hit, asked = hit + got, asked + READER_CHUNKS
        if step % 10 == 0:
            core.check_invariants()
        assert core.used_bytes("pool") <= CAPACITY + SCAN_CHUNKS + READER_CHUNKS
        if "scanner" in quotas and quotas["scanner"].hard_bytes is not None:
            assert core.tenant_bytes("scanner") <= quotas["scanner"].hard_bytes
    return hit / asked


SCAN_RESISTANT: set[tuple[PolicyName, AdmissionName]] = {
    ("lru", "second_hit"),
    ("lru2", "always"),
    ("s3fifo", "always"),
    ("wtinylfu", "always"),
    ("reuse", "always"),
    ("reuse", "predicted"),
    ("density", "always"),
    ("density", "predicted"),
}


@pytest.mark.parametrize(("policy", "admission"), POLICIES)
def test_without_a_share_only_recency_policies_let_the_scan_flush_the_reader(
    policy: PolicyName, admission: AdmissionName
) -> None:
    """The control: 10 steps between two reads of a prompt write 240 scan chunks and the
    reader's 36 others, past the 190-chunk watermark. LRU, GDSF and SIEVE evict the prompt
    before it is read again; admission, frequency and the learned policies keep it on their own."""
    rate = reader_hit_rate(policy, admission, {})
    assert rate >= 0.99 if (policy, admission) in SCAN_RESISTANT else rate < 0.5


@pytest.mark.parametrize(("policy", "admission"), POLICIES)
def test_a_guaranteed_share_holds_the_readers_hit_rate_under_a_scan(
    policy: PolicyName, admission: AdmissionName
) -> None:
    quotas: dict[Hashable, TenantQuota] = {"reader": TenantQuota(guaranteed_bytes=GUARANTEED)}
    assert reader_hit_rate(policy, admission, quotas) >= 0.99


@pytest.mark.parametrize(("policy", "admission"), POLICIES)
def test_a_hard_quota_on_the_scanner_holds_the_readers_hit_rate(
    policy: PolicyName, admission: AdmissionName
) -> None:
    quotas: dict[Hashable, TenantQuota] = {"scanner": TenantQuota(hard_bytes=SCANNER_HARD)}
    assert reader_hit_rate(policy, admission, quotas) >= 0.99


def test_admission_refuses_nothing_of_a_tenant_below_its_guaranteed_share() -> None:
    """A reader below its guarantee is never refused at put time (its bytes would never be
    taken by pool pressure anyway): under a scan, predicted admission admits every chunk."""
    core = EvictionCore(
        EvictionConfig(policy="density", admission="predicted", high_watermark=0.95, low_watermark=0.9),
        {"reader": TenantQuota(guaranteed_bytes=GUARANTEED)},
    )
    core.set_capacity("pool", CAPACITY)
    for step in range(STEPS // 2):
        request(core, "scanner", [f"scan-{step}-{i}" for i in range(SCAN_CHUNKS)], step * STEP_MS)
    # the pool is pressed by the scan; the reader's first prompt is written whole
    for i in range(READER_CHUNKS):
        effects = core.insert(
            f"new-{i}",
            tenant="reader",
            pool="pool",
            size=1,
            parent=f"new-{i - 1}" if i else None,
            chunk_index=i,
            now_ms=STEPS * STEP_MS,
            prompt_chunks=READER_CHUNKS,
        )
        assert effects and isinstance(effects[0], Admitted), effects
