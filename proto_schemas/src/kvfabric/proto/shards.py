"""Which virtual shard a key belongs to (pure; shared by the directory, segments and callers).

A shard is picked by the chain hash of a chunk group: the little-endian u32 of its first four
bytes, mod the cluster's shard count. Chain hashes are salted per share domain and uniform, so
shards fill evenly. Every id form that carries the chain hash maps the same way: a chunk group
id (90 bytes), an object key (the group id + member), a directory group key (domain digest +
chain hash, 48 bytes) or a bare chain hash (32 bytes).
"""

from __future__ import annotations

from typing import Final

from kvfabric.format.ids import ChainHash, chain_in_any

__all__ = ["SHARDS_MAX", "chain_hash_of", "shard_of", "shard_of_chain"]

SHARDS_MAX: Final = 4096


def shard_of_chain(chain_hash: bytes, shards: int) -> int:
    """The shard of a chain hash (at least 4 bytes)."""
    if len(chain_hash) < 4:
        raise ValueError(f"chain hash shorter than 4 bytes: {len(chain_hash)}")
    if not 1 <= shards <= SHARDS_MAX:
        raise ValueError(f"shards must be in 1..{SHARDS_MAX}, got {shards}")
    return int.from_bytes(chain_hash[:4], "little") % shards


def chain_hash_of(raw: bytes) -> ChainHash:
    """The chain hash inside a group id or key (≥ 90 B), group key (48 B) or chain hash (32 B):
    `kvfabric.format.ids.chain_in_any`. `ValueError` for any other size."""
    return chain_in_any(raw)


def shard_of(raw: bytes, shards: int) -> int:
    """The shard of any id form that carries a chain hash (see the module docstring)."""
    if shards == 1:
        return 0
    return shard_of_chain(chain_hash_of(raw), shards)
