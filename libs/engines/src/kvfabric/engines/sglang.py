"""`KvfabricStorage`: kvfabric as SGLang's HiCache L3 tier (a `HiCacheStorage` subclass; tested
on SGLang 0.5.23's own classes).

Load it into an unmodified SGLang by module path (SGLang's `StorageBackendFactory`, backend
"dynamic"):

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvfabric",
        "module_path": "kvfabric.engines.sglang", "class_name": "KvfabricStorage",
        "interface_v1": 1, "hicache_storage_pass_prefix_keys": true,
        "nats_url": "nats://127.0.0.1:4222", "tenant_id": "...", "domain_salt_hex": "..."}'

Extra config keys: `nats_url` (or env KVF_CLIENT_NATS_URL), `tenant_id`, `domain_salt_hex`,
`weights_revision` (default: a digest of the weight files when the model name is a local
directory; else required), `model_path`, `model_id`, `attn_config_digest`, `tensor_layout`
(default: SGLang's version and the host pool's page format), `exists_hold_ms` (10,000),
`held_hits_max` (8,192), and any `ClientSettings` field (timeouts, limits); every client setting
can also come from `KVF_CLIENT_*`. SGLang's own keys (`backend_name`, `module_path`,
`class_name`, `interface_v1`) are read by SGLang.

## How it maps (the functional core is `kvfabric.engines.sglang_keys`)
- One kvfabric chunk = one SGLang page; one object = that page's bytes in the host pool's
  `get_page_buffer_meta` order (page_first: K then V of every layer; layer_first: K, V per
  layer; MLA: the latent page). Loads write straight into the host pool pages (a scatter list
  of views of the pool's own tensors: no staging copy); a save reads a one-region page in
  place and gathers a multi-region page into one buffer (the client takes one buffer per
  object), and waits for the save, so SGLang may reuse the page once `batch_set_v1` returns.
- Keys: the share domain, model fingerprint and page format are in every key; the chain runs
  over SGLang's page hashes (`sglang_keys`: chained with `hicache_storage_pass_prefix_keys`,
  else one chain per page).
- `batch_exists` looks the pages up and keeps the read-leased hit until `batch_get_v1` loads
  from it (`HeldHits`): what exists reported cannot be evicted before the get (while held: up
  to `exists_hold_ms`, `held_hits_max` hits). A request's later batches replace its earlier
  hits on the chain (one hit a request, not one a batch: review, stop 71), and a get gives back
  only what its own answer held. A get with no held hit (its hold expired, another instance
  checked) looks up again. Every page a get cannot fill (gone, corrupt: the client verifies
  every checksum, timed out, a dead segment) is False, and so is every page after it: SGLang
  counts the leading True pages and recomputes the rest. Nothing a get reports True holds
  unverified bytes.
- Any failure is a miss: `batch_exists` 0, `batch_get_v1` / `batch_set_v1` False, never an
  exception into SGLang's threads (logged at most once per `_LOG_EVERY_S` per kind).
- A cache that cannot start (settings, NATS down or refusing) never stops SGLang: the client
  starts in the background and misses until it has; settings it cannot read leave it
  disabled (`config_error`), one line logged, and so do random weights (`--load-format dummy`)
  and a `--quantization-param-path` it cannot read (review, stop 71).
- Weights changed after start (SGLang's `update_weights_from_*` with a `weight_version`): every
  call reads the served version (`get_serving().weight_version`, SGLang's runtime context in
  the scheduler process the backend runs in); once it differs from the one the keys were made
  for, a new client keys every page with `+version:<version>` in the weights revision
  (`sglang_keys.versioned_spec`), the held hits are given back and the old client is closed in a
  thread of its own (the call returns at once: SGLang's flush right after fails the update if a
  storage thread is still busy 10 s later; `close()` waits for it; the new client serves the old
  one's metrics, again once that close ends if the old one's start served them after the swap,
  `_serve_metrics_for_newest`): pages of the old weights are
  no longer found, those of the new are (and shared by every worker at that version). A re-key
  that fails leaves the client disabled, saying why. An update that names no version changes
  nothing here: not seen (docs/sglang.md).
- `clear()` gives back this backend's leases; it deletes nothing (the store is shared by every
  engine of the tenant; the directory's eviction frees space). `get_stats()` returns SGLang's
  `StorageMetrics` (pages and GB/s per prefetch and backup batch since the last call).
- v2 calls (SGLang's hybrid models: Mamba/SWA/DSA side pools) store only the KV pool: pools
  other than KV are reported missing and not written, so SGLang recomputes such models' L3
  hits (correct, no gain). Legacy calls (`get`, `batch_get`, `set`, `batch_set`, `exists`)
  miss: the constructor sets `interface_v1` when the extra config lacks it, so SGLang's
  controller picks the zero-copy v1 path.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

import msgspec
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvfabric.client import ClientSettings, EngineSpec, Hit, KvClient, SaveResult, settings_from_env
from kvfabric.engines.sglang_keys import (
    HELD_HITS_MAX_DEFAULT,
    HOLD_MS_DEFAULT,
    HeldHits,
    PoolGeometry,
    StorageIdentity,
    chain_words,
    chained_pages_stored,
    engine_spec,
    new_pages,
    versioned_spec,
)
from kvfabric.format.clock import monotonic_ms
from kvfabric.format.errors import KvfError
from kvfabric.format.key import KVLayout, ModelFingerprint, ShareDomain, chain_hashes
from kvfabric.proto.directory import LOOKUP_BATCH_GROUPS_MAX

if TYPE_CHECKING:
    from sglang.srt.mem_cache.pool_host import HostKVCache

__all__ = ["KvfabricStorage", "pool_geometry"]

log = logging.getLogger("kvfabric.engines.sglang")

_CLIENT_FIELDS: Final = frozenset(f.name for f in msgspec.structs.fields(ClientSettings))
CAUSE_CONFIG_ERROR: Final = "config_error"
# Clients a re-key replaced still closing at once; past it, calls miss until one has closed
REPLACED_CLOSING_MAX: Final = 2
CAUSE_CLIENT_ERROR: Final = "client_error"  # what no one expected (logged with its traceback)
_LOG_EVERY_S: Final = 30.0  # one line per kind of failure at most this often
# Host pool tensors a page region may lie in (zero-copy views are cut from these only).
_POOL_TENSORS: Final = ("kv_buffer", "k_buffer", "v_buffer", "index_k_buffer", "index_k_scale_buffer")


def _sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:
        return "unknown"


def pool_geometry(pool: HostKVCache) -> PoolGeometry:
    """The page format of SGLang's host pool (one page's regions from `get_page_buffer_meta`)."""
    page_size = int(pool.page_size)
    first_page = torch.arange(page_size, dtype=torch.int64)
    _, sizes = pool.get_page_buffer_meta(first_page)
    return PoolGeometry(
        pool_kind=type(pool).__name__,
        layout=str(pool.layout),
        page_size=page_size,
        layer_num=int(getattr(pool, "layer_num", 0)),
        head_num=int(getattr(pool, "head_num", 0)),
        head_dim=int(getattr(pool, "head_dim", getattr(pool, "kv_lora_rank", 0))),
        dtype=str(pool.dtype).removeprefix("torch."),
        region_bytes=tuple(int(s) for s in sizes),
        sglang_version=_sglang_version(),
        start_layer=int(getattr(getattr(pool, "device_pool", pool), "start_layer", 0) or 0),
    )


def served_weight_version() -> str | None:
    """The weight version SGLang serves (`--weight-version`, then what `update_weights_from_*` or
    `update_weight_version` named: `Scheduler.record_weight_version_change` sets it in the
    scheduler process's runtime context, where the backend runs); None where SGLang cannot say
    (another version, not published yet). Read on every batch call: a dict lookup or two."""
    runtime = _runtime_context()
    try:
        return None if runtime is None else str(runtime.get_serving().weight_version)
    except Exception:  # not published (yet), no such field
        return None


@functools.cache
def _runtime_context() -> Any:
    """SGLang's `runtime_context` module; None in a version without it (imported once: a failed
    import is not cached by Python, and every batch call would search for it again)."""
    try:
        from sglang.srt import runtime_context

        return runtime_context
    except Exception:
        return None


def _server_args_keyed() -> dict[str, str]:
    """The server args that change the KV without changing the host pool's format
    (`StorageIdentity`): empty where SGLang cannot say (another version, no server args yet)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
    except Exception:  # any failure: what the extra config says, else refused
        return {}
    overrides = getattr(args, "json_model_override_args", "") or ""
    load_format = getattr(args, "load_format", "") or ""
    return {
        "kv_cache_dtype": str(getattr(args, "kv_cache_dtype", "") or ""),
        "model_dtype": str(getattr(args, "dtype", "") or ""),
        "quantization": str(getattr(args, "quantization", "") or ""),
        "model_overrides": overrides if isinstance(overrides, str) else json.dumps(overrides, sort_keys=True),
        # an enum's value, not its name ("dummy", never "LoadFormat.DUMMY": refused by value)
        "load_format": str(getattr(load_format, "value", load_format)),
        "kv_scales_path": str(getattr(args, "quantization_param_path", "") or ""),
        # torchao quantization at load (SGLang versions that have `--torchao-config`, applied by
        # the default loader after loading or by the layered one per layer): other weights
        "torchao_config": str(getattr(args, "torchao_config", "") or ""),
    }


class _PageViews:
    """Zero-copy byte views of host pool pages: each region `get_page_buffer_meta` names is cut
    from the pool tensor that holds it (checked: a region outside every pool tensor is an error,
    never a raw pointer dereference)."""

    def __init__(self, pool: HostKVCache) -> None:
        self.pool = pool
        self._spans: list[tuple[int, int, memoryview]] = []  # (start address, end, bytes view)
        for name in _POOL_TENSORS:
            tensor = getattr(pool, name, None)
            if isinstance(tensor, torch.Tensor) and tensor.numel() and tensor.device.type == "cpu":
                if not tensor.is_contiguous():
                    continue
                flat = tensor.reshape(-1).view(torch.uint8).numpy()
                start = tensor.data_ptr()
                self._spans.append((start, start + flat.nbytes, flat.data))

    def pages(self, host_indices: torch.Tensor, pages: int) -> list[list[memoryview]]:
        """One list of region views per page (`pages` pages from `host_indices`)."""
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        if pages == 0 or len(ptrs) % pages:
            raise ValueError(f"{len(ptrs)} buffer regions for {pages} pages")
        per = len(ptrs) // pages
        out: list[list[memoryview]] = []
        for i in range(pages):
            regions = []
            for ptr, size in zip(ptrs[i * per : (i + 1) * per], sizes[i * per : (i + 1) * per], strict=True):
                regions.append(self._view(int(ptr), int(size)))
            out.append(regions)
        return out

    def _view(self, ptr: int, size: int) -> memoryview:
        for start, end, view in self._spans:
            if start <= ptr and ptr + size <= end:
                return view[ptr - start : ptr - start + size]
        raise ValueError(f"page region {ptr:#x}+{size} lies outside the host pool's tensors")


def _unconfigured_spec() -> EngineSpec:
    """A key space for a client that never starts."""
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
            tokens_per_chunk=8,
            tensor_layout="unconfigured",
        ),
    )


class KvfabricStorage(HiCacheStorage):
    """SGLang HiCache L3 storage over the kvfabric client (module docstring). Thread-safe:
    SGLang calls it from its prefetch, prefetch-IO and backup threads at once."""

    def __init__(
        self,
        storage_config: HiCacheStorageConfig,
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        """SGLang's factory calls `cls(storage_config, kwargs)`; the client is made later, in
        `register_mem_pool_host`, once the page format is known."""
        self.storage_config = storage_config
        extra = storage_config.extra_config
        if extra is not None and not extra.get("interface_v1"):
            # SGLang reads this after building the backend: its zero-copy page path calls
            # batch_get_v1 / batch_set_v1 (the legacy calls miss here).
            extra["interface_v1"] = 1
            log.info("kvfabric: interface_v1 set: SGLang calls batch_get_v1 / batch_set_v1")
        self.extra: dict[str, Any] = dict(extra or {})
        self.client: KvClient | None = None  # made when SGLang registers its host pool
        self.spec: EngineSpec | None = None  # the key space `client` saves and loads under
        self._settings: ClientSettings | None = None
        self._start_spec: EngineSpec | None = None  # the key space of the weights at start
        # The served weight version the keys are for (`served_weight_version`; None: unknown,
        # the first one read is taken as the start's). Once it changes, `_rekey` makes a client
        # for the new version's keys, under `_rekey_lock` (one thread; the others miss meanwhile).
        self.weight_version: str | None = None
        self.rekeys = 0  # times the keys followed a new weight version
        # Alone guards `_closed` and every swap of `client` after set-up: held by a re-key, by
        # `_run_close`'s serve for the newest client and by `close`; never by the batch calls
        # (`_lock` is theirs: nothing slow is done under it).
        self._rekey_lock = threading.Lock()
        self._closed = False
        self._replaced: set[KvClient] = set()  # clients a re-key replaced, still closing (`_lock`)
        self.geometry: PoolGeometry | None = None
        self._views: _PageViews | None = None
        self._lock = threading.Lock()
        try:
            hold_ms = int(self.extra.get("exists_hold_ms", HOLD_MS_DEFAULT))
            held_max = int(self.extra.get("held_hits_max", HELD_HITS_MAX_DEFAULT))
            self._held = HeldHits(hold_ms, held_max)
        except (TypeError, ValueError) as exc:
            log.error("kvfabric: exists_hold_ms / held_hits_max: %s: using the defaults", exc)
            self._held = HeldHits()
        self._logged: dict[str, float] = {}
        # Chained keys (`prefix_keys` passed): True once any call carried them (or configured:
        # `chained_keys`; SGLang keeps `hicache_storage_pass_prefix_keys` to itself). Then a call
        # without them is one at the sequence's start: SGLang 0.5.23's hybrid controller sends
        # `None` for an empty prefix on its exists queries while its gets and backups send `[]`,
        # and per-page keys there found at most the first page (review, 2026-12-05).
        self._chained = bool(self.extra.get("chained_keys", False))
        # SGLang's StorageMetrics lists, since the last get_stats()
        self._prefetch_pages: list[int] = []
        self._backup_pages: list[int] = []
        self._prefetch_gbps: list[float] = []
        self._backup_gbps: list[float] = []
        self.enable_storage_metrics = bool(getattr(storage_config, "enable_storage_metrics", False))

    # ---- set-up ------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: HostKVCache) -> None:
        """SGLang hands over its host pool: the page format is known now, so the key space and
        the client are made here (the client starts in the background)."""
        super().register_mem_pool_host(mem_pool_host)
        if self.client is not None:
            return
        self.weight_version = served_weight_version()
        overrides = {k: v for k, v in self.extra.items() if k in _CLIENT_FIELDS}
        cfg = self.storage_config
        try:
            self.geometry = pool_geometry(mem_pool_host)
            self._views = _PageViews(mem_pool_host)
            settings = settings_from_env(**overrides)
            who = StorageIdentity(
                tp_rank=cfg.tp_rank,
                tp_size=cfg.tp_size,
                pp_rank=cfg.pp_rank,
                pp_size=cfg.pp_size,
                is_mla_model=cfg.is_mla_model,
                model_name=cfg.model_name or "",
                attn_cp_size=getattr(cfg, "attn_cp_size", 1) or 1,
                dcp_size=getattr(cfg, "dcp_size", 1) or 1,
                should_split_heads=bool(getattr(cfg, "should_split_heads", False)),
                **_server_args_keyed(),
            )
            self.spec = engine_spec(who, self.geometry, self.extra, settings)
        except Exception as exc:  # a pool or setting it cannot use: SGLang still starts, uncached
            detail = exc.message if isinstance(exc, KvfError) else f"{type(exc).__name__}: {exc}"
            self.client = KvClient.disabled(
                _unconfigured_spec(),
                CAUSE_CONFIG_ERROR,
                f"hicache storage extra config / KVF_CLIENT_*: {detail}",
            )
            return
        self._settings, self._start_spec = settings, self.spec
        self.client = KvClient(settings, self.spec, background_start=True)

    # ---- helpers -----------------------------------------------------------------------------

    def _warn(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._logged.get(kind, -_LOG_EVERY_S) >= _LOG_EVERY_S:
            self._logged[kind] = now
            log.warning("kvfabric: " + message, *args)

    @staticmethod
    def _release(client: KvClient | None, hits: Sequence[Hit]) -> None:
        """Give `hits` back through `client`, the one that leased them (a re-key replaces
        `self.client`: a hit goes back through its own client, never the new one)."""
        if client is not None:
            for hit in hits:
                client.release(hit)

    def _expire_held(self) -> None:
        with self._lock:  # every held hit but a drained one in use is `self.client`'s
            old = self._held.expired(monotonic_ms())
            client = self.client
        self._release(client, old)

    def _prefix(self, extra_info: HiCacheStorageExtraInfo | None) -> list[str] | None:
        """The call's prefix keys; None: per-page keys (never with chained keys in use)."""
        prefix = None if extra_info is None else extra_info.prefix_keys
        if prefix is not None:
            self._chained = True
            return list(prefix)
        return [] if self._chained else None

    def _serving(self) -> KvClient | None:
        """The client to use for this call: None (a miss) while off, or while another thread
        re-keys for a new weight version."""
        version = served_weight_version()
        if version is not None and version != self.weight_version and not self._rekey(version):
            return None
        client = self.client
        return client if client is not None and client.enabled else None

    def _rekey(self, version: str) -> bool:
        """SGLang serves weight version `version`, not the one the keys were made for: swap in a
        client for the new version's keys (`versioned_spec`; it misses until started, as at
        start), give back what is held under the old keys and close the old client in a thread
        of its own (`_close_replaced`: its running calls end as misses, the directory gets every
        lease it held back). Returns promptly: SGLang records the version and then flushes its
        cache, which joins this (storage) thread for 10 s and fails the weight update if it is
        still alive, and a close may take its saves' deadlines and more (~172 s by default;
        review, 2026-12-07: it was closed here). False: another thread is at it (this call
        misses). A version that cannot be keyed, or a client that cannot be made, leaves the
        cache off (a disabled client saying why), never on the old keys and never without a
        client (review, 2026-12-07: an exception left `client` None, and the next call took that
        for nothing keyed: the cache off for good, unlogged, the old client never closed)."""
        if not self._rekey_lock.acquire(blocking=False):
            return False
        try:
            start, settings = self._start_spec, self._settings
            if version == self.weight_version or self._closed:
                return True
            if self.weight_version is None or start is None or settings is None:
                # the first version SGLang reports (the start's), or nothing keyed: no re-key
                self.weight_version = version
                return True
            with self._lock:
                closing = len(self._replaced)
            if closing >= REPLACED_CLOSING_MAX:
                # Each replaced client lives (loop thread, executors, NATS connection) until its
                # close ends, up to ~172 s: updates every few seconds kept dozens (review of the
                # change). This call misses; a later one re-keys once a close has ended.
                return False
            with self._lock:  # from here no call takes the old client, no hit joins the table
                old, self.client, self.spec = self.client, None, None
                held = self._held.drain()  # those gets load under come back at their `finished`
            client: KvClient | None = None
            spec: EngineSpec | None = None
            try:
                self._release(old, held)  # queued on its loop, never waited for (`KvClient.release`)
                spec = versioned_spec(start, version)
                # the old client's metrics go on (counters, and a fixed `metrics_port`: the
                # server stays up, the new client serves it and stops it when it closes)
                metrics = None if old is None else old.metrics
                client = KvClient(settings, spec, metrics=metrics, background_start=True)
            except Exception as exc:  # the cache stays off, never the old keys
                spec = None
                if isinstance(exc, ValueError):  # a version the key cannot carry (not UTF-8)
                    cause, detail = CAUSE_CONFIG_ERROR, f"weight version {version!r}: {exc}"
                else:  # nothing expected: logged with its traceback
                    log.error("kvfabric: re-key for weight version %r failed", version, exc_info=exc)
                    cause = CAUSE_CLIENT_ERROR
                    detail = f"re-key for weight version {version!r}: {type(exc).__name__}: {exc}"
                client = KvClient.disabled(_unconfigured_spec(), cause, detail)
            finally:
                # (`client` None here only if even the disabled one could not be made: the next
                # call re-keys again, `weight_version` unchanged)
                if old is not None:
                    self._close_replaced(
                        old, hand_metrics=client is not None and client.metrics is old.metrics
                    )
            with self._lock:
                self.spec, self.client = spec, client
            previous, self.weight_version = self.weight_version, version
            if spec is not None:
                self.rekeys += 1
                log.info(
                    "kvfabric: weight version %r -> %r: pages keyed as weights %r from now on",
                    previous,
                    version,
                    spec.model.weights_revision,
                )
            return True
        finally:
            self._rekey_lock.release()

    def _close_replaced(self, old: KvClient, *, hand_metrics: bool) -> None:
        """Close `old`, replaced by a re-key, in a daemon thread of its own (its close gives
        back its leases and waits, bounded, for its saves in flight); `close` waits for those
        still closing. `hand_metrics`: the new client serves `old`'s metrics now, so `old`'s close
        leaves the server up (it would stop the server the new client took over). A start of
        `old`'s that reaches `metrics.serve` after this takes the server back, and its close
        stops it: once that close has ended the newest client serves them again
        (`_serve_metrics_for_newest`; the server was left stopped, the newest client's with it)."""
        if hand_metrics:
            old.aio.serves_metrics = False
        with self._lock:
            self._replaced.add(old)
        closer = threading.Thread(
            target=functools.partial(self._run_close, old, hand_metrics=hand_metrics),
            name="kvf-sglang-rekey-close",
            daemon=True,
        )
        try:
            closer.start()
        except RuntimeError as exc:  # no thread to be had: `close` closes it
            log.error("kvfabric: the replaced client is closed at shutdown (%s)", exc)

    def _run_close(self, old: KvClient, *, hand_metrics: bool) -> None:
        try:
            old.close()  # bounded, never raises
        finally:
            with self._lock:
                self._replaced.discard(old)
            if hand_metrics and old.aio.serves_metrics:
                # Its background start had not reached `metrics.serve` at the hand-over, and
                # did afterwards (or, failing, served them in `_disable`): it took the server
                # back and its close has just stopped it, the newest client's with it. Served
                # again for the newest, now that `old` can touch it no more (its loop stopped).
                # Under `_rekey_lock`, so `client` is never a re-key's passing None here. Not
                # `_lock`: the batch calls, `clear` and `get_stats` wait on it, and serving binds
                # a socket and starts a thread.
                with self._rekey_lock:
                    self._serve_metrics_for_newest(old)

    def _serve_metrics_for_newest(self, old: KvClient) -> None:
        """(Under `_rekey_lock`, which alone guards `_closed` and every swap of `client`.) Serve
        `old`'s metrics for the newest client, if it shares them and the backend is not closed
        (its close stops them), and make it the one whose close stops them. Never for a
        superseded client: a re-key since `old` made a newer one `self.client`, and its
        replaced clients' ends serve for that one."""
        client, settings = self.client, self._settings
        if self._closed or client is None or client.metrics is not old.metrics or settings is None:
            return
        if settings.metrics_port < 0:
            return
        try:
            client.metrics.serve(settings.metrics_port, settings.metrics_host)
        except OSError as exc:
            log.error("kvfabric: metrics no longer served: port %d: %s", settings.metrics_port, exc)
            return
        client.aio.serves_metrics = True  # stopped by its close

    # ---- exists ------------------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of `keys`, from the first, are stored; those stay read-leased until their
        get (or `exists_hold_ms`)."""
        if not keys:
            return 0
        try:
            self._expire_held()
            client = self._serving()
            if client is None:
                return 0
            prefix = self._prefix(extra_info)
            if prefix is not None:
                return self._exists_chain(client, prefix, keys)
            found = 0
            for key in keys:  # per page: one chain each, stop at the first miss
                if self._exists_chain(client, [], [key]) == 0:
                    break
                found += 1
            return found
        except Exception as exc:  # failure = miss, never an error in SGLang's thread
            self._warn("exists", "batch_exists failed (%s: %s): reported as a miss", type(exc).__name__, exc)
            return 0

    def _exists_chain(self, client: KvClient, prefix: list[str], keys: list[str]) -> int:
        hit = client.lookup(chain_words(prefix, keys))
        found = new_pages(hit.chunks, len(prefix), len(keys))
        if found == 0:
            self._release(client, [hit])
            return 0
        with self._lock:
            if client is self.client:
                dropped = self._held.hold(hit, monotonic_ms())
            else:  # re-keyed meanwhile: not held (its lease goes back; its get looks up again)
                dropped, found = [hit], 0
        self._release(client, dropped)
        return found

    # ---- get ---------------------------------------------------------------------------------

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Load `keys` straight into the host pool pages at `host_indices`; True for each page
        from the first that was loaded and verified, False from the first that was not."""
        if not keys:
            return []
        started = time.perf_counter()
        try:
            self._expire_held()
            client = self._serving()
            if client is None or self._views is None:
                return [False] * len(keys)
            pages = self._views.pages(host_indices, len(keys))
            prefix = self._prefix(extra_info)
            if prefix is not None:
                loaded = self._get_chain(client, prefix, keys, pages)
            else:
                loaded = 0
                for key, page in zip(keys, pages, strict=True):
                    if self._get_chain(client, [], [key], [page]) == 0:
                        break
                    loaded += 1
        except Exception as exc:
            self._warn("get", "batch_get_v1 failed (%s: %s): reported as a miss", type(exc).__name__, exc)
            return [False] * len(keys)
        self._record(self._prefetch_pages, self._prefetch_gbps, loaded, started)
        return [i < loaded for i in range(len(keys))]

    def _get_chain(
        self, client: KvClient, prefix: list[str], keys: list[str], pages: list[list[memoryview]]
    ) -> int:
        """Pages of `keys` loaded and verified, from the first."""
        words = chain_words(prefix, keys)
        spec = client.aio.spec
        chain = [bytes(h) for h in chain_hashes(spec.domain, spec.model, spec.layout, words)]
        end = len(chain)
        with self._lock:
            if client is not self.client:  # re-keyed meanwhile: nothing loads under the old keys
                return 0
            hit = self._held.covering(chain, end)  # a held hit is the current client's
        fresh = hit is None
        if hit is None:  # nothing held for these pages: look them up now (and give back after)
            hit = client.lookup(words)
        try:
            first = len(prefix)
            wanted = new_pages(hit.chunks, first, len(keys))
            if wanted == 0:
                return 0
            result = client.load(hit, [[page] for page in pages[:wanted]], first_chunk=first)
            return new_pages(result.tokens // hit.tokens_per_chunk, first, wanted)
        finally:
            if fresh:
                self._release(client, [hit])
            else:  # its claim used up: the hit comes back with its last (another request's stays)
                with self._lock:
                    done = self._held.finished(hit, end)
                self._release(client, done)

    # ---- set ---------------------------------------------------------------------------------

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Save the host pool pages of `keys`; returns once the client no longer reads them.
        True for a page stored (now or before); a chained batch is all True or all False (the
        client reports counts, not which chunk failed), but for the engine's save rate, which
        skips a batch's tail: its leading pages are True."""
        if not keys:
            return []
        started = time.perf_counter()
        try:
            self._expire_held()
            client = self._serving()
            if client is None or self._views is None:
                return [False] * len(keys)
            pages = self._views.pages(host_indices, len(keys))
            prefix = self._prefix(extra_info)
            if prefix is not None:
                ok = self._set_chained(client, prefix, keys, pages)
            else:
                ok = self._set_pages(client, keys, [[_one_buffer(regions)] for regions in pages])
        except Exception as exc:
            self._warn("set", "batch_set_v1 failed (%s: %s): pages not stored", type(exc).__name__, exc)
            return [False] * len(keys)
        if not all(ok):
            self._warn("set_failed", "%d of %d pages not stored", ok.count(False), len(ok))
        self._record(self._backup_pages, self._backup_gbps, ok.count(True), started)
        return ok

    def _set_chained(
        self, client: KvClient, prefix: list[str], keys: list[str], pages: list[list[memoryview]]
    ) -> list[bool]:
        """A chained batch as saves of at most half the client's `save_inflight_bytes_max` each,
        one after another, each extending the chain the one before stored (the client admits a
        save whole: one past its bound was dropped, so every batch of pages over 4 MiB, say 128
        of 8 MiB, was never stored; review, stop 68), gathered one save at a time. A page at
        chain position `LOOKUP_BATCH_GROUPS_MAX` or past is not stored: no lookup reaches it."""
        ok = [False] * len(keys)
        stored = max(0, min(len(keys), LOOKUP_BATCH_GROUPS_MAX - len(prefix)))
        budget = max(1, client.settings.save_inflight_bytes_max // 2)
        sizes = [_page_bytes(regions) for regions in pages[:stored]]
        start = 0
        while start < stored:
            end, nbytes = start, 0
            while end < stored and (end == start or nbytes + sizes[end] <= budget):
                nbytes += sizes[end]
                end += 1
            objects = [[_one_buffer(regions)] for regions in pages[start:end]]
            saving = client.save_async(
                chain_words(prefix + keys[:start], keys[start:end]), objects, first_chunk=len(prefix) + start
            )
            result = self._saved(client, saving)
            part = [False] * (end - start) if result is None else chained_pages_stored(end - start, result)
            ok[start:end] = part
            if not all(part):
                break  # a page after a missing one is behind a gap: not stored
            start = end
        return ok

    def _set_pages(self, client: KvClient, keys: list[str], objects: list[list[Any]]) -> list[bool]:
        """Per-page chains: at most half the client's `saves_queued_max` saves in flight at once
        (it drops a save past that: all 128 pages at once failed from the 65th; review, stop 68)."""
        window = max(1, client.settings.saves_queued_max // 2)
        ok = [False] * len(keys)
        for start in range(0, len(keys), window):
            futures: list[concurrent.futures.Future[SaveResult] | None] = [
                client.save_async(chain_words([], [key]), [row])
                for key, row in zip(
                    keys[start : start + window], objects[start : start + window], strict=True
                )
            ]
            results = self._saved_all(client, futures)
            part = [r is not None and r.chunks_failed == 0 for r in results]
            ok[start : start + len(part)] = part
            if not all(part):
                break  # SGLang stops the node's backup at a batch not all True: one wait at most
        return ok

    def _saved_all(
        self, client: KvClient, futures: list[concurrent.futures.Future[SaveResult] | None]
    ) -> list[SaveResult | None]:
        """`_saved` for a batch of saves under one deadline: waited for one after another,
        each had its own, and a wedged client held SGLang's backup thread for hours."""
        timeout_s = client.settings.save_timeout_ms / 1000 * 3
        running = [f for f in futures if f is not None]
        _, left = concurrent.futures.wait(running, timeout_s)
        if left:
            _, left = concurrent.futures.wait(left, timeout_s + _SAVE_END_GRACE_S)
        if left:
            log.error(
                "kvfabric: %d saves still run past their deadlines: their pages may be read after reuse",
                len(left),
            )
        return [None if f is None or f in left else _result_or_none(f) for f in futures]

    def _saved(
        self, client: KvClient, future: concurrent.futures.Future[SaveResult] | None
    ) -> SaveResult | None:
        """The save's result, once it no longer reads its pages (a one-region page is read in
        place: SGLang reuses it once `batch_set_v1` returns). Past its deadlines (3 x
        save_timeout_ms) a save still running is waited for up to as long again: returning at
        the first timeout let its writes read a page SGLang had reused (review, stop 66). None:
        not stored (failed, or still running then: logged, the client is wedged)."""
        if future is None:
            return None
        timeout_s = client.settings.save_timeout_ms / 1000 * 3
        for wait_s in (timeout_s, timeout_s + _SAVE_END_GRACE_S):
            try:
                return future.result(wait_s)
            except concurrent.futures.TimeoutError:
                continue
            except Exception:
                return None
        log.error(
            "kvfabric: a save still runs %.0f s after its deadlines: its pages may be read after reuse",
            wait_s,
        )
        return None

    # ---- v2 (hybrid models) ------------------------------------------------------------------

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """KV pages as `batch_exists`; side pools are not stored, so a request that needs one
        gets no hit (SGLang recomputes)."""
        if pool_transfers:
            return PoolTransferResult(0, {}, [])
        pages = self.batch_exists(keys, extra_info)
        return PoolTransferResult(pages, {PoolName.KV: pages} if pages else {}, list(range(1, pages + 1)))

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._v2(transfers, extra_info, self.batch_get_v1)

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._v2(transfers, extra_info, self.batch_set_v1)

    @staticmethod
    def _v2(
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None,
        v1: Callable[[list[str], torch.Tensor, HiCacheStorageExtraInfo | None], list[bool]],
    ) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            if transfer.name == PoolName.KV and transfer.host_indices is not None:
                out[str(transfer.name)] = v1(keys, transfer.host_indices, extra_info)
            else:
                out[str(transfer.name)] = [False] * len(keys)
        return out

    # ---- legacy calls (SGLang's generic page path): the zero-copy v1 path is used instead ------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return None

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        return [None] * len(keys)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return False

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        return False

    def exists(self, key: str) -> bool:
        return False

    # ---- housekeeping ------------------------------------------------------------------------

    def _record(self, pages_list: list[int], gbps_list: list[float], pages: int, started: float) -> None:
        if not self.enable_storage_metrics or not pages or self.geometry is None:
            return
        seconds = max(time.perf_counter() - started, 1e-9)
        with self._lock:
            pages_list.append(pages)
            gbps_list.append(pages * self.geometry.page_bytes / seconds / 1e9)

    def get_stats(self) -> Any:
        """SGLang's `StorageMetrics` for the batches since the last call."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            stats = StorageMetrics(
                prefetch_pgs=self._prefetch_pages[:],
                backup_pgs=self._backup_pages[:],
                prefetch_bandwidth=self._prefetch_gbps[:],
                backup_bandwidth=self._backup_gbps[:],
            )
            for values in (self._prefetch_pages, self._backup_pages, self._prefetch_gbps, self._backup_gbps):
                values.clear()
        return stats

    def clear(self) -> None:
        """Give back every lease this backend holds but those a get loads under now (given back
        when it is done: `HeldHits.drain`). Stored pages stay: the store is shared by every
        engine of the tenant (the directory's eviction frees space)."""
        with self._lock:
            held = self._held.drain()
            client = self.client
        self._release(client, held)

    def close(self) -> None:
        """Give back what is held and close the client, and wait for the clients re-keys
        replaced to end their closes (each bounded: a second `KvClient.close` waits for the
        first), so none is left running past the backend."""
        # a re-key running ends first (it returns promptly); none after. And no replaced
        # client's end serves the metrics again (`_serve_metrics_for_newest`, under this lock)
        with self._rekey_lock:
            self._closed = True
        self.clear()
        if self.client is not None:
            self.client.close()
        with self._lock:
            replaced = list(self._replaced)
        for old in replaced:
            old.close()
            with self._lock:
                self._replaced.discard(old)


_SAVE_END_GRACE_S: Final = 5.0  # beyond a save's own deadlines, for its end to reach us


def _result_or_none(future: concurrent.futures.Future[SaveResult]) -> SaveResult | None:
    """An ended save's result; None when it raised (not stored)."""
    try:
        return future.result(0)
    except Exception:
        return None


def _page_bytes(regions: list[memoryview]) -> int:
    return sum(r.nbytes for r in regions)


def _one_buffer(regions: list[memoryview]) -> memoryview | bytes:
    """A page as one buffer for the client's save: in place when it is one region, else gathered
    (one copy; the client reads it until the save returns)."""
    return regions[0] if len(regions) == 1 else b"".join(regions)
