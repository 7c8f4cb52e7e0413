"""Cache-aware routing: which engine instance gets a prompt, from one estimate of its TTFT.

Synchronous and I/O-free; the router service (`kvfabric.router`) calls it with the time, through
the one entry `step(event, now_ms)` (`kvfabric.core.step`; the events in
`kvfabric.core.routing_events`) or the methods it stands for. Sizes are bytes, times seconds
unless the name says `_ms`.

## Inputs
- `prompt_keys(spec, tokens)`: the 48-byte group keys (share domain digest + chain hash) of the
  prompt's full chunks, exactly as the engines' kvfabric connector and the directory name them.
- `index` (`RoutingIndex`): which chunks kvfabric holds, on which segments (directory events).
- Per instance (`InstanceSpec`): its co-located segments, its queue bound, and how many chunks
  its own prefix cache holds (0: prefix caching off). The engine's cache is *learned from the
  router's own history* (the prompts whose first token came back from it, least recently used
  forgotten past `engine_cache_chunks_max`), the approach of SGLang's cache-aware router; or,
  for an instance with `engine_events`, *told by the engine's KV events* (vLLM's BlockStored /
  BlockRemoved / AllBlocksCleared, `engine_stored` / `engine_removed` / `engine_cleared`;
  `kvfabric.core.routing_engine_cache`), which see its evictions too. The learned cache is
  forgotten when the instance is seen down (it may have restarted); the events' map when they
  say so (a gap in their sequence: a restarted engine starts it again).
- Per instance load: requests routed to it and not finished (`queue`), those still waiting for
  their first token and the tokens they must compute (`queued_prefill_tokens`).

## The estimate (`ttft_estimate_s`; docs/router.md has the measured coefficients)
Usable chunks: the prompt's full chunks, at most `(prompt_tokens - 1) // tokens_per_chunk`
(the last token is always computed: its logits are needed). From the first chunk on:
`engine_tokens` (a run of chunks in the instance's own cache), then `colocated_tokens` /
`remote_tokens` (the run continues in kvfabric; a chunk with a replica on one of the instance's
co-located segments counts as co-located, else remote), the rest `compute_tokens`.

    ttft = overhead_s
         + (queued_prefill_tokens + compute_tokens) / prefill_tokens_per_s
         + colocated_bytes / colocated_bytes_per_s + remote_bytes / remote_bytes_per_s
         + running * running_s

Monotone: never lower when the queue, the running requests, the tokens to compute or the bytes
to load grow (Hypothesis-tested).

Coefficients: `config.coefficients`, or with `config.refit` set, an online refit of them from
the realised TTFTs (`kvfabric.core.routing_refit`): each request's chosen inputs and its
realised TTFT (given with `first_token`; failovers left out: their TTFT holds the failed
attempt; text and chat prompts too: their token counts are guesses) are one observation;
`coefficients_at(now_ms)` is what every estimate uses. The refit keeps every coefficient within
bounds that are never negative, so the estimate stays monotone.

## Decision (`route`)
Policies: `cache_aware` (lowest estimate), `round_robin`, `least_loaded` (fewest in flight):
the benchmark runs every configuration through the same router.
- Eligible: healthy, last health check within `health_stale_ms` (stale health = down: a dead
  instance is never chosen), not excluded (failover), its queue below `queue_max`, not ejected:
  `EJECT_AFTER_FAILURES` requests in a row that it failed (a 5xx, a refused router key, a slow
  first byte: reachable, so not marked down) take it out for `EJECT_MS_MIN`, doubled each time
  it fails again once back (at most `EJECT_MS_MAX`); its first token ends that. At most half
  the instances are ejected at once (one failing everything while its `/health` answered 200
  had the lowest estimate, no load, and was every request's first choice; review, stop 70).
- Ties: estimates within `tie_s` of the lowest are equal; among them the instance whose own
  cache holds more of the prompt wins (a conversation stays where its cache is, when loading it
  elsewhere looks as cheap), then fewer requests in flight, then rendezvous hashing of (the
  prompt's last usable chunk key, instance id): one prompt keeps going to one instance, and
  prompts that share only a system prompt spread (hashing the first chunk sent every tie of a
  trace whose prompts all open with one block to one instance: docs/router.md).
- Stale cache data: while the index is not `synced`, or the event stream has not been heard
  from for `index_stale_ms`, no kvfabric token is counted (only the engine's own cache and the
  load): a router that may have missed evictions never promises a load.
- Admission (bounded queues, per-tenant fairness): at most `admitted_max` requests in flight in
  all, at most `tenant_inflight_max` of one tenant; over either, or with no eligible instance
  with room, the answer is `Refused` with `retry_after_s` (the shell: 429 / 503 + Retry-After).

## Request lifecycle (the shell reports each exactly once)
    route --> ROUTED (queued_prefill_tokens += compute_tokens)
    ROUTED --first_token--> RUNNING (its chunks enter the instance's learned cache)
    ROUTED --presume_prefilled--> RUNNING (not streamed: its estimated TTFT passed; no first
                                  token yet, which may still come)
    ROUTED --failed (before the first byte)--> gone; the instance is marked down when it
                                               cannot be reached (`down`); the shell may route
                                               again excluding it (failover)
    ROUTED/RUNNING --finished--> gone
Unknown request ids are counted and ignored (the network may repeat).

## Invariants (`check_invariants`)
Per instance: queue = its routed requests; running = those prefilled (a first token, or
presumed); queued_prefill_tokens = the sum over the others; learned cache within its bound;
totals per tenant match the requests.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from kvfabric.core import routing_events
from kvfabric.core.routing_engine_cache import ChunkKeyer, EngineCache
from kvfabric.core.routing_events import RoutingEvent, RoutingOutput
from kvfabric.core.routing_index import RoutingIndex
from kvfabric.core.routing_refit import CoefficientRefit, RefitConfig, features, theta_of
from kvfabric.core.step import not_before
from kvfabric.format.ids import pack_group_key
from kvfabric.format.invariant import invariant
from kvfabric.format.key import (
    KVLayout,
    ModelFingerprint,
    ShareDomain,
    chain_hashes,
    chain_step,
    tokens_to_u32,
)

__all__ = [
    "EJECT_AFTER_FAILURES",
    "EJECT_MS_MAX",
    "EJECT_MS_MIN",
    "POLICIES",
    "Coefficients",
    "CostInputs",
    "Decision",
    "Estimate",
    "InstanceSpec",
    "Policy",
    "RefitConfig",
    "Refused",
    "RoutingConfig",
    "RoutingCore",
    "chunk_keyer",
    "prompt_keys",
    "ttft_estimate_s",
]

Policy = Literal["cache_aware", "round_robin", "least_loaded"]
POLICIES: Final = ("cache_aware", "round_robin", "least_loaded")
# An instance that fails (reachable) this many requests in a row is ejected (module docstring)
EJECT_AFTER_FAILURES: Final = 3
EJECT_MS_MIN: Final = 5_000
EJECT_MS_MAX: Final = 60_000


def prompt_keys(
    domain: ShareDomain, model: ModelFingerprint, layout: KVLayout, tokens: Sequence[int]
) -> list[bytes]:
    """Group keys (domain digest + chain hash) of the full chunks of `tokens`."""
    digest = domain.digest()
    return [
        pack_group_key(digest, h) for h in chain_hashes(domain, model, layout, tokens_to_u32(list(tokens)))
    ]


def chunk_keyer(domain: ShareDomain, model: ModelFingerprint, layout: KVLayout) -> ChunkKeyer:
    """A chunk's group key (as `prompt_keys` names it) from its parent's chain hash and its
    tokens: what an engine's KV events give (`kvfabric.core.routing_engine_cache`)."""
    digest = domain.digest()

    def key(prev: bytes | None, tokens: Sequence[int]) -> tuple[bytes, bytes]:
        chain = chain_step(domain, model, layout, prev, tokens)
        return bytes(pack_group_key(digest, chain)), bytes(chain)

    return key


@dataclass(frozen=True, kw_only=True)
class Coefficients:
    overhead_s: float = 0.03  # per request: HTTP hops, scheduling, the connector's lookup
    prefill_tokens_per_s: float = 6000.0
    colocated_bytes_per_s: float = 1.0e9
    remote_bytes_per_s: float = 0.5e9
    running_s: float = 0.002  # per request already decoding on the instance

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "colocated_bytes_per_s", "remote_bytes_per_s"):
            invariant(getattr(self, name) > 0, "rates are positive", name=name)
        invariant(self.overhead_s >= 0 and self.running_s >= 0, "times are not negative")


@dataclass(frozen=True, kw_only=True)
class CostInputs:
    prompt_tokens: int
    engine_tokens: int = 0
    colocated_tokens: int = 0
    remote_tokens: int = 0
    colocated_bytes: int = 0
    remote_bytes: int = 0
    queued_prefill_tokens: int = 0
    running: int = 0

    @property
    def compute_tokens(self) -> int:
        return self.prompt_tokens - self.engine_tokens - self.colocated_tokens - self.remote_tokens


def ttft_estimate_s(inputs: CostInputs, c: Coefficients) -> float:
    invariant(inputs.compute_tokens >= 1, "the last token is always computed", compute=inputs.compute_tokens)
    return (
        c.overhead_s
        + (inputs.queued_prefill_tokens + inputs.compute_tokens) / c.prefill_tokens_per_s
        + inputs.colocated_bytes / c.colocated_bytes_per_s
        + inputs.remote_bytes / c.remote_bytes_per_s
        + inputs.running * c.running_s
    )


@dataclass(frozen=True, kw_only=True)
class InstanceSpec:
    instance_id: str
    colocated_segments: frozenset[str] = frozenset()
    engine_cache_chunks_max: int = 0  # 0: the engine runs without prefix caching
    queue_max: int = 16  # requests in flight on it (routed, not finished)
    # Its own cache from its KV events (`engine_stored` ...), not from the router's history.
    engine_events: bool = False


@dataclass(frozen=True, kw_only=True)
class RoutingConfig:
    tokens_per_chunk: int
    coefficients: Coefficients = Coefficients()
    policy: Policy = "cache_aware"
    tie_s: float = 0.001
    health_stale_ms: int = 5_000
    index_stale_ms: int = 5_000
    admitted_max: int = 64
    tenant_inflight_max: int = 32
    retry_after_s_max: int = 30
    refit: RefitConfig | None = None  # None: the coefficients as configured

    def __post_init__(self) -> None:
        invariant(self.tokens_per_chunk >= 1, "chunks hold tokens")
        invariant(self.policy in POLICIES, "a known policy", policy=self.policy)
        invariant(1 <= self.tenant_inflight_max <= self.admitted_max, "tenant share within the total")


@dataclass(frozen=True, slots=True)
class Estimate:
    instance_id: str
    ttft_s: float
    inputs: CostInputs


@dataclass(frozen=True, slots=True)
class Decision:
    request_id: str
    instance_id: str
    estimate: Estimate
    estimates: tuple[Estimate, ...]  # every eligible instance's, best first
    reason: str  # cache_aware | tie_cache | tie_load | tie_hash | round_robin | least_loaded | failover


RefusedReason = Literal["admitted_max", "tenant_inflight_max", "no_instance", "queues_full"]


@dataclass(frozen=True, slots=True)
class Refused:
    request_id: str
    reason: RefusedReason
    retry_after_s: int


@dataclass(slots=True)
class _Request:
    tenant: str
    instance_id: str
    keys: tuple[bytes, ...]
    compute_tokens: int
    # the chosen estimate's (None after a failover, or for an unkeyed prompt: not observed)
    inputs: CostInputs | None = None
    first_token: bool = False
    # its prefill counted done: out of `queued_prefill_tokens`, in `running` (its first token,
    # or `presume_prefilled` for one whose first byte is its whole answer)
    prefilled: bool = False


@dataclass(slots=True)
class _Instance:
    spec: InstanceSpec
    healthy: bool = False
    last_ok_ms: int = -(10**18)
    queue: int = 0
    running: int = 0
    queued_prefill_tokens: int = 0
    cache: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    events: EngineCache | None = None  # the engine's cache from its KV events (`engine_events`)
    failures_in_row: int = 0  # requests it failed (reachable) since its last first token
    ejections: int = 0  # in a row (its backoff doubles with each); a first token ends them
    ejected_until_ms: int = 0


class RoutingCore:
    def __init__(
        self,
        config: RoutingConfig,
        instances: Iterable[InstanceSpec],
        index: RoutingIndex,
        engine_keyer: ChunkKeyer | None = None,
    ) -> None:
        """`engine_keyer`: a chunk's group key from its parent's chain hash and its tokens, for
        the instances whose cache their KV events tell (`InstanceSpec.engine_events`)."""
        self.config = config
        self.index = index
        self.instances: dict[str, _Instance] = {}
        for spec in instances:
            invariant(spec.instance_id not in self.instances, "instance ids are unique", id=spec.instance_id)
            invariant(spec.queue_max >= 1 and spec.engine_cache_chunks_max >= 0, "instance bounds")
            inst = self.instances[spec.instance_id] = _Instance(spec)
            if spec.engine_events and spec.engine_cache_chunks_max:
                invariant(engine_keyer is not None, "engine events need a keyer", id=spec.instance_id)
                assert engine_keyer is not None  # for mypy: the invariant above
                inst.events = EngineCache(engine_keyer, config.tokens_per_chunk, spec.engine_cache_chunks_max)
        invariant(bool(self.instances), "at least one instance")
        self._requests: dict[str, _Request] = {}
        self._tenants: dict[str, int] = {}
        self._rr = 0
        self._index_heard_ms: int | None = None
        self._step_ms = 0  # the latest time given to `step`
        self.refit: CoefficientRefit | None = None
        if config.refit is not None:
            c = config.coefficients
            prior = theta_of(
                c.overhead_s,
                c.prefill_tokens_per_s,
                c.colocated_bytes_per_s,
                c.remote_bytes_per_s,
                c.running_s,
            )
            self.refit = CoefficientRefit(config.refit, prior)
        self.counters: dict[str, int] = {
            "routed": 0,
            "refused": 0,
            "failovers": 0,
            "unknown_request": 0,
            "instance_down": 0,
            "instance_ejected": 0,
            "prefill_presumed": 0,
        }

    def step(self, event: RoutingEvent, now_ms: int) -> list[RoutingOutput]:
        """The one entry (`kvfabric.core.step`): `event` at `now_ms` as the method of the same
        meaning; `Route` and `Failed` answer one `Reply`. Time going backwards is refused first
        (the methods themselves take any time: a wall clock may step back)."""
        self._step_ms = not_before(self._step_ms, now_ms)
        return routing_events.dispatch(self, event, now_ms)

    # ---- inputs from the shell -----------------------------------------------------------

    def health(self, instance_id: str, ok: bool, now_ms: int) -> None:
        inst = self.instances[instance_id]
        if ok:
            inst.healthy = True
            inst.last_ok_ms = now_ms
        else:
            self._down(inst)

    def _down(self, inst: _Instance) -> None:
        if inst.healthy:
            self.counters["instance_down"] += 1
        inst.healthy = False
        # It may come back as a new process with an empty cache. Its events, if it has them,
        # say so themselves (a restarted publisher's sequence starts again: a gap, a clear);
        # cleared on a late health check instead, a still-resident prefix would stay unknown,
        # vLLM announcing a block once.
        inst.cache.clear()

    def engine_stored(
        self,
        instance_id: str,
        block_hashes: Sequence[int | bytes],
        parent: int | bytes | None,
        token_ids: Sequence[int],
        block_size: int,
        *,
        plain: bool = True,
    ) -> None:
        """The instance's engine stored these blocks (its KV event; ignored for an instance
        whose cache is learned from history)."""
        events = self.instances[instance_id].events
        if events is not None:
            events.stored(block_hashes, parent, token_ids, block_size, plain=plain)

    def engine_removed(self, instance_id: str, block_hashes: Sequence[int | bytes]) -> None:
        events = self.instances[instance_id].events
        if events is not None:
            events.removed(block_hashes)

    def engine_cleared(self, instance_id: str) -> None:
        """All its blocks cleared, or its events cannot be trusted (a gap in their sequence)."""
        events = self.instances[instance_id].events
        if events is not None:
            events.clear()

    def engine_cache_counters(self, instance_id: str) -> dict[str, int]:
        events = self.instances[instance_id].events
        return dict(events.counters) if events is not None else {}

    def index_heard(self, now_ms: int) -> None:
        """The event stream answered (an event, or an empty fetch at its end)."""
        self._index_heard_ms = now_ms

    def index_usable(self, now_ms: int) -> bool:
        heard = self._index_heard_ms
        return self.index.synced and heard is not None and now_ms - heard <= self.config.index_stale_ms

    def eligible(self, instance_id: str, now_ms: int) -> bool:
        inst = self.instances[instance_id]
        return (
            inst.healthy
            and now_ms - inst.last_ok_ms <= self.config.health_stale_ms
            and now_ms >= inst.ejected_until_ms
        )

    # ---- estimates -----------------------------------------------------------------------

    def coefficients_at(self, now_ms: int) -> Coefficients:
        """The configured coefficients, or the refit's as of `now_ms` (its observations older
        than its window dropped first)."""
        if self.refit is not None:
            self.refit.coefficients(now_ms)
        return self.current_coefficients()

    def current_coefficients(self) -> Coefficients:
        """The coefficients as of the latest time given (a view: changes nothing)."""
        if self.refit is None or self.refit.state == "prior":
            return self.config.coefficients
        t = self.refit.current
        return Coefficients(
            overhead_s=t[0],
            prefill_tokens_per_s=1.0 / t[1],
            colocated_bytes_per_s=1.0 / t[2],
            remote_bytes_per_s=1.0 / t[3],
            running_s=t[4],
        )

    def usable_chunks(self, keys: Sequence[bytes], prompt_tokens: int) -> int:
        return max(0, min(len(keys), (prompt_tokens - 1) // self.config.tokens_per_chunk))

    def inputs_for(
        self, instance_id: str, keys: Sequence[bytes], prompt_tokens: int, now_ms: int
    ) -> CostInputs:
        invariant(prompt_tokens >= 1, "a prompt has tokens")
        inst = self.instances[instance_id]
        tpc = self.config.tokens_per_chunk
        usable = keys[: self.usable_chunks(keys, prompt_tokens)]
        engine = 0
        holds = inst.events.holds if inst.events is not None else inst.cache.__contains__
        while engine < len(usable) and holds(usable[engine]):
            engine += 1
        coloc_tokens = remote_tokens = coloc_bytes = remote_bytes = 0
        if self.index_usable(now_ms):
            for entry in self.index.available_run(usable, engine):
                if entry.replicas & inst.spec.colocated_segments:
                    coloc_tokens += tpc
                    coloc_bytes += entry.copy_bytes
                else:
                    remote_tokens += tpc
                    remote_bytes += entry.copy_bytes
        return CostInputs(
            prompt_tokens=prompt_tokens,
            engine_tokens=engine * tpc,
            colocated_tokens=coloc_tokens,
            remote_tokens=remote_tokens,
            colocated_bytes=coloc_bytes,
            remote_bytes=remote_bytes,
            queued_prefill_tokens=inst.queued_prefill_tokens,
            running=inst.running,
        )

    def estimates(
        self, keys: Sequence[bytes], prompt_tokens: int, now_ms: int, exclude: Iterable[str] = ()
    ) -> list[Estimate]:
        """Every eligible instance's estimate, best first (ties as `route` breaks them)."""
        skip = set(exclude)
        coefficients = self.coefficients_at(now_ms)
        out = []
        for iid in self.instances:
            if iid in skip or not self.eligible(iid, now_ms):
                continue
            inputs = self.inputs_for(iid, keys, prompt_tokens, now_ms)
            out.append(Estimate(iid, ttft_estimate_s(inputs, coefficients), inputs))
        tie_key = self._tie_key(keys, prompt_tokens)
        out.sort(key=lambda e: (e.ttft_s, *self._tie_order(e, tie_key)))
        return out

    def _tie_key(self, keys: Sequence[bytes], prompt_tokens: int) -> bytes:
        usable = self.usable_chunks(keys, prompt_tokens)
        return keys[usable - 1] if usable else (keys[0] if keys else b"")

    def _tie_order(self, e: Estimate, tie_key: bytes) -> tuple[int, int, int]:
        """Among equal estimates: more in the instance's own cache, fewer in flight, rendezvous."""
        return (
            -e.inputs.engine_tokens,
            self.instances[e.instance_id].queue,
            -_rendezvous(tie_key, e.instance_id),
        )

    # ---- decisions -----------------------------------------------------------------------

    def route(
        self,
        request_id: str,
        tenant: str,
        keys: Sequence[bytes],
        prompt_tokens: int,
        now_ms: int,
        *,
        exclude: Iterable[str] = (),
        admit: bool = True,
        tokens_guessed: bool = False,
    ) -> Decision | Refused:
        """Choose an instance; with `admit`, the request is in flight on it until `finished` or
        `failed`. `admit=False` only answers (the `route` endpoint for other proxies).
        `tokens_guessed`: `prompt_tokens` is a guess (a text or chat prompt: no tokenizer in
        the router), so its TTFT is no refit observation."""
        cfg = self.config
        if admit:
            invariant(request_id not in self._requests, "a request is routed once at a time", id=request_id)
            if len(self._requests) >= cfg.admitted_max:
                return self._refuse(request_id, "admitted_max", now_ms)
            if self._tenants.get(tenant, 0) >= cfg.tenant_inflight_max:
                return self._refuse(request_id, "tenant_inflight_max", now_ms)
        skip = tuple(exclude)
        failover = bool(skip)
        ranked = self.estimates(keys, prompt_tokens, now_ms, skip)
        if not ranked:
            return self._refuse(request_id, "no_instance", now_ms)
        with_room = [
            e
            for e in ranked
            if self.instances[e.instance_id].queue < self.instances[e.instance_id].spec.queue_max
        ]
        if not with_room:
            return self._refuse(request_id, "queues_full", now_ms)
        chosen, reason = self._choose(with_room, self._tie_key(keys, prompt_tokens), failover)
        if admit:
            inst = self.instances[chosen.instance_id]
            compute = chosen.inputs.compute_tokens
            self._requests[request_id] = _Request(
                tenant,
                chosen.instance_id,
                tuple(keys[: self.usable_chunks(keys, prompt_tokens)]),
                compute,
                # A text or chat prompt (no tokenizer in the router) has a token count guessed
                # from its characters and no cached tokens known: its TTFT would teach the refit
                # a cost for inputs that were never its own (stop 70's list).
                None if failover or tokens_guessed else chosen.inputs,
            )
            self._tenants[tenant] = self._tenants.get(tenant, 0) + 1
            inst.queue += 1
            inst.queued_prefill_tokens += compute
            self.counters["routed"] += 1
            if reason == "failover":
                self.counters["failovers"] += 1
        others = tuple(e for e in ranked if e is not chosen)
        return Decision(request_id, chosen.instance_id, chosen, (chosen, *others), reason)

    def _choose(self, ranked: list[Estimate], tie_key: bytes, failover: bool) -> tuple[Estimate, str]:
        policy = self.config.policy
        if policy == "round_robin":
            order = list(self.instances)
            ids = {e.instance_id: e for e in ranked}
            for step in range(len(order)):
                iid = order[(self._rr + step) % len(order)]
                if iid in ids:
                    self._rr = (self._rr + step + 1) % len(order)
                    return ids[iid], "failover" if failover else "round_robin"
        if policy == "least_loaded":
            best = min(ranked, key=lambda e: (self.instances[e.instance_id].queue, e.ttft_s))
            return best, "failover" if failover else "least_loaded"
        tied = [e for e in ranked if e.ttft_s <= ranked[0].ttft_s + self.config.tie_s]
        best = min(tied, key=lambda e: self._tie_order(e, tie_key))
        if failover:
            return best, "failover"
        if len(tied) == 1:
            return best, "cache_aware"
        if len({e.inputs.engine_tokens for e in tied}) > 1:
            return best, "tie_cache"
        queues = {self.instances[e.instance_id].queue for e in tied}
        return best, "tie_hash" if len(queues) == 1 else "tie_load"

    def _refuse(self, request_id: str, reason: RefusedReason, now_ms: int) -> Refused:
        self.counters["refused"] += 1
        self.coefficients_at(now_ms)  # the refit's window moves to now (as before)
        return Refused(request_id, reason, self.retry_after_s(now_ms))

    def retry_after_s(self, now_ms: int) -> int:
        """When a refused request should come back: the shortest queue's prefill work done (at
        least 1 s, at most `retry_after_s_max`). A query: the coefficients as of the latest
        time given to the core (`current_coefficients`), eligibility as of `now_ms`."""
        rate = self.current_coefficients().prefill_tokens_per_s
        drains = [
            inst.queued_prefill_tokens / rate
            for iid, inst in self.instances.items()
            if self.eligible(iid, now_ms)
        ]
        after = max(1, math.ceil(min(drains, default=float(self.config.retry_after_s_max))))
        return min(after, self.config.retry_after_s_max)

    def admission_refusal(
        self, tenant: str, *, reading: int = 0, reading_total: int = 0
    ) -> RefusedReason | None:
        """What `route` would refuse an admitted request of `tenant` for whatever its prompt (a
        query): the shell answers it before reading the body. A tenant at its share sent 16 MiB
        bodies that cost ~0.25 s of the router's loop each (JSON, keys) before their 429
        (review, 2026-12-06). `reading` / `reading_total`: the shell's requests of this tenant /
        of all whose bodies are still read and keyed, not yet routed: they count as in flight."""
        if len(self._requests) + reading_total >= self.config.admitted_max:
            return "admitted_max"
        if self._tenants.get(tenant, 0) + reading >= self.config.tenant_inflight_max:
            return "tenant_inflight_max"
        return None

    # ---- request lifecycle ---------------------------------------------------------------

    def first_token(self, request_id: str, ttft_s: float | None = None, now_ms: int | None = None) -> None:
        """The request's first token; with `ttft_s` (realised, seconds) and `now_ms`, and a
        refit configured, its chosen inputs and TTFT are an observation (not after a failover)."""
        req = self._requests.get(request_id)
        if req is None or req.first_token:
            self.counters["unknown_request"] += 1
            return
        req.first_token = True
        if self.refit is not None and req.inputs is not None and ttft_s is not None and now_ms is not None:
            i = req.inputs
            x = features(
                i.queued_prefill_tokens, i.compute_tokens, i.colocated_bytes, i.remote_bytes, i.running
            )
            self.refit.observe(x, ttft_s, now_ms)
        inst = self.instances[req.instance_id]
        self._prefilled(req, inst)
        inst.failures_in_row = inst.ejections = 0  # it serves: no ejection pending or in backoff
        if inst.healthy and inst.spec.engine_cache_chunks_max and inst.events is None:
            for key in req.keys:
                inst.cache[key] = None
                inst.cache.move_to_end(key)
            while len(inst.cache) > inst.spec.engine_cache_chunks_max:
                inst.cache.popitem(last=False)

    def presume_prefilled(self, request_id: str) -> None:
        """A request whose first byte is its whole answer (not streamed) is presumed past its
        prefill once its estimated TTFT has passed: its tokens leave `queued_prefill_tokens`
        and it counts `running`. It counted as queued prefill for its whole generation, so
        every estimate for its instance saw a prefill queue that was long done (stop 70's list).
        Nothing else a first token does (no refit observation, no learned cache, no end of an
        ejection count): none has come. Unknown or already prefilled: ignored."""
        req = self._requests.get(request_id)
        if req is None or req.prefilled:
            return
        self._prefilled(req, self.instances[req.instance_id])
        self.counters["prefill_presumed"] += 1

    @staticmethod
    def _prefilled(req: _Request, inst: _Instance) -> None:
        if not req.prefilled:
            req.prefilled = True
            inst.queued_prefill_tokens -= req.compute_tokens
            inst.running += 1

    def finished(self, request_id: str) -> None:
        self._end(request_id)

    def failed(self, request_id: str, *, down: bool = True, now_ms: int | None = None) -> str | None:
        """The instance failed the request before its first byte. `down` (it could not be
        reached: refused, dropped the connection): it is marked down, its cache forgotten (a
        health check brings it back); otherwise (a 5xx, a slow first byte) only this request
        ends: one request's failure, a poison input say, does not take a healthy engine and
        what the router learned of its cache out of routing (review, 2026-12-05), unless it
        fails `EJECT_AFTER_FAILURES` in a row (ejected from `now_ms`, else the latest step's
        time). Returns the instance, or None for an unknown id."""
        req = self._end(request_id)
        if req is None:
            return None
        inst = self.instances[req.instance_id]
        if down:
            self._down(inst)
        else:
            self._failed_reachable(inst, self._step_ms if now_ms is None else now_ms)
        return req.instance_id

    def _failed_reachable(self, inst: _Instance, now: int) -> None:
        """Ejected after `EJECT_AFTER_FAILURES` in a row (module docstring), unless half the
        instances are ejected already (then it stays: a poison input failing on every engine
        must not take them all out)."""
        inst.failures_in_row += 1
        if inst.failures_in_row < EJECT_AFTER_FAILURES:
            return
        ejected = sum(1 for i in self.instances.values() if i.ejected_until_ms > now)
        if ejected >= len(self.instances) // 2:
            return
        inst.failures_in_row = 0
        inst.ejections += 1
        inst.ejected_until_ms = now + min(EJECT_MS_MIN << min(inst.ejections - 1, 16), EJECT_MS_MAX)
        self.counters["instance_ejected"] += 1

    def _end(self, request_id: str) -> _Request | None:
        req = self._requests.pop(request_id, None)
        if req is None:
            self.counters["unknown_request"] += 1
            return None
        inst = self.instances[req.instance_id]
        inst.queue -= 1
        if req.prefilled:
            inst.running -= 1
        else:
            inst.queued_prefill_tokens -= req.compute_tokens
        left = self._tenants[req.tenant] - 1
        if left:
            self._tenants[req.tenant] = left
        else:
            del self._tenants[req.tenant]
        return req

    # ---- views ---------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    def queue_of(self, instance_id: str) -> int:
        return self.instances[instance_id].queue

    def check_invariants(self) -> None:
        for iid, inst in self.instances.items():
            mine = [r for r in self._requests.values() if r.instance_id == iid]
            invariant(inst.queue == len(mine), "queue counts its requests", instance=iid)
            invariant(inst.running == sum(r.prefilled for r in mine), "running counts the prefilled")
            invariant(all(r.prefilled for r in mine if r.first_token), "a first token ends a prefill")
            pending = sum(r.compute_tokens for r in mine if not r.prefilled)
            invariant(inst.queued_prefill_tokens == pending, "queued prefill tokens", instance=iid)
            invariant(len(inst.cache) <= inst.spec.engine_cache_chunks_max, "learned cache bounded")
            if inst.events is not None:
                inst.events.check_invariants()
        tenants: dict[str, int] = {}
        for r in self._requests.values():
            tenants[r.tenant] = tenants.get(r.tenant, 0) + 1
        invariant(tenants == self._tenants, "tenant counts")
        self.index.check_invariants()
        if self.refit is not None:
            self.refit.check_invariants()


def _rendezvous(key: bytes, instance_id: str) -> int:
    digest = hashlib.blake2b(key + instance_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")
