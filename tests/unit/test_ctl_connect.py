"""What kvctl says when it cannot reach NATS (`kvfabric.ctl.queries.connect_error`): a refusal
names the credentials it used and where a local cluster's operator credentials are, a timeout
says so, anything else names the error's text, not only its type; a password in the URL is never
printed; an unreadable password file is one line."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import nats.errors
from typer.testing import CliRunner

from kvfabric.cluster.natsauth import nats_servers, servers_without_userinfo
from kvfabric.cluster.natsauth import url_without_userinfo as without_userinfo
from kvfabric.ctl.cli import app
from kvfabric.ctl.queries import connect_error
from kvfabric.format.errors import Unauthorized, Unavailable

URL = "nats://127.0.0.1:4222"
REFUSED = nats.errors.Error("nats: 'Authorization Violation'")


def test_a_refusal_without_credentials_says_none_are_set_and_where_they_are() -> None:
    error = connect_error(URL, REFUSED, user="", timeout_s=5)
    assert isinstance(error, Unauthorized) and error.code == "unauthorized"
    assert "Authorization Violation" in error.message and "none are set (KVF_NATS_USER" in error.message
    assert ".data/auth/env/admin.env" in error.message


def test_a_refusal_of_a_user_names_it() -> None:
    error = connect_error(URL, REFUSED, user="admin", timeout_s=5)
    assert (
        isinstance(error, Unauthorized)
        and "KVF_NATS_USER=admin and its password were refused" in error.message
    )


def test_a_timeout_and_other_errors_are_unavailable_with_their_text() -> None:
    timeout = connect_error(URL, TimeoutError(), user="", timeout_s=2.5)
    assert isinstance(timeout, Unavailable) and "no connection within 2.5 s" in timeout.message
    refused = connect_error(URL, ConnectionRefusedError(111, "Connection refused"), user="", timeout_s=5)
    assert isinstance(refused, Unavailable)
    assert refused.message.endswith("ConnectionRefusedError: [Errno 111] Connection refused")
    other = connect_error(
        URL, nats.errors.Error("nats: 'Maximum Connections Exceeded'"), user="u", timeout_s=5
    )
    assert isinstance(other, Unavailable) and other.message.endswith("nats: 'Maximum Connections Exceeded'")


def test_a_password_in_the_url_is_never_printed_and_its_user_is_named() -> None:
    url = "nats://admin:s3cretPW@127.0.0.1:4222"
    refused = connect_error(url, REFUSED, user="", timeout_s=5)
    assert "s3cretPW" not in refused.message and "nats://127.0.0.1:4222" in refused.message
    assert "the user admin of the URL and its password were refused" in refused.message
    for other in (TimeoutError(), OSError("boom")):
        assert "s3cretPW" not in connect_error(url, other, user="", timeout_s=5).message
    assert without_userinfo("nats://u:p@h:1") == ("nats://h:1", "u", True)
    assert without_userinfo("h:1") == ("h:1", "", False)
    assert without_userinfo("nats://u:p@ss@[::1]:4222") == ("nats://[::1]:4222", "u", True)
    assert without_userinfo("admin:x://y@h:4222") == ("h:4222", "admin", True)  # no scheme
    # A password not URL-escaped may hold "/", "?" or "#": everything up to the last "@" goes
    # (review, 2026-12-05: cut at the first "/", the password was printed)
    assert without_userinfo("nats://bob:s3cr/et@h:4222") == ("nats://h:4222", "bob", True)
    assert without_userinfo("nats://bob:a?b#c@h:4222/x") == ("nats://h:4222/x", "bob", True)
    assert without_userinfo("tls://h:1/p") == ("tls://h:1/p", "", False)


def test_a_token_in_the_url_is_never_printed_and_the_environment_s_user_is_named_first() -> None:
    token = connect_error("nats://s3cretTOKEN@127.0.0.1:4222", REFUSED, user="", timeout_s=5)
    assert "s3cretTOKEN" not in token.message and "the token in the URL was refused" in token.message
    both = connect_error("nats://urluser:pw@h:1", REFUSED, user="envuser", timeout_s=5)
    assert "KVF_NATS_USER=envuser" in both.message and "pw" not in both.message.split("refused this")[0]


def test_kvctl_says_an_unreadable_password_file_in_one_line(tmp_path: Path) -> None:
    missing = str(tmp_path / "none")
    result = CliRunner().invoke(
        app, ["status", "--nats-url", "nats://127.0.0.1:1"], env={"KVF_NATS_PASSWORD_FILE": missing}
    )
    assert (
        result.exit_code == 1
        and result.stderr == "bad_request: cannot read KVF_NATS_PASSWORD_FILE: No such file or directory\n"
    )


def test_kvctl_says_a_password_file_not_in_utf8_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "pw"
    bad.write_bytes(b"\xff\xfe")
    result = CliRunner().invoke(
        app, ["status", "--nats-url", "nats://127.0.0.1:1"], env={"KVF_NATS_PASSWORD_FILE": str(bad)}
    )
    assert result.exit_code == 1
    assert result.stderr == "bad_request: cannot read KVF_NATS_PASSWORD_FILE: UnicodeDecodeError\n"


def test_kvctl_names_the_connect_error_it_saw_and_does_not_wait_for_its_timeout() -> None:
    """A refused port: kvctl says the error the connect saw, at once (nats-py reads
    `max_reconnect_attempts=0` as no limit and retried it until kvctl's timeout: 5.7 s)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
        started = time.monotonic()
        result = CliRunner().invoke(
            app,
            ["status", "--nats-url", f"nats://127.0.0.1:{port}", "--timeout-s", "30"],
            env={"KVF_NATS_USER": ""},
        )
        took = time.monotonic() - started
    assert result.exit_code == 1 and "ConnectionRefusedError" in result.stderr, result.output
    assert took < 10, f"waited {took:.1f} s of its 30 s timeout"


def test_a_nats_setting_may_name_a_clusters_servers() -> None:
    """One URL or a comma list of URLs (each with its scheme); a comma in a password is kept."""
    assert nats_servers("nats://a:4222") == ["nats://a:4222"]
    assert nats_servers("nats://a:4222, tls://b:4222,nats://c") == [
        "nats://a:4222",
        "tls://b:4222",
        "nats://c",
    ]
    assert nats_servers("nats://u:pa,ss@a:4222") == ["nats://u:pa,ss@a:4222"]
    assert nats_servers("nats://a:4222,") == ["nats://a:4222,"]  # no URL after it: no separator
    listed = servers_without_userinfo("nats://u:secret@a:4222,nats://u:s,ecret@b:4222")
    assert listed == "nats://a:4222,nats://b:4222" and "secret" not in listed and "ecret" not in listed
