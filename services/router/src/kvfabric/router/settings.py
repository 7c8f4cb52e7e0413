"""Router settings, from `KVF_ROUTER_*` environment variables (strict: a bad value stops the
service with a `SettingsError` naming the variable).

| variable | default | meaning |
|---|---|---|
| `KVF_ROUTER_ENGINES` | (required) | JSON list of engines (below) |
| `KVF_ROUTER_KEYSPACE` | (required) | JSON: the engines' kvfabric key space (below) |
| `KVF_ROUTER_POLICY` | `cache_aware` | or `round_robin`, `least_loaded` |
| `KVF_ROUTER_COEFFICIENTS` | built-in | JSON of `Coefficients` fields (docs/router.md) |
| `KVF_ROUTER_REFIT` | `off` | `on`: refit coefficients from realised TTFTs (below); or `RefitConfig` JSON |
| `KVF_ROUTER_HTTP_HOST` / `_PORT` | 127.0.0.1 / 8080 | the OpenAI-compatible front (0: a free port) |
| `KVF_ROUTER_ADMITTED_MAX` | 64 | requests in flight through the router; more get 429 |
| `KVF_ROUTER_TENANT_INFLIGHT_MAX` | 32 | in flight per tenant; more get 429 |
| `KVF_ROUTER_API_KEYS` | (unset) | tenant -> its keys' SHA-256 digests (`kvfabric.router.tenants`) |
| `KVF_ROUTER_ENGINE_API_KEY` | (unset) | sent to the engines as a bearer key (vLLM's `--api-key`) |
| `KVF_ROUTER_HEALTH_INTERVAL_MS` | 500 | `GET /health` of every engine |
| `KVF_ROUTER_HEALTH_STALE_MS` | 3000 | an engine without a good health answer for this long is not chosen |
| `KVF_ROUTER_INDEX_STALE_MS` | 5000 | no word from the event stream for this long: kvfabric tokens count 0 |
| `KVF_ROUTER_CONNECT_TIMEOUT_MS` | 2000 | connecting to an engine |
| `KVF_ROUTER_FIRST_BYTE_TIMEOUT_MS` | 120000 | streamed: the first byte; past it the request fails over |
| `KVF_ROUTER_RESPONSE_TIMEOUT_MS` | 600000 | not streamed: the whole answer; past it 504, no failover |
| `KVF_ROUTER_FAILOVER_ATTEMPTS_MAX` | 3 | engines tried for one request before its first byte |
| `KVF_ROUTER_LISTING_PAGES_MAX` | 100 | pages (of 1,000 groups) per shard in a resync |

An engine: `{"id", "url", "segments": [its co-located segment ids], "cache_chunks": chunks its
prefix cache holds (0: prefix caching off), "queue_max": 16, "kv_events": its vLLM KV event
publisher, e.g. "tcp://127.0.0.1:5557" (optional: vLLM's `--kv-events-config
'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}'`; then its
own cache is what its events say, not what the router's history learned; its block size must be
the key space's `tokens_per_chunk`), "kv_events_replay": its replay socket, e.g.
"tcp://127.0.0.1:5558" (optional: `"replay_endpoint": "tcp://*:5558"` in the same config; then a
gap in the events, or a router started while the engine holds blocks, is filled from the
engine's buffer instead of leaving its map empty)}`. The key space: `tenant_id`,
`domain_salt_hex`, `model_id`, `weights_revision`, `kv_dtype`, `attn_config_digest`,
`tensor_layout`, `tokens_per_chunk`, as the engines' connector derives them
(`keyspace_for_model_dir` builds it for a local model).

The refit (`kvfabric.core.routing_refit`): the configured coefficients are its prior, used until
it holds enough observations (each request's chosen estimate inputs and realised TTFT); then
its fit over a bounded window, every coefficient within bounds around the prior.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvfabric.core.routing import POLICIES, Coefficients, InstanceSpec, RefitConfig, RoutingConfig
from kvfabric.format.invariant import InvariantViolation
from kvfabric.format.key import KVLayout, ModelFingerprint, ShareDomain
from kvfabric.router.tenants import ApiKeys, api_keys_from
from kvfabric.runtime.config import SettingsError, env_int

_ENGINE_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")

__all__ = ["Engine", "KeySpace", "RouterSettings", "keyspace_for_model_dir", "load_router_settings"]


@dataclass(frozen=True, kw_only=True)
class Engine:
    spec: InstanceSpec
    url: str
    kv_events: str = ""  # the engine's KV event publisher (ZMQ), e.g. tcp://127.0.0.1:5557
    kv_events_replay: str = ""  # its replay socket (vLLM's replay_endpoint), "" for none


@dataclass(frozen=True, kw_only=True)
class KeySpace:
    domain: ShareDomain
    model: ModelFingerprint
    layout: KVLayout


@dataclass(frozen=True, kw_only=True)
class RouterSettings:
    engines: tuple[Engine, ...]
    keyspace: KeySpace
    routing: RoutingConfig
    http_host: str
    http_port: int
    health_interval_s: float
    connect_timeout_s: float
    first_byte_timeout_s: float
    response_timeout_s: float  # a request not streamed: its whole answer (KVF_ROUTER_RESPONSE_TIMEOUT_MS)
    failover_attempts_max: int
    listing_pages_max: int
    request_timeout_s: float = 2.0
    api_keys: ApiKeys | None = None  # digest -> tenant; None: the X-Kvf-Tenant header is trusted
    engine_api_key: str = field(default="", repr=False)  # sent to the engines; "" for none


def _json(env: Mapping[str, str], name: str, default: Any = None) -> Any:
    text = env.get(name)
    if text is None:
        if default is None:
            raise SettingsError(f"{name} is required")
        return default
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise SettingsError(f"{name}: not JSON ({exc})") from None


def keyspace_from(raw: Mapping[str, Any]) -> KeySpace:
    try:
        return KeySpace(
            domain=ShareDomain(str(raw["tenant_id"]), bytes.fromhex(str(raw["domain_salt_hex"]))),
            model=ModelFingerprint(
                model_id=str(raw["model_id"]),
                weights_revision=str(raw["weights_revision"]),
                kv_dtype=str(raw["kv_dtype"]),
                attn_config_digest=str(raw["attn_config_digest"]),
            ),
            layout=KVLayout(
                tp_size=1,
                tp_rank=0,
                pp_stage=0,
                layer_group=0,
                layer_group_count=1,
                tokens_per_chunk=int(raw["tokens_per_chunk"]),
                tensor_layout=str(raw["tensor_layout"]),
            ),
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise SettingsError(f"KVF_ROUTER_KEYSPACE: {type(exc).__name__}: {exc}") from None


def keyspace_for_model_dir(
    model_dir: str,
    *,
    tenant_id: str,
    domain_salt_hex: str,
    weights_revision: str,
    tensor_layout: str,
    tokens_per_chunk: int,
    served_model_name: str | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """The key space a vLLM engine's kvfabric connector uses for a local model directory, given
    the connector's `weights_revision` and `tensor_layout` extra config (set both on the engines:
    the router cannot ask vLLM for them). Needs transformers (the engines' `[hf]` extra)."""
    import transformers

    from kvfabric.engines.identity import attn_config_digest

    hf = transformers.AutoConfig.from_pretrained(model_dir).to_dict()
    return {
        "tenant_id": tenant_id,
        "domain_salt_hex": domain_salt_hex,
        "model_id": (served_model_name or model_dir)[:200],
        "weights_revision": weights_revision,
        "kv_dtype": dtype,
        "attn_config_digest": attn_config_digest(hf),
        "tensor_layout": tensor_layout[:200],
        "tokens_per_chunk": tokens_per_chunk,
    }


def refit_from(text: str) -> RefitConfig | None:
    """`off`, `on` (the defaults) or a JSON object of `RefitConfig` fields."""
    if text == "off":
        return None
    if text == "on":
        return RefitConfig()
    try:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise TypeError("not a JSON object")
        return RefitConfig(**raw)
    except (json.JSONDecodeError, TypeError, ValueError, InvariantViolation) as exc:
        raise SettingsError(
            f"KVF_ROUTER_REFIT: off, on or a JSON object of RefitConfig fields ({exc})"
        ) from None


def load_router_settings(env: Mapping[str, str]) -> RouterSettings:
    engines_raw = _json(env, "KVF_ROUTER_ENGINES")
    if not isinstance(engines_raw, list) or not engines_raw:
        raise SettingsError("KVF_ROUTER_ENGINES: a non-empty JSON list")
    engines = []
    for raw in engines_raw:
        try:
            engines.append(
                Engine(
                    spec=InstanceSpec(
                        instance_id=str(raw["id"]),
                        colocated_segments=frozenset(str(s) for s in raw.get("segments", [])),
                        engine_cache_chunks_max=int(raw.get("cache_chunks", 0)),
                        queue_max=int(raw.get("queue_max", 16)),
                        engine_events=bool(raw.get("kv_events")),
                    ),
                    url=str(raw["url"]).rstrip("/"),
                    kv_events=str(raw.get("kv_events") or ""),
                    kv_events_replay=str(raw.get("kv_events_replay") or ""),
                )
            )
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            raise SettingsError(f"KVF_ROUTER_ENGINES: {type(exc).__name__}: {exc}") from None
    for e in engines:
        if not _ENGINE_ID.fullmatch(e.spec.instance_id):
            # (it is a response header, `x-kvf-instance`, and a metrics label: one starlette
            # could not encode failed every request routed there; review, stop 68)
            raise SettingsError(
                f"KVF_ROUTER_ENGINES: engine id {e.spec.instance_id!r}: 1-64 of A-Z a-z 0-9 . _ : -"
            )
        if e.kv_events_replay and not e.kv_events:
            raise SettingsError(
                f"KVF_ROUTER_ENGINES: {e.spec.instance_id}: kv_events_replay without kv_events"
            )
    if len({e.spec.instance_id for e in engines}) != len(engines):
        raise SettingsError("KVF_ROUTER_ENGINES: engine ids must be unique")
    keyspace = keyspace_from(_json(env, "KVF_ROUTER_KEYSPACE"))
    policy = env.get("KVF_ROUTER_POLICY", "cache_aware")
    if policy not in POLICIES:
        raise SettingsError(f"KVF_ROUTER_POLICY: one of {', '.join(POLICIES)}")
    try:
        coefficients = Coefficients(**_json(env, "KVF_ROUTER_COEFFICIENTS", {}))
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"KVF_ROUTER_COEFFICIENTS: {exc}") from None
    refit = refit_from(env.get("KVF_ROUTER_REFIT", "off"))
    admitted = env_int(env, "KVF_ROUTER_ADMITTED_MAX", 64, 1, 1_000_000)
    routing = RoutingConfig(
        tokens_per_chunk=keyspace.layout.tokens_per_chunk,
        coefficients=coefficients,
        policy=policy,  # type: ignore[arg-type]
        health_stale_ms=env_int(env, "KVF_ROUTER_HEALTH_STALE_MS", 3_000, 100, 3_600_000),
        index_stale_ms=env_int(env, "KVF_ROUTER_INDEX_STALE_MS", 5_000, 100, 3_600_000),
        admitted_max=admitted,
        tenant_inflight_max=min(admitted, env_int(env, "KVF_ROUTER_TENANT_INFLIGHT_MAX", 32, 1, 1_000_000)),
        refit=refit,
    )
    interval_ms = env_int(env, "KVF_ROUTER_HEALTH_INTERVAL_MS", 500, 10, 600_000)
    connect_ms = env_int(env, "KVF_ROUTER_CONNECT_TIMEOUT_MS", 2_000, 10, 600_000)
    if interval_ms + connect_ms >= routing.health_stale_ms:
        # a healthy engine's good answers may come this far apart: it went stale between them,
        # and every request in that gap was answered 503 (review, stop 70)
        raise SettingsError(
            f"KVF_ROUTER_HEALTH_INTERVAL_MS ({interval_ms}) + KVF_ROUTER_CONNECT_TIMEOUT_MS ({connect_ms})"
            f" must be below KVF_ROUTER_HEALTH_STALE_MS ({routing.health_stale_ms})"
        )
    return RouterSettings(
        engines=tuple(engines),
        keyspace=keyspace,
        routing=routing,
        http_host=env.get("KVF_ROUTER_HTTP_HOST", "127.0.0.1"),
        http_port=env_int(env, "KVF_ROUTER_HTTP_PORT", 8080, 0, 65535),
        health_interval_s=interval_ms / 1000,
        connect_timeout_s=connect_ms / 1000,
        first_byte_timeout_s=env_int(env, "KVF_ROUTER_FIRST_BYTE_TIMEOUT_MS", 120_000, 10, 3_600_000) / 1000,
        response_timeout_s=env_int(env, "KVF_ROUTER_RESPONSE_TIMEOUT_MS", 600_000, 10, 3_600_000) / 1000,
        failover_attempts_max=env_int(env, "KVF_ROUTER_FAILOVER_ATTEMPTS_MAX", 3, 1, 64),
        listing_pages_max=env_int(env, "KVF_ROUTER_LISTING_PAGES_MAX", 100, 1, 100_000),
        api_keys=api_keys_from(env.get("KVF_ROUTER_API_KEYS")),
        engine_api_key=_engine_api_key(env.get("KVF_ROUTER_ENGINE_API_KEY", "")),
    )


def _engine_api_key(key: str) -> str:
    if any(c.isspace() for c in key) or not key.isprintable():
        raise SettingsError("KVF_ROUTER_ENGINE_API_KEY: printable characters, no spaces")
    return key
