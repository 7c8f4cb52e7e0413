"""The fair-admission shell: tenants' requests wait for their turn here before any core sees them.

`FairGate.turn(tenant, ids)` is an async context manager around one tenant request's work
(`kvfabric.directory.shard_host`, after the request is decoded, before the shard's shell runs it):
it asks the pure core (`kvfabric.directory.admission`) to queue the request, refuses it at
once with `Busy` (the existing error: every client backs off and asks again,
`kvfabric.client.busy`) when the tenant's bucket or queue is full, and otherwise waits until
the core starts it, at most `TURN_WAIT_S_MAX` (then `busy`: no client waits that long).
Leaving the block tells the core the request is done, and starts the next ones. Time is
`time.monotonic`.

Gives-back (lease release, unpin, put abort, lease_release_many) never wait for a turn: they
are never refused for load (`authz.GIVEBACK_VERBS`, their own in-flight lane in
`kvfabric.runtime.service`). Only their ids that released nothing are charged, to a separate
per-tenant budget (`giveback`, `admission.GivebackBudget`, which may go into debt); a tenant
that spent it has its next give-back tried one slice first, refused `busy` when that slice gives
nothing back (`kvfabric.directory.giveback`), and from then on, until a token has refilled, its
give-backs are refused before they are decoded (`giveback_refuse_early`, held like the others
below). Neither do
services' requests (segments' heartbeats, kvctl) nor the shard map (its own per-tenant rate).
A request waiting here holds its runtime in-flight slot, so the runtime's per-tenant share
(`tenant_inflight_max`) still bounds what one tenant has in the directory.

A refusal is held (`REFUSAL_HOLD_S_MAX`, or until the tenant's bucket would take the request,
whichever is sooner) before it is answered: `Busy.hold_s`, held by the runtime off the request's
in-flight lane (a refusal slept on here kept its lane slot for the hold: four flooding tenants
filled the give-back lane and segments' heartbeats were refused; review, stop 67). Answered at
once, a flood that never backs off asks again at once: the loop then spends itself on receiving
and refusing (measured: alice's lookup p50 4-7x her baseline during bob's max-size flood, 16 in
flight, vs within 2x while his requests waited). Held, each of the flooder's in-flight requests
costs one refusal per hold; an honest client waits `retry_after_ms` anyway
(`kvfabric.client.busy`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Final, Protocol

from kvfabric.directory.admission import AdmissionConfig, FairAdmission, GivebackBudget, Refusal, cost_of
from kvfabric.format.errors import Busy
from kvfabric.proto.common import TIMEOUT_MS_HEADER

__all__ = ["REFUSAL_HOLD_S_MAX", "SENDER_WAIT_SHARE", "TURN_WAIT_S_MAX", "FairGate", "sender_wait_s"]

REFUSAL_HOLD_S_MAX: Final = 0.25  # a refusal is answered after at most this long (module docstring)
# A request waits at most this long for its turn, then is `busy` (its turn given up): no client
# waits longer (a lookup's timeout is 2 s, a save's 30 s is spread over several requests), and a
# request whose client gave up would still run, on the tenant's slot and tokens (review, 2026-12-05).
TURN_WAIT_S_MAX: Final = 10.0


# A request waits for its turn at most this share of its sender's own timeout (what is left is
# the work and the reply's way back).
SENDER_WAIT_SHARE: Final = 0.8


def sender_wait_s(headers: Mapping[str, str]) -> float:
    """How long a request may wait for its turn: `SENDER_WAIT_SHARE` of the timeout its sender
    named (`TIMEOUT_MS_HEADER`), at most `TURN_WAIT_S_MAX` (no header, or a bad one: that).
    Past its sender's timeout a request still ran, on the tenant's slot and budget, and a lookup
    took a lease nobody would give back (~30 s on up to 4,096 groups; review, stop 67)."""
    try:
        timeout_ms = int(headers.get(TIMEOUT_MS_HEADER, ""))
    except ValueError:
        return TURN_WAIT_S_MAX
    return TURN_WAIT_S_MAX if timeout_ms <= 0 else min(TURN_WAIT_S_MAX, SENDER_WAIT_SHARE * timeout_ms / 1000)


class Tarpit(Protocol):
    """What the gate asks of the service's tarpit (`kvfabric.runtime.service.ServiceRuntime`)."""

    def note_tenant_refusal(self, tenant: str) -> None: ...

    def on_tenant_tarpitted(self, listener: Callable[[str, float], None]) -> None: ...


class FairGate:
    """One per directory instance: every shard it leads shares the loop, so one gate for all.

    With `tarpit` (the directory's runtime), a refusal of the tenant's own doing is counted
    towards its tarpit when it is decided, not when its held answer goes out: the tenant's
    requests keep arriving during the hold (counted when answered, a flooder coming off a tarpit
    was tarpitted again ~0.45 s after its release; counted when decided, ~0.2 s: measured,
    docs/security.md "The tarpit"). And
    whenever a tenant is tarpitted (by these refusals or the runtime's own), its bucket is
    suspended for the tarpit's length (`FairAdmission.suspend`): it banked up to a burst of its
    largest requests while its requests went unread, and spent it on its release, each one
    making the other tenants' next request wait its turn. Without `tarpit`, a refusal is
    `Busy.own`, counted by the runtime when answered."""

    def __init__(
        self,
        config: AdmissionConfig,
        clock: Callable[[], float] = time.monotonic,
        tarpit: Tarpit | None = None,
    ) -> None:
        self.core = FairAdmission(config)
        self.clock = clock
        self.tarpit = tarpit
        if tarpit is not None:
            tarpit.on_tenant_tarpitted(self._suspend)
        self._waiters: dict[int, asyncio.Future[None]] = {}
        self.giveback = GivebackBudget(config.giveback_empty_ids_per_s, config.giveback_empty_burst_ids)
        self.waited_out_total = 0  # requests that waited `TURN_WAIT_S_MAX` for a turn: busy

    def giveback_spent(self, tenant: str) -> bool:
        """Whether `tenant` spent its budget of give-back ids that released nothing."""
        return self.giveback.spent(tenant, self.clock())

    def giveback_charge(self, tenant: str, named: int, released: int) -> None:
        """A give-back of `tenant`'s named `named` ids and released `released` of them."""
        self.giveback.charge(tenant, max(0, named - released), self.clock())

    def giveback_tried(self, tenant: str, released: bool) -> None:
        """A spent tenant's first slice released something or (`giveback_busy` follows) nothing."""
        self.giveback.tried_spent(tenant, released)

    async def giveback_refuse_early(self, tenant: str) -> None:
        """`Busy` (held, module docstring) for a give-back of a tenant whose last slice tried
        while spent released nothing, before it is decoded; nothing otherwise."""
        now_s = self.clock()
        if self.giveback.refuses(tenant, now_s):
            busy = self._giveback_busy(tenant, now_s)
            busy.hold_s = min(REFUSAL_HOLD_S_MAX, self.giveback.retry_after_s(tenant, now_s))
            raise busy

    def giveback_busy(self, tenant: str) -> Busy:
        """The refusal of a spent tenant's give-back whose first slice gave nothing back."""
        self.giveback.refused_total += 1
        self.giveback.tried_spent(tenant, released=False)
        return self._giveback_busy(tenant, self.clock())

    def _giveback_busy(self, tenant: str, now_s: float) -> Busy:
        c = self.core.config
        return Busy(
            "tenant's budget of give-backs that release nothing is spent",
            giveback_empty_ids_per_s=c.giveback_empty_ids_per_s,
            retry_after_ms=math.ceil(self.giveback.retry_after_s(tenant, now_s) * 1000),
        )

    async def refuse_early(self, tenant: str) -> None:
        """`Busy` (held, module docstring) when `tenant`'s request would be refused whatever its
        size (the caller has not decoded it yet: a flood's refusals cost no decoding)."""
        now_s = self.clock()
        why = self.core.refuse_early(tenant, now_s)
        if why is not None:
            busy, hold_s = self._busy(tenant, max(1, self.core.config.request_cost_ids), why, now_s)
            busy.hold_s = hold_s  # held by the runtime, off the lane (module docstring)
            raise busy

    @contextlib.asynccontextmanager
    async def turn(self, tenant: str, ids: int, wait_s_max: float = TURN_WAIT_S_MAX) -> AsyncIterator[None]:
        """Wait for `tenant`'s turn for a request naming `ids` ids, at most `wait_s_max` (the
        sender's own wait, `sender_wait_s`; never more than `TURN_WAIT_S_MAX`); `Busy` when
        refused."""
        core = self.core
        cost = cost_of(ids, core.config.request_cost_ids)
        now_s = self.clock()
        ticket = core.offer(tenant, cost, now_s)
        if isinstance(ticket, Refusal):
            busy, hold_s = self._busy(tenant, cost, ticket, now_s)
            busy.hold_s = hold_s  # held by the runtime, off the lane (module docstring)
            raise busy
        waiter = asyncio.get_running_loop().create_future()
        self._waiters[ticket] = waiter
        self._start(now_s)
        try:
            async with asyncio.timeout(max(0.0, min(wait_s_max, TURN_WAIT_S_MAX))):
                await waiter  # done already when it started at once: no suspension
        except (asyncio.CancelledError, TimeoutError) as stopped:
            self._waiters.pop(ticket, None)
            if not core.cancel(ticket, self.clock()):  # it started meanwhile: it owes a done
                self._done(tenant)
            if isinstance(stopped, asyncio.CancelledError):
                raise
            self.waited_out_total += 1
            raise Busy(
                "waited too long for a turn at the directory",
                turn_wait_s_max=min(wait_s_max, TURN_WAIT_S_MAX),
                retry_after_ms=math.ceil(REFUSAL_HOLD_S_MAX * 1000),
            ) from None
        try:
            yield
        finally:
            self._done(tenant)

    def charge_more(self, tenant: str, ids: int) -> None:
        """Inside `turn`: the request cost `ids` more than it named (`FairAdmission.charge_more`)."""
        self.core.charge_more(tenant, ids, self.clock())

    def _done(self, tenant: str) -> None:
        now_s = self.clock()
        self.core.done(tenant, now_s)
        self._start(now_s)

    def _start(self, now_s: float) -> None:
        for started in self.core.start(now_s):
            waiter = self._waiters.pop(started.ticket)
            if not waiter.done():  # a cancelled one's task calls `done` itself (`turn`)
                waiter.set_result(None)

    def _busy(self, tenant: str, cost: int, why: Refusal, now_s: float) -> tuple[Busy, float]:
        """The refusal and how long to hold it before answering (module docstring). Its own
        doing: counted towards the tenant's tarpit here, before its retry time is read (a
        refusal that tarpits it suspends its bucket), or, without a tarpit here, by the runtime
        when answered (`Busy.own`)."""
        refusal = Busy.own  # counted by the runtime when answered
        if self.tarpit is not None:
            self.tarpit.note_tenant_refusal(tenant)
            refusal = Busy  # counted here: the runtime must not count it again
        c = self.core.config
        if why is Refusal.QUEUE:
            busy = refusal(
                "tenant's queue of requests waiting for the directory is full",
                fair_tenant_queue_max=c.queue_max,
            )
            return busy, REFUSAL_HOLD_S_MAX
        retry_after_s = self.core.retry_after_s(tenant, cost, now_s)
        busy = refusal(
            "tenant's directory budget (ids a second) spent",
            fair_tenant_ids_per_s=c.ids_per_s,
            cost_ids=cost,
            retry_after_ms=math.ceil(retry_after_s * 1000),
        )
        return busy, min(REFUSAL_HOLD_S_MAX, max(0.0, retry_after_s))

    def _suspend(self, tenant: str, seconds: float) -> None:
        """The tenant was tarpitted for `seconds` (the runtime's listener): its bucket suspended."""
        self.core.suspend(tenant, self.clock(), seconds)
