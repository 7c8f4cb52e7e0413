"""What live admission at put_begin ships, in the simulator (issue 25 item 4).

    python tools/evict_admission_sim.py [--traces ../shared/traces/*.jsonl] [--capacities 5,10]
                                        [--max-requests 2000] [--publish-ms 1000]

Replays the first requests of each trace (as `tools/evict_sim.py`: full chunks, hit = longest
resident prefix, one pool of a share of the replayed unique blocks) with policy `density`, three
ways:
- `density`: every miss written (the policy service's own core: admission `always`);
- `density+admission`: the core's predicted admission (`tools/evict_sim.py`'s row: it sees every
  insert, with the prompt's length, and judges each block at once);
- `density+filter`: what the live cluster does. The policy's core (admission `always`, no
  prompt length: the service's class is the chunk's position + 1) builds an admission filter
  (`kvfabric.core.eviction_admission.build_filter`) every `--publish-ms` of trace time; each
  missed block is judged by that filter through the directory's gate (`AdmissionGate`, stale
  bound never reached: the policy is up; blocks its ghost remembers pass through the filter's
  bloom) and, once one is refused, the rest of the request's blocks are not written (the
  client's rule). A refused block never reaches the policy.
Reports prefill tokens saved (share of input tokens) and blocks written, per trace and capacity.
"""

from __future__ import annotations

import argparse
import glob
import sys
import time
from collections.abc import Hashable
from pathlib import Path
from typing import Any, Final

from evict_sim import BLOCK_TOKENS, full_chunks, load_trace, serve  # type: ignore[import-not-found]

from kvfabric.core.eviction import EvictBatch, EvictionConfig, EvictionCore
from kvfabric.core.eviction_admission import AdmissionGate, AdmissionView, build_filter
from kvfabric.proto.codec import encode

REPO: Final = Path(__file__).resolve().parents[1]
VARIANTS: Final = ("density", "density+admission", "density+filter")


class _Refusals:
    """The gate's decisions for one request's chunks: nothing is written past a refused one (as
    the client does)."""

    def __init__(self, gate: AdmissionGate, now: int) -> None:
        self.gate, self.now = gate, now
        self.stopped = False
        self.count = 0

    def __call__(self, i: int, block: Hashable) -> bool:
        self.stopped = self.stopped or not self.gate.decide(["pool"], repr(block).encode(), i, 1, self.now)[0]
        self.count += self.stopped
        return self.stopped


def replay(requests: list[dict[str, Any]], capacity: int, variant: str, publish_ms: int) -> dict[str, Any]:
    config = EvictionConfig(
        policy="density",
        admission="predicted" if variant == "density+admission" else "always",
        high_watermark=1.0,
        low_watermark=0.99,
        batch_max=4096,
        tokens_per_chunk=BLOCK_TOKENS,
    )
    core = EvictionCore(config)
    core.set_capacity("pool", capacity)
    gate = AdmissionGate(stale_ms=1 << 40) if variant == "density+filter" else None
    next_publish = 0
    saved = total = written = refused = 0
    for request in requests:
        now = int(request["timestamp"])
        blocks = request["hash_ids"]
        total += request["input_length"]
        if gate is not None and now >= next_publish:
            message = build_filter(core, {"pool": capacity}, now, 0)
            gate.install(AdmissionView.of(message, len(encode(message))), now)
            next_publish = now + publish_ms
        refusals = None if gate is None else _Refusals(gate, now)
        hit, wrote = serve(core, blocks, now, skip=refusals, prompt_chunks=variant != "density+filter")
        refused += refusals.count if refusals is not None else 0
        written += wrote
        saved += min(hit * BLOCK_TOKENS, request["input_length"])
        for effect in core.tick(now):
            assert isinstance(effect, EvictBatch)
            for victim in effect.victims:
                core.removed(victim)
    return {"saved_share": saved / max(total, 1), "written": written, "refused": refused}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--traces", nargs="*", default=sorted(glob.glob(str(REPO.parent / "shared/traces/*.jsonl")))
    )
    parser.add_argument("--capacities", default="5,10")
    parser.add_argument("--max-requests", type=int, default=2000)
    parser.add_argument("--publish-ms", type=int, default=1000)
    args = parser.parse_args()
    began = time.monotonic()
    print(f"`python tools/evict_admission_sim.py {' '.join(sys.argv[1:])}`")
    print("| trace | capacity | variant | prefill saved | blocks written | vs density | refused (filter) |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for path in args.traces:
        requests = full_chunks(load_trace(Path(path)))[: args.max_requests]
        unique = len({b for r in requests for b in r["hash_ids"]})
        for pct in (int(c) for c in args.capacities.split(",")):
            capacity = max(1, unique * pct // 100)
            base = None
            for variant in VARIANTS:
                row = replay(requests, capacity, variant, args.publish_ms)
                base = base or row
                print(
                    f"| {Path(path).stem} | {pct} % | `{variant}` | {100 * row['saved_share']:.2f} % | "
                    f"{row['written']} | {100 * row['written'] / max(base['written'], 1):.0f} % | "
                    f"{row['refused']} |"
                )
    print(f"({time.monotonic() - began:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
