"""Tiny random-weight Llama models built locally (no downloads), saved once per test session."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

VOCAB = 4096
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=16384,
    initializer_range=0.2,  # larger than default: greedy outputs vary instead of repeating a token
    tie_word_embeddings=False,
)


def build_tiny_llama(path: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """Save a random-weight Llama (≈ 18 MB in fp32) at `path` and return it."""
    import transformers

    llama: Any = transformers.LlamaForCausalLM
    config_cls: Any = transformers.LlamaConfig

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    config = config_cls(**TINY)
    model = llama(config).to(dtype).eval()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return path


def prompt_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, VOCAB, (n,), generator=g).tolist()
