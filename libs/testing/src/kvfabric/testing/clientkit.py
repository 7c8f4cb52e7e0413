"""Client helpers for tests, benchmarks and tools: an engine spec, chunk objects, a stored-byte
corrupter, and a load of every chunk a lookup finds (bench/ and tools/ import them from here:
nothing imports tests)."""

from __future__ import annotations

import mmap
import os
import ssl
from typing import Any

from kvfabric.client import ClientSettings, EngineSpec, Hit, KvClient
from kvfabric.client.transfers import read_ref
from kvfabric.dataplane.tcp import TcpDataClient
from kvfabric.format.key import KVLayout, ModelFingerprint, ShareDomain
from kvfabric.testing.nats_server import NatsServer

TOKENS_PER_CHUNK = 16
CHUNK_BYTES = 64 << 10

SPEC = EngineSpec(
    domain=ShareDomain(tenant_id="tenant-a", salt=b"client-test-salt"),
    model=ModelFingerprint(
        model_id="tiny", weights_revision="r1", kv_dtype="float32", attn_config_digest="a"
    ),
    layout=KVLayout(
        tp_size=1,
        tp_rank=0,
        pp_stage=0,
        layer_group=0,
        layer_group_count=1,
        tokens_per_chunk=TOKENS_PER_CHUNK,
        tensor_layout="test-bytes",
    ),
)


def client(nats: NatsServer, **overrides: Any) -> KvClient:
    settings = ClientSettings(nats_url=nats.url, **overrides)
    return KvClient(settings, SPEC)


def prompt(n_tokens: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 for i in range(n_tokens)]


def chunk_bytes(tokens: list[int], chunk: int) -> bytes:
    """Deterministic bytes for one chunk of a prompt (a stand-in for its KV)."""
    seed = hash(tuple(tokens[: (chunk + 1) * TOKENS_PER_CHUNK])) & 0xFFFF_FFFF
    return (seed.to_bytes(4, "little") * (CHUNK_BYTES // 4))[:CHUNK_BYTES]


def objects_for(tokens: list[int], first: int, last: int) -> list[list[bytes]]:
    return [[chunk_bytes(tokens, c)] for c in range(first, last)]


def corrupt_stored_byte(hit: Hit, chunk: int, tls: ssl.SSLContext | None = None) -> None:
    """Test hook: flip one byte of a stored object in its segment's arena."""
    location = hit.objects[chunk][0]
    replica = location.replicas[0]
    ref = read_ref(replica, location.size_bytes)
    with TcpDataClient.connect(replica.data_addr, tls=tls) as data:
        info = data.map_info(reads=[ref])  # the arena path only for a token holder
        fd = os.open(info.arena_path, os.O_RDWR)
        try:
            with mmap.mmap(fd, info.arena_bytes) as arena:
                grants = data.pin_local([ref])
                arena[grants.grants[0].offset + 777] ^= 0x5A
                data.unpin_local(grants.grant_id)
        finally:
            os.close(fd)


def load_all(kv_client: KvClient, tokens: list[int]) -> tuple[int, bool]:
    """(chunks loaded, all bytes identical): look `tokens` up, load every chunk found, release."""
    hit = kv_client.lookup(tokens)
    out = [[bytearray(CHUNK_BYTES)] for _ in range(hit.chunks)]
    result = kv_client.load(hit, out)
    kv_client.release(hit)
    n = result.tokens // TOKENS_PER_CHUNK
    return n, all(bytes(out[c][0]) == chunk_bytes(tokens, c) for c in range(n))
