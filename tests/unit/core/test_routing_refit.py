"""The online refit of the routing cost model (`kvfabric.core.routing_refit`) and its use by the
routing core: converges to known coefficients, stays within its bounds whatever it is fed, keeps
the estimate monotone, is deterministic, forgets by age, and changes decisions the way the
realised TTFTs say."""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfabric.core.routing import (
    Coefficients,
    CostInputs,
    Decision,
    RoutingCore,
    prompt_keys,
    ttft_estimate_s,
)
from kvfabric.core.routing_refit import CoefficientRefit, RefitConfig, Vector, features, theta_of

from .test_routing import DOMAIN, FIELDS, KEYS, LAYOUT, MODEL, PROMPT, core, inputs_st

PRIOR = Coefficients(
    overhead_s=0.09,
    prefill_tokens_per_s=5700,
    colocated_bytes_per_s=2e10,
    remote_bytes_per_s=2e10,
    running_s=0.002,
)
PRIOR_THETA = theta_of(
    PRIOR.overhead_s,
    PRIOR.prefill_tokens_per_s,
    PRIOR.colocated_bytes_per_s,
    PRIOR.remote_bytes_per_s,
    PRIOR.running_s,
)
TRUE = (0.06, 1 / 3500, 1 / 1.2e8, 1 / 2e9, 0.08)  # theta: overhead, s/token, s/byte x2, s/running


def synthetic(rng: random.Random, n: int, noise_s: float = 0.0) -> list[tuple[Vector, float]]:
    out: list[tuple[Vector, float]] = []
    for _ in range(n):
        x = features(
            rng.choice([0, 0, 0, rng.randrange(0, 6000)]),
            rng.randrange(1, 3100),
            rng.choice([0, rng.randrange(0, 3000) * 4096]),
            rng.choice([0, 0, rng.randrange(0, 3000) * 4096]),
            rng.choice([0, 0, 1, 2, 3]),
        )
        y = sum(t * v for t, v in zip(TRUE, x, strict=True)) + rng.gauss(0, noise_s)
        out.append((x, max(0.0, y)))
    return out


def fed(config: RefitConfig, data: list[tuple[Vector, float]], t0: int = 0) -> CoefficientRefit:
    r = CoefficientRefit(config, PRIOR_THETA)
    for i, (x, y) in enumerate(data):
        r.observe(x, y, t0 + i)
        r.check_invariants()
    return r


def test_converges_to_known_coefficients() -> None:
    r = fed(RefitConfig(), synthetic(random.Random(1), 256))
    assert r.state == "fitted"
    for got, want in zip(r.current, TRUE, strict=True):
        assert abs(got - want) <= 0.05 * want, (r.current, TRUE)


def test_converges_under_noise_and_outliers() -> None:
    """5 ms of noise and 5 % of requests stalled by seconds (another job, a GC pause): the
    robust fit stays within 15 % on every term the data carries."""
    rng = random.Random(2)
    data = synthetic(rng, 256, noise_s=0.005)
    data = [(x, y + rng.uniform(2, 10)) if rng.random() < 0.05 else (x, y) for x, y in data]
    r = fed(RefitConfig(), data)
    for got, want in zip(r.current, TRUE, strict=True):
        assert abs(got - want) <= 0.15 * want, (r.current, TRUE)
    plain = fed(RefitConfig(irls_rounds=1), data)  # least squares only: the stalls drag it
    assert max(abs(g - w) / w for g, w in zip(plain.current, TRUE, strict=True)) > 0.15


def test_prior_until_enough_observations_then_forgotten_by_age() -> None:
    cfg = RefitConfig(min_observations=24, refit_every=1, window_ms=10_000)
    data = synthetic(random.Random(3), 40)
    r = fed(cfg, data[:23])
    assert r.state == "prior" and r.current == PRIOR_THETA
    r.observe(data[23][0], data[23][1], 23)
    assert r.fits == 1 and r.current != PRIOR_THETA
    assert r.coefficients(5_000) != PRIOR_THETA  # all still within the window
    assert r.coefficients(10_030) == PRIOR_THETA and r.state == "prior"  # all older than 10 s
    assert not r.window
    r.check_invariants()


def test_unseen_terms_keep_the_prior() -> None:
    """A window without remote loads and without running requests leaves those two terms at
    the prior (a ridge, not a guess)."""
    data = [(replace_x(x, remote=0, running=0), y) for x, y in synthetic(random.Random(4), 200)]
    r = fed(RefitConfig(), data)
    assert r.current[3] == PRIOR_THETA[3] and r.current[4] == PRIOR_THETA[4]


def replace_x(x: Vector, *, remote: float, running: float) -> Vector:
    return (x[0], x[1], x[2], remote, running)


def test_deterministic() -> None:
    data = synthetic(random.Random(5), 150, noise_s=0.01)
    assert fed(RefitConfig(), data).current == fed(RefitConfig(), data).current


adversarial_x = st.tuples(
    st.just(1.0),
    st.floats(0, 1e9, allow_nan=False),
    st.floats(0, 1e15, allow_nan=False),
    st.floats(0, 1e15, allow_nan=False),
    st.floats(0, 1e4, allow_nan=False),
)
adversarial_y = st.one_of(
    st.floats(0, 1e6, allow_nan=False), st.sampled_from([0.0, 1e-9, float("inf"), float("nan"), -1.0])
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(adversarial_x, adversarial_y), min_size=0, max_size=80))
def test_adversarial_data_stays_within_bounds_and_monotone(data: list[tuple[Vector, float]]) -> None:
    """Whatever is observed (zeros, huge TTFTs, inf, nan, huge features), every coefficient
    stays within its bounds, so rates stay positive and no term is ever negative."""
    r = CoefficientRefit(RefitConfig(min_observations=4, refit_every=1), PRIOR_THETA)
    for i, (x, y) in enumerate(data):
        r.observe(x, y, i)
        r.check_invariants()
    assert all(v >= 0 for v in r.current) and all(v > 0 for v in r.current[1:4])


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(adversarial_x, st.floats(0, 100, allow_nan=False)), min_size=30, max_size=60),
    inputs_st,
    st.sampled_from(FIELDS),
    st.integers(1, 10**5),
)
def test_estimate_monotone_with_refitted_coefficients(
    data: list[tuple[Vector, float]], inputs: CostInputs, name: str, more: int
) -> None:
    """The routing core's estimate after any refit is never lower when an input grows."""
    c = refit_core(RefitConfig(min_observations=8, refit_every=10))
    for i, (x, y) in enumerate(data):
        assert c.refit is not None
        c.refit.observe(x, y, i)
    coef = c.coefficients_at(len(data))
    grown = replace(inputs, **{name: getattr(inputs, name) + more})
    assert ttft_estimate_s(grown, coef) >= ttft_estimate_s(inputs, coef)


# ---- in the routing core -----------------------------------------------------------------------


QUICK = RefitConfig(min_observations=8, refit_every=1)


def refit_core(refit: RefitConfig | None = QUICK) -> RoutingCore:
    return core(coefficients=PRIOR, refit=refit)


def busy_a_with_the_prefix(c: RoutingCore, now: int) -> Decision:
    """a holds PROMPT's prefix in its own cache and decodes three requests; b is idle."""
    first = c.route(f"warm{now}", "t", KEYS, len(PROMPT), now, exclude=("b",))
    assert isinstance(first, Decision) and first.instance_id == "a"
    c.first_token(f"warm{now}")
    c.finished(f"warm{now}")
    for i in range(3):
        rid = f"dec{now}-{i}"
        d = c.route(rid, "t", prompt_keys(DOMAIN, MODEL, LAYOUT, [7000 + i] * 300), 300, now, exclude=("b",))
        assert isinstance(d, Decision)
        c.first_token(rid)  # no TTFT given: nothing observed
    d = c.route("probe", "t", KEYS, len(PROMPT), now, admit=False)
    assert isinstance(d, Decision)
    for i in range(3):
        c.finished(f"dec{now}-{i}")
    return d


def test_refit_learns_that_running_requests_cost_and_routes_away() -> None:
    """Observations where each decoding request on the instance added 0.2 s of TTFT: with the
    refit, a prompt whose prefix a holds in its own cache goes to the idle b (3,000 tokens to
    compute there, 0.5 s) instead of a with three requests decoding (0.6 s+); with the
    configured running_s (0.002 s) it stays on a."""
    static = refit_core(refit=None)
    assert busy_a_with_the_prefix(static, 0).instance_id == "a"
    c = refit_core()
    assert busy_a_with_the_prefix(c, 0).instance_id == "a"  # nothing observed yet: the prior
    rng = random.Random(6)
    decoding: list[str] = []
    for n in range(60):  # realised: overhead 0.05 + tokens / 6000 + 0.2 per running request
        rid = f"obs{n}"
        length = rng.randrange(200, 3000)
        d = c.route(rid, "t", prompt_keys(DOMAIN, MODEL, LAYOUT, [9000 + n] * length), length, 1)
        assert isinstance(d, Decision)
        running = d.estimate.inputs.running
        c.first_token(rid, 0.05 + length / 6000 + 0.2 * running, 1 + n)
        decoding.append(rid)
        while len(decoding) > rng.randrange(0, 6):
            c.finished(decoding.pop(0))
    for rid in decoding:
        c.finished(rid)
    c.check_invariants()
    assert c.refit is not None and c.refit.state == "fitted"
    assert abs(c.coefficients_at(50).running_s - 0.2) < 0.02
    assert busy_a_with_the_prefix(c, 50).instance_id == "b"


def test_failover_is_not_observed() -> None:
    c = refit_core()
    assert c.refit is not None
    d = c.route("r", "t", KEYS, len(PROMPT), 0)
    assert isinstance(d, Decision)
    c.failed("r")
    again = c.route("r", "t", KEYS, len(PROMPT), 0, exclude=(d.instance_id,))
    assert isinstance(again, Decision) and again.reason == "failover"
    c.first_token("r", 9.0, 1)
    assert not c.refit.window
    c.finished("r")
    d2 = c.route("r2", "t", KEYS, len(PROMPT), 2)
    assert isinstance(d2, Decision)
    c.first_token("r2", 0.3, 3)
    assert len(c.refit.window) == 1


def test_a_prompt_whose_token_count_is_a_guess_is_not_observed() -> None:
    """A text or chat prompt (its tokens guessed from its characters, nothing known cached)
    taught the refit a cost for inputs that were not its own (stop 70's list). Token ids shorter
    than a chunk (no keys, an exact count) still are observations."""
    c = refit_core()
    assert c.refit is not None
    d = c.route("text", "t", [], 1200, 0, tokens_guessed=True)
    assert isinstance(d, Decision)
    c.first_token("text", 0.02, 1)
    assert not c.refit.window
    c.finished("text")
    short = c.route("short", "t", [], 10, 2)
    assert isinstance(short, Decision)
    c.first_token("short", 0.05, 3)
    keyed = c.route("ids", "t", KEYS, len(PROMPT), 4)
    assert isinstance(keyed, Decision)
    c.first_token("ids", 0.3, 5)
    assert len(c.refit.window) == 2


def test_a_presumed_prefill_leaves_the_queue_and_is_no_first_token() -> None:
    """Not streamed, a request's first byte is its whole answer: past its estimated TTFT the
    shell presumes its prefill done, so later estimates stop counting its tokens as queued
    (they counted for its whole generation: stop 70's list). No observation, no learned cache;
    its real first byte later is still its first token."""
    c = refit_core()
    assert c.refit is not None
    d = c.route("whole", "t", KEYS, len(PROMPT), 0, exclude=("b",))
    assert isinstance(d, Decision) and d.instance_id == "a"
    a = c.instances["a"]
    assert a.queued_prefill_tokens == d.estimate.inputs.compute_tokens > 0 and a.running == 0
    c.presume_prefilled("whole")
    c.presume_prefilled("whole")  # once
    assert a.queued_prefill_tokens == 0 and a.running == 1 and c.counters["prefill_presumed"] == 1
    assert not a.cache and not c.refit.window
    c.check_invariants()
    c.first_token("whole", 4.0, 5)
    assert a.queued_prefill_tokens == 0 and a.running == 1 and len(a.cache) > 0
    c.check_invariants()
    c.finished("whole")
    assert a.running == 0 and a.queue == 0
    c.check_invariants()


class RefitRoutingMachine(RuleBasedStateMachine):
    """Health changes, routes, first tokens with arbitrary realised TTFTs (a refit at every
    observation), finishes and failures: a chosen instance is always eligible (a dead one is
    never chosen), the coefficients stay within bounds, the counts match the requests."""

    def __init__(self) -> None:
        super().__init__()
        self.c = refit_core(RefitConfig(min_observations=3, refit_every=1, window_ms=200))
        self.now = 0
        self.live: dict[str, bool] = {}
        self.n = 0

    @rule(iid=st.sampled_from(["a", "b"]), ok=st.booleans())
    def health(self, iid: str, ok: bool) -> None:
        self.c.health(iid, ok, self.now)

    @rule(ms=st.integers(1, 400))
    def tick(self, ms: int) -> None:
        self.now += ms

    @rule(prefix=st.integers(0, 3), length=st.integers(1, 1200))
    def route(self, prefix: int, length: int) -> None:
        rid = f"r{self.n}"
        self.n += 1
        d = self.c.route(rid, "t", prompt_keys(DOMAIN, MODEL, LAYOUT, [prefix] * length), length, self.now)
        if isinstance(d, Decision):
            assert self.c.eligible(d.instance_id, self.now)
            self.live[rid] = False

    @precondition(lambda self: any(not v for v in self.live.values()))
    @rule(data=st.data(), ttft=st.floats(0, 1e5, allow_nan=False))
    def first_token(self, data: st.DataObject, ttft: float) -> None:
        rid = data.draw(st.sampled_from(sorted(r for r, v in self.live.items() if not v)))
        self.c.first_token(rid, ttft, self.now)
        self.live[rid] = True

    @precondition(lambda self: self.live)
    @rule(data=st.data(), fail=st.booleans())
    def end(self, data: st.DataObject, fail: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        if fail and not self.live[rid]:
            self.c.failed(rid)
        else:
            self.c.finished(rid)
        del self.live[rid]

    @invariant()
    def bounded(self) -> None:
        self.c.check_invariants()
        coef = self.c.coefficients_at(self.now)
        assert coef.running_s >= 0 and coef.overhead_s >= 0


TestRefitRoutingMachine = RefitRoutingMachine.TestCase
TestRefitRoutingMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
