"""Model identity for engines: a weights digest, so two checkpoints never share KV by accident.

A model id or path names nothing stable (two random-weight models saved to one path differ), so
unless the operator gives an immutable revision, the weights revision is a digest of the weight
files' bytes (xxh3-128, streamed: ~1 s per few GB, once per engine start).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable
from typing import Final

import xxhash

__all__ = ["files_digest", "weights_digest_of_dir"]

_READ_BYTES: Final = 8 << 20
_WEIGHT_PATTERNS: Final = ("*.safetensors", "*.bin", "*.pt", "*.gguf")


def files_digest(paths: Iterable[str]) -> str:
    """xxh3-128 over (name, size, bytes) of each file, in sorted order."""
    h = xxhash.xxh3_128()
    for path in sorted(paths):
        h.update(os.path.basename(path).encode() + b"\0" + os.path.getsize(path).to_bytes(8, "little"))
        with open(path, "rb") as f:
            while block := f.read(_READ_BYTES):
                h.update(block)
    return h.hexdigest()


def weights_digest_of_dir(model_dir: str) -> str:
    """Digest of the weight files in a local model directory. Raises `FileNotFoundError` when
    there are none (then the operator must say which revision it is)."""
    paths = [p for pattern in _WEIGHT_PATTERNS for p in glob.glob(os.path.join(model_dir, pattern))]
    if not paths:
        raise FileNotFoundError(f"no weight files in {model_dir!r}: pass weights_revision explicitly")
    return "xxh3:" + files_digest(paths)
