"""Run one fresh vLLM engine over a plan of prompts; write what it produced as JSON.

    python -m kvfabric.testing.vllm_run --model DIR --plan plan.json --out out.json \
        [--connector none|kvfabric|example] [--nats-url URL] [--example-dir DIR]

A plan is {"steps": [{"name", "prompt": [ids], "max_tokens", "before": [actions],
"during": [actions], "after": [actions]}]}; an action is ["signal", pid, "SIGSTOP"] or
["sleep", seconds]; "during" actions run on a timer thread while the step generates (e.g.
kill a segment mid-load). Each step's result: output token ids, `num_cached_tokens` (vLLM's
count of prompt tokens it did not compute: external + local prefix cache) and its times
(`timings`: time to first token, queue wait, prefill, decode). Used by the vLLM engine tests
and `make bench-engines`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import threading
import time
from typing import Any

SHUTDOWN_TIMEOUT_S = 30.0  # the engine core's graceful stop (it flushes the connector's saves)

for _name, _value in {
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}.items():
    os.environ.setdefault(_name, _value)


def run_actions(actions: list[list[Any]]) -> None:
    for action in actions:
        if action[0] == "signal":
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(action[1]), getattr(signal, action[2]))
        elif action[0] == "sleep":
            time.sleep(float(action[1]))
        else:
            raise ValueError(f"unknown action {action!r}")


def timings(metrics: Any, output_tokens: int) -> dict[str, float | None]:
    """A request's times from vLLM's `RequestStateStats` (needs `disable_log_stats=False`):
    - `ttft_s`: arrival -> first token, as the frontend saw it (vLLM's time to first token);
    - `queued_s`: queued -> scheduled in the engine core (for a kvfabric hit: the lookup wait,
      the connector answers "ask again" until its asynchronous lookup is back);
    - `prefill_s`: scheduled -> first token (ExampleConnector's lookup is inside it: synchronous);
    - `decode_s`: first -> last token (`decode_tokens` = output tokens after the first)."""

    def stamp(name: str) -> float:
        return float(getattr(metrics, name, None) or 0.0)

    queued, scheduled, first, last = (
        stamp(n) for n in ("queued_ts", "scheduled_ts", "first_token_ts", "last_token_ts")
    )
    return {
        "ttft_s": stamp("first_token_latency") or None,
        "queued_s": scheduled - queued if queued and scheduled else None,
        "prefill_s": first - scheduled if first and scheduled else None,
        "decode_s": last - first if first and last and output_tokens > 1 else None,
        "decode_tokens": output_tokens - 1,
    }


def transfer_config(args: argparse.Namespace) -> Any:
    from vllm.config import KVTransferConfig

    if args.connector == "kvfabric":
        module, _, name = args.kvfabric_class.partition(":")
        return KVTransferConfig(
            kv_connector=name,
            kv_connector_module_path=module,
            kv_role="kv_both",  # vLLM's default kv_load_failure_policy ("fail"): the connector's job
            kv_connector_extra_config={
                "nats_url": args.nats_url,
                "lookup_timeout_ms": 1000,
                "load_timeout_ms": 5000,
                "lease_ttl_ms": args.lease_ttl_ms,
                **json.loads(args.kvfabric_extra),
            },
        )
    if args.connector == "example":
        return KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": args.example_dir},
        )
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--plan", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--connector", choices=["none", "kvfabric", "example"], default="none")
    parser.add_argument("--nats-url", default="")
    parser.add_argument("--example-dir", default="/tmp/kvf-example-connector")
    parser.add_argument(
        "--kvfabric-class",
        default="kvfabric.engines.vllm_connector:KvfabricConnector",
        help="module:Class of the kvfabric connector (tests subclass it)",
    )
    parser.add_argument("--kvfabric-extra", default="{}", help="JSON merged into the kvfabric extra config")
    parser.add_argument("--max-model-len", type=int, default=10_240)
    parser.add_argument("--lease-ttl-ms", type=int, default=30_000)
    parser.add_argument("--max-num-batched-tokens", type=int, default=0, help="0: vLLM's default (2048)")
    args = parser.parse_args()
    with open(args.plan) as f:
        plan = json.load(f)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=False,  # every reuse must come through the connector
        max_model_len=args.max_model_len,
        disable_log_stats=False,
        kv_transfer_config=transfer_config(args),
        **({"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}),
    )
    startup_s = time.perf_counter() - started
    results: list[dict[str, Any]] = []
    for step in plan["steps"]:
        run_actions(step.get("before", []))
        timer = None
        if step.get("during"):
            timer = threading.Thread(target=run_actions, args=(step["during"],), daemon=True)
            timer.start()
        params = SamplingParams(
            max_tokens=step.get("max_tokens", 8), temperature=0.0, ignore_eos=True, detokenize=False
        )
        t0 = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=step["prompt"])], params, use_tqdm=False)
        wall_s = time.perf_counter() - t0
        if timer is not None:
            timer.join()
        run_actions(step.get("after", []))
        token_ids = list(out.outputs[0].token_ids)
        results.append(
            {
                "name": step["name"],
                "prompt_tokens": len(step["prompt"]),
                "token_ids": token_ids,
                "num_cached_tokens": out.num_cached_tokens or 0,
                **timings(out.metrics, len(token_ids)),
                "wall_s": wall_s,
            }
        )
    with open(args.out, "w") as f:
        json.dump({"startup_s": startup_s, "connector": args.connector, "steps": results}, f)
    # A graceful stop, as a serving engine would: the connector's shutdown lets saves still in
    # flight finish (the last prompt's blocks are saved after its last forward). Bounded.
    llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
    os._exit(0)  # vLLM's engine-core shutdown can linger; the results are written


if __name__ == "__main__":
    main()
