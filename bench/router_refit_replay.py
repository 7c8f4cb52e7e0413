"""Offline replay of a serving benchmark's requests through the router's TTFT estimate, with the
coefficients as calibrated and with the online refit (`kvfabric.core.routing_refit`) (issue 24).

    .venv/bin/python -m bench.router_refit_replay [--serving bench/results/serving.json]
                                                  [--configs cde] [--json OUT]

`bench.serving` records per request: sent time, realised TTFT (the client's), end to end, prompt
and cached tokens, the instance. From them and the workload (regenerated from the trace with the
run's parameters: the same hash blocks) this rebuilds, for every request and both instances, what
the router's cost model saw at the request's arrival:
- `queued_prefill_tokens`: tokens to compute of requests on the instance sent and without their
  first token yet (their realised computed tokens); `running`: requests past their first token
  and not finished;
- the engine's own cache: the run of the prompt's chunks that requests on that instance had
  reached their first token with before the arrival (the router's learned cache, unbounded:
  2,048 blocks per engine hold a whole run); kvfabric: the run continues in chunks any instance
  computed before; compute: the rest (the last token always computed). Loaded bytes: 4,096 per
  token (the tiny Llama); co-located when the chunk was computed on the same instance.
Then it replays the arrivals and first tokens in time order: each arrival is estimated (both
instances) with the calibrated coefficients (the run's `calibration`, `running_s` at its
default) and with the refit's coefficients as of then (fed only the first tokens already seen:
the chosen instance's features and realised TTFT). Reported: median absolute error of the
chosen instance's estimate against the realised TTFT, the pick each would make (a pick within
`tie_s` is a tie: broken as the run broke it), and a batch fit over the whole run with every
term's seconds on the median request (which coefficient is off, and by how much).

With the router's own records (`router_<config>` in `bench.serving` runs from 2026-12-02 on: the inputs of
the chosen engine's estimate as logged, and the router's realised TTFT) it also replays those
exactly (`logged`: no rebuilt features, the router's TTFT).

Caveats (of the rebuilt replay): the realised TTFT is the client's (the router's own is 10-60
ms less: the relay and the client's connection), the features are rebuilt, not logged (the
rebuilt cached tokens agree with vLLM's `cached_tokens` per request: printed), and a different
pick would have changed what came after (the replay scores one decision at a time, not the
counterfactual run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from bench.serving import BLOCK_TOKENS, RESULTS, TRACE, Request, select_workload
from kvfabric.core.routing_refit import TERMS, CoefficientRefit, RefitConfig, Vector, features, theta_of

BYTES_PER_TOKEN: Final = 4096
TIE_S: Final = 0.001
RUNNING_S_DEFAULT: Final = 0.002
INSTANCES: Final = ("e1", "e2")


@dataclass(frozen=True)
class Seen:
    engine: int
    colocated: int
    remote: int
    compute: int
    queued: int
    running: int

    @property
    def x(self) -> Vector:
        return features(
            self.queued,
            self.compute,
            self.colocated * BYTES_PER_TOKEN,
            self.remote * BYTES_PER_TOKEN,
            self.running,
        )


def rebuild(out: list[dict[str, Any]], reqs: list[Request], i: int, inst: str) -> Seen:
    t = out[i]["sent_s"]
    req = reqs[i]
    queued = running = 0
    engine: set[tuple[int, ...]] = set()
    owner: dict[tuple[int, ...], str] = {}
    for j, (o, r) in enumerate(zip(out, reqs, strict=True)):
        if j == i or o["ttft_s"] is None:
            continue
        first = o["sent_s"] + o["ttft_s"]
        if o["instance"] == inst:
            if o["sent_s"] < t < first:
                queued += o["prompt_tokens"] - o["cached_tokens"]
            elif first <= t < o["sent_s"] + o["e2e_s"]:
                running += 1
        if first <= t:
            for k in range(min(len(r.hash_ids), r.prompt_tokens // BLOCK_TOKENS)):
                chunk = r.hash_ids[: k + 1]
                owner.setdefault(chunk, o["instance"])
                if o["instance"] == inst:
                    engine.add(chunk)
    usable = (req.prompt_tokens - 1) // BLOCK_TOKENS
    e = 0
    while e < usable and req.hash_ids[: e + 1] in engine:
        e += 1
    coloc = remote = 0
    k = e
    while k < usable and req.hash_ids[: k + 1] in owner:
        if owner[req.hash_ids[: k + 1]] == inst:
            coloc += 1
        else:
            remote += 1
        k += 1
    return Seen(
        engine=e * BLOCK_TOKENS,
        colocated=coloc * BLOCK_TOKENS,
        remote=remote * BLOCK_TOKENS,
        compute=req.prompt_tokens - k * BLOCK_TOKENS,
        queued=queued,
        running=running,
    )


def estimate(theta: tuple[float, ...], x: Vector) -> float:
    return sum(t * v for t, v in zip(theta, x, strict=True))


def pick(ests: dict[str, float], actual: str) -> tuple[str, bool]:
    low = min(ests.values())
    tied = [i for i, v in ests.items() if v <= low + TIE_S]
    if len(tied) == 1:
        return tied[0], False
    return (actual if actual in tied else tied[0]), True


def replay_config(
    out: list[dict[str, Any]], reqs: list[Request], prior: tuple[float, ...], config: RefitConfig
) -> dict[str, Any]:
    ok = [i for i, o in enumerate(out) if o["ttft_s"] is not None and o["instance"]]
    seen = {i: {inst: rebuild(out, reqs, i, inst) for inst in INSTANCES} for i in ok}
    agree = sum(
        1
        for i in ok
        if seen[i][out[i]["instance"]].engine
        + seen[i][out[i]["instance"]].colocated
        + seen[i][out[i]["instance"]].remote
        == out[i]["cached_tokens"]
    )
    refit = CoefficientRefit(config, prior)  # type: ignore[arg-type]
    events: list[tuple[float, int, int]] = []  # (time, 0 arrival / 1 first token, request)
    for i in ok:
        events.append((out[i]["sent_s"], 0, i))
        events.append((out[i]["sent_s"] + out[i]["ttft_s"], 1, i))
    events.sort()
    err_static: list[float] = []
    err_refit: list[float] = []
    picks_static: list[str] = []
    picks_refit: list[str] = []
    ties_static = ties_refit = differ = 0
    ties_went_to = dict.fromkeys(INSTANCES, 0)  # where the run sent the calibrated estimate's ties
    for t, kind, i in events:
        now_ms = round(t * 1000)
        chosen = out[i]["instance"]
        if kind == 1:
            refit.observe(seen[i][chosen].x, out[i]["ttft_s"], now_ms)
            continue
        theta = refit.coefficients(now_ms)
        st = {inst: estimate(prior, seen[i][inst].x) for inst in INSTANCES}
        rf = {inst: estimate(theta, seen[i][inst].x) for inst in INSTANCES}
        err_static.append(abs(st[chosen] - out[i]["ttft_s"]))
        err_refit.append(abs(rf[chosen] - out[i]["ttft_s"]))
        ps, ts = pick(st, chosen)
        pr, tr = pick(rf, chosen)
        picks_static.append(ps)
        picks_refit.append(pr)
        ties_static += ts
        if ts:
            ties_went_to[chosen] += 1
        ties_refit += tr
        differ += ps != pr
    # batch fit over the whole run: which term is off
    batch = CoefficientRefit(
        RefitConfig(
            window_max=len(ok), window_ms=10**9, min_observations=min(24, len(ok)), refit_every=len(ok)
        ),
        prior,  # type: ignore[arg-type]
    )
    for i in ok:
        batch.observe(seen[i][out[i]["instance"]].x, out[i]["ttft_s"], 0)
    xs = [seen[i][out[i]["instance"]].x for i in ok]
    terms = {}
    for j, name in enumerate(TERMS):
        nonzero = [x[j] for x in xs if x[j] > 0]
        typical = statistics.median(nonzero) if nonzero else 0.0
        terms[name] = {
            "requests_with_term": len(nonzero),
            "median_when_nonzero": typical,
            "calibrated_s": prior[j] * typical,
            "fitted_s": batch.current[j] * typical,
            "ratio_fitted_to_calibrated": batch.current[j] / prior[j] if prior[j] > 0 else None,
        }
    n = len(ok)
    return {
        "balance_bound": balance_bound(out, ok, seen),
        "requests": n,
        "rebuilt_cached_agrees": round(agree / n, 3),
        "tie_fraction_static": round(ties_static / n, 3),
        "tie_fraction_refit": round(ties_refit / n, 3),
        "ties_went_to": ties_went_to,
        "estimate_abs_error_p50_s": {
            "calibrated": round(statistics.median(err_static), 4),
            "refit_online": round(statistics.median(err_refit), 4),
        },
        "estimate_abs_error_p90_s": {
            "calibrated": round(sorted(err_static)[int(0.9 * n)], 4),
            "refit_online": round(sorted(err_refit)[int(0.9 * n)], 4),
        },
        "picks_actual": {inst: sum(out[i]["instance"] == inst for i in ok) for inst in INSTANCES},
        "picks_calibrated": {inst: picks_static.count(inst) for inst in INSTANCES},
        "picks_refit": {inst: picks_refit.count(inst) for inst in INSTANCES},
        "picks_differ": differ,
        "refit_final": coefficients_of(refit.current),
        "refit_state": refit.state,
        "batch_fit": coefficients_of(batch.current),
        "terms": terms,
    }


def replay_logged(
    out: list[dict[str, Any]], logged: list[dict[str, Any]], prior: tuple[float, ...], config: RefitConfig
) -> dict[str, Any] | None:
    """With the router's own per-request records (`bench.serving`'s `router_<config>`: the chosen
    engine's inputs as the router saw them and its realised TTFT), the error of its estimate
    with the calibrated coefficients and with the refit, exactly as the router would observe
    (no rebuilt features; arrivals and first tokens ordered by the client's times)."""
    rows = {r["index"]: r for r in logged if r.get("outcome") == "ok" and r.get("router_ttft_s") is not None}
    rows = {i: r for i, r in rows.items() if i < len(out) and out[i]["ttft_s"] is not None}
    if not rows:
        return None
    xs: dict[int, Vector] = {
        i: features(
            int(r.get("queued_prefill_tokens", 0)),
            int(r["compute_tokens"]),
            int(r.get("colocated_bytes", 0)),
            int(r.get("remote_bytes", 0)),
            int(r.get("running", 0)),
        )
        for i, r in rows.items()
    }
    refit = CoefficientRefit(config, prior)  # type: ignore[arg-type]
    events = sorted(
        [(out[i]["sent_s"], 0, i) for i in rows] + [(out[i]["sent_s"] + out[i]["ttft_s"], 1, i) for i in rows]
    )
    err_static: list[float] = []
    err_refit: list[float] = []
    for t, kind, i in events:
        y = float(rows[i]["router_ttft_s"])
        if kind == 1:
            refit.observe(xs[i], y, round(t * 1000))
            continue
        err_static.append(abs(estimate(prior, xs[i]) - y))
        err_refit.append(abs(estimate(refit.coefficients(round(t * 1000)), xs[i]) - y))
    return {
        "requests": len(rows),
        "estimate_abs_error_p50_s": {
            "calibrated": round(statistics.median(err_static), 4),
            "refit_online": round(statistics.median(err_refit), 4),
        },
        "refit_final": coefficients_of(refit.current),
    }


def balance_bound(
    out: list[dict[str, Any]], ok: list[int], seen: dict[int, dict[str, Seen]]
) -> dict[str, Any]:
    """What a perfect balancer could have won, one decision at a time: requests that met a busy
    engine (something queued or running) while the other was idle, given the TTFT an idle
    engine gives their computed tokens (overhead + tokens / rate, least squares over the
    requests that did meet an idle engine), if lower. Optimistic: the moved request would also
    have had to load its prefix there, and nothing after it changes."""

    def idle(s: Seen) -> bool:
        return s.queued == 0 and s.running == 0

    def computed(i: int) -> int:
        return int(out[i]["prompt_tokens"] - out[i]["cached_tokens"])

    free = [i for i in ok if idle(seen[i][out[i]["instance"]])]
    busy = [i for i in ok if i not in free]
    movable = [i for i in busy if any(idle(seen[i][x]) for x in INSTANCES if x != out[i]["instance"])]
    xs = [float(computed(i)) for i in free]
    ys = [float(out[i]["ttft_s"]) for i in free]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    base = my - slope * mx
    moved = [
        min(out[i]["ttft_s"], base + slope * computed(i)) if i in movable else out[i]["ttft_s"] for i in ok
    ]
    return {
        "met_idle_engine": len(free),
        "ttft_p50_met_idle_s": round(statistics.median(ys), 4),
        "met_busy_engine": len(busy),
        "ttft_p50_met_busy_s": round(statistics.median(out[i]["ttft_s"] for i in busy), 4) if busy else None,
        "idle_engine_fit": {"overhead_s": round(base, 4), "prefill_tokens_per_s": round(1 / slope, 1)},
        "busy_while_other_idle": len(movable),
        "ttft_p50_s": round(statistics.median(out[i]["ttft_s"] for i in ok), 4),
        "ttft_p50_if_moved_s": round(statistics.median(moved), 4),
    }


def coefficients_of(theta: tuple[float, ...]) -> dict[str, float]:
    return {
        "overhead_s": round(theta[0], 4),
        "prefill_tokens_per_s": round(1 / theta[1], 1),
        "colocated_bytes_per_s": float(f"{1 / theta[2]:.3g}"),
        "remote_bytes_per_s": float(f"{1 / theta[3]:.3g}"),
        "running_s": round(theta[4], 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--serving", type=Path, default=RESULTS / "serving.json")
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--configs", default="bcde")
    parser.add_argument("--output-max", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    report = json.loads(args.serving.read_text())
    wl = report["workload"]
    rows = [json.loads(line) for line in args.trace.read_text().splitlines() if line.strip()]
    reqs, _ = select_workload(
        rows,
        requests=wl["requests"],
        rate=wl["rate_rps"],
        blocks_max=wl["blocks_max"],
        output_max=args.output_max,
    )
    cal = report["calibration"]["coefficients"]
    prior = theta_of(
        cal["overhead_s"],
        cal["prefill_tokens_per_s"],
        cal["colocated_bytes_per_s"],
        cal["remote_bytes_per_s"],
        cal.get("running_s", RUNNING_S_DEFAULT),
    )
    result: dict[str, Any] = {
        "serving": str(args.serving),
        "serving_when": report["when"],
        "calibrated": coefficients_of(prior),
        "refit_config": RefitConfig().__dict__,
        "configs": {},
    }
    for name in args.configs:
        out = report.get(f"requests_{name}")
        if not out:
            continue
        if [o["prompt_tokens"] for o in out] != [r.prompt_tokens for r in reqs]:
            print(f"({name}): the workload does not match the run's requests", file=sys.stderr)
            return 1
        result["configs"][name] = replay_config(out, reqs, prior, RefitConfig())
        logged = report.get(f"router_{name}")
        if logged:
            result["configs"][name]["logged"] = replay_logged(out, logged, prior, RefitConfig())
    text = json.dumps(result, indent=1)
    if args.json is not None:
        args.json.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
