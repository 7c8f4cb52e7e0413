"""The router's Prometheus metrics (`kvfabric_router_*`), on the service's `/metrics` and the
HTTP front's `/metrics`.

| metric | labels | what |
|---|---|---|
| `kvfabric_router_decisions_total` | instance, reason, keys | routed (`keys`: known, or unknown) |
| `kvfabric_router_refused_total` | reason | 429/503/401/408 (below) |
| `kvfabric_router_failovers_total` | instance, why | engines failing before the first byte (*) |
| `kvfabric_router_http_requests_total` | instance, outcome | ended (outcomes below) |
| `kvfabric_router_estimate_seconds` | instance | the chosen engine's TTFT estimate |
| `kvfabric_router_ttft_seconds` | instance | realised: received -> the engine's first body byte |
| `kvfabric_router_ttft_error_seconds` | | abs(realised - estimate) per request |
| `kvfabric_router_e2e_seconds` | instance | request received -> its last byte |
| `kvfabric_router_estimated_tokens_total` | instance, tier | engine, colocated, remote, compute |
| `kvfabric_router_state` | name | in flight, queue_<id>, index sequence/groups/synced/gaps, refit_* |
| `kvfabric_router_coefficient` | name | the cost model's coefficients in use (configured or refitted) |

(*) Not a non-streamed request's response timeout: answered 504, never failed over.

Refusal reasons: the core's (admitted_max, tenant_inflight_max: 429; no_instance, queues_full:
503), unauthenticated (401), models_inflight_max (429), body_timeout (408). Outcomes: ok,
status_<code>, broken_after_first_byte, client_disconnected, client_stalled, unrelayable_headers;
answered by the router itself: engines_failed (502: every engine tried failed before its first
byte; under the last one tried), response_timeout (504), refused_<reason> (a failover found no
engine with room, or the router full: 429/503 with Retry-After).

`refit_*` (with `KVF_ROUTER_REFIT` on): refit_fitted (0: the configured coefficients are in use),
refit_observations (in its window), refit_fits, refit_rejected (TTFTs not finite or negative).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvfabric.core.routing import Decision, RoutingCore

__all__ = ["RouterMetrics", "StateCollector"]

BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.4, 0.6, 1.0, 1.5, 2.5, 4.0, 6.0, 10.0, 20.0, 60.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "kvfabric_router_"
        self.decisions = Counter(
            p + "decisions", "Requests routed.", ["instance", "reason", "keys"], registry=registry
        )
        self.refusals = Counter(p + "refused", "Admission refusals.", ["reason"], registry=registry)
        self.failovers = Counter(
            p + "failovers", "Engines failing before the first byte.", ["instance", "why"], registry=registry
        )
        self.requests = Counter(
            p + "http_requests", "HTTP requests ended.", ["instance", "outcome"], registry=registry
        )
        self.estimate = Histogram(
            p + "estimate_seconds",
            "Chosen TTFT estimate.",
            ["instance"],
            buckets=BUCKETS_S,
            registry=registry,
        )
        self.ttft = Histogram(
            p + "ttft_seconds", "Realised TTFT.", ["instance"], buckets=BUCKETS_S, registry=registry
        )
        self.error = Histogram(
            p + "ttft_error_seconds", "abs(realised - estimate).", buckets=BUCKETS_S, registry=registry
        )
        self.e2e = Histogram(
            p + "e2e_seconds", "End to end.", ["instance"], buckets=BUCKETS_S, registry=registry
        )
        self.tokens = Counter(
            p + "estimated_tokens",
            "Tokens of chosen estimates, by tier.",
            ["instance", "tier"],
            registry=registry,
        )
        # Per request (for the benchmark and the docs: the estimate's median error).
        self.samples: list[tuple[float, float]] = []
        self.samples_max = 100_000

    def decided(self, d: Decision, keys_known: bool) -> None:
        iid = d.instance_id
        self.decisions.labels(iid, d.reason, "known" if keys_known else "unknown").inc()
        self.estimate.labels(iid).observe(d.estimate.ttft_s)
        i = d.estimate.inputs
        for tier, n in (
            ("engine", i.engine_tokens),
            ("colocated", i.colocated_tokens),
            ("remote", i.remote_tokens),
            ("compute", i.compute_tokens),
        ):
            if n:
                self.tokens.labels(iid, tier).inc(n)

    def refused(self, reason: str) -> None:
        self.refusals.labels(reason).inc()

    def failover(self, iid: str, why: str) -> None:
        self.failovers.labels(iid, why).inc()

    def first_byte(self, iid: str, d: Decision, ttft_s: float) -> None:
        self.ttft.labels(iid).observe(ttft_s)
        self.error.observe(abs(ttft_s - d.estimate.ttft_s))
        if len(self.samples) < self.samples_max:
            self.samples.append((d.estimate.ttft_s, ttft_s))

    def done(self, iid: str, outcome: str, e2e_s: float) -> None:
        self.requests.labels(iid, outcome).inc()
        self.e2e.labels(iid).observe(e2e_s)


class StateCollector(Collector):
    def __init__(self, core: RoutingCore, extra: Callable[[], dict[str, float]]) -> None:
        self.core = core
        self.extra = extra

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily("kvfabric_router_state", "Router state, by name.", labels=["name"])
        core = self.core
        index = core.index
        values: dict[str, float] = {
            "in_flight": core.in_flight,
            "index_last_seq": index.last_seq,
            "index_groups": len(index.groups),  # (with those whose replicas are dead, until swept)
            "index_dead_replicas": index.dead_replicas,  # of lost segments, not swept yet
            "index_segments_up": len(index.segments),
            "index_synced": int(index.synced),
            **{f"index_{k}": v for k, v in index.counters.items()},
            **{f"core_{k}": v for k, v in core.counters.items()},
            **self.extra(),
        }
        for iid in core.instances:
            values[f"queue_{iid}"] = core.queue_of(iid)
        refit = core.refit
        if refit is not None:
            values["refit_fitted"] = int(refit.state == "fitted")
            values["refit_observations"] = len(refit.window)
            values["refit_fits"] = refit.fits
            values["refit_rejected"] = refit.rejected
        for name, value in sorted(values.items()):
            g.add_metric([name], float(value))
        yield g
        coef = GaugeMetricFamily(
            "kvfabric_router_coefficient", "Cost model coefficients in use, by name.", labels=["name"]
        )
        for name, value in sorted(asdict(core.current_coefficients()).items()):
            coef.add_metric([name], float(value))
        yield coef
