"""Pure planning formulas: numbers in, numbers out (bytes, seconds, fractions).

Metadata sizes come from the real encodings: `KEY_BYTES`/`CHUNK_GROUP_BYTES` of
`kvfabric.format.key`, `encode_manifest()` of synthetic manifests of the right shape with 0 and
1 chunks (`manifest_bytes()` derives the size for any chunk count from those two without building
it), and the directory's packed record per published chunk group (`kvfabric.core.directory.records`):
header 10 B + per member 31 B + per replica 16 B. Directory RAM adds the measured overhead per
record (docs/directory.md: 243 B of RSS per published single-member single-replica object whose
record is 57 B, so 186 B of dict/`bytes` overhead per group).
"""

from __future__ import annotations

import math
from typing import Final

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
from kvfabric.plan.model import DTYPE_BYTES, ModelSpec

__all__ = [
    "DIRECTORY_LOOKUP_GROUPS_PER_S",
    "DIRECTORY_PUBLISH_OBJECTS_PER_S",
    "DIRECTORY_RAM_OVERHEAD_PER_GROUP",
    "RECORD_HEADER_BYTES",
    "RECORD_MEMBER_BYTES",
    "RECORD_REPLICA_BYTES",
    "directory_ram_bytes",
    "domain_hosts_lost",
    "dram_read_share",
    "drive_writes_per_day",
    "full_chunks",
    "gbps_to_bytes_per_s",
    "group_record_bytes",
    "hosts_needed",
    "hotspot_factor",
    "kv_bytes_per_token",
    "kv_elements_per_token_per_layer",
    "manifest_bytes",
    "moved_fraction_on_expand",
    "objects_per_chunk_group",
    "tp_duplication",
]

RECORD_HEADER_BYTES: Final = 10  # namespace u32, chunk index u32, member count u8, flags u8
RECORD_MEMBER_BYTES: Final = 31  # 3 x u16 member, u64 size, 16 B checksum, u8 replica count
RECORD_REPLICA_BYTES: Final = 16  # placement u32, slot u32, slot generation u64
DIRECTORY_MEASURED_RAM_PER_OBJECT: Final = 243  # docs/directory.md, 1 member x 1 replica
DIRECTORY_RAM_OVERHEAD_PER_GROUP: Final = DIRECTORY_MEASURED_RAM_PER_OBJECT - (
    RECORD_HEADER_BYTES + RECORD_MEMBER_BYTES + RECORD_REPLICA_BYTES
)
# Per shard, measured with the service's GC policy (docs/directory.md, `make bench`):
DIRECTORY_LOOKUP_GROUPS_PER_S: Final = 73_516  # batched lookups
DIRECTORY_PUBLISH_OBJECTS_PER_S: Final = 15_469  # begin+confirm+commit


def kv_elements_per_token_per_layer(model: ModelSpec) -> int:
    """MLA: latent + decoupled RoPE key; MHA/GQA/MQA: K and V per KV head."""
    if model.is_mla:
        return model.kv_lora_rank + model.qk_rope_head_dim
    return 2 * model.kv_heads * model.head_dim


def kv_bytes_per_token(model: ModelSpec) -> float:
    """Logical KV bytes of one token across all layers (each distinct byte once)."""
    if model.kv_bytes_per_token > 0:
        return model.kv_bytes_per_token
    return model.layers * kv_elements_per_token_per_layer(model) * DTYPE_BYTES[model.dtype]


def tp_duplication(model: ModelSpec, tp: int, *, dedup: bool = False) -> float:
    """Stored bytes / logical bytes under TP when every rank stores what it holds. MLA: every rank
    holds the whole latent (x tp). GQA with fewer KV heads than ranks: a head is replicated on
    tp / kv_heads ranks. With `dedup` (or an explicit bytes-per-token) each slice is stored once."""
    if dedup or tp == 1 or model.kv_bytes_per_token > 0:
        return 1.0
    if model.is_mla:
        return float(tp)
    heads_per_rank = math.ceil(model.kv_heads / tp)
    return tp * heads_per_rank / model.kv_heads


def full_chunks(tokens: int, chunk_tokens: int) -> int:
    """Only full chunks are hashed and cached; a trailing partial chunk is recomputed."""
    return tokens // chunk_tokens


def objects_per_chunk_group(tp: int, pp: int, layer_groups: int) -> int:
    return tp * pp * layer_groups


def group_record_bytes(members: int, replicas: int) -> int:
    """Packed directory record of one published chunk group (`pack_group`)."""
    return RECORD_HEADER_BYTES + members * (RECORD_MEMBER_BYTES + replicas * RECORD_REPLICA_BYTES)


def directory_ram_bytes(groups: int, members: int, replicas: int) -> int:
    """Directory RSS for `groups` published chunk groups: record + measured per-group overhead."""
    return groups * (group_record_bytes(members, replicas) + DIRECTORY_RAM_OVERHEAD_PER_GROUP)


# msgpack's unsigned integer encodings: (first value, first value past the range, bytes).
_MSGPACK_UINT_SIZES: Final = (
    (0, 1 << 7, 1),  # positive fixint
    (1 << 7, 1 << 8, 2),  # uint 8
    (1 << 8, 1 << 16, 3),  # uint 16
    (1 << 16, 1 << 32, 5),  # uint 32
    (1 << 32, 1 << 64, 9),  # uint 64
)
_MANIFEST_CHUNKS_MAX: Final = (1 << 32) - 1  # an array 32 holds at most 2**32 - 1 entries


def _msgpack_array_header_bytes(n: int) -> int:
    """fixarray (n < 16), array 16 (n < 65,536), array 32."""
    if n < 16:
        return 1
    return 3 if n < 1 << 16 else 5


def _msgpack_uints_bytes(n: int) -> int:
    """Total msgpack bytes of the integers 0, 1, ..., n - 1 (one count per encoding range)."""
    return sum(size * max(0, min(n, hi) - lo) for lo, hi, size in _MSGPACK_UINT_SIZES)


def _manifest(tp: int, pp: int, layer_groups: int, chunks: tuple[ChunkEntry, ...]) -> Manifest:
    return Manifest(
        format_version=1,
        domain_digest=DomainDigest(b"\x00" * DOMAIN_DIGEST_BYTES),
        model_digest=ModelDigest(b"\x00" * MODEL_DIGEST_BYTES),
        tp_size=tp,
        pp_size=pp,
        layer_group_count=layer_groups,
        tokens_per_chunk=1,
        layout_digest=LayoutDigest(b"\x00" * LAYOUT_DIGEST_BYTES),
        chunks=chunks,
    )


def manifest_bytes(chunks: int, tp: int, pp: int, layer_groups: int, object_bytes: int) -> int:
    """Size of the real msgpack manifest (`encode_manifest()`) of a prefix with `chunks` complete
    chunk groups (chunk indices 0..chunks-1, tp x pp x layer_groups objects each), exact, without
    building it: O(members), not O(chunks x members).

    The manifests with 0 chunks and with one chunk (index 0) are encoded; their difference is one
    chunk entry with chunk_index 0. Every chunk entry is an array [chunk_index, chain_hash,
    objects] with the same chain hash and objects, so the entries differ only in the msgpack
    encoding of chunk_index (1, 2, 3, 5 or 9 bytes by range), and `chunks` is the last field of
    the manifest map, whose array header grows from 1 byte (fixarray) to 3 (array 16) or 5
    (array 32): size = empty - 1 + header(chunks) + chunks x (entry - 1) + sum of the msgpack
    sizes of 0..chunks-1."""
    n = max(0, chunks)
    if n > _MANIFEST_CHUNKS_MAX:
        raise ValueError(f"chunks={chunks} out of range 0..{_MANIFEST_CHUNKS_MAX}")
    checksum = b"\x00" * SUPPORTED_CHECKSUM_ALGOS[CHECKSUM_ALGO]
    size = max(1, object_bytes)
    objects = tuple(
        ObjectEntry(tp_rank=r, pp_stage=s, layer_group=g, size_bytes=size, checksum=checksum)
        for r in range(tp)
        for s in range(pp)
        for g in range(layer_groups)
    )
    first = ChunkEntry(chunk_index=0, chain_hash=ChainHash(b"\xff" * CHAIN_HASH_BYTES), objects=objects)
    empty, one = (len(encode_manifest(_manifest(tp, pp, layer_groups, e))) for e in ((), (first,)))
    entry_without_index = one - empty - _msgpack_uints_bytes(1)  # chunk_index 0: 1 byte
    without_chunks = empty - _msgpack_array_header_bytes(0)
    return without_chunks + _msgpack_array_header_bytes(n) + n * entry_without_index + _msgpack_uints_bytes(n)


def gbps_to_bytes_per_s(gbps: float) -> float:
    """1 Gbit/s = 1e9 bit/s."""
    return gbps * 1e9 / 8


def hotspot_factor(hot_units: float, hosts: int, hot_read_share: float) -> float:
    """Peak/mean read load per host when `hot_read_share` of reads go to `hot_units` placement
    units (chunk-group replicas) spread at random over `hosts`, the rest uniform. Fewer hot units
    than hosts: the hot load lands on `hot_units` hosts. Otherwise balls-in-bins: the busiest host
    gets about mean * (1 + sqrt(2 ln(hosts) / (hot_units / hosts)))."""
    if hosts <= 1 or hot_read_share <= 0 or hot_units <= 0:
        return 1.0
    if hot_units < hosts:
        concentration = hosts / hot_units
    else:
        concentration = 1 + math.sqrt(2 * math.log(hosts) / (hot_units / hosts))
    return hot_read_share * concentration + (1 - hot_read_share)


def domain_hosts_lost(hosts: int, domains: int) -> int:
    """Hosts in the largest failure domain (hosts spread as evenly as possible)."""
    return math.ceil(hosts / domains)


def hosts_needed(
    demand_bytes: float, usable_per_host: float, *, domains: int = 1, survive: bool = False
) -> int:
    """Fewest hosts whose usable DRAM holds `demand_bytes`; with `survive`, also after losing the
    largest of `domains` failure domains (domains kept, hosts per domain grown)."""
    n = max(1, math.ceil(demand_bytes / usable_per_host - 1e-9))
    if not survive or domains <= 1:
        return n
    while (n - domain_hosts_lost(n, domains)) * usable_per_host < demand_bytes - 1e-6:
        n += 1
    return n


def moved_fraction_on_expand(hosts: int, added: int) -> float:
    """Share of stored bytes that move when `added` hosts join a balanced placement (consistent /
    rendezvous hashing moves only what the new hosts take)."""
    return added / (hosts + added) if added > 0 else 0.0


def dram_read_share(dram_fraction: float, hot_prefix_share: float, hot_read_share: float) -> float:
    """Share of the read bytes DRAM serves when it holds `dram_fraction` of the stored bytes, the
    hottest first (the rest on the SSD tier): `hot_read_share` of the reads go uniformly to the
    hot `hot_prefix_share` of the prefixes, the rest uniformly to the others. Uniform reads
    (shares 1, 1): DRAM serves `dram_fraction`."""
    d = min(max(dram_fraction, 0.0), 1.0)
    if d >= 1:
        return 1.0
    if d < hot_prefix_share:
        return hot_read_share * d / hot_prefix_share
    return hot_read_share + (1 - hot_read_share) * (d - hot_prefix_share) / (1 - hot_prefix_share)


def drive_writes_per_day(write_bytes_per_s: float, disk_bytes: float) -> float:
    """Disk writes per day (DWPD, the endurance unit SSDs are rated in): bytes written in 86,400 s
    over the disk's size."""
    return write_bytes_per_s * 86_400 / disk_bytes if disk_bytes > 0 else 0.0
