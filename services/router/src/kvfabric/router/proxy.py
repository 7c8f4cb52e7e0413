"""The OpenAI-compatible HTTP front (starlette on uvicorn; httpx to the engines).

`POST /v1/completions` and `POST /v1/chat/completions`: the body is passed to the chosen engine
unchanged and its answer (streamed or not) is passed back byte for byte.
- Routing keys: a completions `prompt` given as token ids (a list of ints) is hashed into the
  kvfabric group keys (`prompt_keys`). A text prompt or chat messages are routed by load only
  (no tokenizer in the router: `keys_unknown` in the decision metric), with the prompt's length
  in characters / 4 as its token estimate.
- Tenant: the API key's (`Authorization: Bearer`, when `KVF_ROUTER_API_KEYS` is set: a request
  without a known key gets 401), else the header `X-Kvf-Tenant` (default `default`;
  `kvfabric.router.tenants`). Trace id: header `X-Kvf-Trace-Id` (else a
  new one), returned in the response and sent to the engine as `X-Request-Id`, which vLLM makes
  its request id and the kvfabric connector carries as the client library's trace id.
- Admission (`RoutingCore.route`): refused requests get 429 (total or tenant bound) or 503 (no
  engine eligible, or every queue full) with `Retry-After`, at once: nothing waits in the router.
- Failover: nothing is sent to the client before the engine's first body byte. A connection
  error, a 5xx, a first-byte timeout or a stream closed before it sends the request to the next
  engine (at most `failover_attempts_max` engines); only an engine that cannot be reached
  (`_ENGINE_GONE`) is marked down (`RoutingCore.failed`); a request not streamed that times out
  gets 504, not a failover. After the first byte a failure ends the client's stream unfinished
  (the connection closed without the body's end). A client gone before the first byte cancels
  the engine request.
- Bounds before routing: requests whose bodies are read, parsed and keyed count against their
  tenant's share and the total (`admission_refusal`); a body has `BODY_READ_TIMEOUT_S` (408).
- TTFT realised = request received -> the engine's first body byte (for a streamed completion,
  its first token), next to the estimate of the engine chosen: both in `/metrics` and in the
  `request_routed` / `request_done` log lines.
- `GET /health` (200 while one engine is eligible), `GET /v1/models` (the first eligible
  engine's), `GET /metrics`.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Final

import httpx
import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvfabric.core import routing_events
from kvfabric.core.routing import Decision, Refused, RoutingCore, prompt_keys
from kvfabric.core.routing_events import RoutingEvent, RoutingOutput
from kvfabric.core.step import reply_of
from kvfabric.format.clock import now_ms
from kvfabric.proto.common import trace_id_of
from kvfabric.router.metrics import RouterMetrics
from kvfabric.router.settings import RouterSettings
from kvfabric.router.tenants import tenant_of
from kvfabric.runtime.core_driver import CoreDriver
from kvfabric.runtime.logs import get_logger
from kvfabric.runtime.ticker import every

__all__ = ["KEYED_TOKENS_MAX", "Proxy", "now_ms"]

TENANT_HEADER: Final = "x-kvf-tenant"
TRACE_HEADER: Final = "x-kvf-trace-id"
# vLLM makes a request id `cmpl-<X-Request-Id>-<n>-<8 random>` (`chatcmpl-` for chat), and the
# connector's client keeps the first 128 characters of it as its trace id: cut at 96, the
# router's id survives whole inside the engine's (review, stop 70).
TRACE_ID_CHARS_ROUTER_MAX: Final = 96
ENGINE_AUTH_STATUSES: Final = frozenset({401, 403, 407})  # the engine refused the router's key
BODY_BYTES_MAX: Final = 16 << 20
BODY_READ_TIMEOUT_S: Final = 30.0  # a request's whole body (16 MiB at ~0.5 MB/s); later: 408
# A client that takes no part of the answer for this long is cut (`client_stalled`): a reader
# that stopped reading held its admission slot and an engine's queue place for good (review,
# stop 66: two such streams of one tenant answered every other tenant 503 `queues_full`).
SEND_STALL_S: Final = 30.0


class _RoutedFields(msgspec.Struct):
    """What routing reads of a completion's body; the engine gets the body as it came. `stream`
    must be a JSON boolean: the string "false", which vLLM reads as false, made the router treat
    a whole generation as a stream's first token and fail it over (review, stop 66)."""

    prompt: msgspec.Raw = msgspec.Raw()  # as sent (empty: absent)
    messages: msgspec.Raw = msgspec.Raw()
    stream: bool | None = None


_routed_fields: Final = msgspec.json.Decoder(_RoutedFields)
_token_ids: Final = msgspec.json.Decoder(list[int])
KEYED_TOKENS_MAX: Final = 1 << 17  # a prompt's tokens the router keys and checks (`_keys`)
MODELS_INFLIGHT_MAX: Final = 4  # /v1/models calls relayed at once; more get 429
MODELS_BYTES_MAX: Final = 1 << 20  # an engine's /v1/models answer; a longer one is a 502
MODELS_TIMEOUT_S: Final = 10.0
HOP_HEADERS: Final = frozenset(
    {
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "content-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-authenticate",
        "proxy-authorization",
        "date",  # the router's server sends its own
        "server",
    }
)
# An idle pooled connection to an engine is dropped after this: below the engines' own keep-alive
# (uvicorn's and vLLM's 5 s). At httpx's default, 5 s too, a request sent on a connection the
# engine was closing failed `RemoteProtocolError`, which marks the engine down and forgets its
# cache (review, stop 70).
ENGINE_KEEPALIVE_S: Final = 2.0
# Failures before the first byte that say the engine cannot be reached (it is marked down, its
# cache forgotten); any other (a 5xx, a slow first byte, the router's own pool) fails this
# request over without taking the engine out of routing (review, 2026-12-05).
_ENGINE_GONE: Final = frozenset(
    {
        "ConnectError",
        "connect_timeout",
        "closed_before_first_byte",
        "RemoteProtocolError",
        "ReadError",
        "WriteError",
    }
)


class _Failed(Exception):
    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why
        self.engine_gone = why in _ENGINE_GONE


@dataclass
class _Upstream:
    response: httpx.Response
    chunks: AsyncIterator[bytes]
    first: bytes


class Proxy:
    def __init__(
        self,
        settings: RouterSettings,
        core: RoutingCore,
        metrics: RouterMetrics,
        registry: CollectorRegistry,
        driver: CoreDriver[RoutingEvent, RoutingOutput],
    ) -> None:
        self.settings = settings
        self.core = core  # read directly (queries); its events go through `driver` (they carry the time)
        self.driver = driver
        self.metrics = metrics
        self.registry = registry
        self.urls = {e.spec.instance_id: e.url for e in settings.engines}
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(
                connect=settings.connect_timeout_s, read=settings.first_byte_timeout_s, write=30.0, pool=30.0
            ),
            limits=httpx.Limits(
                max_connections=settings.routing.admitted_max + 2 * len(self.urls),
                keepalive_expiry=ENGINE_KEEPALIVE_S,
            ),
        )
        # Health checks on connections of their own: a pool full of requests (or of slow
        # /v1/models calls) made every check time out, and every engine was marked down.
        self.health_client = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.connect_timeout_s),
            limits=httpx.Limits(keepalive_expiry=ENGINE_KEEPALIVE_S),
        )
        self._checking: dict[str, asyncio.Task[None]] = {}  # each engine's health check in flight
        self._engine_auth = (
            {"authorization": f"Bearer {settings.engine_api_key}"} if settings.engine_api_key else {}
        )
        # /v1/models is not admitted by the routing core: its own small bound, so a flood of it
        # cannot take the pool's connections from the completions (review, 2026-12-05).
        self._models_slots = asyncio.Semaphore(MODELS_INFLIGHT_MAX)
        self._log = get_logger("kvfabric.router")
        self._n = 0
        self._reading: dict[str, int] = {}  # requests whose body is read, parsed or keyed, per tenant
        self._reading_total = 0
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics_page, methods=["GET"]),
            ]
        )

    async def close(self) -> None:
        await self.client.aclose()
        await self.health_client.aclose()

    # ---- health --------------------------------------------------------------------------

    async def health_loop(self) -> None:
        try:
            await every(self.settings.health_interval_s, self._check_all)
        finally:  # cancelled (the router stopping): no check outlives the loop
            checks = list(self._checking.values())
            for check in checks:
                check.cancel()
            if checks:
                await asyncio.wait(checks, timeout=self.settings.connect_timeout_s)

    async def _check_all(self) -> None:
        """Start a check of every engine whose last one has ended, without waiting for them: a
        round waited for every check, so one hung engine held every other engine's health
        answer for the connect timeout; past the stale window every engine was stale, every
        request 503 (review, stop 68). At most one check per engine is in flight."""
        for iid, url in self.urls.items():
            if iid in self._checking:
                continue  # its last check still waits (bounded by the connect timeout)
            check = asyncio.create_task(self._check(iid, url), name=f"router-health-{iid}")
            self._checking[iid] = check
            check.add_done_callback(functools.partial(self._check_ended, iid))

    def _check_ended(self, iid: str, _check: asyncio.Task[None]) -> None:
        self._checking.pop(iid, None)

    async def _check(self, iid: str, url: str) -> None:
        """One engine's health check, bounded by the connect timeout whatever hangs; anything
        but a 200 is down. Never raises (an exception here ended the health loop: every engine
        then went stale, every request 503, the process alive)."""
        try:
            resp = await asyncio.wait_for(
                self.health_client.get(f"{url}/health"), self.settings.connect_timeout_s
            )
            ok = resp.status_code == 200
        except (httpx.HTTPError, TimeoutError):
            ok = False
        except Exception as exc:  # a bug: logged, and the engine counted down this round
            self._log.error("health_check_failed", instance=iid, error=repr(exc))
            ok = False
        was = self.core.eligible(iid, now_ms())
        await self.driver.feed(routing_events.Health(iid, ok))
        if was and not ok:
            self._log.warning("engine_down", instance=iid, via="health")
        elif ok and not was:
            self._log.info("engine_up", instance=iid)

    async def health(self, request: Request) -> Response:
        now = now_ms()
        up = [iid for iid in self.urls if self.core.eligible(iid, now)]
        return JSONResponse(
            {"engines_up": up, "index_synced": self.core.index.synced}, status_code=200 if up else 503
        )

    async def models(self, request: Request) -> Response:
        """The first eligible engine's model list: at most `MODELS_INFLIGHT_MAX` at once (the
        rest 429 at once), each bounded in time and size (it was neither: a slow or endless
        engine answer held a pool connection and the router's memory)."""
        if tenant_of(request.headers, self.settings.api_keys, TENANT_HEADER) is None:
            return _error(401, "a known API key is required (Authorization: Bearer)", "")
        if self._models_slots.locked():
            self.metrics.refused("models_inflight_max")
            return _error(429, "models_inflight_max", "", retry_after_s=1)
        async with self._models_slots:
            now = now_ms()
            for iid, url in self.urls.items():
                if not self.core.eligible(iid, now):
                    continue
                try:
                    async with asyncio.timeout(MODELS_TIMEOUT_S):
                        status, body = await self._models_of(url)
                except (httpx.HTTPError, TimeoutError):
                    continue
                if body is None:
                    return _error(502, f"the engine's model list is over {MODELS_BYTES_MAX} bytes", "")
                return Response(body, status_code=status, media_type="application/json")
        return JSONResponse({"error": {"message": "no engine up", "type": "unavailable"}}, status_code=503)

    async def _models_of(self, url: str) -> tuple[int, bytes | None]:
        async with self.client.stream("GET", f"{url}/v1/models", headers=self._engine_auth) as resp:
            parts: list[bytes] = []
            size = 0
            async for part in resp.aiter_bytes():
                size += len(part)
                if size > MODELS_BYTES_MAX:
                    return resp.status_code, None
                parts.append(part)
            return resp.status_code, b"".join(parts)

    async def metrics_page(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- requests ------------------------------------------------------------------------

    def _keys(self, body: _RoutedFields) -> tuple[list[bytes], int, bool]:
        """The chunk keys of the prompt's first `KEYED_TOKENS_MAX` tokens (what the index can
        tell about a longer one is its prefix's: 1.5 M tokens cost ~0.14 s of the loop to check
        and key; review, 2026-12-06), its token count, and whether that count is a guess. A
        prompt that is no list of token ids (text, several prompts, chat messages) is keyed by
        nothing and counted by its length (a guess: no refit observation); token ids shorter
        than a chunk have no keys but an exact count."""
        prompt = bytes(body.prompt if len(body.prompt) and bytes(body.prompt) != b"null" else body.messages)
        if not prompt or prompt == b"null":
            return [], 1, True
        try:
            ids = _token_ids.decode(prompt)
        except msgspec.ValidationError:  # not token ids: estimated from its length
            return [], max(1, len(prompt) // 4), True
        if not ids:
            return [], 1, True
        ks = self.settings.keyspace
        try:
            return prompt_keys(ks.domain, ks.model, ks.layout, ids[:KEYED_TOKENS_MAX]), len(ids), False
        except ValueError:
            return [], len(ids), False

    async def completions(self, request: Request) -> Response:
        received = time.monotonic()
        # the clients' rule (`trace_id_of`): printable ASCII, no space, else a new one; cut at
        # `TRACE_ID_CHARS_ROUTER_MAX` (module top). A latin-1 byte (h11 accepts them) made the
        # engine request's `x-request-id` unencodable, a 500 a request (review, stop 68); an id
        # with a space the router kept was replaced by the engine's client (stop 70).
        trace_id = trace_id_of(request.headers.get(TRACE_HEADER))[:TRACE_ID_CHARS_ROUTER_MAX]
        tenant = tenant_of(request.headers, self.settings.api_keys, TENANT_HEADER)
        if tenant is None:
            self.metrics.refused("unauthenticated")
            return _error(401, "a known API key is required (Authorization: Bearer)", trace_id)
        full = self.core.admission_refusal(
            tenant, reading=self._reading.get(tenant, 0), reading_total=self._reading_total
        )
        if full is not None:  # refused before its body is read or parsed
            self.metrics.refused(full)
            self.core.counters["refused"] += 1
            retry_after_s = self.core.retry_after_s(now_ms())
            self._log.info(
                "request_refused", trace_id=trace_id, tenant=tenant, reason=full, retry_after_s=retry_after_s
            )
            return _error(429, full, trace_id, retry_after_s=retry_after_s)
        # Until it is routed, the request counts against its tenant's share and the total as
        # one being read: a tenant at 0 in flight sent 128 bodies of 16 MiB at once, each read,
        # parsed and keyed before `Route` refused all but its share (review, 2026-12-06).
        self._reading[tenant] = self._reading.get(tenant, 0) + 1
        self._reading_total += 1
        try:
            async with asyncio.timeout(BODY_READ_TIMEOUT_S):
                raw = await _body_within(request, BODY_BYTES_MAX)
            if raw is None:
                return _error(413, "body too large", trace_id)
            try:  # only what routing reads; the rest is skipped, never built (review, stop 66:
                # `json.loads` of 16 MiB of nested junk held the loop 1.65 s and 415 MiB)
                body = _routed_fields.decode(raw)
            except msgspec.ValidationError as exc:
                return _error(400, f"body: {exc}", trace_id)
            except msgspec.DecodeError as exc:
                return _error(400, f"body is not a JSON object: {exc}", trace_id)
            keys, prompt_tokens, tokens_guessed = self._keys(body)
        except TimeoutError:
            self.metrics.refused("body_timeout")
            return _error(408, f"the body did not arrive within {BODY_READ_TIMEOUT_S:g} s", trace_id)
        finally:
            self._reading_total -= 1
            if self._reading[tenant] <= 1:
                del self._reading[tenant]  # (no entry per tenant ever seen)
            else:
                self._reading[tenant] -= 1
        # Not streamed, the first byte is the whole answer: its wait is the generation's, not a
        # first token's (a longer timeout; no failover after a read timeout: it would run the
        # whole generation again elsewhere; no TTFT observation).
        streamed = body.stream is True
        # The refit's TTFT starts here: the client's upload and the parse are not what the cost
        # model estimates (a tenant uploading slowly pushed the shared coefficients to their
        # bounds; review, 2026-12-06).
        routed = time.monotonic()
        self._n += 1
        rid = f"{trace_id}-{self._n}"
        log = self._log.bind(trace_id=trace_id, tenant=tenant)
        tried: list[str] = []
        while True:
            decision = reply_of(
                await self.driver.feed(
                    routing_events.Route(
                        rid, tenant, keys, prompt_tokens, exclude=tuple(tried), tokens_guessed=tokens_guessed
                    )
                )
            )
            routed_at_ms = self.driver.now_ms()  # the time the route was stepped at (or a ms later)
            assert isinstance(decision, Decision | Refused)
            if isinstance(decision, Refused):
                self.metrics.refused(decision.reason)
                log.info(
                    "request_refused",
                    reason=decision.reason,
                    retry_after_s=decision.retry_after_s,
                    tried=tried,
                )
                if tried and decision.reason == "no_instance":  # every engine left failed it
                    return self._engines_failed(tried, received, trace_id)
                # (after a failover too: the engines left are full, or the router is; the
                # request may come back, where a 502 said the engines had failed it; stop 70)
                if tried:
                    self.metrics.done(tried[-1], f"refused_{decision.reason}", time.monotonic() - received)
                status = 429 if decision.reason in ("admitted_max", "tenant_inflight_max") else 503
                return _error(status, decision.reason, trace_id, retry_after_s=decision.retry_after_s)
            self.metrics.decided(decision, bool(keys))
            iid = decision.instance_id
            log.debug(
                "request_routed",
                instance=iid,
                reason=decision.reason,
                estimate_s=round(decision.estimate.ttft_s, 4),
                engine_tokens=decision.estimate.inputs.engine_tokens,
                colocated_tokens=decision.estimate.inputs.colocated_tokens,
                remote_tokens=decision.estimate.inputs.remote_tokens,
                compute_tokens=decision.estimate.inputs.compute_tokens,
                colocated_bytes=decision.estimate.inputs.colocated_bytes,
                remote_bytes=decision.estimate.inputs.remote_bytes,
                queued_prefill_tokens=decision.estimate.inputs.queued_prefill_tokens,
                running=decision.estimate.inputs.running,
                # why no kvfabric token may have been counted (the index may miss evictions)
                index_usable=self.core.index_usable(routed_at_ms),
                index_groups=len(self.core.index.groups),
            )
            # Not streamed, the first byte is the whole answer: once its estimated TTFT has
            # passed its prefill is presumed done, or it counted as queued prefill on its
            # engine for its whole generation (stop 70's list).
            presuming = (
                None
                if streamed
                else asyncio.get_running_loop().call_later(
                    max(0.0, decision.estimate.ttft_s), self.core.presume_prefilled, rid
                )
            )
            try:
                upstream = await self._open_while_connected(request, iid, raw, trace_id, streamed)
                if upstream is None:  # the client left before the engine's first byte
                    self.core.finished(rid)
                    self.metrics.done(iid, "client_disconnected", time.monotonic() - received)
                    log.info("request_done", instance=iid, outcome="client_disconnected")
                    return Response(status_code=499)  # (nobody reads it)
            except _Failed as failed:
                self.core.failed(rid, down=failed.engine_gone, now_ms=now_ms())
                log.warning(
                    "engine_failed_before_first_byte", instance=iid, why=failed.why, down=failed.engine_gone
                )
                if not streamed and failed.why == "timeout":  # answered 504, never failed over
                    self.metrics.done(iid, "response_timeout", time.monotonic() - received)
                    return _error(504, f"no answer from {iid} within the response timeout", trace_id)
                self.metrics.failover(iid, failed.why)
                tried.append(iid)
                if len(tried) >= self.settings.failover_attempts_max:
                    return self._engines_failed(tried, received, trace_id)
                continue
            except BaseException:
                # cancelled (the router stopping) or a bug: the request's admission ends here,
                # or its slot (and its tenant's) stayed taken for the router's life (review,
                # 2026-12-05: only `_Failed` ended it)
                self.core.finished(rid)
                raise
            finally:
                if presuming is not None:
                    presuming.cancel()
            break
        ttft_s = time.monotonic() - received
        if upstream.response.status_code < 400 and streamed:
            # the realised TTFT is an observation for the coefficients' refit (when configured)
            self.core.first_token(rid, time.monotonic() - routed, self.driver.now_ms())
            self.metrics.first_byte(iid, decision, ttft_s)
        elif upstream.response.status_code < 400:
            self.core.first_token(rid)  # running now; its wait was the whole generation's
        headers = {k: v for k, v in upstream.response.headers.items() if k.lower() not in HOP_HEADERS}
        headers["x-kvf-trace-id"] = trace_id
        headers["x-kvf-instance"] = iid
        relayed = _Relayed(rid, iid, received, ttft_s, decision)
        try:
            return _RelayResponse(
                self._relay(upstream, relayed, log),
                functools.partial(self._end_relay, upstream, relayed, log),
                functools.partial(self._stalled, relayed, log),
                status_code=upstream.response.status_code,
                headers=headers,
            )
        except Exception:
            # A header starlette cannot encode (an engine's UTF-8 value): the request's admission
            # and the engine's response were left open, every such request leaking a slot until
            # the router answered 429 for good (review, stop 68).
            relayed.outcome = "unrelayable_headers"
            await self._end_relay(upstream, relayed, log)
            log.warning("engine_headers_unrelayable", instance=iid)
            return _error(502, f"{iid}'s response headers could not be relayed", trace_id)

    def _engines_failed(self, tried: list[str], received: float, trace_id: str) -> Response:
        """502: every engine tried failed the request before its first byte (counted ended,
        `engines_failed`, under the last one tried: it was not counted at all)."""
        self.metrics.done(tried[-1], "engines_failed", time.monotonic() - received)
        return _error(502, f"engines failed before the first byte: {', '.join(tried)}", trace_id)

    def _stalled(self, relayed: _Relayed, log: Any) -> None:
        relayed.outcome = "client_stalled"
        log.info("client_stalled", instance=relayed.iid, stall_s=SEND_STALL_S)

    async def _open_while_connected(
        self, request: Request, iid: str, raw: bytes, trace_id: str, streamed: bool
    ) -> _Upstream | None:
        """`_open`, cancelled if the client disconnects first (then None): a client gone before
        the first byte kept its engine request generating, and its admission slot, until the
        whole answer came (up to `response_timeout_s`; review, 2026-12-06)."""
        opening = asyncio.create_task(self._open(iid, request.url.path, raw, trace_id, streamed))
        gone = asyncio.create_task(_disconnected(request))
        try:
            await asyncio.wait((opening, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not opening.done():
                opening.cancel()  # (its own `except BaseException` closes the engine's response)
            await asyncio.gather(opening, gone, return_exceptions=True)
        if opening.cancelled() and gone.done() and not gone.cancelled():
            return None
        return opening.result()  # the upstream (even when the client left meanwhile), or its error

    async def _open(self, iid: str, path: str, raw: bytes, trace_id: str, streamed: bool) -> _Upstream:
        url = f"{self.urls[iid]}{path}"
        s = self.settings
        read_s = s.first_byte_timeout_s if streamed else max(s.first_byte_timeout_s, s.response_timeout_s)
        req = self.client.build_request(
            "POST",
            url,
            content=raw,
            # identity: the body is relayed as it comes (`aiter_raw`), its encoding header dropped
            headers={
                "content-type": "application/json",
                "x-request-id": trace_id,
                "accept-encoding": "identity",
                **self._engine_auth,
            },
            timeout=httpx.Timeout(connect=s.connect_timeout_s, read=read_s, write=30.0, pool=30.0),
        )
        response: httpx.Response | None = None
        try:
            response = await self.client.send(req, stream=True)
            if response.status_code >= 500:
                raise _Failed(f"status_{response.status_code}")
            if response.status_code in ENGINE_AUTH_STATUSES:
                # The router's key for this engine is wrong (rotated on it alone, say): its 401
                # went to the client as if the client's key were bad, for 1/N of requests, and
                # vLLM's unguarded /health kept the engine routed (review, stop 68). Failed over.
                raise _Failed("engine_auth")
            chunks = response.aiter_raw()
            first = b""
            while not first:  # the first non-empty body chunk
                first = await chunks.__anext__()
            return _Upstream(response, chunks, first)
        except StopAsyncIteration:
            if response is not None and response.status_code < 400:
                await response.aclose()
                raise _Failed("closed_before_first_byte") from None
            assert response is not None
            return _Upstream(response, _empty(), b"")
        except httpx.TimeoutException as exc:
            if response is not None:
                await response.aclose()
            # (a write that timed out: the engine never had the whole body, so never began:
            # failed over, not answered 504 as a response timeout; review, stop 68)
            why = {
                httpx.ConnectTimeout: "connect_timeout",
                httpx.PoolTimeout: "pool_timeout",
                httpx.WriteTimeout: "write_timeout",
            }.get(type(exc), "timeout")
            raise _Failed(why) from None
        except httpx.HTTPError as exc:
            if response is not None:
                await response.aclose()
            raise _Failed(type(exc).__name__) from None
        except BaseException:  # _Failed, cancelled, a bug: the engine's connection goes back
            if response is not None:
                await response.aclose()
            raise

    async def _relay(self, up: _Upstream, relayed: _Relayed, log: Any) -> AsyncIterator[bytes]:
        """The engine's body, chunk by chunk; what ended it goes in `relayed.outcome`. The
        request's end (the engine's response closed, its admission ended, metrics, the log
        line) is `_end_relay`, run by `_RelayResponse` whether or not this generator ever ran."""
        try:
            if up.first:
                yield up.first
            async for chunk in up.chunks:
                yield chunk
            relayed.outcome = "ok" if up.response.status_code < 400 else f"status_{up.response.status_code}"
        except httpx.HTTPError as exc:
            relayed.outcome = "broken_after_first_byte"
            log.warning("engine_failed_after_first_byte", instance=relayed.iid, error=type(exc).__name__)
            # Not a clean end: returning sent the chunked body's last chunk, and the client took
            # a truncated answer for a whole one (review, 2026-12-06). `_RelayResponse` ends the
            # response unfinished instead, and the server closes the connection.
            raise _BrokenAfterFirstByte from None
        except (asyncio.CancelledError, GeneratorExit):  # the client went away mid-answer
            relayed.outcome = "client_disconnected"
            raise

    async def _end_relay(self, up: _Upstream, relayed: _Relayed, log: Any) -> None:
        if relayed.ended:
            return
        relayed.ended = True
        try:
            await up.response.aclose()
        finally:
            self.core.finished(relayed.rid)
            e2e_s = time.monotonic() - relayed.received
            self.metrics.done(relayed.iid, relayed.outcome, e2e_s)
            (log.debug if relayed.outcome == "ok" else log.info)(
                "request_done",
                instance=relayed.iid,
                outcome=relayed.outcome,
                reason=relayed.decision.reason,
                estimate_s=round(relayed.decision.estimate.ttft_s, 4),
                ttft_s=round(relayed.ttft_s, 4),
                e2e_s=round(e2e_s, 4),
            )


@dataclass
class _Relayed:
    rid: str
    iid: str
    received: float
    ttft_s: float
    decision: Decision
    # until the body's last chunk went out: a client gone before (even before the body's first
    # chunk was asked for, when the generator never ran) is `client_disconnected`
    outcome: str = "client_disconnected"
    ended: bool = False


class _RelayResponse(StreamingResponse):
    """A StreamingResponse whose request ends (`on_end`) however the response ends. Starlette
    cancels the body's task when the client disconnects; if that is before the body's first
    chunk was asked for, the generator never started and its `finally` never ran: the engine's
    connection stayed open and the request's admission slot (and its tenant's) taken for the
    router's life (review, 2026-12-05)."""

    def __init__(
        self, body: AsyncIterator[bytes], on_end: Any, on_stall: Any, *, status_code: int, headers: Any
    ) -> None:
        super().__init__(body, status_code=status_code, headers=headers)
        self._on_end = on_end
        self._on_stall = on_stall

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def send_or_stall(message: Any) -> None:  # a client that stopped reading is cut
            try:
                async with asyncio.timeout(SEND_STALL_S):
                    await send(message)
            except TimeoutError:
                raise _ClientStalled from None

        try:
            await super().__call__(scope, receive, send_or_stall)
        except _BrokenAfterFirstByte:
            pass  # left unfinished: the server closes the connection without the body's end
        except _ClientStalled:
            self._on_stall()  # left unfinished too
        finally:
            await self._on_end()


class _BrokenAfterFirstByte(Exception):
    """The engine's answer broke after the first byte was relayed (logged in `_relay`)."""


class _ClientStalled(Exception):
    """The client took no part of the answer for `SEND_STALL_S`."""


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (its body already read: `receive` then waits for
    the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _body_within(request: Request, limit: int) -> bytes | None:
    """The request's body, or None past `limit` bytes: refused on its Content-Length before
    anything is read, else read with a running count (a body was buffered whole before it was
    measured: any number of connections could each hold 16 MiB and more)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            return None
        parts.append(part)
    return b"".join(parts)


async def _empty() -> AsyncIterator[bytes]:
    return
    yield b""  # an async generator that yields nothing


def _error(status: int, message: str, trace_id: str, *, retry_after_s: int | None = None) -> Response:
    headers = {"x-kvf-trace-id": trace_id}
    if retry_after_s is not None:
        headers["retry-after"] = str(retry_after_s)
    if status == 401:
        headers["www-authenticate"] = "Bearer"
    kind = {429: "rate_limited", 503: "unavailable", 502: "bad_gateway", 401: "authentication_error"}.get(
        status, "invalid_request_error"
    )
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": status}}, status_code=status, headers=headers
    )
