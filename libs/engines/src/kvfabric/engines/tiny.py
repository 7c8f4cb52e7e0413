"""Tiny random-weight Llama models built locally (no downloads): for demos, tests and benches.

`build_tiny_llama(path)` saves a ≈ 18 MB fp32 model (4 layers, hidden 256, 4 heads / 2 KV heads,
head_dim 64, vocab 4096) once; a larger `initializer_range` than transformers' default makes
greedy outputs vary instead of repeating one token, so "identical output" checks mean something.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Final

VOCAB: Final = 4096
TINY: Final[dict[str, Any]] = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=16384,
    initializer_range=0.2,
    tie_word_embeddings=False,
)

__all__ = ["TINY", "VOCAB", "build_tiny_llama", "prompt_ids"]


def build_tiny_llama(path: Path, *, seed: int = 0, dtype: Any = None) -> Path:
    """Save a random-weight Llama at `path` (if not there yet) and return `path`."""
    import torch
    import transformers

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    config: Any = transformers.LlamaConfig(**TINY)
    llama: Any = transformers.LlamaForCausalLM
    model = llama(config).to(dtype or torch.float32).eval()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return path


def prompt_ids(n: int, seed: int) -> list[int]:
    """`n` pseudo-random token ids (5..VOCAB-1), the same for the same seed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids: list[int] = torch.randint(5, VOCAB, (n,), generator=g).tolist()
    return ids
