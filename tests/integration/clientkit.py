"""Client helpers for the tests: they live in `kvfabric.testing.clientkit` (bench/ and tools/ use
them too, and nothing imports tests); re-exported here for the test modules."""

from kvfabric.testing.clientkit import (
    CHUNK_BYTES,
    SPEC,
    TOKENS_PER_CHUNK,
    chunk_bytes,
    client,
    corrupt_stored_byte,
    load_all,
    objects_for,
    prompt,
)

__all__ = [
    "CHUNK_BYTES",
    "SPEC",
    "TOKENS_PER_CHUNK",
    "chunk_bytes",
    "client",
    "corrupt_stored_byte",
    "load_all",
    "objects_for",
    "prompt",
]
