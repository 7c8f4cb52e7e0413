"""`localcluster.port_free` answers as nats-server's own bind would (SO_REUSEADDR): a port held
by a listener is taken; a port whose last connection sits in TIME_WAIT is free (before, `up` after
a power cycle moved NATS to another port the workload could not follow)."""

from __future__ import annotations

import socket

from tests.unit.tools.toolkit import load_tool

localcluster = load_tool("localcluster")


def test_a_listening_port_is_taken_and_a_time_wait_one_is_free() -> None:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        assert not localcluster.port_free(port)
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        accepted.close()  # the server side closes first: its end of the connection is in TIME_WAIT
        client.close()
    finally:
        listener.close()
    assert localcluster.port_free(port)
