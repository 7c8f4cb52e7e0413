"""The router's shell: the HTTP front, the `route` endpoint, the index follower and the engines'
health checks around one `RoutingCore` (through its `CoreDriver`, on the wall clock).

- `attach`: the NATS micro endpoint `route` (`RouteRequest` -> `RouteReply`: answer only,
  nothing admitted) and the HTTP front (`kvfabric.router.proxy`) with its metrics;
- `start`: the index follower (`kvfabric.router.index_follower`: the directory's event stream
  into the `RoutingIndex`), a KV event follower per engine that publishes them
  (`kvfabric.router.kv_events`: its own prefix cache into the core), the engines' health loop
  and the HTTP server on its own socket;
- `stop`: the HTTP server is told to exit and given `STOP_TIMEOUT_S`, then the tasks are
  cancelled (as long again at most) and the engines' HTTP client closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import uuid
from collections.abc import Iterator, Mapping
from typing import Final

import msgspec
import uvicorn
from nats.aio.client import Client as NatsClient

from kvfabric.core.routing import Decision, Refused, RoutingCore, chunk_keyer, prompt_keys
from kvfabric.core.routing_events import IndexHeard, Route, RoutingEvent, RoutingOutput
from kvfabric.core.routing_index import RoutingIndex
from kvfabric.core.step import reply_of
from kvfabric.format.errors import BadRequest
from kvfabric.proto import router as r
from kvfabric.router.http_server import HEAD_BYTES_MAX, BoundedH11Protocol
from kvfabric.router.index_follower import IndexFollower
from kvfabric.router.kv_events import KvEventsFollower
from kvfabric.router.metrics import RouterMetrics
from kvfabric.router.proxy import KEYED_TOKENS_MAX, Proxy, now_ms
from kvfabric.router.settings import RouterSettings
from kvfabric.runtime.core_driver import CoreDriver
from kvfabric.runtime.deadline import cancel_and_wait
from kvfabric.runtime.logs import get_logger
from kvfabric.runtime.service import ServiceRuntime

__all__ = ["RouterShell"]

STOP_TIMEOUT_S: Final = 5.0


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the service runtime owns SIGTERM/SIGINT (bounded stop)


class RouterShell:
    _runtime: ServiceRuntime | None = None  # set by attach

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        ks = settings.keyspace
        self.index = RoutingIndex(domain=ks.domain.digest())  # its prompts' domain only
        self.core = RoutingCore(
            settings.routing,
            [e.spec for e in settings.engines],
            self.index,
            engine_keyer=chunk_keyer(ks.domain, ks.model, ks.layout),
        )
        # Its events carry the wall clock (`now_ms`), as before; it has no effects, only replies.
        self.driver: CoreDriver[RoutingEvent, RoutingOutput] = CoreDriver(self.core, clock=lambda: now_ms())
        self._tasks: list[asyncio.Task[None]] = []
        self._server: _Server | None = None
        self._http_task: asyncio.Task[None] | None = None
        self._sock: socket.socket | None = None
        self.proxy: Proxy | None = None
        self.follower: IndexFollower | None = None
        self.kv_events = [
            KvEventsFollower(e.spec.instance_id, e.kv_events, self.driver.feed, replay=e.kv_events_replay)
            for e in settings.engines
            if e.kv_events and e.spec.engine_cache_chunks_max
        ]
        self._log = get_logger("kvfabric.router")

    def attach(self, runtime: ServiceRuntime) -> None:
        self._runtime = runtime
        runtime.add_endpoint("route", self._on_route, request=r.RouteRequest, decoder=r.router_decoder)
        registry = runtime.metrics.registry
        self.metrics = RouterMetrics(registry)
        self.proxy = Proxy(self.settings, self.core, self.metrics, registry, self.driver)

    def extra_state(self) -> dict[str, float]:
        f = self.follower
        return {
            "resync_failures": f.resync_failures if f else 0,
            "resync_seconds_last": f.resync_seconds_last if f else 0,
            "index_usable": int(self.core.index_usable(now_ms())),
            **{
                f"kv_events_{f.instance_id}_{name}": n
                for f in self.kv_events
                for name, n in (
                    *f.counters.items(),
                    *self.core.engine_cache_counters(f.instance_id).items(),
                )
            },
        }

    @property
    def http_port(self) -> int:
        assert self._sock is not None
        port: int = self._sock.getsockname()[1]
        return port

    async def start(self, nc: NatsClient) -> None:
        assert self.proxy is not None
        self.follower = IndexFollower(
            nc,
            self.index,
            domain_digest=self.settings.keyspace.domain.digest(),
            heard=self._index_heard,
            request_timeout_s=self.settings.request_timeout_s,
            listing_pages_max=self.settings.listing_pages_max,
        )
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((self.settings.http_host, self.settings.http_port))
        self._sock.listen(
            self.settings.routing.admitted_max + 64
        )  # connections wait in the backlog until served
        # Connections and requests at once, before any is authenticated (uvicorn answers 503
        # past it): every open connection held a task and its buffers without bound (review,
        # 2026-12-06). Room for every admitted request, as many being read, and probes.
        config = uvicorn.Config(
            self.proxy.app,
            log_level="warning",
            lifespan="off",
            access_log=False,
            limit_concurrency=2 * self.settings.routing.admitted_max + 64,
            # each request head bounded in bytes and time: silent or slow sockets held those
            # places for good, and httptools read heads of any size (`http_server`)
            http=BoundedH11Protocol,
            h11_max_incomplete_event_size=HEAD_BYTES_MAX,
        )
        self._server = _Server(config)
        self._http_task = asyncio.create_task(self._server.serve(sockets=[self._sock]), name="router-http")
        self._tasks = [
            *(asyncio.create_task(f.run(), name=f"router-kv-events-{f.instance_id}") for f in self.kv_events),
            asyncio.create_task(self.follower.run(), name="router-events"),
            asyncio.create_task(self.proxy.health_loop(), name="router-health"),
            self._http_task,
        ]
        # One that dies of an exception (the HTTP front, the event follower, health checks)
        # stops the router, which is restarted: the process lived on without it (review,
        # 2026-12-05).
        if self._runtime is not None:
            for task in self._tasks:
                self._runtime.watch(task, task.get_name())
        self._log.info("router_http_listening", host=self.settings.http_host, port=self.http_port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            if self._http_task is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self._http_task), STOP_TIMEOUT_S)
        await cancel_and_wait(self._tasks, STOP_TIMEOUT_S)
        if self.proxy is not None:
            await self.proxy.close()
        if self._sock is not None:
            self._sock.close()

    async def _index_heard(self) -> None:
        await self.driver.feed(IndexHeard())

    async def _on_route(self, message: r.RouteRequest, headers: Mapping[str, str]) -> msgspec.Struct:
        if not message.tokens:
            raise BadRequest("route needs the prompt's token ids")
        ks = self.settings.keyspace
        try:  # the head only, as the HTTP front (`KEYED_TOKENS_MAX`: a 1 M-token prompt's keys
            # took 0.14 s of the loop; review, 2026-12-06)
            keys = prompt_keys(ks.domain, ks.model, ks.layout, message.tokens[:KEYED_TOKENS_MAX])
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        decision = reply_of(
            await self.driver.feed(
                Route(
                    f"route-{uuid.uuid4().hex}",
                    message.tenant or "default",
                    keys,
                    len(message.tokens),
                    admit=False,
                )
            )
        )
        assert isinstance(decision, Decision | Refused)
        if not isinstance(decision, Decision):
            return r.RouteReply(instance="", reason=decision.reason)
        return r.RouteReply(
            instance=decision.instance_id,
            reason=decision.reason,
            estimates=[
                r.InstanceEstimate(
                    instance=e.instance_id,
                    ttft_s=e.ttft_s,
                    engine_tokens=e.inputs.engine_tokens,
                    colocated_tokens=e.inputs.colocated_tokens,
                    remote_tokens=e.inputs.remote_tokens,
                    compute_tokens=e.inputs.compute_tokens,
                    queued_prefill_tokens=e.inputs.queued_prefill_tokens,
                    queue=self.core.queue_of(e.instance_id),
                )
                for e in decision.estimates
            ],
        )
