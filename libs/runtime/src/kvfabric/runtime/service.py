"""`ServiceRuntime`: one service instance as a `nats.micro` service, with the shell every daemon needs.

Lifecycle (`state`): created → starting → running → stopping → stopped.
- created: `add_endpoint(verb, handler, request=Kind, decoder=family_decoder)` registers handlers
  (only in this state; see "Typed endpoints" below).
- starting: the metrics server binds, NATS connects (bounded reconnects), the micro service is
  registered (name = `Service` value, SemVer version, queue group = `service_group(service)`
  so instances share load; `$SRV.PING/INFO/STATS` answered by nats.micro), endpoints subscribe.
- running: each request is dispatched by `_dispatch`. nats-py runs one subscription's callbacks
  one after another, so the dispatcher never awaits a handler: it takes an in-flight slot and
  runs the handler in its own task, or answers `Busy` at once when all `inflight_max` slots are
  taken (bounded: nothing queues in the runtime). Endpoints registered with `gives_back=True`
  (requests that only give resources back: a lease release, an unpin, a put abort) take their
  slots from a lane of their own (`giveback_inflight_max` = `inflight_max`, a quarter per
  tenant), so they are never refused because new work fills the service or the tenant's share,
  and new work never waits behind them: at most 2 × `inflight_max` handlers run.
- stopping (SIGTERM/SIGINT, `request_stop`, NATS connection lost, invariant violated): the micro
  service stops (endpoints unsubscribe), in-flight handlers get `shutdown_grace_ms` to finish
  (0 after an invariant violation), the rest are cancelled, NATS drains and closes, the metrics
  server stops.
- stopped: `exit_code` is 0 after a requested stop, `EXIT_UNAVAILABLE` when NATS was lost or
  never reached, `EXIT_SOFTWARE` after an `InvariantViolation` or a watched task's failure.

Bounded stops (`kvfabric.runtime.deadline`): a service that owns its process calls
`stop_on_signals()`; from then on every `request_stop` (a signal, a lapsed lease, NATS lost)
arms a watchdog thread that exits the process with `EXIT_STOP_OVERRUN` (79, logged
`stop_overran`) unless it ended within `stop_deadline_ms`, whatever hangs (a task that does not
end when cancelled, a wedged loop). The signal handlers are plain Python handlers, so SIGTERM
arms the watchdog even while the event loop is blocked; a second SIGTERM/SIGINT exits at once
(`stop_forced`). `run()` (in-process use) closes the watchdog once its stop is done.

Logs: one `request_handled` line per request, at debug level when it succeeded within
`log_slow_request_ms` (its reply pad excluded), at warning level (`slow=true`) when slower;
error replies at info, busy and cancelled at warning, internal errors at error level: errors and
slow requests are always logged, ordinary traffic only with `--log-level debug`.

Tenant endpoints (`add_tenant_endpoint`) listen on `kvf.v1.<service>.t.*.<verb>`; their handler
also gets the tenant token of the subject the request arrived on (NATS permissions guarantee the
sender is that tenant: docs/security.md). A tenant request is dropped unless its reply subject is
the tenant's own inbox, and one tenant holds at most `tenant_inflight_max` (a quarter of
`inflight_max`) slots of a lane: more is `Busy` (docs/security.md); all tenants together hold
at most 7/8 of a lane, the rest is service requests' (`TenantLimiter`'s `service_reserve`).

Held refusals: a tenant request refused because its tenant holds its share is answered after
`tenant_refusal_hold_ms` (250 ms by default, the directory's fair-admission hold), not at once;
so is a handler's `Busy` with a `hold_s` (the directory's fair admission), after that long,
its lane slot given back when the handler raised (slept in the handler, the hold kept the
slot: four flooding tenants filled the give-back lane, review, stop 67).
Answered at once, a flooder that never backs off asks again at once, and each ask costs the
loop a receive and a reply (issue 21 row 2: 26-253 such refusals a second). Bounded: at most
`tenant_inflight_max` held refusals per tenant and `inflight_max` in all (each keeps its request
until answered); past either bound the refusal is answered at once (a handler's is held in its
slot, as before), as are refusals of service requests and of a full lane; a tenant refused
because all tenants hold their part of the lane is held too (not counted towards its tarpit).
A stop answers every held refusal at once (`Unavailable`).

The tarpit (`tarpit=TarpitConfig(...)`, the directory's default; `kvfabric.runtime.tarpit`): a
tenant refused `busy` of its own doing (its share of a lane spent, counted when decided, before
any hold; a handler's `Busy.own`, counted when answered; or a handler's own count,
`note_tenant_refusal`, for one that holds its refusal) on its work endpoints `refusals_max`
times within a second has those endpoints' requests taken (all but those registered
`tarpittable=False`), for a while, by a second connection that never reads them, so the service
stops receiving them at all and the sender waits out its own timeouts (holding refusals paces
only a sender that waits for them); `on_tenant_tarpitted` hears each one. Its give-backs are
never tarpitted nor counted. Started with the service, stopped first when it stops.

Typed endpoints: an endpoint registered with its request type (`request=Kind` and the
`decoder` of Kind's message family) has its request decoded and checked by the runtime, once,
in the request's task: a malformed message is the decoder's `BadRequest` ("malformed <family>
message"), another message of the family is `BadRequest` ("<verb> takes <Kind>, got <Type>"),
both answered as any handler's error (reply pad included) without calling the handler; the
handler gets the typed message: `async (message: Kind, headers) -> msgspec.Struct`
(`RequestHandler[Kind]`; `TenantRequestHandler[Kind]` adds the tenant). Registered without a
request type, a handler gets the request bytes and decodes them itself (the directory host: a
tenant's request is refused, when its share is spent, before it is decoded).

Handler contract: `async (request_bytes, headers) -> msgspec.Struct`, or the typed message for a
typed endpoint; raise a `KvfError` for an
expected error (sent as a typed error reply, see `replies`). Any other exception is a 500
`internal` reply, logged with its traceback, and the service keeps serving. `InvariantViolation`
is a bug: logged once, `internal` reply, then the service stops and exits non-zero.
The handler owns the request bytes only for the duration of the call.

Not split (over 600 lines): `ServiceRuntime` is the one shell every daemon shares; registration,
bounded lanes, tenant endpoints, request logging and the bounded stop share its lane state.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeAlias, TypeVar, overload

import msgspec
import nats
import nats.errors
import nats.micro
from nats.aio.client import Client as NatsClient
from nats.micro.request import Request as MicroRequest
from nats.micro.service import EndpointStats, ServiceVerb, control_subject
from nats.micro.service import Service as MicroService

from kvfabric.cluster.natsauth import nats_auth_from_env, nats_servers, servers_without_userinfo
from kvfabric.format.errors import BadRequest, Busy, KvfError, Unavailable
from kvfabric.format.invariant import InvariantViolation, invariant
from kvfabric.proto.codec import FamilyDecoder, decode_as, encode
from kvfabric.proto.subjects import (
    TENANT_TOKEN,
    Service,
    check_segment_id,
    endpoint_subject,
    service_group,
    tenant_from_subject,
    tenant_inbox_prefix,
)
from kvfabric.runtime.config import RuntimeSettings
from kvfabric.runtime.deadline import EXIT_STOP_OVERRUN, StopWatchdog, cancel_and_wait, exit_now
from kvfabric.runtime.inflight import Admission, TenantLimiter
from kvfabric.runtime.logs import get_logger, request_context
from kvfabric.runtime.metrics import MetricsServer, Outcome, ServiceMetrics
from kvfabric.runtime.replies import error_response, internal_error
from kvfabric.runtime.tarpit import TenantTarpit
from kvfabric.runtime.tarpit_core import TarpitConfig, TarpitCore

__all__ = [
    "EXIT_OK",
    "EXIT_SOFTWARE",
    "EXIT_STOP_OVERRUN",
    "EXIT_UNAVAILABLE",
    "Handler",
    "RequestHandler",
    "RuntimeState",
    "ServiceRuntime",
    "TenantHandler",
    "TenantRequestHandler",
]

M = TypeVar("M", bound=msgspec.Struct)

Handler: TypeAlias = Callable[[bytes, Mapping[str, str]], Awaitable[msgspec.Struct]]
TenantHandler: TypeAlias = Callable[[bytes, Mapping[str, str], str], Awaitable[msgspec.Struct]]
# A typed endpoint's handler (module docstring): the runtime decoded and checked the message.
RequestHandler: TypeAlias = Callable[[M, Mapping[str, str]], Awaitable[msgspec.Struct]]
TenantRequestHandler: TypeAlias = Callable[[M, Mapping[str, str], str], Awaitable[msgspec.Struct]]

EXIT_OK: Final = 0
EXIT_UNAVAILABLE: Final = 69  # EX_UNAVAILABLE: NATS unreachable or lost past the reconnect budget
EXIT_SOFTWARE: Final = 70  # EX_SOFTWARE: an invariant was violated
STEP_TIMEOUT_S: Final = 5.0  # bound on each shutdown step that talks to NATS
TENANT_SHARE_DIVISOR: Final = 4  # one tenant holds at most 1/4 of a lane's in-flight slots
SERVICE_RESERVE_DIVISOR: Final = 8  # 1/8 of each lane only service requests may take
# A tenant's refusal past its share is answered this long after receipt (module docstring).
TENANT_REFUSAL_HOLD_MS_DEFAULT: Final = 250
TENANT_REFUSAL_HOLD_MS_MAX: Final = 10_000
NATS_DRAIN_TIMEOUT_S: Final = 2
STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT)
_OUTCOME_LEVEL: Final = {
    Outcome.OK: logging.DEBUG,  # slow ones: warning (`log_slow_request_ms`)
    Outcome.ERROR: logging.INFO,
    Outcome.BUSY: logging.WARNING,
    Outcome.CANCELLED: logging.WARNING,
    Outcome.INTERNAL: logging.ERROR,
    Outcome.FATAL: logging.CRITICAL,
}


# Request lines logged per second for one (endpoint, outcome, error code, tenant), fatal ones
# excepted; the rest are counted and the next line logged says how many were left out
# (`suppressed`): a flood of refused or malformed requests wrote a line each (review, 2026-12-05;
# issue 21 row 13). Per tenant: one tenant's flood does not hide another's lines (2026-12-06).
LOG_LINES_PER_S_MAX: Final = 20
LOG_KINDS_MAX: Final = 1024


PAD_SPIN_S: Final = 0.0015  # the last part of a reply pad is waited by yielding, not by a timer


async def pad_until(deadline_s: float) -> None:
    """Return at `deadline_s` (time.perf_counter). Event-loop timers wake up to ~1 ms late (epoll
    rounds its timeout up to whole ms), which would keep most of a hit/miss latency gap; so sleep
    until PAD_SPIN_S before the deadline, then yield to other tasks until it (bounded spin)."""
    coarse = deadline_s - PAD_SPIN_S - time.perf_counter()
    if coarse > 0:
        await asyncio.sleep(coarse)
    while time.perf_counter() < deadline_s:  # noqa: ASYNC110 (a deadline, not an event)
        await asyncio.sleep(0)


def _answerable_tenant(request: MicroRequest, service: Service) -> str | None:
    """The tenant of a tenant request, if its reply subject lies in that tenant's own inbox."""
    reply = request._msg.reply or ""  # nats-py exposes it on the message only
    try:
        tenant = tenant_from_subject(request.subject, service)
    except ValueError:
        return None
    return tenant if reply.startswith(tenant_inbox_prefix(tenant) + ".") else None


async def _tenant_only(data: bytes, headers: Mapping[str, str]) -> msgspec.Struct:
    raise BadRequest("tenant endpoint called without a tenant")


def _decoding(verb: str, decoder: FamilyDecoder[Any], kind: type[M], handler: RequestHandler[M]) -> Handler:
    """`handler` behind the one decode and type check of its endpoint (module docstring)."""

    async def handle(data: bytes, headers: Mapping[str, str]) -> msgspec.Struct:
        return await handler(decode_as(decoder, data, kind, verb), headers)

    return handle


def _tenant_decoding(
    verb: str, decoder: FamilyDecoder[Any], kind: type[M], handler: TenantRequestHandler[M]
) -> TenantHandler:
    async def handle(data: bytes, headers: Mapping[str, str], tenant: str) -> msgspec.Struct:
        return await handler(decode_as(decoder, data, kind, verb), headers, tenant)

    return handle


class RuntimeState(enum.StrEnum):
    CREATED = "created"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class _Endpoint:
    verb: str
    subject: str
    handler: Handler
    # Subject relative to the service group: the verb, or `<verb>.<instance>` for endpoints
    # addressed to one instance (e.g. `kvf.v1.segment.free.<segment_id>`), or `t.*.<verb>`.
    relative: str
    tenant_handler: TenantHandler | None = None
    reply_min_s: float = 0.0  # no reply (answer or error) leaves before this long after receipt
    gives_back: bool = False  # only gives resources back: slots from the give-back lane
    tarpittable: bool = False  # a tenant work endpoint the tarpit may take (`add_tenant_endpoint`)


class ServiceRuntime:
    """Runs one service instance; see the module docstring for the lifecycle and contracts."""

    def __init__(
        self,
        service: Service,
        settings: RuntimeSettings,
        *,
        version: str,
        description: str,
        tenant_refusal_hold_ms: int = TENANT_REFUSAL_HOLD_MS_DEFAULT,
        tarpit: TarpitConfig | None = None,
    ) -> None:
        invariant(
            0 <= tenant_refusal_hold_ms <= TENANT_REFUSAL_HOLD_MS_MAX,
            "tenant refusal hold out of range",
            tenant_refusal_hold_ms=tenant_refusal_hold_ms,
            max=TENANT_REFUSAL_HOLD_MS_MAX,
        )
        self.service = service
        self.settings = settings
        self.version = version
        self.description = description
        self.group = service_group(service)
        self.metrics = ServiceMetrics(service.value)
        # One tenant may hold at most this many of a lane's in-flight slots (tenant endpoints),
        # so a busy or padded tenant cannot starve the others or the services.
        self.tenant_inflight_max = max(1, settings.inflight_max // TENANT_SHARE_DIVISOR)
        # ... and all tenants together leave `service_reserve` of each lane to service requests
        # (segments' heartbeats and confirms, kvctl): four tenants' shares were the whole lane.
        self.service_reserve = settings.inflight_max // SERVICE_RESERVE_DIVISOR
        self._limiter = TenantLimiter(settings.inflight_max, self.tenant_inflight_max, self.service_reserve)
        # Gives-back (`gives_back=True` endpoints) have slots of their own, as many, so a release
        # is never refused because new work is in flight, and new work never waits behind them.
        self.giveback_inflight_max = settings.inflight_max
        self._giveback = TenantLimiter(
            self.giveback_inflight_max, self.tenant_inflight_max, self.service_reserve
        )
        # Held refusals (module docstring): as many as a lane's slots, a tenant's share of them.
        self.tenant_refusal_hold_s = tenant_refusal_hold_ms / 1000
        self._held = TenantLimiter(settings.inflight_max, self.tenant_inflight_max)
        self._held_tasks: set[asyncio.Task[None]] = set()
        self._holds_end = asyncio.Event()  # set by `stop`: held refusals are answered at once
        # The tarpit (module docstring): a tenant refused too often has its work requests taken
        # by a connection that never reads them. None: off.
        self._tarpit_config = tarpit
        self._tarpit: TenantTarpit | None = None
        self._tarpit_task: asyncio.Task[None] | None = None
        self._tarpit_exported: dict[str, int] = {}  # its counters' totals as last exported
        self._tarpit_listener: Callable[[str, float], None] | None = None  # `on_tenant_tarpitted`
        self._endpoints: dict[str, _Endpoint] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._state = RuntimeState.CREATED
        self._nc: NatsClient | None = None
        self._micro: MicroService | None = None
        self._metrics_server: MetricsServer | None = None
        self._stop_requested = asyncio.Event()
        self._stopped = asyncio.Event()
        self._stop_reason: str | None = None
        self._exit_code = EXIT_OK
        # An invariant broke: requests still in flight are cancelled at once (their state may be
        # the broken one). A watched task's failure, also EXIT_SOFTWARE, keeps the grace: the
        # requests in flight are sound (review, 2026-12-05: they were cancelled unanswered).
        self._invariant_violated = False
        self._serving_stopped: asyncio.Future[None] | None = None  # `stop_serving`'s end
        # per request line kind: [second, lines logged in it, lines left out since the last]
        self._log_windows: dict[tuple[str, Outcome, str | None, str | None], list[int]] = {}
        self._stop_called = False
        # Bound on the runtime's logger and, per request, in contextvars for handler code.
        self._identity: dict[str, object] = {"service": service.value, "instance_id": settings.instance_id}
        self._log = get_logger("kvfabric.runtime").bind(**self._identity)
        self._slow_s = settings.log_slow_request_ms / 1000
        # Set by `stop_on_signals` (the service owns its process): bounds every requested stop.
        self._watchdog: StopWatchdog | None = None
        self._signals_seen = 0
        self._previous_handlers: dict[signal.Signals, object] = {}

    # ---- read-only views -------------------------------------------------------------------

    @property
    def state(self) -> RuntimeState:
        return self._state

    @property
    def exit_code(self) -> int:
        return self._exit_code

    @property
    def stop_reason(self) -> str | None:
        return self._stop_reason

    @property
    def instance_id(self) -> str:
        return self.settings.instance_id

    @property
    def micro_id(self) -> str | None:
        """The id nats.micro gave this instance (`$SRV.PING.<name>.<id>`); None before start."""
        return self._micro.id if self._micro is not None else None

    @property
    def metrics_port(self) -> int | None:
        """The bound metrics port; None when disabled or not started."""
        server = self._metrics_server
        return server.port if server is not None and server.running else None

    @property
    def inflight_count(self) -> int:
        """Handlers running now, both lanes."""
        return self._limiter.count + self._giveback.count

    @property
    def tenant_rejected_busy(self) -> int:
        """Requests refused because their tenant held its share of a lane."""
        return self._limiter.tenant_rejected_total + self._giveback.tenant_rejected_total

    @property
    def refusals_held(self) -> int:
        """Tenant refusals waiting for their hold to end (module docstring)."""
        return self._held.count

    @property
    def subjects(self) -> list[str]:
        return [endpoint.subject for endpoint in self._endpoints.values()]

    @property
    def nc(self) -> NatsClient:
        invariant(self._nc is not None, "no NATS connection before start")
        assert self._nc is not None
        return self._nc

    # ---- setup -----------------------------------------------------------------------------

    @overload
    def add_endpoint(
        self, verb: str, handler: Handler, *, instance: str | None = None, gives_back: bool = False
    ) -> str: ...

    @overload
    def add_endpoint(
        self,
        verb: str,
        handler: RequestHandler[M],
        *,
        request: type[M],
        decoder: FamilyDecoder[Any],
        instance: str | None = None,
        gives_back: bool = False,
    ) -> str: ...

    def add_endpoint(
        self,
        verb: str,
        handler: Callable[..., Awaitable[msgspec.Struct]],  # as the overload's
        *,
        request: type[msgspec.Struct] | None = None,
        decoder: FamilyDecoder[Any] | None = None,
        instance: str | None = None,
        gives_back: bool = False,
    ) -> str:
        """Register `handler` for `kvf.v1.<service>.<verb>`, or `kvf.v1.<service>.<verb>.<instance>`
        when the endpoint is addressed to this instance only (before `start`). `request` (with
        its family's `decoder`): the runtime decodes and checks the message, and `handler` gets
        it typed (module docstring); without, `handler` gets the bytes. `gives_back`: its
        requests only give resources back (module docstring). Returns the subject."""
        invariant(self._state is RuntimeState.CREATED, "endpoints are added before start", state=self._state)
        invariant(verb not in self._endpoints, "endpoint registered twice", verb=verb)
        invariant((request is None) == (decoder is None), "a request type needs its decoder", verb=verb)
        subject = endpoint_subject(self.service, verb)
        relative = verb
        if instance is not None:
            subject = f"{subject}.{check_segment_id(instance)}"
            relative = f"{verb}.{instance}"
        raw: Handler
        if request is not None and decoder is not None:
            raw = _decoding(verb, decoder, request, handler)
        else:
            raw = handler  # the untyped overload: a bytes handler
        self._endpoints[verb] = _Endpoint(
            verb=verb, subject=subject, handler=raw, relative=relative, gives_back=gives_back
        )
        return subject

    @overload
    def add_tenant_endpoint(
        self,
        verb: str,
        handler: TenantHandler,
        *,
        reply_min_ms: int = 0,
        instance: str | None = None,
        gives_back: bool = False,
        tarpittable: bool = True,
    ) -> str: ...

    @overload
    def add_tenant_endpoint(
        self,
        verb: str,
        handler: TenantRequestHandler[M],
        *,
        request: type[M],
        decoder: FamilyDecoder[Any],
        reply_min_ms: int = 0,
        instance: str | None = None,
        gives_back: bool = False,
        tarpittable: bool = True,
    ) -> str: ...

    def add_tenant_endpoint(
        self,
        verb: str,
        handler: Callable[..., Awaitable[msgspec.Struct]],  # as the overload's
        *,
        request: type[msgspec.Struct] | None = None,
        decoder: FamilyDecoder[Any] | None = None,
        reply_min_ms: int = 0,
        instance: str | None = None,
        gives_back: bool = False,
        tarpittable: bool = True,
    ) -> str:
        """Register `handler` for every tenant's `kvf.v1.<service>.t.<tenant>.<verb>` (or
        `...<verb>.<instance>` for this instance only) before `start`; it is called with the tenant
        token as third argument. `request`/`decoder`: a typed endpoint, as `add_endpoint`.
        `reply_min_ms` > 0 holds every reply until that long after
        receipt (hides how long the handler took: a timing side channel). `gives_back`: its
        requests only give resources back (module docstring). `tarpittable=False`: never taken
        by the tarpit (a report every tenant needs; give-backs never are), though its refusals
        count towards it. Returns the subject."""
        invariant(self._state is RuntimeState.CREATED, "endpoints are added before start", state=self._state)
        name = f"tenant_{verb}"
        invariant(name not in self._endpoints, "endpoint registered twice", verb=name)
        invariant((request is None) == (decoder is None), "a request type needs its decoder", verb=name)
        relative = f"{TENANT_TOKEN}.*.{endpoint_subject(self.service, verb).rsplit('.', 1)[1]}"
        if instance is not None:
            relative = f"{relative}.{check_segment_id(instance)}"
        raw: TenantHandler
        if request is not None and decoder is not None:
            raw = _tenant_decoding(verb, decoder, request, handler)
        else:
            raw = handler  # the untyped overload: a bytes handler
        self._endpoints[name] = _Endpoint(
            verb=name,
            subject=f"{self.group}.{relative}",
            handler=_tenant_only,
            relative=relative,
            tenant_handler=raw,
            reply_min_s=reply_min_ms / 1000,
            gives_back=gives_back,
            tarpittable=tarpittable and not gives_back,
        )
        return f"{self.group}.{relative}"

    async def start(self) -> None:
        """Bind metrics, connect, register. Raises `Unavailable` (after cleaning up) on failure."""
        invariant(self._state is RuntimeState.CREATED, "start called twice", state=self._state)
        invariant(bool(self._endpoints), "a service needs at least one endpoint")
        self._state = RuntimeState.STARTING
        try:
            self._start_metrics()
            self._nc = await self._connect()
            try:
                self._micro = await self._register(self._nc)
            except nats.errors.Error as exc:
                raise Unavailable(f"cannot register the service on NATS: {type(exc).__name__}") from exc
        except BaseException:
            await self._teardown()
            self._state = RuntimeState.STOPPED
            self._stopped.set()
            raise
        self._state = RuntimeState.RUNNING
        self._start_tarpit()
        self._log.info(
            "service_started",
            version=self.version,
            micro_id=self.micro_id,
            nats_url=servers_without_userinfo(self.settings.nats_url),  # never a password
            metrics_port=self.metrics_port,
            queue_group=self.group,
            subjects=self.subjects,
            inflight_max=self._limiter.limit,
        )

    @property
    def tarpit(self) -> TenantTarpit | None:
        """The tarpit, when configured and started (module docstring)."""
        return self._tarpit

    def _tarpit_subjects(self, tenant: str) -> list[str]:
        """`tenant`'s work subjects (its tenant endpoints that are not give-backs)."""
        wildcard = f"{TENANT_TOKEN}.*."
        return [
            f"{self.group}.{endpoint.relative.replace(wildcard, f'{TENANT_TOKEN}.{tenant}.', 1)}"
            for endpoint in self._endpoints.values()
            if endpoint.tarpittable
        ]

    def _start_tarpit(self) -> None:
        config = self._tarpit_config
        if config is None or not any(e.tarpittable for e in self._endpoints.values()):
            return
        nc = self._nc
        auth = nats_auth_from_env(os.environ)
        try:  # built once (a link a second); the main connection was made with the same
            tls = auth.tls_context()
        except (OSError, ValueError) as exc:
            self._log.error("tarpit_off", reason=f"{type(exc).__name__}: {exc}")
            return
        self._tarpit = TenantTarpit(
            TarpitCore(config),
            subjects_for=self._tarpit_subjects,
            queue=self.group,
            server=lambda: nc.connected_url if nc is not None and nc.is_connected else None,
            auth=auth,
            tls=tls,
            name=f"kvf-{self.service.value}-{self.settings.instance_id}-tarpit",
            log=self._log,
            on_change=self._export_tarpit,
            on_tarpitted=self._tarpitted,
        )
        self._tarpit_task = asyncio.create_task(self._tarpit.run(), name=f"kvf-{self.service.value}-tarpit")
        self.watch(self._tarpit_task, "tarpit")

    def note_tenant_refusal(self, tenant: str) -> None:
        """A `busy` of `tenant`'s own doing on a work request, counted towards its tarpit now: for
        a handler that decides a refusal and holds it before answering (the directory's fair
        admission), which then raises a plain `Busy` (a `Busy.own` would count again)."""
        if self._tarpit is not None:
            self._tarpit.note_refusal(tenant)

    def on_tenant_tarpitted(self, listener: Callable[[str, float], None]) -> None:
        """`listener(tenant, seconds)` is called, on the loop, each time a tenant is tarpitted
        for `seconds`, whichever refusal did it (one listener: the last set). It must not raise
        or block: the directory's fair admission suspends the tenant's bucket."""
        self._tarpit_listener = listener

    def _tarpitted(self, tenant: str, seconds: float) -> None:
        if self._tarpit_listener is not None:
            self._tarpit_listener(tenant, seconds)

    def _note_refusal(self, endpoint: _Endpoint, tenant: str | None) -> None:
        """A `busy` answered to a tenant's work request: counted towards its tarpit."""
        tarpit = self._tarpit
        # Every work endpoint counts, taken by the tarpit or not (a flood of an untarpittable
        # verb still tarpits the tenant's others); give-backs never do.
        work = endpoint.tenant_handler is not None and not endpoint.gives_back
        if tarpit is not None and tenant is not None and work:
            tarpit.note_refusal(tenant)

    def _export_tarpit(self) -> None:
        """The tarpit's state into the service's metrics (counters by what grew since last)."""
        tarpit = self._tarpit
        if tarpit is None:
            return
        m = self.metrics
        m.tenants_tarpitted.set(len(tarpit.core.tarpitted()))
        for name, counter, total in (
            ("entries", m.tarpit_entries, tarpit.core.entries_total),
            ("links", m.tarpit_links, tarpit.links_opened_total),
            ("failures", m.tarpit_link_failures, tarpit.link_failures_total),
            ("full", m.tarpit_full, tarpit.core.full_total),
        ):
            grown = total - self._tarpit_exported.get(name, 0)
            if grown > 0:
                counter.inc(grown)
                self._tarpit_exported[name] = total

    async def _stop_tarpit(self) -> None:
        task, self._tarpit_task = self._tarpit_task, None
        if task is not None and not task.done():
            await cancel_and_wait({task}, STEP_TIMEOUT_S)
        self.metrics.tenants_tarpitted.set(0)

    def _start_metrics(self) -> None:
        if not self.settings.metrics_enabled:
            return
        server = MetricsServer(
            self.metrics.registry, host=self.settings.metrics_host, port=self.settings.metrics_port
        )
        try:
            port = server.start()
        except OSError as exc:
            raise Unavailable(
                f"cannot bind metrics server on "
                f"{self.settings.metrics_host}:{self.settings.metrics_port}: {exc}"
            ) from exc
        self._metrics_server = server
        self._log.info("metrics_server_started", metrics_host=self.settings.metrics_host, metrics_port=port)

    async def _connect(self) -> NatsClient:
        s = self.settings
        try:
            nc = await nats.connect(
                nats_servers(s.nats_url),  # one URL, or a NATS cluster's servers as a comma list
                **nats_auth_from_env(os.environ).connect_options(),
                name=f"kvf-{self.service.value}-{s.instance_id}",
                connect_timeout=s.nats_connect_timeout_ms / 1000,  # as set (was rounded to whole seconds)
                reconnect_time_wait=s.nats_reconnect_wait_ms / 1000,
                max_reconnect_attempts=s.nats_reconnect_attempts_max,
                drain_timeout=NATS_DRAIN_TIMEOUT_S,
                error_cb=self._on_nats_error,
                disconnected_cb=self._on_nats_disconnected,
                reconnected_cb=self._on_nats_reconnected,
                closed_cb=self._on_nats_closed,
            )
        except Exception as exc:
            where = servers_without_userinfo(s.nats_url)
            raise Unavailable(f"cannot connect to NATS at {where}: {type(exc).__name__}") from exc
        self._log.info(
            "nats_connected",
            nats_url=servers_without_userinfo(s.nats_url),
            server=_server_of(nc),
        )
        return nc

    async def _register(self, nc: NatsClient) -> MicroService:
        micro = await nats.micro.add_service(
            nc,
            name=self.service.value,
            version=self.version,
            description=self.description,
            metadata={
                "instance_id": self.settings.instance_id,
                "inflight_max": str(self._limiter.limit),
                "giveback_inflight_max": str(self._giveback.limit),
            },
            queue_group=self.group,
            stats_handler=self._stats_data,
        )
        group = micro.add_group(name=self.group, queue_group=self.group)
        for endpoint in self._endpoints.values():
            await group.add_endpoint(
                name=endpoint.verb, subject=endpoint.relative, handler=self._dispatcher(endpoint)
            )
        # Readiness: nats-py's flush() writes its PING ahead of SUBs still in the client's buffer,
        # so a PONG does not prove the server has the endpoint subscriptions. A request to our
        # own `$SRV.PING.<name>.<id>` is written through that buffer after every SUB: its reply
        # proves all of them are in place (and that discovery answers).
        await nc.request(
            control_subject(ServiceVerb.PING, name=self.service.value, id=micro.id),
            b"",
            timeout=self.settings.nats_connect_timeout_ms / 1000,
        )
        return micro

    def _stats_data(self, _stats: EndpointStats) -> dict[str, int]:
        return {  # both lanes' handlers and refusals; the work lane's bound
            "inflight": self.inflight_count,
            "inflight_max": self._limiter.limit,
            "rejected_busy": self._limiter.rejected_total + self._giveback.rejected_total,
        }

    # ---- requests --------------------------------------------------------------------------

    def _dispatcher(self, endpoint: _Endpoint) -> Callable[[MicroRequest], Awaitable[None]]:
        async def dispatch(request: MicroRequest) -> None:
            await self._dispatch(endpoint, request)

        return dispatch

    async def _dispatch(self, endpoint: _Endpoint, request: MicroRequest) -> None:
        """Runs on the subscription's task: must not wait on handlers, must not raise."""
        received_s = time.perf_counter()
        tenant = None
        if endpoint.tenant_handler is not None:
            tenant = _answerable_tenant(request, self.service)
            if tenant is None:
                # NATS checks the subject a tenant publishes to, not the reply subject it attaches:
                # answering anywhere else would let a tenant make this service publish (with its
                # rights) to any subject. Dropped unanswered.
                self._finish(endpoint, Outcome.ERROR, received_s, "foreign_reply_subject")
                return
        lane = self._lane(endpoint)
        if self._state is not RuntimeState.RUNNING:
            await self._reject_busy(endpoint, request, received_s, Admission.FULL, tenant)
            return
        admission = lane.try_acquire(tenant)
        if admission is Admission.TENANT_FULL:
            # its share: its own doing (not a full lane), counted towards its tarpit when decided,
            # not when a held answer goes out (its requests keep arriving meanwhile)
            self._note_refusal(endpoint, tenant)
            if self._hold_refusal(endpoint, request, received_s, tenant, admission):
                return
        if admission is Admission.TENANTS_FULL:
            # the tenants' part of the lane: not this one's doing (not counted), held all the same
            if self._hold_refusal(endpoint, request, received_s, tenant, admission):
                return
            if tenant is not None and self._held.tenant_count(tenant) >= self._held.tenant_limit:
                # its own share of held refusals is full: it does not back off (counted; else a
                # flood past it was answered at once and never tarpitted; review of the fix).
                # Not when the table is full of others' holds, holds are off, or stopping.
                self._note_refusal(endpoint, tenant)
        if admission is not Admission.ADMITTED:
            await self._reject_busy(endpoint, request, received_s, admission, tenant)
            return
        self.metrics.inflight.set(self.inflight_count)
        task = asyncio.create_task(
            self._handle(endpoint, request, received_s, tenant),
            name=f"kvf-{self.service.value}-{endpoint.verb}",
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _hold_refusal(
        self,
        endpoint: _Endpoint,
        request: MicroRequest,
        received_s: float,
        tenant: str | None,
        admission: Admission,
    ) -> bool:
        """Answer a tenant's refusal later, in a task of its own, if the bounds on held
        refusals allow (module docstring); False: the caller answers at once."""
        if tenant is None or self.tenant_refusal_hold_s <= 0 or self._holds_end.is_set():
            return False
        if self._held.try_acquire(tenant) is not Admission.ADMITTED:
            return False
        task = asyncio.create_task(
            self._held_refusal(endpoint, request, received_s, tenant, admission),
            name=f"kvf-{self.service.value}-{endpoint.verb}-held",
        )
        self._held_tasks.add(task)
        task.add_done_callback(self._held_tasks.discard)
        return True

    async def _held_refusal(
        self, endpoint: _Endpoint, request: MicroRequest, received_s: float, tenant: str, admission: Admission
    ) -> None:
        try:
            await self._hold_until(received_s + self.tenant_refusal_hold_s)
            await self._reject_busy(endpoint, request, received_s, admission, tenant)
        finally:
            self._held.release(tenant)

    def _hold_error(
        self, endpoint: _Endpoint, request: MicroRequest, received_s: float, tenant: str | None, err: Busy
    ) -> bool:
        """A handler's refusal to be held `err.hold_s` (the directory's fair admission):
        answered later in a task of its own, within the bounds on held refusals, so the
        handler's lane slot is free meanwhile; False: the caller holds it in its slot."""
        if tenant is None or self._holds_end.is_set():
            return False
        if self._held.try_acquire(tenant) is not Admission.ADMITTED:
            return False

        async def answer_later() -> None:
            try:
                await self._hold_until(time.perf_counter() + err.hold_s)
                await pad_until(received_s + endpoint.reply_min_s)
                if self._state is RuntimeState.RUNNING:
                    await self._reply_error(request, err)
                    self._finish(
                        endpoint, Outcome.ERROR, received_s, err.code, error=err.message, tenant=tenant
                    )
                else:
                    await self._reject_busy(endpoint, request, received_s, Admission.FULL, tenant)
            finally:
                self._held.release(tenant)

        task = asyncio.create_task(answer_later(), name=f"kvf-{self.service.value}-{endpoint.verb}-held")
        self._held_tasks.add(task)
        task.add_done_callback(self._held_tasks.discard)
        return True

    async def _hold_until(self, until_s: float) -> None:
        """Until `until_s` (`time.perf_counter`), or the stop, whichever is first."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, until_s - time.perf_counter())):
                await self._holds_end.wait()

    async def _answer_held_refusals(self) -> None:
        """On stop: every held refusal answered now (`Unavailable`: the service is stopping)."""
        self._holds_end.set()
        pending = set(self._held_tasks)
        if pending:
            _, stuck = await asyncio.wait(pending, timeout=STEP_TIMEOUT_S)
            if stuck:
                await cancel_and_wait(stuck, STEP_TIMEOUT_S)

    def _lane(self, endpoint: _Endpoint) -> TenantLimiter:
        return self._giveback if endpoint.gives_back else self._limiter

    async def _reject_busy(
        self,
        endpoint: _Endpoint,
        request: MicroRequest,
        received_s: float,
        admission: Admission,
        tenant: str | None = None,
    ) -> None:
        """Answer at once without running the handler: `Busy` when full, `Unavailable` when stopping."""
        headers = request.headers or {}
        with request_context(subject=endpoint.subject, headers=headers, **self._identity):
            err: KvfError
            outcome: Outcome
            if self._state is RuntimeState.RUNNING:
                err, outcome = self._busy(endpoint, admission), Outcome.BUSY
            else:
                err, outcome = Unavailable(f"service is {self._state.value}"), Outcome.ERROR
            await self._reply_error(request, err)
            self._finish(endpoint, outcome, received_s, err.code, tenant=tenant)

    def _busy(self, endpoint: _Endpoint, admission: Admission) -> Busy:
        """Which bound refused, in the message and details (the caller backs off and retries)."""
        lane = self._lane(endpoint)
        name = "giveback_inflight_max" if endpoint.gives_back else "inflight_max"
        what = "give-back in-flight limit" if endpoint.gives_back else "in-flight limit"
        if admission is Admission.TENANT_FULL:
            return Busy(f"tenant's share of the {what} reached", tenant_inflight_max=lane.tenant_limit)
        if admission is Admission.TENANTS_FULL:
            tenants_max = lane.limit - lane.service_reserve
            return Busy(f"tenants' part of the {what} reached", tenants_inflight_max=tenants_max)
        return Busy(f"{what} reached", **{name: lane.limit})

    async def _handle(
        self, endpoint: _Endpoint, request: MicroRequest, received_s: float, tenant: str | None = None
    ) -> None:
        """One request in its own task (so contextvars bound here stay here)."""
        headers = request.headers or {}
        try:
            with request_context(subject=endpoint.subject, headers=headers, **self._identity):
                await self._run_handler(endpoint, request, headers, received_s, tenant)
        finally:
            self._lane(endpoint).release(tenant)
            self.metrics.inflight.set(self.inflight_count)

    async def _run_handler(
        self,
        endpoint: _Endpoint,
        request: MicroRequest,
        headers: Mapping[str, str],
        received_s: float,
        tenant: str | None,
    ) -> None:
        try:
            if endpoint.tenant_handler is not None:
                invariant(tenant is not None, "tenant request dispatched without its tenant")
                assert tenant is not None
                reply = await endpoint.tenant_handler(request.data, headers, tenant)
            else:
                reply = await endpoint.handler(request.data, headers)
            invariant(
                isinstance(reply, msgspec.Struct),
                "handler must return a msgspec.Struct",
                verb=endpoint.verb,
                got=type(reply).__name__,
            )
            data = encode(reply)
        except KvfError as err:
            if isinstance(err, Busy) and err.tenants_own:  # the directory's fair admission
                self._note_refusal(endpoint, tenant)
            if isinstance(err, Busy) and err.hold_s > 0 and tenant is not None:
                if self._hold_error(endpoint, request, received_s, tenant, err):
                    return  # answered after its hold, off the lane: this slot is free now
                # past the bounds on held refusals: held here, in its slot, as before (answered
                # at once, a flood's next request would run its handler at once; review of the fix)
                await self._hold_until(time.perf_counter() + err.hold_s)
            await pad_until(received_s + endpoint.reply_min_s)
            await self._reply_error(request, err)
            self._finish(endpoint, Outcome.ERROR, received_s, err.code, error=err.message, tenant=tenant)
        except InvariantViolation as exc:
            internal = internal_error(exc)
            await self._reply_error(request, internal)
            self._finish(endpoint, Outcome.FATAL, received_s, internal.code, exc_info=exc, tenant=tenant)
            self._exit_code = EXIT_SOFTWARE
            self._invariant_violated = True
            self.request_stop("invariant_violated")
        except asyncio.CancelledError:
            self._finish(endpoint, Outcome.CANCELLED, received_s, None, tenant=tenant)
            raise
        except Exception as exc:
            internal = internal_error(exc)
            await self._reply_error(request, internal)
            self._finish(endpoint, Outcome.INTERNAL, received_s, internal.code, exc_info=exc, tenant=tenant)
        else:
            await pad_until(received_s + endpoint.reply_min_s)
            await self._reply(request, data)
            self._finish(endpoint, Outcome.OK, received_s, None, tenant=tenant)

    def _finish(
        self,
        endpoint: _Endpoint,
        outcome: Outcome,
        received_s: float,
        error_code: str | None,
        *,
        error: str | None = None,
        exc_info: BaseException | None = None,
        tenant: str | None = None,
    ) -> None:
        """Metrics and the one summary log line of a request (naming its tenant, if one)."""
        duration_s = max(0.0, time.perf_counter() - received_s)
        self.metrics.observe(
            endpoint=endpoint.verb, outcome=outcome, duration_s=duration_s, error_code=error_code
        )
        event = "invariant_violated" if outcome is Outcome.FATAL else "request_handled"
        level = _OUTCOME_LEVEL[outcome]
        slow = duration_s - endpoint.reply_min_s >= self._slow_s
        if slow:
            level = max(level, logging.WARNING)
        if not self._log.is_enabled_for(level):
            return  # most requests at the default level: build no fields for a dropped line
        suppressed = 0
        if outcome is not Outcome.FATAL:
            suppressed = self._log_sampled((endpoint.verb, outcome, error_code, tenant))
            if suppressed < 0:
                return
        fields: dict[str, object] = {
            "endpoint": endpoint.verb,
            "outcome": outcome.value,
            "duration_ms": round(duration_s * 1000, 3),
        }
        if slow:
            fields["slow"] = True
        if error_code is not None:
            fields["error_code"] = error_code
        if tenant is not None:
            fields["tenant"] = tenant
        if error is not None:
            fields["error"] = error
        if exc_info is not None:
            fields["exc_info"] = exc_info
        if suppressed:
            fields["suppressed"] = suppressed
        self._log.log(level, event, **fields)

    def _log_sampled(
        self, key: tuple[str, Outcome, str | None, str | None], per_s: int = LOG_LINES_PER_S_MAX
    ) -> int:
        """-1: leave this line out (`per_s` of its kind logged this second); else how many of
        its kind were left out since the last one logged."""
        second = int(time.monotonic())
        window = self._log_windows.get(key)
        if window is None or window[0] != second:
            left_out = window[2] if window is not None else 0
            if len(self._log_windows) >= LOG_KINDS_MAX and key not in self._log_windows:
                # bounded (endpoints x outcomes x codes x tenants): earlier seconds' kinds go first
                self._log_windows = {k: w for k, w in self._log_windows.items() if w[0] == second}
                if len(self._log_windows) >= LOG_KINDS_MAX:
                    self._log_windows.clear()
            self._log_windows[key] = [second, 1, 0]
            return left_out
        if window[1] >= per_s:
            window[2] += 1
            return -1
        window[1] += 1
        return 0

    async def _reply(self, request: MicroRequest, data: bytes) -> None:
        try:
            await request.respond(data)
        except (ValueError, nats.errors.Error) as exc:
            # No reply subject (a publish, not a request) or the connection is gone.
            self._log.warning("reply_failed", reason=type(exc).__name__)

    async def _reply_error(self, request: MicroRequest, err: KvfError) -> None:
        response = error_response(err)
        try:
            await request.respond_error(
                code=response.status,
                description=response.description,
                data=response.data,
                headers=response.headers,
            )
        except (ValueError, nats.errors.Error) as exc:
            self._log.warning("reply_failed", reason=type(exc).__name__, error_code=err.code)

    # ---- NATS connection events ------------------------------------------------------------

    async def _on_nats_error(self, exc: Exception) -> None:
        """nats-py's error callback (awaited in its read path): one line per second per kind of
        error, the next saying how many were left out. A subscription past its pending bound
        reports every message it drops (a slow consumer), hundreds a second (review, 2026-12-06)."""
        suppressed = self._log_sampled((f"nats:{type(exc).__name__}", Outcome.ERROR, None, None), per_s=1)
        if suppressed < 0:
            return
        self._log.warning("nats_error_reported", error=repr(exc), suppressed=suppressed)

    async def _on_nats_disconnected(self) -> None:
        if self._state is RuntimeState.RUNNING:
            self._log.warning("nats_disconnected")

    async def _on_nats_reconnected(self) -> None:
        nc = self._nc
        self._log.info("nats_reconnected", server=_server_of(nc) if nc is not None else None)

    async def _on_nats_closed(self) -> None:
        if self._state is not RuntimeState.RUNNING:
            return  # our own drain/close, or a failed start (reported by `start`)
        self._log.error(
            "nats_connection_lost", reconnect_attempts_max=self.settings.nats_reconnect_attempts_max
        )
        if self._exit_code == EXIT_OK:
            self._exit_code = EXIT_UNAVAILABLE
        self.request_stop("nats_connection_lost")

    def watch(self, task: asyncio.Task[Any], name: str) -> None:
        """A background task of the service (a follower, a ticker): one that ends with an
        exception is logged and stops the service with `EXIT_SOFTWARE`, so its supervisor
        restarts it. Before (review, 2026-12-05), such a task died silently: the exception sat
        on it until `stop`, and the service looked healthy while it did nothing."""

        def ended(done: asyncio.Task[Any]) -> None:
            if done.cancelled() or done.exception() is None:
                return
            exc = done.exception()
            self._log.error("task_failed", task=name, error=repr(exc), exc_info=exc)
            if self._exit_code == EXIT_OK:
                self._exit_code = EXIT_SOFTWARE
            if isinstance(exc, InvariantViolation):  # its state is broken: no grace either
                self._invariant_violated = True
            self.request_stop("task_failed")

        task.add_done_callback(ended)

    # ---- stopping --------------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        """Ask `run` to stop (idempotent; call it on the loop). With `stop_on_signals` in
        effect, the process exits `stop_deadline_ms` later whatever still runs."""
        if self._watchdog is not None:
            self._watchdog.arm(self.settings.stop_deadline_ms / 1000, reason)
        if self._stop_requested.is_set():
            return
        self._stop_reason = reason
        self._log.info("stop_requested", reason=reason, inflight=self.inflight_count)
        self._stop_requested.set()

    async def wait_stop_requested(self) -> str:
        await self._stop_requested.wait()
        reason = self._stop_reason
        invariant(reason is not None, "stop requested without a reason")
        return reason or ""

    async def run(self) -> int:
        """Start, serve until SIGTERM/SIGINT (or a fatal event), stop gracefully. Returns the exit code."""
        try:
            await self.start()
        except Unavailable as err:
            self._log.error("service_start_failed", error=err.message)
            return EXIT_UNAVAILABLE
        self.stop_on_signals()
        try:
            await self._stop_requested.wait()
            return await self.stop()
        finally:
            self.release_signals()

    def stop_on_signals(self) -> None:
        """SIGTERM/SIGINT ask for a graceful stop (`request_stop`), bounded by
        `stop_deadline_ms` (module docstring). For a service that owns its process and drives
        `start`/`wait_stop_requested`/`stop` itself; the main thread only."""
        loop = asyncio.get_running_loop()
        if self._watchdog is None:
            self._watchdog = StopWatchdog(identity=self._identity)
            self._watchdog.start()

        def on_signal(signum: int, _frame: object) -> None:
            # A plain handler: runs between two bytecodes of the main thread even while the loop
            # is blocked, and only assigns (no lock a wedged thread could hold) before exiting.
            name = signal.Signals(signum).name.lower()
            self._signals_seen += 1
            if self._signals_seen > 1:
                exit_now(EXIT_STOP_OVERRUN, "stop_forced", identity=self._identity, signal=name)
            assert self._watchdog is not None
            self._watchdog.arm(self.settings.stop_deadline_ms / 1000, name)
            with contextlib.suppress(RuntimeError):  # a closed loop: the process is exiting
                loop.call_soon_threadsafe(self.request_stop, name)

        for sig in STOP_SIGNALS:
            self._previous_handlers.setdefault(sig, signal.getsignal(sig))
            signal.signal(sig, on_signal)

    def release_signals(self) -> None:
        """Undo `stop_on_signals`: previous handlers back, watchdog closed (in-process use)."""
        for sig, previous in self._previous_handlers.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous_handlers.clear()
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None

    async def stop(self) -> int:
        """Graceful stop (see the module docstring). Idempotent. Returns the exit code."""
        if self._stop_called or self._stopped.is_set():  # (a failed start stopped it already)
            await self._stopped.wait()
            return self._exit_code
        self._stop_called = True
        stopping_s = time.perf_counter()
        await self.stop_serving()
        await self._teardown()
        self._state = RuntimeState.STOPPED
        self._stopped.set()
        self._log.info(
            "service_stopped",
            reason=self._stop_reason,
            exit_code=self._exit_code,
            duration_ms=round((time.perf_counter() - stopping_s) * 1000, 3),
        )
        return self._exit_code

    async def stop_serving(self) -> None:
        """The first half of `stop`: no request taken from now on (endpoints unsubscribed), held
        refusals answered, requests in flight given their grace; NATS stays connected. A shell
        calls it before its own stop, so no handler runs on what that stop releases (they did:
        a segment's free or copy on a closed arena, a prefetch hint after its ticker stopped;
        review, 2026-12-05), then `stop`. Idempotent."""
        if self._serving_stopped is not None:  # a second caller waits for the first one's
            await asyncio.shield(self._serving_stopped)
            return
        self._serving_stopped = asyncio.get_running_loop().create_future()
        try:
            if self._stop_reason is None:
                self._stop_reason = "stop_called"
            self._state = RuntimeState.STOPPING
            await self._stop_tarpit()
            await self._answer_held_refusals()
            await self._stop_micro()
            await self._finish_inflight()
        finally:
            self._serving_stopped.set_result(None)

    async def _stop_micro(self) -> None:
        micro, self._micro = self._micro, None
        if micro is None:
            return
        try:
            await asyncio.wait_for(micro.stop(), STEP_TIMEOUT_S)
        except (TimeoutError, nats.errors.Error) as exc:
            self._log.warning("micro_stop_failed", reason=type(exc).__name__)

    async def _finish_inflight(self) -> None:
        pending = set(self._tasks)
        if not pending:
            return
        grace_s = 0.0 if self._invariant_violated else self.settings.shutdown_grace_ms / 1000
        if grace_s > 0:
            _, pending = await asyncio.wait(pending, timeout=grace_s)
        if not pending:
            return
        stuck = await cancel_and_wait(pending, STEP_TIMEOUT_S)  # cancelled again if swallowed
        self._log.warning(
            "inflight_cancelled", count=len(pending), still_running=len(stuck), grace_ms=round(grace_s * 1000)
        )

    async def _teardown(self) -> None:
        """Close NATS (drain first when possible) and the metrics server. Never raises."""
        nc, self._nc = self._nc, None
        if nc is not None and not nc.is_closed:
            try:
                await asyncio.wait_for(nc.drain(), STEP_TIMEOUT_S)
            except (TimeoutError, nats.errors.Error) as exc:
                self._log.warning("nats_drain_failed", reason=type(exc).__name__)
                if not nc.is_closed:
                    await nc.close()
        server, self._metrics_server = self._metrics_server, None
        if server is not None:
            await asyncio.to_thread(server.stop)


def _server_of(nc: NatsClient) -> str | None:
    """The server `nc` is connected to, as host:port for a log line: its URL's netloc held the
    URL's user and password (review, stop 71)."""
    url = nc.connected_url
    return None if url is None else f"{url.hostname}:{url.port}"
