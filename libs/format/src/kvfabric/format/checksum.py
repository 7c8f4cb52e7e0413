"""Object checksums (docs/design.md invariant 5): every object's manifest entry carries one.

`checksum()` is XXH3-128 over the object's bytes, as the 16-byte canonical (big-endian) digest.
It reads any C-contiguous buffer (bytes, bytearray, memoryview, numpy array, mmap) in place,
without copying. XXH3 is not cryptographic: it detects corruption (bit flips, torn or misplaced
writes), not tampering; tampering is prevented by who may write (tenancy), not by the checksum.

A reader verifies before it hands bytes to the engine; a mismatch is a miss plus a corruption
report, never a load.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, cast

import xxhash

from kvfabric.format.errors import BadRequest

if TYPE_CHECKING:  # collections.abc.Buffer is 3.12+; type-only import, no runtime dependency
    import numpy.typing as npt
    from typing_extensions import Buffer

    # numpy's stubs declare the buffer protocol on arrays only for Python >= 3.12.
    ChecksumInput = Buffer | npt.NDArray[Any]

__all__ = [
    "CHECKSUM_ALGO",
    "CHECKSUM_BYTES",
    "SUPPORTED_CHECKSUM_ALGOS",
    "StreamingChecksum",
    "checksum",
    "verify_checksum",
]

CHECKSUM_ALGO: Final = "xxh3-128"
CHECKSUM_BYTES: Final = 16
SUPPORTED_CHECKSUM_ALGOS: Final[Mapping[str, int]] = MappingProxyType({CHECKSUM_ALGO: CHECKSUM_BYTES})
"""Algorithm name -> digest size in bytes, for every algorithm this build can verify."""


def checksum(buf: ChecksumInput) -> bytes:
    """XXH3-128 digest (16 bytes) of `buf`'s bytes, read in place."""
    return xxhash.xxh3_128_digest(cast("Buffer", buf))


class StreamingChecksum:
    """The same digest as `checksum()`, fed piece by piece: transports hash each chunk right after
    it arrives (still in cache) instead of re-reading the whole object afterwards."""

    __slots__ = ("_state",)

    def __init__(self) -> None:
        self._state = xxhash.xxh3_128()

    def update(self, chunk: ChecksumInput) -> None:
        self._state.update(cast("Buffer", chunk))

    def digest(self) -> bytes:
        return self._state.digest()


def verify_checksum(buf: ChecksumInput, expected: bytes, algo: str = CHECKSUM_ALGO) -> bool:
    """Whether `buf` matches `expected` under `algo`. An algorithm this build does not know
    raises `BadRequest`: an object that cannot be verified must never be treated as intact."""
    if algo != CHECKSUM_ALGO:
        raise BadRequest(
            f"unknown checksum algorithm {algo!r}; this build verifies {CHECKSUM_ALGO}", algo=algo
        )
    return len(expected) == CHECKSUM_BYTES and checksum(buf) == expected
