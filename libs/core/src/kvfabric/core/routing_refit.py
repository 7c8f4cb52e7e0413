"""Online refit of the routing cost model's coefficients from realised TTFTs (issue 24).

Synchronous, I/O-free and deterministic: the same observations at the same times give the same
coefficients. The routing core (`kvfabric.core.routing`) holds one when its `RoutingConfig.refit`
is set, feeds it the chosen estimate's inputs and the realised TTFT of each request at its first
token, and estimates with `coefficients(now_ms)`. Times are ms (`now_ms`, given by the caller),
TTFTs seconds.

## The model
The estimate (`ttft_estimate_s`) is linear in its coefficients:

    ttft = theta . x,  x = (1, queued_prefill_tokens + compute_tokens, colocated_bytes,
                            remote_bytes, running)
    theta = (overhead_s, 1 / prefill_tokens_per_s, 1 / colocated_bytes_per_s,
             1 / remote_bytes_per_s, running_s)

## The fit (`_fit`)
Over the window (at most `window_max` observations, none older than `window_ms`): least squares
in each term's scale (column k divided by its root mean square over the window), with
- a ridge toward the prior (`ridge` x the total weight, per term): a term the window does not
  vary (no remote load seen, no request running) stays at the prior instead of swinging;
- bounds: every coefficient within `[low, high]`, solved exactly (the quadratic is strictly
  convex; every active set of the five terms, free / at low / at high, is one small linear
  system: the feasible one of least objective is the optimum); a term the window never saw
  (column all zero) keeps the prior;
- robustness: `irls_rounds` rounds of Huber weights (residuals past `huber_k` x the scaled
  median absolute deviation weigh `huber_k * s / |r|`): one 10 s stall cannot drag the fit.

## States
    PRIOR  --observations >= min_observations, a fit--> FITTED
    FITTED --every refit_every observations, or the window lost some by age--> FITTED (refit)
    FITTED --the window falls below min_observations (age, or nothing observed)--> PRIOR
In PRIOR `coefficients()` is the prior (the configured coefficients, measured on the machine);
in FITTED the latest fit.

## Invariants (`check_invariants`)
Every coefficient of `current` is within `[low, high]` (so rates stay positive and the
estimate stays monotone in every input: no coefficient is ever negative); the window holds at
most `window_max` observations; PRIOR holds the prior exactly; FITTED iff the window held at least
`min_observations` at the latest fit.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

from kvfabric.format.invariant import invariant

__all__ = ["TERMS", "CoefficientRefit", "Observation", "RefitConfig", "Vector", "features", "theta_of"]

# What each column of the model is, in `theta`'s order.
TERMS: Final = ("overhead", "prefill", "colocated", "remote", "running")
Vector: TypeAlias = tuple[float, float, float, float, float]  # one value per term, TERMS' order
_MAD_TO_SIGMA: Final = 1.4826
TTFT_S_MAX: Final = 3600.0  # a realised TTFT above this is read as this (a hung request, not a speed)


@dataclass(frozen=True, slots=True)
class Observation:
    x: Vector
    ttft_s: float
    at_ms: int


@dataclass(frozen=True, kw_only=True)
class RefitConfig:
    """Bounds are on the coefficients as `Coefficients` spells them (rates in /s, times in s).
    `None` for a rate bound: relative to the prior (`rate_factor` below and above it)."""

    window_max: int = 256
    window_ms: int = 120_000
    min_observations: int = 24
    refit_every: int = 16  # a fit costs ~10 ms of CPU (256 observations, this VM)
    ridge: float = 0.001
    irls_rounds: int = 3
    huber_k: float = 1.345
    rate_factor: float = 10.0  # prefill rate within [prior / f, prior * f]
    byte_rate_factor: float = 1000.0  # load rates within [prior / f, prior * f]
    overhead_s_max: float = 1.0
    running_s_max: float = 1.0

    def __post_init__(self) -> None:
        invariant(self.window_max >= self.min_observations >= 2, "a window holds a fit's observations")
        invariant(self.window_ms >= 1 and self.refit_every >= 1, "window age and refit cadence")
        invariant(self.ridge > 0, "the ridge keeps every term's equation solvable")
        invariant(self.irls_rounds >= 1 and self.huber_k > 0, "robust weights")
        invariant(self.rate_factor >= 1 and self.byte_rate_factor >= 1, "bounds around the prior")
        invariant(self.overhead_s_max > 0 and self.running_s_max > 0, "time bounds")


def features(
    queued_prefill_tokens: int,
    compute_tokens: int,
    colocated_bytes: int,
    remote_bytes: int,
    running: int,
) -> Vector:
    return (
        1.0,
        float(queued_prefill_tokens + compute_tokens),
        float(colocated_bytes),
        float(remote_bytes),
        float(running),
    )


def theta_of(
    overhead_s: float,
    prefill_tokens_per_s: float,
    colocated_bytes_per_s: float,
    remote_bytes_per_s: float,
    running_s: float,
) -> Vector:
    return (
        overhead_s,
        1.0 / prefill_tokens_per_s,
        1.0 / colocated_bytes_per_s,
        1.0 / remote_bytes_per_s,
        running_s,
    )


State = Literal["prior", "fitted"]


class CoefficientRefit:
    """See the module docstring. `prior` is theta (`theta_of` of the configured coefficients)."""

    def __init__(self, config: RefitConfig, prior: Vector) -> None:
        invariant(all(v >= 0 and math.isfinite(v) for v in prior), "a prior is finite, not negative")
        invariant(all(v > 0 for v in prior[1:4]), "prior rates are positive")
        self.config = config
        self.prior = prior
        f, fb = config.rate_factor, config.byte_rate_factor
        # bounds on theta (seconds per unit): a rate bound [r/f, r*f] is theta [t/f, t*f]
        self.low: tuple[float, ...] = (0.0, prior[1] / f, prior[2] / fb, prior[3] / fb, 0.0)
        self.high: tuple[float, ...] = (
            max(config.overhead_s_max, prior[0]),
            prior[1] * f,
            prior[2] * fb,
            prior[3] * fb,
            max(config.running_s_max, prior[4]),
        )
        self.window: deque[Observation] = deque()
        self.current: tuple[float, ...] = prior
        self.state: State = "prior"
        self.fits = 0
        self.rejected = 0  # observations not finite or negative (ignored)
        self._since_fit = 0
        self._fitted_on = 0  # observations in the window at the latest fit

    # ---- inputs ------------------------------------------------------------------------------

    def observe(self, x: Vector, ttft_s: float, now_ms: int) -> None:
        if not (math.isfinite(ttft_s) and ttft_s >= 0 and all(math.isfinite(v) and v >= 0 for v in x)):
            self.rejected += 1
            return
        self.window.append(Observation(x, min(ttft_s, TTFT_S_MAX), now_ms))
        while len(self.window) > self.config.window_max:
            self.window.popleft()
        self._since_fit += 1
        self._expire(now_ms)
        if self._since_fit >= self.config.refit_every:
            self._refit()

    def coefficients(self, now_ms: int) -> tuple[float, ...]:
        """Theta as of `now_ms` (observations older than `window_ms` dropped first)."""
        self._expire(now_ms)
        return self.current

    def _expire(self, now_ms: int) -> None:
        cutoff = now_ms - self.config.window_ms
        dropped = False
        while self.window and self.window[0].at_ms < cutoff:
            self.window.popleft()
            dropped = True
        if dropped:
            self._refit()

    # ---- the fit -------------------------------------------------------------------------------

    def _refit(self) -> None:
        self._since_fit = 0
        self._fitted_on = len(self.window)
        if len(self.window) < self.config.min_observations:
            self.current, self.state = self.prior, "prior"
            return
        self.current = self._fit([o.x for o in self.window], [o.ttft_s for o in self.window])
        self.state = "fitted"
        self.fits += 1

    def _fit(self, xs: list[tuple[float, ...]], ys: list[float]) -> tuple[float, ...]:
        cfg = self.config
        n, k = len(xs), len(self.prior)
        scale = [math.sqrt(sum(x[j] * x[j] for x in xs) / n) for j in range(k)]
        seen = [s > 0 for s in scale]
        # u_j = theta_j * scale_j: each term's seconds on a typical observation; z = x / scale
        zs = [[x[j] / scale[j] if seen[j] else 0.0 for j in range(k)] for x in xs]
        u0 = [self.prior[j] * scale[j] if seen[j] else 0.0 for j in range(k)]
        lo = [self.low[j] * scale[j] for j in range(k)]
        hi = [self.high[j] * scale[j] for j in range(k)]
        u = u0
        weights = [1.0] * n
        for _ in range(cfg.irls_rounds):
            u = self._solve(zs, ys, weights, u0, lo, hi, seen)
            residuals = [ys[i] - sum(u[j] * zs[i][j] for j in range(k)) for i in range(n)]
            spread = _MAD_TO_SIGMA * _median([abs(r) for r in residuals])
            cut = cfg.huber_k * spread
            weights = [1.0 if cut <= 0 or abs(r) <= cut else cut / abs(r) for r in residuals]
        theta = tuple(u[j] / scale[j] if seen[j] else self.prior[j] for j in range(k))
        return tuple(min(max(theta[j], self.low[j]), self.high[j]) for j in range(k))

    def _solve(
        self,
        zs: list[list[float]],
        ys: list[float],
        w: list[float],
        u0: list[float],
        lo: list[float],
        hi: list[float],
        seen: list[bool],
    ) -> list[float]:
        """argmin sum w (y - u.z)^2 + ridge * sum(w) * |u - u0|^2 within [lo, hi] (the unseen
        terms held at 0), exactly: over the active sets (3^5 small linear systems)."""
        k = len(u0)
        lam = self.config.ridge * sum(w)
        a = [[sum(wi * z[p] * z[q] for wi, z in zip(w, zs, strict=True)) for q in range(k)] for p in range(k)]
        b = [sum(wi * z[p] * y for wi, z, y in zip(w, zs, ys, strict=True)) for p in range(k)]
        for p in range(k):
            a[p][p] += lam
            b[p] += lam * u0[p]
        free = [p for p in range(k) if seen[p]]
        inside = _solve_linear([[a[p][q] for q in free] for p in free], [b[p] for p in free])
        if inside is not None and all(lo[p] <= v <= hi[p] for p, v in zip(free, inside, strict=True)):
            u = [0.0] * k
            for p, v in zip(free, inside, strict=True):
                u[p] = v
            return u  # the unconstrained optimum is within the bounds: the common case
        best: list[float] = [0.0] * k
        best_f = math.inf
        # Every active set: each seen term free, at its low or at its high bound. The problem is
        # strictly convex (the ridge), so the feasible candidate of least objective is the optimum.
        for statuses in itertools.product((0, 1, 2), repeat=len(free)):
            u = [0.0] * k
            loose = []
            for p, st in zip(free, statuses, strict=True):
                if st == 0:
                    loose.append(p)
                else:
                    u[p] = lo[p] if st == 1 else hi[p]
            if loose:
                sol = _solve_linear(
                    [[a[p][q] for q in loose] for p in loose],
                    [b[p] - sum(a[p][q] * u[q] for q in range(k) if q not in loose) for p in loose],
                )
                if sol is None or any(not lo[p] <= v <= hi[p] for p, v in zip(loose, sol, strict=True)):
                    continue
                for p, v in zip(loose, sol, strict=True):
                    u[p] = v
            f = 0.5 * sum(u[p] * a[p][q] * u[q] for p in range(k) for q in range(k)) - sum(
                b[p] * u[p] for p in range(k)
            )
            if f < best_f:
                best, best_f = u, f
        return best

    # ---- views ---------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        invariant(len(self.window) <= self.config.window_max, "window bounded")
        for j, v in enumerate(self.current):
            invariant(self.low[j] <= v <= self.high[j], "coefficient within its bounds", term=TERMS[j], v=v)
        invariant(
            (self.state == "fitted") == (self._fitted_on >= self.config.min_observations),
            "fitted iff the latest fit had enough observations",
        )
        invariant(self.state == "fitted" or self.current == self.prior, "the prior until fitted")


def _solve_linear(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [[*row, rhs] for row, rhs in zip(a, b, strict=True)]
    for c in range(n):
        piv = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[piv][c]) < 1e-300:
            return None
        m[c], m[piv] = m[piv], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for j in range(c, n + 1):
                m[r][j] -= f * m[c][j]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][j] * x[j] for j in range(r + 1, n))) / m[r][r]
    return x


def _median(values: list[float]) -> float:
    s = sorted(values)
    m = len(s) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2
