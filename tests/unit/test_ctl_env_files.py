"""`kvctl auth init`'s env files survive being sourced as docs/security.md says (`set -a; .
file`): the directory's JSON grants were written unquoted and came out of the shell as
`{alice:[...]}`, so a directory configured that way refused to start (review, 2026-12-05)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from kvfabric.ctl.auth import plan_auth, read_env_file, write_auth


def test_an_env_file_sourced_by_a_shell_gives_back_every_value(tmp_path: Path) -> None:
    write_auth(tmp_path / "auth", plan_auth(["alice", "bob"], {"pub": ["alice", "bob"]}), bcrypt_cost=4)
    for env_file in sorted((tmp_path / "auth" / "env").glob("*.env")):
        written = read_env_file(env_file.read_text())
        sourced = subprocess.run(
            ["sh", "-c", f'set -a; . "{env_file}"; set +a; env -0'],
            capture_output=True,
            check=True,
            env={},
        ).stdout.decode()
        got = dict(item.split("=", 1) for item in sourced.split("\0") if "=" in item)
        for name, value in written.items():
            assert got[name] == value, (env_file.name, name)
    directory = read_env_file((tmp_path / "auth" / "env" / "svc-directory.env").read_text())
    assert set(json.loads(directory["KVF_DIRECTORY_TENANT_GRANTS"])) == {"alice", "bob"}
