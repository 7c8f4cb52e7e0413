"""The SGLang HiCache backend's functional core: SGLang page keys as kvfabric chunks, and the
table of read-leased hits held from `batch_exists` until `batch_get_v1` (no SGLang, torch or
I/O here; time is passed in).

## Page keys
SGLang names an L3 page by a string (`get_hash_str`: SHA-256 over the page's tokens chained with
the previous page's hash, seeded with the request's namespace). kvfabric keys a chunk by a chain
over token words, salted with the tenant's share domain and rooted in the model fingerprint and
layout. One kvfabric chunk is one SGLang page, and its "tokens" are the page key's
`PAGE_WORDS` words: blake2b-256 of the key string as 8 little-endian u32 (`page_words`), so
`tokens_per_chunk` is `PAGE_WORDS` and the client's token counters count 8 per page.

- **Chained** (SGLang passes `prefix_keys`, the page hashes before the call's keys, when its
  extra config has `"hicache_storage_pass_prefix_keys": true`): the chain runs over
  `prefix_keys + keys` from the sequence start, so one lookup (one lease per directory shard)
  answers a whole batch, and a page is found by any later call that names the same prefix.
- **Per page** (no `prefix_keys`): a call's first page may sit anywhere in the sequence, so a
  chain over the call's keys would name a page differently in each call. Each page is then its
  own one-chunk chain. SGLang's page hash already commits to every token before it, so the
  identity is kept, at one directory round trip per page (`docs/engines.md` has the cost).

Writers and readers of one share domain must use the same mode: the two name a page differently.

## Held hits
`batch_exists` leases what it reports present (`HeldHits.hold`); `batch_get_v1` loads from the
held hit that covers its pages (`HeldHits.covering`) and then gives that hit its get
(`HeldHits.finished`). A held hit stands for the `batch_exists` answers it was held for, its
*claims* (each the chunk its answer reached): its own, and those of the shorter hits on its chain
it replaced. A hit that covers held ones on its chain replaces them at once (their leases come
back, their claims move to it): SGLang checks a request's pages batch by batch, each lookup
leasing the chain from chunk 0, and kept every batch's hit until its get, so a 4,096-page request
held ~67k group leases per rank instead of 4,096 and filled the directory's per-tenant lease
bound (review, stop 71). A get uses up one claim, the one ending soonest at or after its end
(its own answer's); the hit comes back once none is left, so one request's get no longer gives
back another's hit on a shared prefix (it gave back every hit of the chain it reached the end
of: the other's get looked up again; review, stop 71). SGLang may never ask for what it was
told (a prefetch revoked below its threshold, terminated, or cut to the minimum over TP ranks):
such hits are given back after `hold_ms` (`HeldHits.expired`, checked on every call; a claim
older than that is not moved to a newer hit), and the table holds at most `held_max` (the oldest
is given back first); the directory expires any lease the client never gives back. Invariants:
every hit that enters the table leaves it exactly once (through `finished`, `expired`, `hold`:
replaced or crowded out, or `drain`), no hit leaves while a get loads under it (a hit in use is
never replaced: `covering` .. `finished`), and the table never holds more than `held_max` hits
but those a get is loading under (kept past the bound until `finished`).

## Weight version
SGLang may change the weights after start (`update_weights_from_disk` / `_tensor` /
`_distributed` / `_ipc`) and records the version it names (`weight_version`, read from its
runtime context by the backend). The weights revision names the weights the worker started with;
once the served version differs from the one at start, the backend keys every page with
`versioned_spec` (the revision `+version:<version>`, for good: a later return to the starting
label is not the starting weights), so two workers updated to the same version share pages and
a worker still on its starting weights does not see them. An update that names no version
leaves it unchanged: not seen.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import numpy as np
import numpy.typing as npt

from kvfabric.client import ClientSettings, EngineSpec, Hit, SaveResult
from kvfabric.client.aio_saves import SAVE_RATE
from kvfabric.engines.identity import (
    LONGROPE_UNCACHEABLE,
    attn_config_digest,
    longrope_long_factors,
    weights_digest_of_dir,
)
from kvfabric.format.key import KVLayout, ModelFingerprint, ShareDomain, digest_config

__all__ = [
    "HELD_HITS_MAX_DEFAULT",
    "HOLD_MS_DEFAULT",
    "PAGE_WORDS",
    "HeldHits",
    "PoolGeometry",
    "StorageIdentity",
    "chain_words",
    "chained_pages_stored",
    "engine_spec",
    "new_pages",
    "page_words",
    "versioned_spec",
]

PAGE_WORDS: Final = 8  # u32 words per page key: blake2b-256
# How long a hit leased by `batch_exists` waits for its `batch_get_v1`: SGLang's prefetch gives up
# after prefetch_timeout_base (1 s) + 0.25 s per 1,024 tokens by default; below the client's
# lease_ttl_ms (30 s), so the backend gives the lease back before the directory would expire it.
HOLD_MS_DEFAULT: Final = 10_000
# Hits held at once: SGLang checks a request's pages in batches of 128 (`STORAGE_BATCH_SIZE`),
# every batch before any get. Chained keys hold one hit a batch, per-page keys one a page: 64
# gave the first half of one batch's leases back within its own `batch_exists` (review, stop 66),
# so a page reported present could be evicted before its get. 8,192 hold 64 batches: a per-page
# request of more hit pages gives its first leases back before their gets (misses, never wrong
# bytes). One-chunk hits are indexed by chain hash (`HeldHits`), so a per-page get costs O(1)
# whatever the table holds (it was a scan: ~2.7 ms a page at 8,192; stop 66 kept 1,024 then).
HELD_HITS_MAX_DEFAULT: Final = 8192

_P_PAGE: Final = b"kvf1/sglang-page"
_REVISION_CHARS_MAX: Final = 200  # the weights revision the key carries (longer is cut or hashed)
# SGLang load formats that read the model's checkpoint files as they are (the weights revision
# names those): any other is in the key (bitsandbytes and flash_rl quantize at load, sharded_state,
# presharded and gguf read other files, remote ones fetch the weights from elsewhere); "dummy" is
# refused. `layered` is the default loader layer by layer (`LayeredModelLoader` sets the format
# back to `auto`; quantizing at load is `+q:` already) and `mistral` the default loader on the
# checkpoint's consolidated*.safetensors (in the directory digest): they were keyed as other
# weights (review, stop 71). SGLang 0.5.23's loader.py sends every other format elsewhere or
# refuses it (jax, rdma, local_cached: `_prepare_weights` raises "Unknown load_format")
_FILE_LOAD_FORMATS: Final = frozenset(
    {"", "auto", "pt", "safetensors", "fastsafetensors", "instanttensor", "npcache", "layered", "mistral"}
)


def page_words(key: str) -> npt.NDArray[np.uint32]:
    """The `PAGE_WORDS` u32 words that stand for one SGLang page key in a kvfabric chain."""
    digest = hashlib.blake2b(key.encode(), digest_size=4 * PAGE_WORDS, person=_P_PAGE).digest()
    return np.frombuffer(digest, dtype="<u4")


def chain_words(prefix_keys: Sequence[str], keys: Sequence[str]) -> npt.NDArray[np.uint32]:
    """The "token" words of a chain over `prefix_keys + keys` (one chunk per page)."""
    pages = [*prefix_keys, *keys]
    if not pages:
        return np.zeros(0, dtype="<u4")
    return np.concatenate([page_words(k) for k in pages])


def new_pages(hit_chunks: int, prefix_pages: int, pages: int) -> int:
    """How many of a call's `pages` (after `prefix_pages`) a hit of `hit_chunks` covers."""
    return max(0, min(pages, hit_chunks - prefix_pages))


@dataclass(slots=True)
class _Held:
    hit: Hit
    held_ms: int
    seq: int  # its place in the table: older hits have smaller ones
    page: bytes | None  # a one-chunk hit's chain hash (indexed by it); None for a longer hit
    # the `batch_exists` answers it stands for, (chunk reached, held_ms), by chunk then age: its
    # own and those of the hits it replaced (`hold`); a get uses up one (`finished`)
    claims: list[tuple[int, int]]
    # gets loading under this hit's lease now (`covering` .. `finished`): its lease is not given
    # back meanwhile, whatever expires, crowds out or covers it (review, 2026-12-05: another
    # thread's `hold`, an expiry or another get's `finished` released it while a load ran under it)
    users: int = 0
    # `drain` came, or its last claim was used up, while gets loaded under it: no new get takes
    # it, and the last of those gives it back (`finished`; review, stop 69: `drain` gave the lease
    # back under a running load)
    drained: bool = False


def _on_chain(hit: Hit, chain: Sequence[bytes]) -> bool:
    """Whether `hit` lies on `chain` (chain hashes from chunk 0): its last chunk's hash, or the
    chain's last, agree (a chain hash commits to every chunk before it)."""
    at = min(hit.chunks, len(chain)) - 1
    return at >= 0 and bytes(hit.groups[at].chain_hash) == chain[at]


class HeldHits:
    """Read-leased hits from `batch_exists`, waiting for their `batch_get_v1` (module docstring).
    Not thread-safe: the backend calls it under its lock. Returns the hits whose leases the
    caller must give back.

    Per-page keys hold one one-chunk hit a page, up to `held_max` of them: those are indexed by
    their chain hash, so a per-page get finds its page's hits in O(1), whatever the table holds
    (each get scanned it: ~2.7 ms a page at 8,192 held; review, stop 66). Hits of more chunks
    (chained keys: one a request, the batches' hits replaced by the last) are few and scanned.
    `now_ms` must not go backwards between calls (the backend reads one monotonic clock under
    its lock): the table is in the order hits were held, so an expiry stops at the first hit
    still young."""

    def __init__(self, hold_ms: int = HOLD_MS_DEFAULT, held_max: int = HELD_HITS_MAX_DEFAULT) -> None:
        if hold_ms < 0 or held_max < 1:
            raise ValueError(f"hold_ms must be >= 0 and held_max >= 1, got {hold_ms}, {held_max}")
        self.hold_ms = hold_ms
        self.held_max = held_max
        self._seq = 0
        self._held: dict[int, _Held] = {}  # by seq: oldest first
        self._pages: dict[bytes, dict[int, _Held]] = {}  # one-chunk hits by chain hash, by seq
        self._longer: dict[int, _Held] = {}  # hits of two or more chunks, by seq
        self._of_hit: dict[int, dict[int, _Held]] = {}  # id(hit) -> its entries (`finished`)

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, hit: Hit, now_ms: int) -> list[Hit]:
        """Keep `hit` (it has chunks and a lease). The held hits on its chain that it covers (no
        longer than it) and no get loads under come back at once, their claims younger than
        `hold_ms` moved to it; then the oldest beyond `held_max` not in use by a get (those in
        use stay: as many as gets run at once)."""
        if hit.chunks == 0:
            return [hit] if hit.lease_id else []
        chain = [bytes(g.chain_hash) for g in hit.groups[: hit.chunks]]
        covered = sorted(
            (
                h
                for h in self._on(chain)
                if not h.users and h.hit is not hit and h.hit.chunks <= hit.chunks and _on_chain(h.hit, chain)
            ),
            key=lambda h: h.seq,
        )
        claims = [c for h in covered for c in h.claims if now_ms - c[1] < self.hold_ms]
        out = covered[:]
        self._drop(covered)
        self._seq += 1
        page = chain[0] if hit.chunks == 1 else None
        held = _Held(hit, now_ms, self._seq, page, sorted([*claims, (hit.chunks, now_ms)]))
        self._held[held.seq] = held
        if page is None:
            self._longer[held.seq] = held
        else:
            self._pages.setdefault(page, {})[held.seq] = held
        self._of_hit.setdefault(id(hit), {})[held.seq] = held
        over = len(self._held) - self.held_max
        if over > 0:
            crowded: list[_Held] = []
            for old in self._held.values():  # oldest first; past those in use (a get's at most)
                if not old.users:
                    crowded.append(old)
                    if len(crowded) == over:
                        break
            out += crowded
            self._drop(crowded)
        return [h.hit for h in out]

    def _on(self, chain: Sequence[bytes]) -> list[_Held]:
        """Every held hit that may lie on `chain`: its first page's one-chunk hits and every
        longer hit (the callers check the rest)."""
        pages = self._pages.get(chain[0], {}) if chain else {}
        return [*pages.values(), *self._longer.values()]

    def covering(self, chain: Sequence[bytes], end: int) -> Hit | None:
        """The held hit on `chain` that covers chunks `< end`, the shortest such (the oldest of
        those): it stays held, in use by the caller until its `finished`."""
        best: _Held | None = None
        for held in self._on(chain[:end]):
            hit = held.hit
            if (
                hit.chunks >= end
                and not held.drained
                and _on_chain(hit, chain[:end])
                and (best is None or (hit.chunks, held.seq) < (best.hit.chunks, best.seq))
            ):
                best = held
        if best is None:
            return None
        best.users += 1
        return best.hit

    def finished(self, hit: Hit, end: int) -> list[Hit]:
        """A get that `covering` gave `hit` is done with chunks `< end`: it uses up the hit's
        claim that ends soonest at or after `end` (its own `batch_exists` answer's, or one that
        stood for as much). The hit itself comes back once it has no claim left (or was
        drained) and no other get still loads under it; until then no new get takes a hit with
        no claim left. Another request's hit on the same chain stays for that request's get."""
        for held in self._of_hit.get(id(hit), {}).values():
            if held.users:
                held.users -= 1
                if not held.drained:
                    at = next((i for i, (reached, _) in enumerate(held.claims) if reached >= end), None)
                    if at is not None:
                        del held.claims[at]
                    held.drained = not held.claims
                return self._drop([held]) if held.drained and not held.users else []
        return []

    def expired(self, now_ms: int) -> list[Hit]:
        """Hits held longer than `hold_ms` and not in use: no get came for them."""
        old: list[_Held] = []
        for held in self._held.values():  # oldest first: the rest are younger
            if now_ms - held.held_ms < self.hold_ms:
                break
            if not held.users:
                old.append(held)
        return self._drop(old)

    def _drop(self, gone: list[_Held]) -> list[Hit]:
        for held in gone:
            del self._held[held.seq]
            if held.page is None:
                del self._longer[held.seq]
            else:
                pages = self._pages[held.page]
                del pages[held.seq]
                if not pages:
                    del self._pages[held.page]
            mine = self._of_hit[id(held.hit)]
            del mine[held.seq]
            if not mine:
                del self._of_hit[id(held.hit)]
        return [h.hit for h in gone]

    def drain(self) -> list[Hit]:
        """Every held hit no get loads under now (clear, close); those in use stay until their
        last get is `finished` with them, and no new get takes them."""
        for held in self._held.values():
            held.drained = True
        return self._drop([h for h in self._held.values() if not h.users])


# ---- identity ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StorageIdentity:
    """What SGLang's `HiCacheStorageConfig` says about the worker (copied out, so this core
    needs no SGLang)."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    is_mla_model: bool
    model_name: str
    attn_cp_size: int = 1
    dcp_size: int = 1
    should_split_heads: bool = False
    # SGLang's server args that change the KV but not the host pool's format: the KV cache dtype
    # (fp8_e4m3 and fp8_e5m2 both live in a uint8 pool), the model's dtype, weights quantized at
    # load, config overrides ("" / "auto": none or unknown; review, stop 66)
    kv_cache_dtype: str = ""
    model_dtype: str = ""
    quantization: str = ""
    model_overrides: str = ""
    # how the weights were loaded (`--load-format`: "dummy" is random weights, others quantize
    # or fetch them elsewhere) and the fp8 KV scales file (`--quantization-param-path`: SGLang
    # divides K and V by its per-layer scales before storing them, in an fp8_e4m3 cache only);
    # review, stop 71
    load_format: str = ""
    kv_scales_path: str = ""
    # `--torchao-config` where SGLang has it (quantizes the weights at load; not in 0.5.23):
    # keyed as `--quantization` is, so `layered` (the loader that applies it per layer) can key
    # as `auto` (review of the change, stop 71)
    torchao_config: str = ""


@dataclass(frozen=True, slots=True)
class PoolGeometry:
    """The host pool's page format: what one stored page's bytes are."""

    pool_kind: str  # the host pool's class name
    layout: str  # SGLang's host layout: layer_first, page_first, page_first_direct, ...
    page_size: int  # tokens per page
    layer_num: int
    head_num: int
    head_dim: int
    dtype: str
    region_bytes: tuple[int, ...]  # one page's regions (get_page_buffer_meta order), bytes each
    sglang_version: str
    start_layer: int = 0  # the first model layer the pool holds (a pipeline stage's)

    @property
    def page_bytes(self) -> int:
        return sum(self.region_bytes)

    def layout_text(self) -> str:
        regions = f"{len(self.region_bytes)}x{self.region_bytes[0]}" if self.region_bytes else "0"
        return (
            f"sglang{self.sglang_version}:hicache:{self.pool_kind}:{self.layout}:page{self.page_size}"
            f":L{self.layer_num}{f'@{self.start_layer}' if self.start_layer else ''}"
            f":kvh{self.head_num}:hd{self.head_dim}:{self.dtype}:regions{regions}:pagekey-blake2b256"
        )[:1000]


def engine_spec(
    who: StorageIdentity,
    pool: PoolGeometry,
    extra: Mapping[str, Any],
    defaults: ClientSettings,
    *,
    weights_digest: Callable[[str], str] = weights_digest_of_dir,
) -> EngineSpec:
    """The key space of one SGLang worker's L3 pages: share domain (extra config `tenant_id` /
    `domain_salt_hex`, else the client settings), model (id, weights revision, KV dtype,
    attention config, fp8 KV scales), layout (TP, PP, the page format). MLA KV is the same on
    every TP rank: one object per page for all ranks (tp 1 in the key). Raises `ValueError` for
    what the key cannot name yet (attention context parallel, decode context parallel, split
    heads), for random weights (`--load-format dummy`), for a model whose weights cannot be
    identified and for a KV scales file that cannot be read (in an fp8_e4m3 KV cache, the only
    one SGLang reads it for)."""
    if who.attn_cp_size > 1 or who.dcp_size > 1 or who.should_split_heads:
        raise ValueError(
            "kvfabric: attention/decode context parallel and tp_lcm_size head splits are not "
            f"supported (attn_cp_size={who.attn_cp_size}, dcp_size={who.dcp_size}, "
            f"split_heads={who.should_split_heads})"
        )
    if who.load_format == "dummy":  # random weights under the real files' key (review, stop 71)
        raise ValueError("kvfabric: --load-format dummy (random weights): nothing to cache")
    model_path = str(extra.get("model_path") or who.model_name or "")
    revision = str(extra.get("weights_revision") or "")
    if not revision and model_path and os.path.isdir(model_path):
        revision = weights_digest(model_path)
    if not revision:
        raise ValueError(
            f"kvfabric: model {who.model_name!r} is not a local directory: set weights_revision "
            "(or model_path) in the extra config"
        )
    attn = str(extra.get("attn_config_digest") or "")
    config_file = os.path.join(model_path, "config.json") if model_path else ""
    if not attn and config_file and os.path.isfile(config_file):
        with open(config_file) as f:
            config = json.load(f)
        if isinstance(config, dict) and longrope_long_factors(config, 0) is not None:
            raise ValueError(LONGROPE_UNCACHEABLE.format(engine="SGLang", model=who.model_name))
        attn = attn_config_digest(config)
    if not attn:  # the weights revision names the model; the geometry is what the pages show
        attn = digest_config({"layers": pool.layer_num, "kv_heads": pool.head_num, "head_dim": pool.head_dim})
    if who.model_overrides and who.model_overrides not in ("{}", "null"):  # config overridden at start
        attn = digest_config({"config": attn, "overrides": who.model_overrides})
    if who.quantization:  # quantized at load (fp8 of bf16 files, say): other weights, other KV
        revision = f"{revision}+q:{who.quantization}"
    if who.torchao_config and who.torchao_config.lower() not in ("none", ""):
        revision = f"{revision}+torchao:{who.torchao_config}"
    if who.load_format not in _FILE_LOAD_FORMATS:  # not the files as they are (review, stop 71)
        revision = f"{revision}+load:{who.load_format}"
    kv_cache_dtype = str(extra.get("kv_cache_dtype") or who.kv_cache_dtype or "")
    kv_quant = "none"
    # K and V are divided by its scales before they are stored (stop 71), but only in an e4m3
    # cache: SGLang reads the file for nothing else (`load_kv_cache_scales`; "auto" neither), so
    # another KV dtype shares with no file, and a file it never reads is not refused (review,
    # stop 71: it disabled kvfabric)
    if who.kv_scales_path and kv_cache_dtype == "fp8_e4m3":
        try:
            with open(who.kv_scales_path, "rb") as f:
                scales = f.read()
        except OSError as exc:
            raise ValueError(
                f"kvfabric: the KV scales file (--quantization-param-path) {who.kv_scales_path!r} "
                f"cannot be read ({exc}): its scales are part of the key"
            ) from exc
        kv_quant = "scales-sha256:" + hashlib.sha256(scales).hexdigest()
    kv_dtype = pool.dtype
    if kv_cache_dtype not in ("", "auto"):  # what the pool's bytes mean, and what made them
        kv_dtype = f"{kv_cache_dtype}/{who.model_dtype or '?'}"
    elif pool.dtype in ("uint8", "int8") and kv_cache_dtype == "auto":
        # SGLang chose the format from the checkpoint (an FP8 checkpoint's kv_cache_quant_algo,
        # DeepSeek V4): the same weights choose the same, so "auto" pages are their own key
        # space, apart from an explicit e4m3 or e5m2 (review of the change: refused, such
        # deployments were no longer cached)
        kv_dtype = f"auto-{pool.dtype}/{who.model_dtype or '?'}"
    elif pool.dtype in ("uint8", "int8"):
        raise ValueError(
            "kvfabric: the host pool stores its KV as bytes (an fp8 KV cache): set kv_cache_dtype in"
            " the extra config (SGLang's --kv-cache-dtype); e4m3 and e5m2 pages look alike"
        )
    replicated = who.is_mla_model
    fingerprint = ModelFingerprint(
        model_id=str(extra.get("model_id") or who.model_name or model_path)[:200],
        weights_revision=revision[:_REVISION_CHARS_MAX],
        kv_dtype=kv_dtype[:64],
        kv_quant=kv_quant,
        attn_config_digest=attn,
    )
    layout = KVLayout(
        tp_size=1 if replicated else who.tp_size,
        tp_rank=0 if replicated else who.tp_rank,
        pp_stage=who.pp_rank,
        layer_group=0,
        layer_group_count=1,
        tokens_per_chunk=PAGE_WORDS,
        tensor_layout=str(extra.get("tensor_layout") or pool.layout_text()),
        pp_size=who.pp_size,
    )
    domain = ShareDomain(
        tenant_id=str(extra.get("tenant_id", defaults.tenant_id)),
        salt=bytes.fromhex(str(extra.get("domain_salt_hex", defaults.domain_salt_hex))),
    )
    return EngineSpec(domain=domain, model=fingerprint, layout=layout)


def versioned_spec(spec: EngineSpec, version: str) -> EngineSpec:
    """`spec` for the weights SGLang serves as `version` after changing them in place (module
    docstring): the weights revision with `+version:<version>`; past `_REVISION_CHARS_MAX`
    characters a SHA-256 of that text (cut, a long revision lost the version: two versions
    shared a key). Raises `ValueError` for a version the key cannot carry (not UTF-8)."""
    revision = f"{spec.model.weights_revision}+version:{version}"
    if len(revision) > _REVISION_CHARS_MAX:
        revision = "sha256:" + hashlib.sha256(revision.encode()).hexdigest()
    model = msgspec.structs.replace(spec.model, weights_revision=revision)
    return dataclasses.replace(spec, model=model)


def chained_pages_stored(pages: int, result: SaveResult) -> list[bool]:
    """Which pages of a chained batch `batch_set_v1` saved in one call are stored: all or none
    (the client reports counts, not which chunk failed), but for the engine's save rate, which
    skips only a save's tail, so its leading pages are stored (or were already)."""
    if result.chunks_failed and result.causes.keys() == {SAVE_RATE}:
        stored = pages - result.chunks_failed
    else:
        stored = 0 if result.chunks_failed else pages
    return [page < stored for page in range(pages)]
