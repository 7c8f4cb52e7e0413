"""Issue 21 row 8: nats-server verifies a password user's bcrypt hash on every connection attempt,
right or wrong. At cost 8, 121 wrong passwords a second from anyone took both cores (alice's lookup
p50 0.62 -> 24 ms). `kvctl auth init` now writes cost-4 hashes (bcrypt's minimum) of passwords of
`PASSWORD_BYTES` random bytes, which brute force cannot reach at any cost; `python -m
bench.nats_storm` measures the storms (docs/security.md, "NATS connection storms").

Quick checks of the generated config: every user has a cost-4 bcrypt hash, never a plaintext
password; passwords keep their length; no monitoring port; and a real nats-server takes the
hashes (the right password connects, a wrong one is refused).
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import bcrypt
import nats
import nats.errors
import pytest

from kvfabric.cluster.natsauth import nats_auth_from_env
from kvfabric.ctl.auth import PASSWORD_BYTES, plan_auth, write_auth
from kvfabric.testing import NatsServer

CONNECT_TIMEOUT_S = 5.0


def users_of(conf: str) -> list[dict[str, Any]]:
    found = re.search(r"users = (\[.*?\n\])", conf, flags=re.S)
    assert found is not None, conf
    users: list[dict[str, Any]] = json.loads(found[1])
    return users


@pytest.fixture
def doc(tmp_path: Path) -> dict[str, Any]:
    return write_auth(tmp_path / "auth", plan_auth(["alice", "bob"]))


def test_every_user_gets_a_cost_4_bcrypt_hash_of_a_long_random_password(doc: dict[str, Any]) -> None:
    assert PASSWORD_BYTES >= 24  # the reason a low cost is safe: 192 random bits
    conf = Path(doc["conf"]).read_text()
    users = users_of(conf)
    assert {u["user"] for u in users} == set(doc["users"])
    for user in users:
        password = Path(doc["users"][user["user"]]["password_file"]).read_text().strip()
        assert len(bytes.fromhex(password)) == PASSWORD_BYTES
        assert user["password"].startswith("$2a$04$"), user["user"]
        assert bcrypt.checkpw(password.encode(), ("$2b$" + user["password"][4:]).encode())
        assert password not in conf
    assert not re.search(r"^\s*(http|https|http_port|https_port|monitor_port)\s*[:=]", conf, flags=re.M)


def test_nats_server_takes_the_hashes_and_refuses_a_wrong_password(
    doc: dict[str, Any], tmp_path: Path
) -> None:
    async def connect(server: NatsServer, options: dict[str, Any]) -> None:
        nc = await nats.connect(
            server.url,
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=CONNECT_TIMEOUT_S,
            **options,
        )
        await nc.close()

    with NatsServer(tmp_path / "nats", extra_args=["-c", doc["conf"]]) as server:
        alice = nats_auth_from_env(doc["tenants"]["alice"]["env"], prefix="KVF_CLIENT_NATS_")
        asyncio.run(connect(server, {"user": alice.user, "password": alice.password}))
        with pytest.raises((nats.errors.Error, OSError)):
            asyncio.run(connect(server, {"user": alice.user, "password": "not-" + alice.password}))
