"""A segment's data address: its transports' URLs separated by spaces, preferred first.

E.g. `"tcp://10.0.0.5:7100 ucx://10.0.0.5:7101"`. The directory stores and hands out this string
unchanged (`Replica.data_addr`, `WriteTicket.data_addr`); each client picks the transport it can
use (`pick`). Co-located clients reach the shared-memory path through the TCP control connection.
"""

from __future__ import annotations

from kvfabric.format.errors import BadRequest

__all__ = ["join", "pick", "pick_stream", "split_host_port"]


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
