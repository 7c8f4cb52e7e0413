"""Free TCP ports for test servers. Never assume a well-known port (4222, 8222) is free.

Why not port 0 and release: Linux hands out port 0 binds at random from the ephemeral range
(32768–60999 by default, odd ports only: ~14,000 candidates), not in sequence. A port picked
that way and bound later could be taken meanwhile by a second pick, or by any service under test
that binds port 0 for itself (every metrics and data listener does): one chance in ~14,000 per
pair, and a NATS cluster test had ~30 such pairs (~2e-3 a run; audit, 2026-12-06).

So ports come from *below* the ephemeral range, where no port-0 bind or outgoing connection ever
lands, at random, each checked bindable, and never the same one twice in one process. What is
left is two processes (xdist workers, a tool run beside a test) drawing the same port from
~20,000 within the moment before one binds it.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

__all__ = ["free_port", "free_ports"]

_LOWEST = 10_000  # under the registered services people run on dev machines (8080, 8222, 9090, …)
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_TRIES = 200

_handed_out: set[int] = set()  # ports this process already gave a caller: never again
_lock = threading.Lock()
_rng = random.Random()  # unseeded on purpose: two processes must not walk the same sequence


def _below_ephemeral() -> range:
    """Ports under the kernel's ephemeral range; empty when that range starts too low to leave
    room (then `free_port` falls back to a port-0 bind)."""
    try:
        low = int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    return range(_LOWEST, low) if low - _LOWEST >= 1_000 else range(0)


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))  # no SO_REUSEADDR: a port with a TIME_WAIT socket is skipped too
        except OSError:
            return False
        return True


def _kernel_pick(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago and that this process has not handed out
    before (still racy against other processes: bind it soon)."""
    candidates = _below_ephemeral()
    with _lock:
        if len(_handed_out) > (len(candidates) // 2 if candidates else 10_000):
            _handed_out.clear()  # a very long run: start over rather than search a full set
        for _ in range(_TRIES):
            port = _rng.choice(candidates) if candidates else _kernel_pick(host)
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
    raise OSError(f"no free TCP port on {host} after {_TRIES} tries")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct free ports (none of them handed out before by this process)."""
    return [free_port(host) for _ in range(n)]
