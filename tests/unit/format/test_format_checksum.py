"""Object checksums: XXH3-128, pinned to the reference, read in place from any buffer."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from kvfabric.format import CHECKSUM_ALGO, CHECKSUM_BYTES, BadRequest, checksum, verify_checksum


def test_checksum_matches_the_xxh3_128_reference() -> None:
    # XXH3_128bits("") from the xxHash reference implementation, canonical (big-endian) form.
    assert checksum(b"").hex() == "99aa06d3014798d86001c324468d497f"
    assert CHECKSUM_ALGO == "xxh3-128"
    assert CHECKSUM_BYTES == len(checksum(b"kvfabric")) == 16


def test_checksum_is_pinned() -> None:
    assert checksum(b"kvfabric").hex() == checksum(bytearray(b"kvfabric")).hex()
    assert checksum(bytes(range(256)) * 64).hex() == checksum(memoryview(bytes(range(256)) * 64)).hex()
    assert checksum(b"chunk 0 rank 0 group 0").hex() == "19fc7b4a9d68d60b55b0a732950a6511"


def test_every_buffer_kind_gives_the_same_digest() -> None:
    data = bytes(range(256)) * 4096  # 1 MiB
    expected = checksum(data)
    arr = np.frombuffer(data, dtype=np.uint16)
    assert checksum(arr) == expected
    assert checksum(memoryview(data)) == expected
    assert checksum(bytearray(data)) == expected
    with mmap.mmap(-1, len(data)) as mm:
        mm.write(data)
        assert checksum(mm) == expected
    # A slice of a larger buffer is read in place (no copy needed for a memoryview slice).
    big = bytearray(b"\xee" * 10 + data + b"\xee" * 10)
    assert checksum(memoryview(big)[10:-10]) == expected
    assert checksum(data[:-1]) != expected


def test_a_non_contiguous_buffer_is_refused_not_silently_copied() -> None:
    arr = np.arange(16, dtype=np.uint8)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        checksum(arr)


def test_verify_checksum() -> None:
    data = b"some kv bytes"
    good = checksum(data)
    assert verify_checksum(data, good)
    assert not verify_checksum(data + b"!", good)
    flipped = bytes([good[0] ^ 1]) + good[1:]
    assert not verify_checksum(data, flipped)
    assert not verify_checksum(data, good[:8])
    with pytest.raises(BadRequest, match="unknown checksum algorithm 'crc32'"):
        verify_checksum(data, good, "crc32")
