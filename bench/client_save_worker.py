"""An engine process of `bench/client_save.py`: `bench.client_worker`'s engine, with its client code
(`kvfabric.client`) taken from a folder of its own.

Nothing of kvfabric is imported before that folder is first on `sys.path`: the process's arguments
are plain values (a spawned process unpickles them before `main` runs), and `bench.client_worker`
(which imports the client) is imported inside `main`.
"""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection
from typing import Any


def main(conn: Connection, code_path: str, config: dict[str, Any]) -> None:
    """`code_path`: a folder holding `kvfabric/client/` ("" for this checkout's client)."""
    if code_path:
        sys.path.insert(0, code_path)
    from bench.client_worker import WorkerConfig, worker_main

    worker_main(conn, {}, WorkerConfig(**config))
