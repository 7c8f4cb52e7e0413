"""The SGLang HiCache backend's batch calls, next to SGLang's Mooncake backend's (same page sizes).

Run with SGLang's venv (`make sglang-setup`): `.venv-sglang/bin/python -m bench.sglang_hicache`
[--pages-per-call 32] [--repeats 3] [--mooncake] [--json OUT]. One nats-server, directory and
segment (4 GiB arena) on loopback; SGLang's own host pool (`MHATokenToKVPoolHost`, page_first,
8 layers, 2 KV heads, head dim 64, fp16) at page sizes of 16, 64 and 256 tokens (64 KiB, 256 KiB
and 1 MiB a page). Each repeat writes fresh pages (new page keys), then reads them back.

- `kvfabric set`: `batch_set_v1` of one call's pages (chained keys, SGLang's
  `hicache_storage_pass_prefix_keys`): one object per page.
- `kvfabric prefetch`: what SGLang's prefetch does per call: `batch_exists` (lookup, leased),
  then `batch_get_v1` (load straight into the host pool pages, verified, lease given back).
- `kvfabric get (fresh lookup)`: `batch_get_v1` with no held hit (its own lookup).
- `group of 4 pages`: the alternative layout, one object per 4 pages (a quarter of the objects,
  4× their size), through the same client calls (save; lookup + load into the same host pool
  pages, gathered and scattered): what per-object overhead grouping would save.
- `Mooncake`: with `--mooncake`, Mooncake Store 0.3.13 (`bench.mooncake`, its own venv and network
  namespace) doing what SGLang's `MooncakeStore` does for an MHA page_first pool: one
  `batch_put_from` / `batch_get_into` call per SGLang call with two objects per page (K and V,
  half a page each), zero-copy, `--mode local` (co-located segment) and `remote` (TCP).
  (`MooncakeStore.batch_set_v1` also calls `batch_is_exist` first; not counted here.)

Every read is checked: pages reported loaded are compared with what was written (a mismatch is an
error). GB/s = page bytes / median seconds per call; ms = median per call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

PAGE_TOKENS: Final = (16, 64, 256)
LAYERS, HEADS, HEAD_DIM = 8, 2, 64
GROUP_PAGES: Final = 4
SEGMENT_BYTES: Final = 4 << 30


def measure_kvfabric(nats_url: str, page: int, pages: int, repeats: int) -> dict[str, Any]:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    from kvfabric.engines.sglang_keys import chain_words
    from kvfabric.testing import sglangkit as kit

    pool = kit.host_pool(
        page=page,
        device_tokens=2 * pages * page,
        dtype=torch.float16,
        layers=LAYERS,
        heads=HEADS,
        head_dim=HEAD_DIM,
    )
    kit.PAGE = page  # the kit's page helpers read it
    storage = kit.backend(kit.extra_config(nats_url, save_timeout_ms=60_000), pool)
    inner = kit.kvfabric_of(storage)
    client = inner.client
    assert client is not None and client.enabled, client.status if client else "no client"
    src = kit.alloc_pages(pool, pages)
    dst = kit.alloc_pages(pool, pages)
    page_bytes = inner.geometry.page_bytes
    times: dict[str, list[float]] = {
        k: [] for k in ("set", "prefetch", "get_fresh", "group_save", "group_load")
    }
    errors = 0
    for rep in range(repeats):
        keys = kit.page_keys(pages, seed=1000 * page + rep)
        gen = torch.Generator().manual_seed(rep)
        like = pool.get_dummy_flat_data_page()
        for i in range(pages):
            pool.set_from_flat_data_page(
                int(src[i * page]), torch.rand(like.shape, generator=gen).to(like.dtype)
            )
        info = HiCacheStorageExtraInfo(prefix_keys=[])
        t = time.perf_counter()
        ok = storage.batch_set_v1(keys, src, info)
        times["set"].append(time.perf_counter() - t)
        errors += ok.count(False)
        expected = [pool.get_data_page(int(src[i * page]), flat=True).clone() for i in range(pages)]
        for label in ("prefetch", "get_fresh"):
            pool.kv_buffer.view(-1)[:0] = 0
            for i in range(pages):
                pool.set_from_flat_data_page(int(dst[i * page]), torch.zeros_like(expected[0]))
            t = time.perf_counter()
            found = storage.batch_exists(keys, info) if label == "prefetch" else pages
            got = storage.batch_get_v1(keys[:found], dst[: found * page], info)
            times[label].append(time.perf_counter() - t)
            loaded = next((i for i, r in enumerate(got) if not r), len(got))
            same = all(
                torch.equal(pool.get_data_page(int(dst[i * page]), flat=True), expected[i])
                for i in range(loaded)
            )
            errors += (pages - loaded) + (0 if same else pages)
        # One object per GROUP_PAGES pages, through the same client calls and host pool pages.
        views = inner._views.pages(src, pages)
        groups = pages // GROUP_PAGES
        words = chain_words([], [f"group-{page}-{rep}-{g}" for g in range(groups)])
        objects = [
            [b"".join(r for p in views[g * GROUP_PAGES : (g + 1) * GROUP_PAGES] for r in p)]
            for g in range(groups)
        ]
        t = time.perf_counter()
        saved = client.save(words, objects)
        times["group_save"].append(time.perf_counter() - t)
        errors += saved.chunks_failed
        dviews = inner._views.pages(dst, pages)
        t = time.perf_counter()
        hit = client.lookup(words)
        result = client.load(
            hit,
            [
                [[r for p in dviews[g * GROUP_PAGES : (g + 1) * GROUP_PAGES] for r in p]]
                for g in range(hit.chunks)
            ],
        )
        client.release(hit)
        times["group_load"].append(time.perf_counter() - t)
        errors += groups - result.chunks_loaded
    storage.close()
    out: dict[str, Any] = {
        "page_tokens": page,
        "page_bytes": page_bytes,
        "pages_per_call": pages,
        "errors": errors,
    }
    for k, v in times.items():
        med = statistics.median(v)
        out[k] = {"ms": round(med * 1000, 2), "gbps": round(page_bytes * pages / med / 1e9, 3)}
    return out


def measure_mooncake(page_bytes: int, pages: int, repeats: int, mode: str) -> dict[str, Any] | str:
    from bench.mooncake import measure

    # SGLang's MooncakeStore, MHA page_first: a page is two objects (K, V) of half a page each.
    result = measure(
        sizes=[page_bytes // 2],
        objects=2 * pages,
        repeats=repeats,
        mode=mode,
        procs=1,
        working_set_bytes=max(64 << 20, 4 * page_bytes * pages),
    )
    if isinstance(result, str):
        return result
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages-per-call", type=int, default=32)  # Mooncake: 2 objects a page, <= 64
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mooncake", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from kvfabric.testing import NatsServer
    from kvfabric.testing.cluster import directory_process, segment_process

    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "loadavg": os.getloadavg(),
        "kvfabric": [],
        "mooncake": {},
    }
    with (
        tempfile.TemporaryDirectory(prefix="bench-sglang-") as tmp,
        NatsServer(Path(tmp) / "nats") as nats,
        directory_process(nats),
        segment_process(nats, "seg-bench-sglang", arena_bytes=SEGMENT_BYTES),
    ):
        for page in PAGE_TOKENS:
            row = measure_kvfabric(nats.url, page, args.pages_per_call, args.repeats)
            results["kvfabric"].append(row)
            print(json.dumps(row), flush=True)
    if args.mooncake:
        for row in results["kvfabric"]:
            for mode in ("local", "remote"):
                got = measure_mooncake(row["page_bytes"], args.pages_per_call, args.repeats, mode)
                results["mooncake"][f"{row['page_tokens']}:{mode}"] = got
                print(row["page_tokens"], mode, json.dumps(got)[:2000], flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
