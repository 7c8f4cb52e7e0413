"""Planner inputs: model, layout, workload, cluster (msgspec Structs, so `--json` echoes them).

Units everywhere: bytes and seconds; GiB = 2**30 B, TiB = 2**40 B; NIC speeds in Gbit/s with
1 Gbit/s = 1e9 bit/s (so 400 Gbit/s = 50e9 B/s). Fractions are 0..1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

import msgspec

__all__ = [
    "DTYPE_BYTES",
    "PRESETS",
    "Cluster",
    "Layout",
    "ModelSpec",
    "Workload",
    "model_from_config",
]

DTYPE_BYTES: Final[dict[str, float]] = {
    "fp32": 4,
    "float32": 4,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
    "int4": 0.5,
}


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What shapes the KV. MLA when `kv_lora_rank > 0`: the cache holds the compressed latent plus
    the decoupled RoPE key, `kv_lora_rank + qk_rope_head_dim` elements per token per layer;
    otherwise (MHA/GQA/MQA) K and V for each KV head, `2 * kv_heads * head_dim`.
    `kv_bytes_per_token > 0` overrides the shape (then only `name` matters)."""

    name: str = "custom"
    layers: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    dtype: str = "bf16"
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    kv_bytes_per_token: float = 0.0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; known: {', '.join(DTYPE_BYTES)}")
        if self.kv_bytes_per_token < 0:
            raise ValueError("kv_bytes_per_token must be >= 0")
        if self.kv_bytes_per_token == 0:
            if self.layers < 1:
                raise ValueError("layers must be >= 1 (or give kv_bytes_per_token)")
            if self.kv_lora_rank > 0:
                if self.qk_rope_head_dim < 0:
                    raise ValueError("qk_rope_head_dim must be >= 0")
            elif self.kv_heads < 1 or self.head_dim < 1:
                raise ValueError("kv_heads and head_dim must be >= 1 (or give kv_lora_rank for MLA)")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0


class Layout(msgspec.Struct, frozen=True, kw_only=True):
    """How the KV of a chunk is cut into objects: one object per (tp_rank, pp_stage, layer_group).
    `tp_dedup`: a TP-replicated KV (MLA latent, or GQA with fewer KV heads than TP ranks) is stored
    once per distinct slice instead of once per rank."""

    tp: int = 1
    pp: int = 1
    layer_groups: int = 1
    chunk_tokens: int = 256
    tp_dedup: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "layer_groups", "chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


class Workload(msgspec.Struct, frozen=True, kw_only=True):
    """Retained prefixes and request mix. Prefix length: mean `prefix_tokens`, longest
    `prefix_tokens_max` (0 = fixed length). `remote_share`: requests that load their whole prefix
    from the store; `write_share`: requests that publish a new prefix (replicated). Skew:
    `hot_prefix_share` of the prefixes receives `hot_read_share` of the reads;
    `hotspot_factor > 0` overrides the derived per-host peak/mean factor. `ssd_read_share`: share
    of the remote loads' bytes that the SSD tier serves (None: derived from the hot set, assuming
    DRAM holds the hottest bytes; `kvfabric.plan.formulas.dram_read_share`)."""

    prefixes: int
    prefix_tokens: int
    prefix_tokens_max: int = 0
    request_rate: float
    remote_share: float = 1.0
    write_share: float = 0.0
    hot_prefix_share: float = 1.0
    hot_read_share: float = 1.0
    hotspot_factor: float = 0.0
    ssd_read_share: float | None = None

    def __post_init__(self) -> None:
        if self.ssd_read_share is not None and not 0 <= self.ssd_read_share <= 1:
            raise ValueError("ssd_read_share must be within 0..1")
        if self.prefixes < 1 or self.prefix_tokens < 1:
            raise ValueError("prefixes and prefix_tokens must be >= 1")
        if self.prefix_tokens_max and self.prefix_tokens_max < self.prefix_tokens:
            raise ValueError("prefix_tokens_max must be >= prefix_tokens (the mean)")
        if self.request_rate < 0:
            raise ValueError("request_rate must be >= 0")
        for name in ("remote_share", "write_share", "hot_read_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be within 0..1")
        if not 0 < self.hot_prefix_share <= 1:
            raise ValueError("hot_prefix_share must be within (0, 1]")
        if self.hotspot_factor and self.hotspot_factor < 1:
            raise ValueError("hotspot_factor must be >= 1 (or 0 to derive it)")

    @property
    def max_tokens(self) -> int:
        return self.prefix_tokens_max or self.prefix_tokens


class Cluster(msgspec.Struct, frozen=True, kw_only=True):
    """Storage hosts. `domains`: failure domains (racks), hosts spread evenly; each replica of an
    object goes to a different domain. `repair_share`: NIC share per host that repair and
    rebalancing may use. `expand_hosts`: hosts added in the expansion scenario.
    SSD tier (issue 23; `ssd_gib` 0 = none): `ssd_gib` of disk per host of which
    `ssd_usable_fraction` holds objects; `ssd_read_gib_s` / `ssd_write_gib_s`: what one host's
    disks sustain, GiB/s (0 = not checked); `demote_share`: share of the DRAM's victims demoted to
    the SSD (the rest are dropped)."""

    hosts: int
    dram_gib: float
    usable_fraction: float = 0.8
    nic_gbps: float = 400.0
    nic_usable_fraction: float = 0.8
    domains: int = 8
    replicas: int = 2
    repair_share: float = 0.25
    expand_hosts: int = 0
    directory_shards: int = 1
    ssd_gib: float = 0.0
    ssd_usable_fraction: float = 0.9
    ssd_read_gib_s: float = 0.0
    ssd_write_gib_s: float = 0.0
    demote_share: float = 1.0

    def __post_init__(self) -> None:
        if min(self.ssd_gib, self.ssd_read_gib_s, self.ssd_write_gib_s) < 0:
            raise ValueError("ssd_gib, ssd_read_gib_s and ssd_write_gib_s must be >= 0")
        if not 0 < self.ssd_usable_fraction <= 1 or not 0 <= self.demote_share <= 1:
            raise ValueError("ssd_usable_fraction must be within (0, 1], demote_share within 0..1")
        if self.hosts < 1 or self.domains < 1 or self.replicas < 1 or self.directory_shards < 1:
            raise ValueError("hosts, domains, replicas and directory_shards must be >= 1")
        if self.domains > self.hosts:
            raise ValueError("domains must be <= hosts")
        if self.dram_gib <= 0 or self.nic_gbps <= 0:
            raise ValueError("dram_gib and nic_gbps must be > 0")
        for name in ("usable_fraction", "nic_usable_fraction", "repair_share"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be within (0, 1]")
        if self.expand_hosts < 0:
            raise ValueError("expand_hosts must be >= 0")


PRESETS: Final[dict[str, ModelSpec]] = {
    # 32 x 2 x 8 x 128 x 2 B = 128 KiB/token: exactly 1 GiB per 8K-token prefix (the seed example).
    "llama3-8b": ModelSpec(name="llama3-8b", layers=32, kv_heads=8, head_dim=128, dtype="bf16"),
    "llama3-70b": ModelSpec(name="llama3-70b", layers=80, kv_heads=8, head_dim=128, dtype="bf16"),
    "qwen2.5-7b": ModelSpec(name="qwen2.5-7b", layers=28, kv_heads=4, head_dim=128, dtype="bf16"),
    "deepseek-v2": ModelSpec(
        name="deepseek-v2", layers=60, dtype="bf16", kv_lora_rank=512, qk_rope_head_dim=64
    ),
    "deepseek-v3": ModelSpec(
        name="deepseek-v3", layers=61, dtype="bf16", kv_lora_rank=512, qk_rope_head_dim=64
    ),
}


def _dtype_from_config(cfg: dict[str, Any]) -> str:
    raw = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return raw if raw in DTYPE_BYTES else "bf16"


def model_from_config(path: Path, *, dtype: str | None = None) -> ModelSpec:
    """A `ModelSpec` from a Hugging Face transformers `config.json` (MLA if it has
    `kv_lora_rank`). `dtype` overrides the config's `torch_dtype` (the KV cache dtype may differ)."""
    cfg: dict[str, Any] = json.loads(path.read_text())
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        cfg = {**cfg, **cfg["text_config"]}
    heads = int(cfg.get("num_attention_heads", 0))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads else 0))
    return ModelSpec(
        name=str(cfg.get("_name_or_path") or cfg.get("model_type") or path.parent.name or "config"),
        layers=int(cfg["num_hidden_layers"]),
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype or _dtype_from_config(cfg),
        kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
        qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0),
    )
