"""The eviction policy's admission filter, followed by one directory instance (issue 25, item 4).

The policy publishes its filter (`kvfabric.proto.eviction.AdmissionFilter`) on
`kvf.v1.eviction.admission_filter` on a bounded cadence; this instance subscribes (every
instance, no queue group: each applies it to the shards it leads), validates it once
(`AdmissionView.of`: bounded size) and installs it into every shard core it leads now, stamped
with this instance's clock. A shard started later gets the next filter (one cadence; until then it
admits). Nothing here is on the request path and nothing waits on the policy: `put_begin`
reads the core's gate (`kvfabric.core.eviction_admission`), which admits everything when no
filter arrived, or the last one is older than `KVF_DIRECTORY_ADMISSION_STALE_MS`.

Only service users may publish there (tenants' NATS permissions stop at
`kvf.v1.directory.t.<tenant>.>`: docs/security.md), as for the policy's `evict` requests.
Metrics (`AdmissionFilterCollector`): the age and size of the newest filter the cores here
hold, filters received (installed), out of order (older than the fresh one every core here
holds: not installed, not counted as received) and rejected; the gate's decisions are core
counters (`admission_admitted_<reason>`, `admission_refused_<reason>` in
`kvfabric_directory_core_events_total`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvfabric.core.directory import DirectoryCore
from kvfabric.core.eviction_admission import AdmissionView
from kvfabric.format.clock import now_ms
from kvfabric.format.errors import BadRequest
from kvfabric.proto.codec import decode_as
from kvfabric.proto.eviction import ADMISSION_FILTER_VERB, AdmissionFilter, eviction_decoder
from kvfabric.proto.subjects import Service, endpoint_subject
from kvfabric.runtime.logs import get_logger

__all__ = ["ADMISSION_FILTER_SUBJECT", "AdmissionFilterCollector", "AdmissionFilterFeed"]

ADMISSION_FILTER_SUBJECT = endpoint_subject(Service.EVICTION, ADMISSION_FILTER_VERB)


class _Shells(Protocol):
    """What the feed needs of `ShardHost`: the shells it leads now, each with its core."""

    @property
    def shells(self) -> Mapping[int, _Shell]: ...


class _Shell(Protocol):
    @property
    def core(self) -> DirectoryCore: ...


class AdmissionFilterFeed:
    """Subscribes to the policy's filters and installs each into the cores led here."""

    def __init__(self, host: _Shells) -> None:
        self.host = host
        self.view: AdmissionView | None = None
        self.received_ms = 0
        self.received = 0
        self.rejected = 0
        self.out_of_order = 0  # older than the fresh filter every core led here holds
        self._sub: Subscription | None = None
        self._log = get_logger("kvfabric.directory.admission_filter")

    async def subscribe(self, nc: NatsClient) -> None:
        self._sub = await nc.subscribe(ADMISSION_FILTER_SUBJECT, cb=self._on_message)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def _on_message(self, msg: Msg) -> None:
        self.on_filter(msg.data, now_ms())

    def on_filter(self, data: bytes, at_ms: int) -> bool:
        """One published filter (public for tests): installed into every core led here."""
        try:
            message = decode_as(eviction_decoder, data, AdmissionFilter)
            view = AdmissionView.of(message, len(data))
        except BadRequest as exc:
            self.rejected += 1
            self._log.info("admission_filter_rejected", error=str(exc))
            return False
        shells = list(self.host.shells.values())
        installed = [shell.core.set_admission_filter(view, at_ms) for shell in shells]
        if shells and not any(installed):
            # older than what every core holds (a publisher restarted with a clock behind, or
            # a late delivery): neither received nor held here, so the age stays the held one's
            self.out_of_order += 1
            self._log.info("admission_filter_out_of_order", generated_ms=message.generated_ms)
            return False
        self.received += 1
        # The gauges show the newest filter the cores here hold (read back from them: a core new
        # to this instance may take an older one the others refuse, and a stale one is replaced
        # by any); none led here: the one received.
        held = [shell.core.admission for shell in shells if shell.core.admission.view is not None]
        gate = max(held, key=lambda g: (g.view.generated_ms if g.view else 0, g.received_ms), default=None)
        if gate is None or gate.view is None:
            self.view, self.received_ms = view, at_ms
        else:
            self.view, self.received_ms = gate.view, gate.received_ms
        return True

    def age_ms(self, at_ms: int) -> int | None:
        return None if self.view is None else max(0, at_ms - self.received_ms)


class AdmissionFilterCollector(Collector):
    """`kvfabric_directory_admission_filter_*` (docs/metrics.md)."""

    def __init__(self, feed: AdmissionFilterFeed) -> None:
        self.feed = feed

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        feed = self.feed
        age = feed.age_ms(now_ms())
        view = feed.view
        yield GaugeMetricFamily(
            "kvfabric_directory_admission_filter_age_seconds",
            "Seconds since the eviction policy's last admission filter arrived (-1: none yet).",
            value=-1.0 if age is None else age / 1000,
        )
        yield GaugeMetricFamily(
            "kvfabric_directory_admission_filter_bytes",
            "Encoded size of the admission filter held (0: none).",
            value=0 if view is None else view.encoded_bytes,
        )
        yield GaugeMetricFamily(
            "kvfabric_directory_admission_filter_pools",
            "Segments the admission filter held refuses on (past their low watermark).",
            value=0 if view is None else len(view.limits),
        )
        yield CounterMetricFamily(
            "kvfabric_directory_admission_filters_received",
            "Admission filters received and installed.",
            value=feed.received,
        )
        yield CounterMetricFamily(
            "kvfabric_directory_admission_filters_out_of_order",
            "Admission filters older than the fresh one every shard core here held: not installed.",
            value=feed.out_of_order,
        )
        yield CounterMetricFamily(
            "kvfabric_directory_admission_filters_rejected",
            "Admission filters dropped as malformed or over their bounds.",
            value=feed.rejected,
        )
