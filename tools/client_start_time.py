"""How long `KvClient(...)` takes when the cluster is down or stopped at start (issue 22).

Default settings (`connect_timeout_ms` 2000). Down: a free port nobody listens on. Stopped: a
socket that accepts connections and never answers (what a SIGSTOPped nats-server looks like).
Each case once waiting for the start, once with `background_start` (`--background`; the client
before issue 22 has no such option).

.venv/bin/python tools/client_start_time.py [--background]
"""

from __future__ import annotations

import logging
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvfabric.client import ClientSettings, KvClient
from kvfabric.testing.clientkit import SPEC
from kvfabric.testing.ports import free_port


def main() -> None:
    logging.disable(logging.CRITICAL)  # the start's own line is not what is measured
    modes: list[dict[str, bool]] = [{}, {"background_start": True}] if "--background" in sys.argv else [{}]
    with socket.socket() as stopped:
        stopped.bind(("127.0.0.1", 0))
        stopped.listen(8)
        cases = {
            "down": f"nats://127.0.0.1:{free_port()}",
            "stopped": f"nats://127.0.0.1:{stopped.getsockname()[1]}",
        }
        for name, url in cases.items():
            for mode in modes:
                started = time.monotonic()
                kv = KvClient(ClientSettings(nats_url=url), SPEC, **mode)  # type: ignore[arg-type]
                took_s = time.monotonic() - started
                print(f"{name:8} {'background' if mode else 'wait':10} {took_s:6.3f} s  enabled={kv.enabled}")
                kv.close()


if __name__ == "__main__":
    main()
