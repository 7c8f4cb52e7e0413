"""Which tenants are tarpitted now: a synchronous, I/O-free core (time passed in).

Why (issue 21 row 2, docs/security.md "The tarpit"): a tenant that keeps sending requests it is
refused (`busy`) costs the other tenants what receiving them costs — each request crosses
nats-server's TLS and the service's one NATS connection and is read whole before anything can
refuse it. Measured, refusing such a tenant at the server with its requests *paced* is what
keeps the others' p99 within 2×; NATS has no per-user rate, so the shell (`tarpit.py`) makes the
pace: while a tenant is tarpitted, its requests are delivered to a connection that never reads
them, and its senders wait out their own timeouts.

States per tenant: free → (≥ `refusals_max` refusals within one `window_s`) → tarpitted until
`now + duration` → on probation (free, the shell drops what it held) → free after `forgive_s`.
On probation a quarter of `refusals_max` in a window tarpits it again (a flooder whose senders
time out quickly comes back at a rate its held refusals pace below the full threshold: measured,
docs/security.md "The tarpit"), for twice the previous duration, up to `duration_max_s`; after
`forgive_s` free it starts again at `duration_s` and the full threshold.

Invariants:
- a tenant is tarpitted only after `refusals_max` refusals in one window (a quarter of it on
  probation; `note_refusal` returns True exactly at that transition); honest clients, who back
  off on `busy` (20 ms doubling to 500 ms, each refusal held 250 ms), stay below it;
- every tarpit ends: `until_s - start ≤ duration_max_s`;
- at most `tarpitted_max` tenants tarpitted at once (each costs the link subscriptions: past it,
  a tenant stays with held refusals);
- bounded memory: at most `tenants_max` tenants tracked (the least recently refused free one
  is forgotten first; tarpitted ones are kept, and a new tenant past the bound is not tracked).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from kvfabric.format.invariant import invariant

__all__ = ["TarpitConfig", "TarpitCore"]

TENANTS_MAX_DEFAULT: Final = 4096


@dataclass(frozen=True, slots=True)
class TarpitConfig:
    refusals_max: int = 48  # refusals of one tenant within one window that tarpit it
    window_s: float = 1.0
    duration_s: float = 2.0  # the first tarpit; doubled on each repeat within forgive_s
    duration_max_s: float = 30.0
    forgive_s: float = 60.0
    tarpitted_max: int = 16
    tenants_max: int = TENANTS_MAX_DEFAULT

    def __post_init__(self) -> None:
        invariant(self.refusals_max >= 1, "tarpit refusals_max must be >= 1", refusals_max=self.refusals_max)
        invariant(self.window_s > 0 and self.duration_s > 0, "tarpit window and duration must be > 0")
        invariant(self.duration_max_s >= self.duration_s, "tarpit duration_max_s below duration_s")
        invariant(self.tenants_max >= 1, "tarpit tenants_max must be >= 1")
        invariant(1 <= self.tarpitted_max <= self.tenants_max, "tarpit tarpitted_max out of range")


@dataclass(slots=True)
class _Tenant:
    window_start_s: float
    refusals: int = 0
    until_s: float | None = None  # tarpitted until then
    released_s: float | None = None  # when the last tarpit ended
    last_duration_s: float = 0.0


class TarpitCore:
    def __init__(self, config: TarpitConfig | None = None) -> None:
        self.config = config or TarpitConfig()
        self._tenants: dict[str, _Tenant] = {}
        self._tarpitted: set[str] = set()
        self.entries_total = 0
        self.full_total = 0  # tenants past the threshold not tarpitted: `tarpitted_max` reached

    def note_refusal(self, tenant: str, now_s: float) -> bool:
        """A `busy` answered to `tenant`'s request. True when this refusal tarpits it."""
        state = self._tenants.get(tenant)
        if state is None:
            if not self._room():
                return False
            state = self._tenants[tenant] = _Tenant(window_start_s=now_s)
        else:  # most recent last: the forgetting order of `_room`
            self._tenants[tenant] = self._tenants.pop(tenant)
        if state.until_s is not None:
            return False  # already tarpitted (a request that reached the service anyway)
        if now_s - state.window_start_s >= self.config.window_s:
            state.window_start_s, state.refusals = now_s, 0
        state.refusals += 1
        repeat = state.released_s is not None and now_s - state.released_s < self.config.forgive_s
        threshold = max(1, self.config.refusals_max // 4) if repeat else self.config.refusals_max
        if state.refusals < threshold:
            return False
        if len(self._tarpitted) >= self.config.tarpitted_max:
            self.full_total += 1  # past the bound: it keeps held refusals only
            return False
        duration = self.config.duration_s
        if repeat:
            duration = min(state.last_duration_s * 2, self.config.duration_max_s)
        state.until_s, state.last_duration_s, state.refusals = now_s + duration, duration, 0
        self._tarpitted.add(tenant)
        self.entries_total += 1
        return True

    def expire(self, now_s: float) -> list[str]:
        """Tenants whose tarpit ended by `now_s` (now free)."""
        ended = sorted(t for t in self._tarpitted if (self._tenants[t].until_s or 0) <= now_s)
        for tenant in ended:
            self._tarpitted.discard(tenant)
            state = self._tenants[tenant]
            state.until_s, state.released_s = None, now_s
            state.window_start_s, state.refusals = now_s, 0
        return ended

    def tarpitted(self) -> frozenset[str]:
        return frozenset(self._tarpitted)

    def until_s(self, tenant: str) -> float | None:
        state = self._tenants.get(tenant)
        return state.until_s if state is not None else None

    def next_expiry_s(self) -> float | None:
        ends = [self._tenants[t].until_s or 0.0 for t in self._tarpitted]
        return min(ends) if ends else None

    def tracked(self) -> int:
        return len(self._tenants)

    def _room(self) -> bool:
        """Make room for one more tenant if the bound allows: forgets the least recent free one
        never tarpitted, else the least recent free one (its probation with it)."""
        if len(self._tenants) < self.config.tenants_max:
            return True
        free = [(t, s) for t, s in self._tenants.items() if s.until_s is None]  # oldest first
        if not free:
            return False
        never = [t for t, s in free if s.released_s is None]
        del self._tenants[never[0] if never else free[0][0]]
        return True
