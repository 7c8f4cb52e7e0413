"""The weights digest of a local model directory (`kvfabric.engines.identity`): by content, but
a Hugging Face cache snapshot's files (links to blobs named by their SHA-256) count by that name
without being read (reading every weight byte at start took minutes for a large checkpoint;
review, 2026-12-05); and the attention config digest of a composite model."""

from __future__ import annotations

import os
from pathlib import Path

from kvfabric.engines.identity import ATTN_CONFIG_KEYS, attn_config_digest, weights_digest_of_dir
from kvfabric.format.key import digest_config


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


def test_a_composite_models_text_config_is_in_its_attention_digest() -> None:
    """vLLM's and SGLang's configs are the whole model's: a vision-language model's attention
    fields sit in `text_config` and its top level leaves them None, so two rope settings of its
    text model digested alike (stop 70). A plain model's digest is what it was."""
    plain = {"model_type": "llama", "num_hidden_layers": 2, "rope_theta": 10_000.0}
    assert attn_config_digest(plain) == digest_config({key: plain.get(key) for key in ATTN_CONFIG_KEYS})
    composite = {"model_type": "qwen2_vl", "text_config": {"num_hidden_layers": 2, "rope_theta": 10_000.0}}
    other_rope = {"model_type": "qwen2_vl", "text_config": {"num_hidden_layers": 2, "rope_theta": 50_000.0}}
    assert attn_config_digest(composite) != attn_config_digest(other_rope)
    noise = {**composite, "text_config": {**composite["text_config"], "vocab_size": 7}}  # type: ignore[dict-item]
    assert attn_config_digest(noise) == attn_config_digest(composite)  # only attention fields count
