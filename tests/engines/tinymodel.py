"""Tiny random-weight Llama models for the engine tests (see `kvfabric.engines.tiny`)."""

from kvfabric.engines.tiny import TINY, VOCAB, build_tiny_llama, prompt_ids

__all__ = ["TINY", "VOCAB", "build_tiny_llama", "prompt_ids"]
