"""SGLang's own classes, as its HiCache controller uses them, for the backend tests (imported only
where SGLang is installed: .venv-sglang, `make test-engines`).

- `host_pool`: SGLang's device KV pool on CPU and its host pool (`MHATokenToKVPoolHost`) over it.
- `backend`: the storage backend as SGLang builds it: `StorageBackendFactory.create_backend(
  "dynamic", ...)` (the module path in the extra config; the failure injector around it when
  SGLang's test variables are set), then `register_mem_pool_host`.
- `prefetch` / `backup`: what SGLang's controller does with a backend (`_storage_hit_query` then
  `_page_transfer`; `_page_backup`): batches of `STORAGE_BATCH_SIZE` pages, `prefix_keys`
  advancing, leading True pages counted.
- Page contents are made from the page key (`page_tensor`), written and read back through the
  host pool's own page accessors (`set_from_flat_data_page`, `get_data_page`), so a byte that
  differs from what was saved is seen whatever the backend's region handling.

`python -m kvfabric.testing.sglangkit write ...` writes pages from a separate process.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from typing import Any

import torch

MODULE_PATH = "kvfabric.engines.sglang"
CLASS_NAME = "KvfabricStorage"
LAYERS, HEADS, HEAD_DIM = 4, 2, 32
PAGE = 16  # tokens per page
HOST_PAGES = 256


def extra_config(nats_url: str, *, prefix_keys: bool = True, **more: Any) -> dict[str, Any]:
    """The extra config SGLang passes to a dynamic backend (after popping its own keys, such as
    `hicache_storage_pass_prefix_keys`, which the caller applies through `prefetch`/`backup`)."""
    return {
        "backend_name": "kvfabric",
        "module_path": MODULE_PATH,
        "class_name": CLASS_NAME,
        "nats_url": nats_url,
        "tenant_id": "tenant-sglang",
        "domain_salt_hex": "5e" * 16,
        "weights_revision": "tiny-sglang-rev-1",
        **more,
    }


def host_pool(
    layout: str = "page_first",
    *,
    page: int = PAGE,
    device_tokens: int = HOST_PAGES * PAGE // 2,
    dtype: torch.dtype = torch.float32,
    layers: int = LAYERS,
    heads: int = HEADS,
    head_dim: int = HEAD_DIM,
) -> Any:
    """SGLang's device KV pool on CPU (`device_tokens` tokens) and its host pool over it, twice
    as large (SGLang's host-to-device ratio 2.0). The tests take the defaults; `bench.sglang_hicache`
    passes its own shapes."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    device = MHATokenToKVPool(
        device_tokens,
        page,
        dtype,
        heads,
        head_dim,
        layers,
        "cpu",
        False,
        start_layer=0,
        end_layer=layers,
    )
    return MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2.0,
        0,
        page,
        layout,
        pin_memory=False,
        device_capacity_tokens=device.size,
        start_layer=0,
        end_layer=layers,
        write_back_staging=device.hicache_write_back_staging,
    )


def storage_config(
    extra: dict[str, Any], *, layout: str = "page_first", model_name: str = "tiny-sglang"
) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=True,
        is_page_first_layout=layout == "page_first",
        model_name=model_name,
        extra_config=dict(extra),
    )


def backend(extra: dict[str, Any], pool: Any, *, layout: str = "page_first", wait_s: float = 10.0) -> Any:
    """The backend as SGLang's controller attaches it; waits until its client serves (or
    `wait_s`, for a cache that cannot start)."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    config = storage_config(extra, layout=layout)
    storage = StorageBackendFactory.create_backend("dynamic", config, pool)
    storage.register_mem_pool_host(pool)
    assert config.extra_config.get("interface_v1") == 1  # SGLang then calls batch_get_v1 / batch_set_v1
    inner = kvfabric_of(storage)
    deadline = time.monotonic() + wait_s
    while (
        inner.client is not None and inner.client.status.state == "starting" and time.monotonic() < deadline
    ):
        time.sleep(0.02)
    return storage


def kvfabric_of(storage: Any) -> Any:
    """Our backend inside SGLang's failure injector, or itself."""
    return getattr(storage, "_backend", storage)


def page_keys(n_pages: int, seed: int = 0) -> list[str]:
    """SGLang's own page hashes of a prompt of `n_pages` pages."""
    from sglang.srt.mem_cache.utils import get_hash_str

    tokens = [(seed * 7919 + i * 31) % 32_000 for i in range(n_pages * PAGE)]
    keys = get_hash_str(tokens, None, page_size=PAGE)
    assert isinstance(keys, list) and len(keys) == n_pages
    return keys


def page_tensor(pool: Any, key: str) -> torch.Tensor:
    """The page's contents, made from its key (flat, as the pool's dummy page)."""
    like = pool.get_dummy_flat_data_page()
    gen = torch.Generator().manual_seed(
        int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    )
    page: torch.Tensor = torch.rand(like.shape, generator=gen, dtype=torch.float32).to(like.dtype)
    return page


def alloc_pages(pool: Any, n_pages: int) -> torch.Tensor:
    indices: torch.Tensor | None = pool.alloc(n_pages * PAGE)
    assert indices is not None, "host pool full"
    return indices


def fill(pool: Any, keys: list[str], indices: torch.Tensor) -> None:
    for i, key in enumerate(keys):
        pool.set_from_flat_data_page(int(indices[i * PAGE]), page_tensor(pool, key))


def identical_pages(pool: Any, keys: list[str], indices: torch.Tensor) -> list[bool]:
    return [
        torch.equal(pool.get_data_page(int(indices[i * PAGE]), flat=True), page_tensor(pool, key))
        for i, key in enumerate(keys)
    ]


def scramble(pool: Any, keys: list[str], indices: torch.Tensor) -> None:
    """Fill the pages with other bytes, so a load that does not write them is seen."""
    for i in range(len(keys)):
        pool.set_from_flat_data_page(
            int(indices[i * PAGE]), torch.full_like(pool.get_dummy_flat_data_page(), -1.0)
        )


def batch_size() -> int:
    from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE

    return int(STORAGE_BATCH_SIZE)


def _info(prefix: list[str] | None) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    return HiCacheStorageExtraInfo(prefix_keys=None if prefix is None else list(prefix))


def backup(storage: Any, keys: list[str], indices: torch.Tensor, prefix: list[str] | None) -> int:
    """SGLang's `_page_backup` with the zero-copy page path: pages stored, from the first."""
    done = 0
    step = batch_size()
    for start in range(0, len(keys), step):
        batch = keys[start : start + step]
        ok = storage.batch_set_v1(batch, indices[start * PAGE : (start + len(batch)) * PAGE], _info(prefix))
        if not all(ok):
            break
        done += len(batch)
        if prefix is not None:
            prefix = prefix + batch
    return done


def prefetch(
    storage: Any, keys: list[str], indices: torch.Tensor, prefix: list[str] | None, *, hybrid: bool = False
) -> tuple[int, int]:
    """SGLang's `_storage_hit_query` then `_page_transfer` (zero-copy path): (pages the storage
    said exist, pages loaded from the first). `hybrid`: as SGLang 0.5.23's hybrid controller
    (plain MHA/MLA models), whose exists queries send `None` for an empty prefix."""
    step = batch_size()
    hits: list[str] = []
    query_prefix = None if hybrid and prefix == [] else prefix
    for start in range(0, len(keys), step):
        batch = keys[start : start + step]
        found = storage.batch_exists(batch, _info(query_prefix))
        hits.extend(batch[:found])
        if found < len(batch):
            break
        if query_prefix is not None:
            query_prefix = query_prefix + batch
        elif hybrid and prefix == []:
            query_prefix = list(batch)
    loaded = 0
    for start in range(0, len(hits), step):
        batch = hits[start : start + step]
        results = storage.batch_get_v1(
            batch, indices[start * PAGE : (start + len(batch)) * PAGE], _info(prefix)
        )
        ok = next((i for i, r in enumerate(results) if not r), len(results))
        loaded += ok
        if ok < len(batch):
            break
        if prefix is not None:
            prefix = prefix + batch
    return len(hits), loaded


def main(argv: list[str] | None = None) -> int:
    """Write pages from this process: `write --nats URL --pages N [--seed S] [--per-page]
    [--layout L] [--split K]` (two backup calls, the second with the first's keys as prefix,
    as SGLang backs up a parent node then its child). Prints {"stored": n}."""
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["write"])
    parser.add_argument("--nats", required=True)
    parser.add_argument("--pages", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", type=int, default=0)
    parser.add_argument("--layout", default="page_first")
    parser.add_argument("--per-page", action="store_true")
    args = parser.parse_args(argv)
    pool = host_pool(args.layout)
    storage = backend(extra_config(args.nats), pool, layout=args.layout)
    keys = page_keys(args.pages, args.seed)
    indices = alloc_pages(pool, args.pages)
    fill(pool, keys, indices)
    prefix: list[str] | None = None if args.per_page else []
    split = args.split or args.pages
    stored = backup(storage, keys[:split], indices[: split * PAGE], prefix)
    if split < args.pages and stored == split:
        rest = None if prefix is None else keys[:split]
        stored += backup(storage, keys[split:], indices[split * PAGE :], rest)
    kvfabric_of(storage).close()
    print(json.dumps({"stored": stored}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
