"""Model identity for engines: a weights digest, so two checkpoints never share KV by accident.

A model id or path names nothing stable (two random-weight models saved to one path differ), so
unless the operator gives an immutable revision, the weights revision is a digest of the weight
files' bytes (xxh3-128, streamed: ~1 s per few GB, once per engine start).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Final

import xxhash

from kvfabric.format.key import digest_config

__all__ = [
    "ATTN_CONFIG_KEYS",
    "LONGROPE_UNCACHEABLE",
    "attn_config_digest",
    "files_digest",
    "longrope_long_factors",
    "rope_entries",
    "weights_digest_of_dir",
]

# The HF config fields that change what the attention KV of a token is (shared by every engine
# integration, so one model's fingerprint is computed one way).
ATTN_CONFIG_KEYS: Final = (
    "model_type",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
    "sliding_window",
    "attention_bias",
)

_READ_BYTES: Final = 8 << 20
_WEIGHT_PATTERNS: Final = ("*.safetensors", "*.bin", "*.pt", "*.gguf")


def attn_config_digest(hf_config: Mapping[str, Any]) -> str:
    """`ModelFingerprint.attn_config_digest` from an HF config dict (`config.to_dict()`). A
    composite model's (vision-language: `text_config`) attention reads its text config, whose
    fields the top level leaves None: those count too (vLLM's and SGLang's configs are the whole
    model's; a rope override of the text model was not in the key, review, stop 66 for the HF
    adapter, which passes the text config itself). vLLM's `max_model_len` is not a field: the
    rotary tables follow the config, but for LongRoPE (`longrope_long_factors`)."""
    fields: dict[str, Any] = {key: hf_config.get(key) for key in ATTN_CONFIG_KEYS}
    text = hf_config.get("text_config")
    if isinstance(text, Mapping):  # (absent otherwise: other models' digests stay as they were)
        fields["text_config"] = {key: text.get(key) for key in ATTN_CONFIG_KEYS}
    return digest_config(fields)


# SGLang and HF transformers rotate a LongRoPE model with its long or short factors per batch (a
# position in it past `original_max_position_embeddings`: all long), so a prefix's KV depends on
# what it was computed beside; no key can name that (review, stop 70). vLLM decides per
# deployment (`longrope_long_factors`).
LONGROPE_UNCACHEABLE: Final = (
    "kvfabric: {model!r} uses LongRoPE, which {engine} applies per batch (its long factors when any"
    " position in the batch passes original_max_position_embeddings): a prefix's KV depends on the"
    " batch, so it is not cached"
)


def rope_entries(hf_config: Mapping[str, Any]) -> Iterator[tuple[Mapping[str, Any], Mapping[str, Any], str]]:
    """Every rope of an HF config dict, as (the config holding it, the rope, its type; "" if
    none said): `rope_parameters` or the older `rope_scaling`, one rope or one per layer type (a
    model with sliding layers), in the config and in a composite model's `text_config`."""
    configs = [hf_config]
    text = hf_config.get("text_config")
    if isinstance(text, Mapping):
        configs.append(text)
    for config in configs:
        for field in ("rope_parameters", "rope_scaling"):
            rope = config.get(field)
            if not isinstance(rope, Mapping):
                continue
            ropes = [rope] if "rope_type" in rope or "type" in rope else list(rope.values())
            for one in ropes:
                if isinstance(one, Mapping):
                    rope_type = one.get("rope_type") or one.get("type")
                    yield config, one, rope_type if isinstance(rope_type, str) else ""


def longrope_long_factors(hf_config: Mapping[str, Any], max_model_len: int) -> bool | None:
    """Whether a LongRoPE model (Phi-3 and kin) rotates with its long factors: vLLM uses them for
    every position when `max_model_len` exceeds `original_max_position_embeddings` (so that its
    prefix cache stays valid), its short ones otherwise, so the same prompt's KV differs between
    two such deployments. None for a model without LongRoPE (its KV does not depend on it)."""
    for config, rope, rope_type in rope_entries(hf_config):
        if rope_type == "longrope":
            original = rope.get("original_max_position_embeddings") or config.get(
                "original_max_position_embeddings"
            )
            return isinstance(original, int) and max_model_len > original
    return None


def files_digest(paths: Iterable[str]) -> str:
    """xxh3-128 over (name, size, bytes) of each file, in sorted order. A file of a Hugging Face
    cache snapshot (a link to a blob named by its SHA-256) counts by that name, not its bytes:
    reading every weight byte at start took minutes for a large checkpoint not in the page cache
    (SGLang's scheduler, each rank; review, 2026-12-05)."""
    h = xxhash.xxh3_128()
    for path in sorted(paths):
        h.update(os.path.basename(path).encode() + b"\0" + os.path.getsize(path).to_bytes(8, "little"))
        blob = os.path.basename(os.path.realpath(path)) if os.path.islink(path) else ""
        if len(blob) == 64 and all(c in "0123456789abcdef" for c in blob):
            h.update(b"sha256:" + blob.encode())
            continue
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
