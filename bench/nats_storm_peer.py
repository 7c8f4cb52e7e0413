"""The attacker of `python -m bench.nats_storm`: NATS connection storms from a process of its own.

Speaks the NATS client protocol on raw sockets (stdlib asyncio; `cryptography` only to sign an
nkey nonce), so the attacker spends as little CPU per attempt as it can and the server's share
of each attempt shows: read `INFO`, TLS if the server requires it, `CONNECT` + `PING`, then
`PONG` (accepted) or `-ERR` / EOF (refused).

Modes (one JSON spec on argv, see `main`):
- `wrong`: attempts at `rate_per_s` for `duration_s`, each with a valid user name and a wrong
  password (or, for an nkey user, a valid public key and a wrong signature); each connection is
  closed once answered.
- `valid`: `count` connections with the right credentials at `rate_per_s`, all held open until
  the last one is answered (or `duration_s` passes), then closed.

Prints one JSON line: the monotonic start and end of the storm (CLOCK_MONOTONIC, comparable with
the victim's samples in the parent), attempts, accepted, refused (by reason), errors.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import ssl
import sys
import time
from collections import Counter
from typing import Any, Final

ATTEMPT_TIMEOUT_S: Final = 10.0
IN_FLIGHT_MAX: Final = 1024  # attempts not answered yet; past it an attempt is skipped (counted)
NKEY_PREFIX_USER: Final = 20 << 3  # nkeys: 'U'
INFO_BYTES_MAX: Final = 64 << 10


def crc16(data: bytes) -> int:
    """CRC-16/XMODEM, the checksum of an encoded nkey."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def public_nkey(public_key: bytes) -> str:
    """The encoded user nkey ('U...') of a raw 32-byte Ed25519 public key."""
    raw = bytes([NKEY_PREFIX_USER]) + public_key
    raw += crc16(raw).to_bytes(2, "little")
    return base64.b32encode(raw).decode().rstrip("=")


def new_nkey() -> tuple[bytes, str]:
    """(raw Ed25519 seed, encoded public user nkey)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    seed = os.urandom(32)
    public = Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes_raw()
    return seed, public_nkey(public)


class Attacker:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.host: str = spec["host"]
        self.port: int = spec["port"]
        self.mode: str = spec["mode"]
        self.user: str = spec.get("user", "")
        self.password: str = spec.get("password", "")
        self.nkey: str = spec.get("nkey", "")
        self.signer: Any = None
        if spec.get("nkey_seed_hex"):
            from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

            self.signer = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(spec["nkey_seed_hex"]))
        self.tls: ssl.SSLContext | None = None
        if spec.get("tls_ca"):
            self.tls = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=spec["tls_ca"])
        self.outcomes: Counter[str] = Counter()
        self.held: list[asyncio.StreamWriter] = []

    def connect_line(self, info: dict[str, Any]) -> bytes:
        options: dict[str, Any] = {"verbose": False, "pedantic": False, "protocol": 1, "lang": "storm"}
        if self.nkey:
            options["nkey"] = self.nkey
            nonce = str(info.get("nonce", "")).encode()
            signature = self.signer.sign(nonce) if self.signer is not None else os.urandom(64)
            options["sig"] = base64.urlsafe_b64encode(signature).decode().rstrip("=")
        else:
            options["user"] = self.user
            options["pass"] = self.password
        return b"CONNECT " + json.dumps(options).encode() + b"\r\nPING\r\n"

    async def attempt(self, hold: bool) -> None:
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(ATTEMPT_TIMEOUT_S):
                reader, writer = await asyncio.open_connection(self.host, self.port, limit=INFO_BYTES_MAX)
                line = await reader.readline()
                if not line.startswith(b"INFO "):
                    self.outcomes[f"refused: {line.strip().decode(errors='replace')[:80] or 'closed'}"] += 1
                    return
                info = json.loads(line[5:])
                if info.get("tls_required"):
                    assert self.tls is not None, "the server requires TLS: pass tls_ca"
                    await writer.start_tls(self.tls)
                writer.write(self.connect_line(info))
                await writer.drain()
                reply = await reader.readline()
                while reply.startswith((b"PING", b"+OK")):  # the server's own ping while it is slow
                    if reply.startswith(b"PING"):
                        writer.write(b"PONG\r\n")
                    reply = await reader.readline()
                if reply.startswith(b"PONG"):
                    self.outcomes["accepted"] += 1
                    if hold:
                        self.held.append(writer)
                        writer = None
                else:
                    self.outcomes[f"refused: {reply.strip().decode(errors='replace')[:80] or 'closed'}"] += 1
        except (OSError, TimeoutError, ssl.SSLError, ValueError) as exc:
            self.outcomes[f"error: {type(exc).__name__}"] += 1
        finally:
            if writer is not None:
                writer.close()

    async def run(self, rate_per_s: float, duration_s: float, count: int) -> dict[str, Any]:
        hold = self.mode == "valid"
        tasks: set[asyncio.Task[None]] = set()
        started = time.monotonic()
        deadline = started + duration_s
        sent = 0
        skipped = 0
        while time.monotonic() < deadline and (not hold or sent < count):
            due = started + sent / rate_per_s
            wait_s = due - time.monotonic()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            sent += 1
            if len(tasks) >= IN_FLIGHT_MAX:
                skipped += 1
                continue
            task = asyncio.create_task(self.attempt(hold))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()) + ATTEMPT_TIMEOUT_S)
        ended = time.monotonic()
        for writer in self.held:
            writer.close()
        return {
            "mode": self.mode,
            "start_s": started,
            "end_s": ended,
            "elapsed_s": round(ended - started, 3),
            "attempts": sent - skipped,
            "skipped": skipped,
            "outcomes": dict(self.outcomes),
            "rate_per_s": round((sent - skipped) / max(ended - started, 1e-9), 1),
        }


def main() -> int:
    spec = json.loads(sys.argv[1])
    attacker = Attacker(spec)
    result = asyncio.run(attacker.run(spec["rate_per_s"], spec["duration_s"], spec.get("count", 0)))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
