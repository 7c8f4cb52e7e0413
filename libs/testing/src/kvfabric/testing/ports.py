"""Free TCP ports for test servers. Never assume a well-known port (4222, 8222) is free."""

from __future__ import annotations

import socket

__all__ = ["free_port", "free_ports"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that the OS just handed out and released.

    Racy by nature (another process may take it before the caller binds), but the OS cycles
    through the ephemeral range, so a port is not handed out again soon after.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct free ports (`free_port` called twice may return the same port: a NATS server
    once got one port for both its clients and its monitor and could not start). All are bound
    at once, then released."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for sock in socks:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()
