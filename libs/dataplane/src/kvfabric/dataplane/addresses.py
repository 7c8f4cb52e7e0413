"""A segment's data address: its transports' URLs separated by spaces, preferred first.

E.g. `"tcp://10.0.0.5:7100 ucx://10.0.0.5:7101"`. The directory stores and hands out this string
unchanged (`Replica.data_addr`, `WriteTicket.data_addr`); each client picks the transport it can
use (`pick`). Co-located clients reach the shared-memory path through the TCP control connection.
Between the remote transports, `pick_transport` chooses from measurements (docs/ucx.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from kvfabric.format.errors import BadRequest

__all__ = [
    "ANY_PEER",
    "UCX_GAIN_MIN",
    "TransportTable",
    "join",
    "pick",
    "pick_stream",
    "pick_transport",
    "split_host_port",
]

# UCX is chosen over the stream transport only when measured at least this much faster (GB/s
# ratio) at the size asked about: run-to-run noise on a shared host is ±25 % (at 16 MiB the two
# measured 0.85-1.19 x each other in three runs, docs/ucx.md), and the stream transport is the
# default (it also serves the shared-memory path and TLS).
UCX_GAIN_MIN: Final = 1.25
ANY_PEER: Final = "*"  # a TransportTable host that stands for every peer not measured on its own


def join(*urls: str) -> str:
    return " ".join(u for u in urls if u)


def pick(data_addr: str, scheme: str) -> str:
    """The first URL of `scheme` (`"tcp"`, `"ucx"`) in a data address; BadRequest if none."""
    for url in data_addr.split():
        if url.startswith(f"{scheme}://"):
            return url
    raise BadRequest(f"no {scheme} transport in data address {data_addr!r}")


def pick_stream(data_addr: str) -> str:
    """The stream transport of a data address: `tls://` when the segment serves TLS (then only
    that), else `tcp://`; BadRequest if neither."""
    for url in data_addr.split():
        if url.startswith("tls://"):
            return url
    return pick(data_addr, "tcp")


def split_host_port(url: str) -> tuple[str, int]:
    """`scheme://host:port` -> (host, port)."""
    _, sep, rest = url.partition("://")
    host, colon, port = rest.rpartition(":")
    if not sep or not colon or not port.isdigit():
        raise BadRequest(f"malformed transport URL {url!r}")
    return host, int(port)


@dataclass(frozen=True, eq=False)
class TransportTable:
    """Throughput measured per peer host, transport scheme and object size (GB/s, higher is better).

    `gbps[(host, scheme, size_bytes)]`; host `ANY_PEER` applies to peers without their own rows.
    E.g. from `bench/ucx_options.py` (GET, one object per request): the `tcp_get` and `ucx_get` rows.
    """

    gbps: Mapping[tuple[str, str, int], float] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_points(cls, points: Iterable[tuple[str, str, int, float]]) -> TransportTable:
        """`(host, scheme, size_bytes, gbps)` rows; a later row for the same key wins."""
        table: dict[tuple[str, str, int], float] = {}
        for host, scheme, size_bytes, gbps in points:
            if size_bytes <= 0 or not gbps > 0:
                raise BadRequest(f"measurement {host} {scheme} {size_bytes} B: {gbps} GB/s is not usable")
            table[(host, scheme, size_bytes)] = float(gbps)
        return cls(MappingProxyType(table))

    def compare(self, host: str, scheme: str, other: str, size_bytes: int) -> tuple[float, float] | None:
        """(GB/s of `scheme`, GB/s of `other`) at the size nearest `size_bytes` (log scale; ties:
        the smaller) among the sizes measured for both, from the host's own rows if it has both
        schemes, else from the `ANY_PEER` rows; None when neither has both."""
        for peer in (host, ANY_PEER):
            sizes = {s for (h, sc, s) in self.gbps if h == peer and sc == scheme}
            sizes &= {s for (h, sc, s) in self.gbps if h == peer and sc == other}
            if sizes:
                want = math.log2(max(size_bytes, 1))
                nearest = min(sizes, key=lambda s: (abs(math.log2(s) - want), s))
                return self.gbps[(peer, scheme, nearest)], self.gbps[(peer, other, nearest)]
        return None


def pick_transport(data_addr: str, size_bytes: int, measured: TransportTable | None = None) -> str:
    """The URL to move an object of `size_bytes` to or from a segment, among its remote transports.

    The stream transport (`pick_stream`: `tls://` when the segment serves TLS, else `tcp://`) unless
    all of these hold: the segment also offers `ucx://`, it does not require TLS (UCX is not
    encrypted), and `measured` has `tcp` and `ucx` for that peer's host (or `ANY_PEER`) with UCX at
    least `UCX_GAIN_MIN` times faster at the nearest size measured for both. Without a table: the
    stream transport.
    A co-located client still prefers shared memory (reached through the stream connection).
    """
    stream = pick_stream(data_addr)
    if measured is None or stream.startswith("tls://"):
        return stream
    try:
        ucx = pick(data_addr, "ucx")
    except BadRequest:
        return stream
    pair = measured.compare(split_host_port(stream)[0], "tcp", "ucx", size_bytes)
    if pair is None or pair[1] < pair[0] * UCX_GAIN_MIN:
        return stream
    return ucx
