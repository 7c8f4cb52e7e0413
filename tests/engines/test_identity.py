"""The weights digest of a local model directory (`kvfabric.engines.identity`): by content, but
a Hugging Face cache snapshot's files (links to blobs named by their SHA-256) count by that name
without being read (reading every weight byte at start took minutes for a large checkpoint;
review, 2026-12-05); and the attention config digest of a composite model."""

from __future__ import annotations

import os
from pathlib import Path

from kvfabric.engines.identity import (
    ATTN_CONFIG_KEYS,
    attn_config_digest,
    longrope_long_factors,
    weights_digest_of_dir,
)
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


def test_a_longrope_models_factors_follow_max_model_len() -> None:
    """vLLM rotates a LongRoPE model (Phi-3) with its long factors at every position when
    `max_model_len` exceeds `original_max_position_embeddings`, so two deployments of one model
    with max_model_len on either side wrote different KV under one key (stop 70)."""
    rope = {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}
    phi3 = {"model_type": "phi3", "original_max_position_embeddings": 4096, "rope_scaling": rope}
    assert longrope_long_factors(phi3, 4096) is False
    assert longrope_long_factors(phi3, 131_072) is True
    newer = {"rope_parameters": {**rope, "original_max_position_embeddings": 8192}}  # transformers 5
    assert longrope_long_factors(newer, 4096) is False and longrope_long_factors(newer, 8193) is True
    composite = {"text_config": phi3}
    assert longrope_long_factors(composite, 131_072) is True
    per_layer = {"original_max_position_embeddings": 4096, "rope_parameters": {"full_attention": rope}}
    assert longrope_long_factors(per_layer, 131_072) is True
    assert longrope_long_factors({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 131_072) is None
    assert longrope_long_factors({}, 4096) is None


def test_the_hf_adapter_refuses_a_longrope_model() -> None:
    """transformers picks a LongRoPE model's factors per forward call from its longest position:
    a prefix's KV depends on what it was computed beside, so no key names it (stop 70)."""
    import pytest
    import torch

    from kvfabric.engines.hf import hf_engine_spec
    from kvfabric.format.key import ShareDomain

    class Config:
        name_or_path = "phi-3-mini"

        def __init__(self, rope: dict[str, object]) -> None:
            self.rope = rope

        def to_dict(self) -> dict[str, object]:
            return {"original_max_position_embeddings": 4096, "rope_scaling": self.rope}

    class Model(torch.nn.Linear):
        def __init__(self, rope: dict[str, object]) -> None:
            super().__init__(1, 1)
            self.config = Config(rope)

    domain = ShareDomain("t", bytes(16))
    with pytest.raises(ValueError, match="LongRoPE"):
        hf_engine_spec(Model({"rope_type": "longrope", "short_factor": [1.0]}), domain, weights_revision="r")
    plain = hf_engine_spec(Model({"rope_type": "llama3", "factor": 8.0}), domain, weights_revision="r")
    assert plain.model.weights_revision == "r"


def test_the_hf_adapter_refuses_a_dynamic_ntk_rope_model() -> None:
    """transformers' dynamic-NTK RoPE rescales its frequencies from a forward's largest position
    once past max_position_embeddings, and keeps them for later calls: a prefix's KV depends on
    the prompt it was computed in (shown below), so no key names it (review, stop 71). Refused
    in `rope_parameters` or `rope_scaling`, per layer type, or in a composite's text config; a
    default or fixed (llama3) rope is not."""
    from typing import Any

    import pytest
    import torch
    import transformers

    from kvfabric.engines.hf import hf_engine_spec
    from kvfabric.engines.tiny import TINY
    from kvfabric.format.key import ShareDomain

    domain = ShareDomain("t", bytes(16))
    small = {**TINY, "num_hidden_layers": 1, "max_position_embeddings": 64}

    def llama(rope: dict[str, object] | None) -> torch.nn.Module:
        torch.manual_seed(0)
        config_class: Any = transformers.LlamaConfig  # (`rope_scaling`: the older field, still read)
        causal_lm: Any = transformers.LlamaForCausalLM
        model: torch.nn.Module = causal_lm(config_class(**small, rope_scaling=rope)).eval()
        return model

    dynamic = llama({"rope_type": "dynamic", "factor": 2.0})

    @torch.inference_mode()
    def prefix_keys(model: torch.nn.Module, n: int) -> torch.Tensor:
        ids = torch.arange(5, 5 + n).unsqueeze(0)
        keys: torch.Tensor = model(input_ids=ids, use_cache=True).past_key_values.layers[0].keys
        return keys[:, :, :48].clone()

    # The cause: one prefix's KV, computed in prompts of 100 and 120 tokens, differs (a default
    # rope's does not).
    assert not torch.allclose(
        prefix_keys(dynamic, 100), prefix_keys(llama({"rope_type": "dynamic", "factor": 2.0}), 120)
    )
    assert torch.allclose(prefix_keys(llama(None), 100), prefix_keys(llama(None), 120))

    with pytest.raises(ValueError, match=r"dynamic-NTK RoPE \(rope_type 'dynamic'\)"):
        hf_engine_spec(dynamic, domain, weights_revision="r")
    assert hf_engine_spec(llama(None), domain, weights_revision="r").model.weights_revision == "r"
    fixed = hf_engine_spec(
        llama(
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "original_max_position_embeddings": 32,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
            }
        ),
        domain,
        weights_revision="r",
    )
    assert fixed.model.weights_revision == "r"

    class Config:
        name_or_path = "some-model"

        def __init__(self, fields: dict[str, Any]) -> None:
            self.fields = fields

        def to_dict(self) -> dict[str, Any]:
            return self.fields

    class Model(torch.nn.Linear):
        def __init__(self, fields: dict[str, Any]) -> None:
            super().__init__(1, 1)
            self.config = Config(fields)

    legacy = {"rope_scaling": {"type": "dynamic", "factor": 2.0}}
    per_layer = {"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0}}}
    composite = {"text_config": {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}}}
    for fields in (legacy, per_layer, composite):
        with pytest.raises(ValueError, match="dynamic-NTK RoPE"):
            hf_engine_spec(Model(fields), domain, weights_revision="r")
    plain = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    assert hf_engine_spec(Model(plain), domain, weights_revision="r").model.weights_revision == "r"
