"""`make demo`: bring the local cluster up (if needed) and run an engine workload on it.

    python tools/demo.py [--run-dir .run] [--requests 8] [--prefix-tokens 2048]
                         [--suffix-tokens 256] [--new-tokens 16]

The workload is what kvfabric is for: requests that share a long prefix (a system prompt or a
document) followed by their own question, served by two engine instances (HF transformers, a
tiny random-weight Llama built locally: no downloads). Every request runs twice: once without
the cache (the baseline prefill time) and once through kvfabric (the first request computes and
saves the prefix; later ones, on either engine, load it and prefill only their suffix). Then a
table says what happened: lookups, candidate hit tokens, loaded tokens and bytes, prefill tokens
saved, fallbacks, prefill time without and with the cache, and whether every output matched.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
LOCALCLUSTER = REPO / "tools" / "localcluster.py"


def ensure_cluster(run: Path) -> dict[str, Any]:
    """The state (`cluster.json`) of the local cluster in `run`, started (`localcluster.py up`)
    if needed; `up` returns at once when the cluster is already up and ready."""
    code = subprocess.call([sys.executable, str(LOCALCLUSTER), "up", "--run-dir", str(run)])
    state_file = run / "cluster.json"
    if code != 0 or not state_file.exists():
        raise SystemExit(f"the local cluster did not come up (see {run / 'logs'})")
    state: dict[str, Any] = json.loads(state_file.read_text())
    return state


def metric_sum(clients: list[Any], name: str, **labels: str) -> float:
    from kvfabric.testing import metric_value

    total = 0.0
    for client in clients:
        text = generate_latest(client.metrics.registry).decode()
        total += metric_value(text, name, **labels) or 0.0
    return total


def fallbacks(clients: list[Any]) -> str:
    causes: dict[str, float] = {}
    for client in clients:
        for metric in client.metrics.fallbacks.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total") and sample.value:
                    cause = sample.labels["cause"]
                    causes[cause] = causes.get(cause, 0) + sample.value
    return ", ".join(f"{k}: {int(v)}" for k, v in sorted(causes.items())) or "none"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run-dir", type=Path, default=REPO / ".run")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--suffix-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    console = Console()
    run = args.run_dir.resolve()
    from kvfabric.client import settings_from_env

    state = ensure_cluster(run)
    # The cluster is authenticated: the demo engines are tenant `demo` (credentials and share
    # domain from its env file); an open cluster (`--no-auth`) gets the defaults.
    tenant_env = ((state.get("auth") or {}).get("tenants") or {}).get("demo", {})
    settings = settings_from_env(tenant_env, nats_url=state["nats_url"])

    import secrets

    import torch
    from transformers import LlamaForCausalLM

    from kvfabric.client import KvClient
    from kvfabric.engines.hf import HfKvAdapter, hf_engine_spec
    from kvfabric.engines.tiny import build_tiny_llama, prompt_ids

    model_dir = build_tiny_llama(run / "models" / "tiny-llama")
    # A fresh model id per demo run (keys name the model): the first request really computes.
    model_id = f"tiny-llama-{secrets.token_hex(4)}"

    def engine() -> HfKvAdapter:
        model: Any = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.eval()
        spec = hf_engine_spec(model, settings.share_domain(), tokens_per_chunk=256, model_id=model_id)
        return HfKvAdapter(model, KvClient(settings, spec))

    engines = [engine(), engine()]
    shared = prompt_ids(args.prefix_tokens, seed=1)
    prompts = [shared + prompt_ids(args.suffix_tokens, seed=100 + i) for i in range(args.requests)]
    without_s = with_s = 0.0
    identical = 0
    try:
        engines[0].generate(prompt_ids(300, seed=7), max_new_tokens=1, use_cache=False)  # warm-up
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("requests", total=len(prompts))
            for i, ids in enumerate(prompts):
                adapter = engines[i % 2]
                base = adapter.generate(ids, max_new_tokens=args.new_tokens, use_cache=False)
                cached = adapter.generate(ids, max_new_tokens=args.new_tokens)
                if cached.saving is not None:
                    cached.saving.result(60)  # so the next request (other engine) can hit
                without_s += base.prefill_s
                with_s += cached.prefill_s
                identical += base.token_ids == cached.token_ids
                progress.update(
                    task, advance=1, description=f"request {i + 1}: loaded {cached.loaded_tokens} tokens"
                )
        clients = [e.client for e in engines]
        table = Table(
            title=f"kvfabric demo: {len(prompts)} requests sharing a {args.prefix_tokens}-token prefix"
        )
        table.add_column("what")
        table.add_column("value", justify="right")
        rows = [
            ("lookups", f"{metric_sum(clients, 'kvfabric_client_lookups_total'):.0f}"),
            ("candidate hit tokens", f"{metric_sum(clients, 'kvfabric_client_hit_tokens_total'):.0f}"),
            ("loaded tokens (verified)", f"{metric_sum(clients, 'kvfabric_client_loaded_tokens_total'):.0f}"),
            ("loaded bytes", f"{metric_sum(clients, 'kvfabric_client_loaded_bytes_total') / 2**20:.1f} MiB"),
            (
                "prefill tokens saved",
                f"{metric_sum(clients, 'kvfabric_client_prefill_tokens_saved_total'):.0f}",
            ),
            ("tokens saved to kvfabric", f"{metric_sum(clients, 'kvfabric_client_saved_tokens_total'):.0f}"),
            ("fallbacks", fallbacks(clients)),
            ("prefill time without cache", f"{without_s:.3f} s"),
            ("prefill time with cache", f"{with_s:.3f} s"),
            ("speed-up", f"{without_s / with_s:.1f}x" if with_s else "-"),
            ("identical outputs", f"{identical}/{len(prompts)}"),
        ]
        for what, value in rows:
            table.add_row(what, value)
        console.print(table)
    finally:
        for e in engines:
            e.client.close()
    return 0 if identical == len(prompts) else 1


if __name__ == "__main__":
    started = time.perf_counter()
    code = main()
    print(f"demo finished in {time.perf_counter() - started:.1f} s; `make down` stops the cluster")
    raise SystemExit(code)
