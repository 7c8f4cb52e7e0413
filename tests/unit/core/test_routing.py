"""The routing core: the TTFT estimate, decisions, ties, stale data, admission, lifecycle."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfabric.core.routing import (
    EJECT_AFTER_FAILURES,
    EJECT_MS_MIN,
    Coefficients,
    CostInputs,
    Decision,
    InstanceSpec,
    Refused,
    RoutingConfig,
    RoutingCore,
    prompt_keys,
    ttft_estimate_s,
)
from kvfabric.core.routing_index import ListedGroup, ListedSegment, RoutingIndex
from kvfabric.format.key import KVLayout, ModelFingerprint, ShareDomain

TPC = 128
COEF = Coefficients(
    overhead_s=0.01,
    prefill_tokens_per_s=5000,
    colocated_bytes_per_s=1e9,
    remote_bytes_per_s=2e8,
    running_s=0.002,
)
DOMAIN = ShareDomain("t", b"s" * 16)
MODEL = ModelFingerprint(model_id="m", weights_revision="r", kv_dtype="float32", attn_config_digest="a")
LAYOUT = KVLayout(
    tp_size=1,
    tp_rank=0,
    pp_stage=0,
    layer_group=0,
    layer_group_count=1,
    tokens_per_chunk=TPC,
    tensor_layout="x",
)
CHUNK_BYTES = 512 * 1024


def core(policy: str = "cache_aware", coefficients: Coefficients = COEF, **kw: object) -> RoutingCore:
    config = RoutingConfig(tokens_per_chunk=TPC, coefficients=coefficients, policy=policy, **kw)  # type: ignore[arg-type]
    specs = [
        InstanceSpec(instance_id="a", colocated_segments=frozenset({"seg-a"}), engine_cache_chunks_max=64),
        InstanceSpec(instance_id="b", colocated_segments=frozenset({"seg-b"}), engine_cache_chunks_max=64),
    ]
    c = RoutingCore(config, specs, RoutingIndex())
    c.index_heard(0)
    for iid in c.instances:
        c.health(iid, True, 0)
    return c


def publish(c: RoutingCore, keys: list[bytes], segment: str) -> None:
    listing = [ListedGroup(k[:16], k[16:], i, CHUNK_BYTES, frozenset({segment})) for i, k in enumerate(keys)]
    c.index.resync([ListedSegment("seg-a", 1, True), ListedSegment("seg-b", 1, True)], listing, at_seq=1)


PROMPT = list(range(3000))
KEYS = prompt_keys(DOMAIN, MODEL, LAYOUT, PROMPT)


# ---- the estimate ---------------------------------------------------------------------------

inputs_st = st.builds(
    lambda p, e, cl, r, q, run, cb, rb: CostInputs(
        prompt_tokens=p + e + cl + r + 1,
        engine_tokens=e,
        colocated_tokens=cl,
        remote_tokens=r,
        colocated_bytes=cb,
        remote_bytes=rb,
        queued_prefill_tokens=q,
        running=run,
    ),
    st.integers(0, 10**5),
    st.integers(0, 10**5),
    st.integers(0, 10**5),
    st.integers(0, 10**5),
    st.integers(0, 10**6),
    st.integers(0, 100),
    st.integers(0, 10**9),
    st.integers(0, 10**9),
)
FIELDS = ("queued_prefill_tokens", "running", "colocated_bytes", "remote_bytes", "prompt_tokens")


@given(inputs_st, st.sampled_from(FIELDS), st.integers(1, 10**5))
def test_estimate_monotone_in_each_input(inputs: CostInputs, name: str, more: int) -> None:
    """More queue, more running requests, more bytes to load or more tokens to compute (a
    longer prompt with the same cached tokens) never lower the estimate."""
    grown = replace(inputs, **{name: getattr(inputs, name) + more})
    assert ttft_estimate_s(grown, COEF) >= ttft_estimate_s(inputs, COEF)


@given(inputs_st, st.integers(1, 10**4))
def test_estimate_lower_when_engine_holds_more(inputs: CostInputs, shift: int) -> None:
    """Tokens moved from compute to the engine's own cache never raise the estimate."""
    shift = min(shift, inputs.compute_tokens - 1)
    moved = replace(inputs, engine_tokens=inputs.engine_tokens + shift)
    assert ttft_estimate_s(moved, COEF) <= ttft_estimate_s(inputs, COEF)


# ---- decisions -----------------------------------------------------------------------------


def test_prefix_on_a_goes_to_a_when_idle_then_b_past_break_even() -> None:
    c = core()
    first = c.route("r0", "t", KEYS, len(PROMPT), 0)
    assert isinstance(first, Decision)
    c.first_token("r0")
    c.finished("r0")
    publish(c, KEYS, f"seg-{first.instance_id}")  # its connector saved the prefix
    other = "b" if first.instance_id == "a" else "a"
    again = c.route("r1", "t", KEYS, len(PROMPT), 0)
    assert isinstance(again, Decision)
    assert again.instance_id == first.instance_id and again.reason == "cache_aware"
    assert again.estimate.inputs.engine_tokens == 2944  # 23 usable chunks in its own cache
    # Load the first instance with long prefills: past the break-even, the other instance
    # (which loads the prefix from kvfabric) is cheaper.
    # Break-even here: B loads 2944 tokens from a remote segment (12 MB at 0.2 GB/s: 0.06 s) and
    # computes 56; A computes 56 after its queue: A wins while its queue is under ~300 tokens.
    c.health(other, False, 0)
    d = c.route("small", "t", [], 200, 0)
    assert isinstance(d, Decision) and d.instance_id == first.instance_id
    c.health(other, True, 0)
    still = c.route("r1b", "t", KEYS, len(PROMPT), 0, admit=False)
    assert isinstance(still, Decision) and still.instance_id == first.instance_id
    c.health(other, False, 0)
    d = c.route("long", "t", [], 4000, 0)
    assert isinstance(d, Decision) and d.instance_id == first.instance_id
    c.health(other, True, 0)
    moved = c.route("r2", "t", KEYS, len(PROMPT), 0)
    assert isinstance(moved, Decision)
    assert moved.instance_id == other
    assert moved.estimate.inputs.remote_tokens == 2944  # from kvfabric, its segment remote to b
    c.check_invariants()


def test_dead_or_stale_instance_never_chosen() -> None:
    c = core(health_stale_ms=1000)
    c.health("a", False, 10)
    for i in range(5):
        d = c.route(f"r{i}", "t", KEYS, len(PROMPT), 10)
        assert isinstance(d, Decision) and d.instance_id == "b"
    assert isinstance(c.route("late", "t", KEYS, len(PROMPT), 1001), Refused)  # b's check is stale too
    refused = c.route("late2", "t", KEYS, len(PROMPT), 1001)
    assert isinstance(refused, Refused) and refused.reason == "no_instance"


def test_ties_break_by_load_then_by_rendezvous() -> None:
    c = core()
    d1 = c.route("r1", "t", KEYS, len(PROMPT), 0, admit=False)
    d2 = c.route("r2", "t", KEYS, len(PROMPT), 0, admit=False)
    assert isinstance(d1, Decision) and isinstance(d2, Decision)
    assert d1.instance_id == d2.instance_id and d1.reason == "tie_hash"  # the same prefix, the same place
    others = [prompt_keys(DOMAIN, MODEL, LAYOUT, [i, *PROMPT[1:]]) for i in range(1, 30)]
    chosen = set()
    for keys in others:
        d = c.route("x", "t", keys, len(PROMPT), 0, admit=False)
        assert isinstance(d, Decision)
        chosen.add(d.instance_id)
    assert chosen == {"a", "b"}  # different prefixes spread
    # Within tie_s, the less loaded instance wins.
    c2 = core(tie_s=1.0)
    busy = c2.route("r", "t", [], 20, 0)
    assert isinstance(busy, Decision)
    d = c2.route("s", "t", [], 20, 0)
    assert isinstance(d, Decision) and d.instance_id != busy.instance_id and d.reason == "tie_load"


def test_ties_spread_prompts_that_share_only_a_system_prompt() -> None:
    """Every prompt opens with the same 128-token block (a system prompt; every request of the
    serving benchmark's trace does): when tied they still spread, by their own last chunk. (A
    rendezvous on the first chunk sent all 104 of the 105 ties of one benchmark run to one engine.)"""
    c = core()
    system = list(range(TPC))
    chosen = []
    for i in range(30):
        prompt = system + [10_000 + i] * (5 * TPC)
        d = c.route(f"s{i}", "t", prompt_keys(DOMAIN, MODEL, LAYOUT, prompt), len(prompt), 0, admit=False)
        assert isinstance(d, Decision) and d.reason == "tie_hash"
        chosen.append(d.instance_id)
    assert set(chosen) == {"a", "b"}


def test_tie_goes_where_the_engine_cache_holds_the_prompt() -> None:
    """a holds the prompt in its own cache and decodes one request; b is idle and could load
    it from kvfabric about as fast (within tie_s): the conversation stays on a."""
    c = core(tie_s=0.05)
    warm = c.route("warm", "t", KEYS, len(PROMPT), 0, exclude=("b",))
    assert isinstance(warm, Decision) and warm.instance_id == "a"
    c.first_token("warm")  # a: the prefix in its cache, one request decoding
    publish(c, KEYS, "seg-b")
    d = c.route("next", "t", KEYS, len(PROMPT), 0, admit=False)
    assert isinstance(d, Decision)
    by_id = {e.instance_id: e for e in d.estimates}
    assert by_id["b"].inputs.colocated_tokens == 2944 and by_id["a"].inputs.engine_tokens == 2944
    assert c.queue_of("a") == 1 and c.queue_of("b") == 0
    assert d.instance_id == "a" and d.reason == "tie_cache"


def test_stale_index_counts_no_kvfabric_tokens() -> None:
    c = core(index_stale_ms=2000)
    publish(c, KEYS, "seg-a")
    e = c.inputs_for("b", KEYS, len(PROMPT), 1000)
    assert e.remote_tokens == 2944
    assert c.inputs_for("b", KEYS, len(PROMPT), 2001).remote_tokens == 0  # stream not heard from
    c.index_heard(2001)
    assert c.inputs_for("a", KEYS, len(PROMPT), 2001).colocated_tokens == 2944
    c.index.synced = False  # a gap: until the resync
    assert c.inputs_for("a", KEYS, len(PROMPT), 2001).colocated_tokens == 0


def test_down_instance_forgets_its_learned_cache() -> None:
    c = core()
    d = c.route("r", "t", KEYS, len(PROMPT), 0)
    assert isinstance(d, Decision)
    c.first_token("r")
    c.finished("r")
    assert c.inputs_for(d.instance_id, KEYS, len(PROMPT), 0).engine_tokens == 2944
    c.health(d.instance_id, False, 1)
    c.health(d.instance_id, True, 2)
    assert c.inputs_for(d.instance_id, KEYS, len(PROMPT), 2).engine_tokens == 0


def test_admission_bounds_total_and_tenant() -> None:
    c = core(admitted_max=4, tenant_inflight_max=2)
    assert isinstance(c.route("a1", "ta", [], 100, 0), Decision)
    assert isinstance(c.route("a2", "ta", [], 100, 0), Decision)
    r = c.route("a3", "ta", [], 100, 0)
    assert isinstance(r, Refused) and r.reason == "tenant_inflight_max" and r.retry_after_s >= 1
    assert isinstance(c.route("b1", "tb", [], 100, 0), Decision)  # another tenant still gets in
    assert isinstance(c.route("b2", "tb", [], 100, 0), Decision)
    r = c.route("c1", "tc", [], 100, 0)
    assert isinstance(r, Refused) and r.reason == "admitted_max"
    c.finished("a1")
    assert isinstance(c.route("c1", "tc", [], 100, 0), Decision)
    c.check_invariants()


def test_queue_bound_per_instance() -> None:
    c = core()
    for i in range(32):
        assert isinstance(c.route(f"r{i}", f"t{i}", [], 100, 0), Decision)
    r = c.route("over", "tx", [], 100, 0)
    assert isinstance(r, Refused) and r.reason == "queues_full"


def test_failover_excludes_and_marks_down() -> None:
    c = core()
    d = c.route("r", "t", KEYS, len(PROMPT), 0)
    assert isinstance(d, Decision)
    assert c.failed("r") == d.instance_id
    again = c.route("r", "t", KEYS, len(PROMPT), 0, exclude=[d.instance_id])
    assert isinstance(again, Decision) and again.instance_id != d.instance_id and again.reason == "failover"
    assert not c.eligible(d.instance_id, 0)
    c.check_invariants()


def test_an_engine_failing_every_request_while_healthy_is_ejected_then_tried_again() -> None:
    """An engine that 500s on everything (or whose router key is wrong) while its `/health`
    answers 200: its requests end at once, so it had no load, the lowest estimate, and was every
    request's first choice (review, stop 70). Ejected after three in a row, for 5 s, doubled if
    it fails again once back; a first token ends it. At most half the engines at once."""
    c = core("least_loaded", health_stale_ms=10**9)
    now = 0

    def fail_on(iid: str) -> None:
        nonlocal now
        decision = c.route(f"r{now}", "t", [], 100, now, exclude=[i for i in c.instances if i != iid])
        assert isinstance(decision, Decision) and decision.instance_id == iid, decision
        assert c.failed(f"r{now}", down=False, now_ms=now) == iid  # a 5xx: reachable, not down
        now += 1

    bad, good = "a", "b"
    for _ in range(EJECT_AFTER_FAILURES):
        fail_on(bad)
    assert not c.eligible(bad, now) and c.eligible(good, now) and c.counters["instance_ejected"] == 1
    for _ in range(3):  # half the engines are out: the other is not ejected for its failures
        fail_on(good)
    assert c.eligible(good, now)
    assert c.eligible(bad, now + EJECT_MS_MIN)  # back after its backoff
    c.check_invariants()


def test_round_robin_alternates() -> None:
    c = core("round_robin")
    got = []
    for i in range(4):
        d = c.route(f"r{i}", "t", KEYS, len(PROMPT), 0)
        assert isinstance(d, Decision)
        got.append(d.instance_id)
    assert got == ["a", "b", "a", "b"]


# ---- random lifecycles ---------------------------------------------------------------------


class RoutingMachine(RuleBasedStateMachine):
    """Random health changes, routes (several prefixes, tenants), first tokens, finishes and
    failures: a chosen instance is always eligible at that moment, bounds hold, the counts
    match the requests, and a request ends exactly once."""

    def __init__(self) -> None:
        super().__init__()
        self.c = core(admitted_max=6, tenant_inflight_max=4, health_stale_ms=50)
        for iid in ("a", "b"):
            self.c.instances[iid].spec = replace(self.c.instances[iid].spec, queue_max=3)
        self.now = 0
        self.live: dict[str, bool] = {}  # request -> first token seen
        self.n = 0

    @rule(iid=st.sampled_from(["a", "b"]), ok=st.booleans())
    def health(self, iid: str, ok: bool) -> None:
        self.c.health(iid, ok, self.now)

    @rule(ms=st.integers(1, 40))
    def tick(self, ms: int) -> None:
        self.now += ms

    @rule(prefix=st.integers(0, 3), length=st.integers(1, 1200), tenant=st.sampled_from(["t1", "t2"]))
    def route(self, prefix: int, length: int, tenant: str) -> None:
        keys = prompt_keys(DOMAIN, MODEL, LAYOUT, [prefix] * length)
        rid = f"r{self.n}"
        self.n += 1
        d = self.c.route(rid, tenant, keys, length, self.now)
        if isinstance(d, Decision):
            assert self.c.eligible(d.instance_id, self.now)
            assert self.c.queue_of(d.instance_id) <= self.c.instances[d.instance_id].spec.queue_max
            self.live[rid] = False
        else:
            assert d.retry_after_s >= 1

    @precondition(lambda self: any(not v for v in self.live.values()))
    @rule(data=st.data())
    def first_token(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(r for r, v in self.live.items() if not v)))
        self.c.first_token(rid)
        self.live[rid] = True

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def presume_prefilled(self, data: st.DataObject) -> None:
        """(a request not streamed, past its estimated TTFT; its first token may still come)"""
        self.c.presume_prefilled(data.draw(st.sampled_from(sorted(self.live))))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), fail=st.booleans())
    def end(self, data: st.DataObject, fail: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        if fail and not self.live[rid]:
            assert self.c.failed(rid) is not None
        else:
            self.c.finished(rid)
        del self.live[rid]

    @invariant()
    def bounded(self) -> None:
        self.c.check_invariants()
        assert self.c.in_flight == len(self.live) <= 6


TestRoutingMachine = RoutingMachine.TestCase
TestRoutingMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
