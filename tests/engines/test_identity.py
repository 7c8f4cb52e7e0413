"""The weights digest of a local model directory (`kvfabric.engines.identity`): by content, but
a Hugging Face cache snapshot's files (links to blobs named by their SHA-256) count by that name
without being read (reading every weight byte at start took minutes for a large checkpoint;
review, 2026-12-05)."""

from __future__ import annotations

import os
from pathlib import Path

from kvfabric.engines.identity import weights_digest_of_dir


def snapshot(root: Path, name: str, blob: str, content: bytes) -> Path:
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    (blobs / blob).write_bytes(content)
    snap = root / "snapshots" / name
    snap.mkdir(parents=True)
    os.symlink(blobs / blob, snap / "model.safetensors")
    return snap


def test_a_cache_snapshot_counts_by_its_blob_names_and_a_plain_dir_by_content(tmp_path: Path) -> None:
    sha_a, sha_b = "a" * 64, "b" * 64
    one = snapshot(tmp_path / "one", "s", sha_a, b"x" * 100)
    same_name = snapshot(tmp_path / "two", "s", sha_a, b"y" * 100)  # not read: the name is the digest
    other = snapshot(tmp_path / "three", "s", sha_b, b"x" * 100)
    assert weights_digest_of_dir(str(one)) == weights_digest_of_dir(str(same_name))
    assert weights_digest_of_dir(str(one)) != weights_digest_of_dir(str(other))
    plain_x, plain_y = tmp_path / "px", tmp_path / "py"
    for d, content in ((plain_x, b"x" * 100), (plain_y, b"y" * 100)):
        d.mkdir()
        (d / "model.safetensors").write_bytes(content)
    assert weights_digest_of_dir(str(plain_x)) != weights_digest_of_dir(str(plain_y))
