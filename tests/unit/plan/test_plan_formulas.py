"""Each planning formula against hand-computed cases (GQA and MLA models included)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvfabric.core.directory.records import MemberRecord, PublishedGroup, ReplicaRecord, pack_group
from kvfabric.format.checksum import CHECKSUM_ALGO, SUPPORTED_CHECKSUM_ALGOS
from kvfabric.format.key import (
    CHAIN_HASH_BYTES,
    DOMAIN_DIGEST_BYTES,
    LAYOUT_DIGEST_BYTES,
    MODEL_DIGEST_BYTES,
    ChainHash,
    DomainDigest,
    LayoutDigest,
    ModelDigest,
)
from kvfabric.format.manifest import ChunkEntry, Manifest, ObjectEntry, encode_manifest
from kvfabric.plan import formulas as f
from kvfabric.plan.model import PRESETS, Cluster, Layout, ModelSpec, Workload, model_from_config
from kvfabric.plan.plan import build_plan

GiB = 2**30
TiB = 2**40


def test_kv_bytes_per_token_gqa() -> None:
    # Llama-3-8B: 32 layers x (2 x 8 KV heads x 128) x 2 B = 131,072 B = 128 KiB/token.
    assert f.kv_elements_per_token_per_layer(PRESETS["llama3-8b"]) == 2048
    assert f.kv_bytes_per_token(PRESETS["llama3-8b"]) == 128 * 1024
    # Llama-3-70B: 80 x 2048 x 2 = 320 KiB/token.
    assert f.kv_bytes_per_token(PRESETS["llama3-70b"]) == 320 * 1024
    # fp8 halves it; an explicit bytes/token wins over the shape.
    fp8 = ModelSpec(layers=32, kv_heads=8, head_dim=128, dtype="fp8")
    assert f.kv_bytes_per_token(fp8) == 64 * 1024
    assert f.kv_bytes_per_token(ModelSpec(kv_bytes_per_token=1000.0)) == 1000.0


def test_kv_bytes_per_token_mla() -> None:
    # DeepSeek-V2: 60 layers x (512 latent + 64 RoPE key) x 2 B = 69,120 B/token.
    ds = PRESETS["deepseek-v2"]
    assert ds.is_mla
    assert f.kv_elements_per_token_per_layer(ds) == 576
    assert f.kv_bytes_per_token(ds) == 69_120


def test_tp_duplication() -> None:
    gqa, mla = PRESETS["llama3-8b"], PRESETS["deepseek-v2"]
    assert f.tp_duplication(gqa, 1) == 1.0
    assert f.tp_duplication(gqa, 8) == 1.0  # one KV head per rank
    assert f.tp_duplication(gqa, 16) == 2.0  # each of 8 heads on 2 ranks
    assert f.tp_duplication(mla, 8) == 8.0  # every rank holds the whole latent
    assert f.tp_duplication(mla, 8, dedup=True) == 1.0


def test_chunks_objects_and_records() -> None:
    assert f.full_chunks(8192, 256) == 32
    assert f.full_chunks(8191, 256) == 31  # a trailing partial chunk is not cached
    assert f.objects_per_chunk_group(4, 2, 3) == 24
    assert f.group_record_bytes(1, 1) == 57
    assert f.group_record_bytes(4, 2) == 10 + 4 * (31 + 2 * 16)
    assert f.directory_ram_bytes(1, 1, 1) == 243  # the measured figure of docs/directory.md
    assert f.directory_ram_bytes(10, 4, 2) == 10 * (262 + 186)


@pytest.mark.parametrize(("members", "replicas"), [(1, 1), (1, 2), (8, 2), (4, 3)])
def test_record_size_matches_pack_group(members: int, replicas: int) -> None:
    reps = tuple(ReplicaRecord(placement=1, slot=2, slot_generation=3) for _ in range(replicas))
    group = PublishedGroup(
        namespace=1,
        chunk_index=7,
        flags=0,
        members=tuple(MemberRecord(r, 0, 0, 2**25, b"\x01" * 16, reps) for r in range(members)),
    )
    assert len(pack_group(group)) == f.group_record_bytes(members, replicas)


def test_manifest_bytes_are_real_encodings() -> None:
    one, two, three = (f.manifest_bytes(n, 2, 1, 1, 2**24) for n in (1, 2, 3))
    assert two - one == three - two > 2 * (16 + 8)  # per chunk: hash + two object entries
    assert 32 < one < 400
    assert f.manifest_bytes(0, 1, 1, 1, 1) > 0


def _built_manifest_bytes(chunks: int, tp: int, pp: int, layer_groups: int, object_bytes: int) -> int:
    """Reference: the whole manifest built and encoded (what `manifest_bytes` did before)."""
    checksum = b"\x00" * SUPPORTED_CHECKSUM_ALGOS[CHECKSUM_ALGO]
    objects = tuple(
        ObjectEntry(tp_rank=r, pp_stage=s, layer_group=g, size_bytes=max(1, object_bytes), checksum=checksum)
        for r in range(tp)
        for s in range(pp)
        for g in range(layer_groups)
    )
    chain_hash = ChainHash(b"\xff" * CHAIN_HASH_BYTES)
    manifest = Manifest(
        format_version=1,
        domain_digest=DomainDigest(b"\x00" * DOMAIN_DIGEST_BYTES),
        model_digest=ModelDigest(b"\x00" * MODEL_DIGEST_BYTES),
        tp_size=tp,
        pp_size=pp,
        layer_group_count=layer_groups,
        tokens_per_chunk=1,
        layout_digest=LayoutDigest(b"\x00" * LAYOUT_DIGEST_BYTES),
        chunks=tuple(
            ChunkEntry(chunk_index=i, chain_hash=chain_hash, objects=objects) for i in range(chunks)
        ),
    )
    return len(encode_manifest(manifest))


# Every msgpack size boundary of the chunks array header (16, 65,536) and of chunk_index
# (128, 256, 65,536: indices run to chunks - 1).
_BOUNDARY_CHUNKS = (0, 1, 2, 15, 16, 17, 127, 128, 129, 255, 256, 257, 65_535, 65_536, 65_537)
# (tp, pp, layer_groups, object_bytes); object sizes and member indices cross msgpack int sizes.
_FEW_MEMBERS = ((1, 1, 1, 1), (2, 1, 1, 2**24), (1, 2, 3, 128), (1, 1, 1, 2**32), (1, 1, 2, 2**63 - 1))
_MANY_MEMBERS = ((130, 1, 2, 65_536), (3, 4, 5, 255), (1, 1, 300, 2**16 - 1))


@pytest.mark.parametrize("chunks", _BOUNDARY_CHUNKS)
@pytest.mark.parametrize("shape", _FEW_MEMBERS)
def test_manifest_bytes_exact_at_msgpack_boundaries(chunks: int, shape: tuple[int, int, int, int]) -> None:
    assert f.manifest_bytes(chunks, *shape) == _built_manifest_bytes(chunks, *shape)


@pytest.mark.parametrize("chunks", [n for n in _BOUNDARY_CHUNKS if n <= 257])
@pytest.mark.parametrize("shape", _MANY_MEMBERS)
def test_manifest_bytes_exact_with_many_members(chunks: int, shape: tuple[int, int, int, int]) -> None:
    assert f.manifest_bytes(chunks, *shape) == _built_manifest_bytes(chunks, *shape)


def test_manifest_bytes_does_not_build_the_manifest(monkeypatch: pytest.MonkeyPatch) -> None:
    # 4,096 chunks x 640 members: building it would take 4,096 ChunkEntry and 2.6 M object
    # entries in the encoding; the closed form builds one chunk entry and its 640 objects once.
    counts = {"chunks": 0, "objects": 0}

    def chunk_entry(*args: object, **kwargs: object) -> ChunkEntry:
        counts["chunks"] += 1
        return ChunkEntry(*args, **kwargs)  # type: ignore[arg-type]

    def object_entry(*args: object, **kwargs: object) -> ObjectEntry:
        counts["objects"] += 1
        return ObjectEntry(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(f, "ChunkEntry", chunk_entry)
    monkeypatch.setattr(f, "ObjectEntry", object_entry)
    size = f.manifest_bytes(4096, 8, 8, 10, 2**20)
    assert counts["chunks"] <= 2
    assert counts["objects"] <= 640
    # Same as 4,096 x the per-chunk entry of a small build, checked exactly on a smaller prefix:
    # the 640-member entry size times chunks, plus what the indices and the header add.
    one, two = f.manifest_bytes(1, 8, 8, 10, 2**20), f.manifest_bytes(2, 8, 8, 10, 2**20)
    entry = two - one
    assert size == one + 4095 * entry + (256 - 128) * 1 + (4096 - 256) * 2 + (3 - 1)


def test_manifest_bytes_up_to_the_largest_array() -> None:
    # Past 65,536 chunks every entry adds the same (chunk_index a uint 32, header an array 32),
    # up to 2**32 - 1 entries, the most an array 32 (and a u32 chunk_index) allows.
    step = f.manifest_bytes(65_538, 1, 1, 1, 1) - f.manifest_bytes(65_537, 1, 1, 1, 1)
    assert step == f.manifest_bytes(2, 1, 1, 1, 1) - f.manifest_bytes(1, 1, 1, 1, 1) + 4
    big = f.manifest_bytes(2**32 - 1, 1, 1, 1, 1)
    assert big == f.manifest_bytes(65_537, 1, 1, 1, 1) + (2**32 - 1 - 65_537) * step
    with pytest.raises(ValueError, match="out of range"):
        f.manifest_bytes(2**32, 1, 1, 1, 1)


def test_units_hotspot_hosts_and_moves() -> None:
    assert f.gbps_to_bytes_per_s(400) == 50e9
    # 4 hot units on 16 hosts take half the reads: the 4 hot hosts see 0.5 x 16/4 + 0.5 = 2.5x.
    assert f.hotspot_factor(4, 16, 0.5) == pytest.approx(2.5)
    # Many hot units: balls-in-bins, 1 + sqrt(2 ln 100 / 200).
    assert f.hotspot_factor(20_000, 100, 1.0) == pytest.approx(1 + math.sqrt(2 * math.log(100) / 200))
    assert f.hotspot_factor(10, 1, 1.0) == 1.0
    assert f.domain_hosts_lost(128, 8) == 16
    assert f.domain_hosts_lost(130, 8) == 17
    # 64 TiB over 409.6 GiB usable hosts: 160; to survive losing one of 8 racks: 183
    # (183 hosts: largest rack 23, 160 left x 409.6 GiB = 64 TiB).
    per_host = 512 * GiB * 0.8
    assert f.hosts_needed(64 * TiB, per_host) == 160
    assert f.hosts_needed(64 * TiB, per_host, domains=8, survive=True) == 183
    assert f.moved_fraction_on_expand(128, 32) == pytest.approx(0.2)
    assert f.moved_fraction_on_expand(128, 0) == 0.0


def test_model_from_config(tmp_path: Path) -> None:
    llama = tmp_path / "llama.json"
    llama.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "hidden_size": 4096,
                "torch_dtype": "bfloat16",
            }
        )
    )
    m = model_from_config(llama)
    assert (m.layers, m.kv_heads, m.head_dim, m.dtype, m.is_mla) == (32, 8, 128, "bfloat16", False)
    assert f.kv_bytes_per_token(m) == 128 * 1024
    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps(
            {
                "model_type": "deepseek_v2",
                "num_hidden_layers": 60,
                "num_attention_heads": 128,
                "num_key_value_heads": 128,
                "hidden_size": 5120,
                "kv_lora_rank": 512,
                "qk_rope_head_dim": 64,
                "torch_dtype": "bfloat16",
            }
        )
    )
    assert f.kv_bytes_per_token(model_from_config(ds)) == 69_120
    assert f.kv_bytes_per_token(model_from_config(ds, dtype="fp8")) == 34_560


def test_mla_plan_with_tp() -> None:
    # DeepSeek-V2, TP 8, 4K-token prefixes, 64-token chunks: each rank stores the whole latent.
    plan = build_plan(
        PRESETS["deepseek-v2"],
        Layout(tp=8, chunk_tokens=64),
        Workload(prefixes=1000, prefix_tokens=4096, prefix_tokens_max=16384, request_rate=10),
        Cluster(hosts=8, dram_gib=256, domains=4),
    )
    s = plan.sizes
    assert s.chunk_bytes == 69_120 * 8 * 64
    assert s.object_bytes == 69_120 * 64
    assert (s.objects_per_chunk, s.chunks_per_prefix, s.chunks_per_prefix_max) == (8, 64, 256)
    assert s.objects == 1000 * 64 * 8
    assert plan.metadata.group_record_bytes == 10 + 8 * (31 + 2 * 16)
    assert plan.metadata.manifest_bytes_max > 3 * plan.metadata.manifest_bytes
    assert plan.capacity.logical_bytes == 1000 * 64 * s.chunk_bytes
    assert plan.metadata.lookups_groups_per_s == 10 * 64


def test_seed_example_plan() -> None:
    plan = build_plan(
        PRESETS["llama3-8b"],
        Layout(chunk_tokens=256),
        Workload(prefixes=32768, prefix_tokens=8192, request_rate=200, remote_share=0.75),
        Cluster(hosts=128, dram_gib=512, usable_fraction=0.8, nic_gbps=400, domains=8, replicas=2),
    )
    assert plan.sizes.prefix_bytes == GiB
    assert plan.sizes.objects == 32768 * 32
    assert plan.capacity.logical_bytes == 32 * TiB
    assert plan.capacity.replicated_bytes == 64 * TiB
    assert plan.capacity.usable_bytes == pytest.approx(51.2 * TiB)
    assert not plan.capacity.fits
    assert plan.traffic.read_bytes_per_s == 150 * GiB
    assert plan.traffic.fits
    loss = plan.domain_loss
    assert (loss.hosts_lost, loss.hosts_left) == (16, 112)
    assert loss.lost_replica_bytes == 8 * TiB
    assert loss.usable_bytes_left == pytest.approx(44.8 * TiB)
    assert loss.unrepaired_bytes == 8 * TiB and not loss.repairable
    v = plan.verdict
    assert not v.fits
    assert v.binding == "dram_after_domain_loss"
    assert (v.hosts_needed, v.hosts_needed_domain_loss) == (160, 183)
    # 183 hosts in 8 racks survive a rack loss with every replica restored.
    big = build_plan(
        plan.inputs.model,
        plan.inputs.layout,
        plan.inputs.workload,
        Cluster(hosts=183, dram_gib=512, usable_fraction=0.8, nic_gbps=400, domains=8, replicas=2),
    )
    assert big.verdict.fits and big.domain_loss.repairable


def test_input_validation() -> None:
    with pytest.raises(ValueError, match="dtype"):
        ModelSpec(layers=1, kv_heads=1, head_dim=1, dtype="fp7")
    with pytest.raises(ValueError, match="layers"):
        ModelSpec()
    with pytest.raises(ValueError, match="prefix_tokens_max"):
        Workload(prefixes=1, prefix_tokens=10, prefix_tokens_max=5, request_rate=1)
    with pytest.raises(ValueError, match="domains"):
        Cluster(hosts=2, dram_gib=1, domains=3)
