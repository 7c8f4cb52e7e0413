"""A client that cannot start leaves the engine running uncached (issue 22, item 3): an unusable
setting, a refusal by NATS, a cluster down or stopped at start each end in a disabled client —
`status` says why, the fallback is counted once by cause, one line is logged (no traceback), and
the start takes at most `connect_timeout_ms` (nothing with `background_start`). Before, a missing
password file raised out of `KvClient()` (vLLM's engine core did not start), and a cluster down
or stopped cost `connect_timeout_ms` + 5 s with one logged traceback per retry.

NATS here is a fake speaking just enough of the protocol (INFO, CONNECT, PING/PONG, -ERR), on a
thread: no nats-server needed.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import nats.aio.client
import pytest

from kvfabric.client import ClientSettings, KvClient, settings_from_env
from kvfabric.client.connect import start_error
from kvfabric.client.sync import ClientStatus, start_cause
from kvfabric.format.errors import BadRequest, Indeterminate, Unauthorized, Unavailable
from kvfabric.testing.ports import free_port
from tests.integration.clientkit import SPEC, objects_for, prompt

CONNECT_TIMEOUT_MS = 1000
SLACK_S = 0.5  # a thread hop and a loaded 2-core VM


class FakeNats(socketserver.ThreadingTCPServer):
    """`mode`: "ok" (answers PING), "refuse_auth" (-ERR after CONNECT, as nats-server does for a
    wrong password), "deny_subjects" (connects; -ERR permissions violation for any SUB or PUB,
    as for a tenant whose subjects the user may not use), "frozen" (accepts, never answers)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.stop = threading.Event()
        super().__init__(("127.0.0.1", 0), _Session)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.server_address[1]}"


class _Session(socketserver.StreamRequestHandler):
    server: FakeNats

    def handle(self) -> None:
        mode = self.server.mode
        if mode == "frozen":
            self.server.stop.wait(10)
            return
        info = {
            "server_id": "fake",
            "version": "2.10.0",
            "max_payload": 1 << 20,
            "auth_required": mode == "refuse_auth",
        }
        self.wfile.write(f"INFO {json.dumps(info)}\r\n".encode())
        for raw in self.rfile:
            line = raw.decode(errors="replace")
            if line.startswith("PING"):
                if mode == "refuse_auth":
                    self.wfile.write(b"-ERR 'Authorization Violation'\r\n")
                    return
                self.wfile.write(b"PONG\r\n")
            elif line.startswith(("SUB", "PUB")) and mode == "deny_subjects":
                what = "Subscription" if line.startswith("SUB") else "Publish"
                subject = line.split()[1]
                self.wfile.write(f"-ERR 'Permissions Violation for {what} to \"{subject}\"'\r\n".encode())
            if line.startswith(("PUB", "HPUB")):
                self.rfile.readline()  # the payload


@pytest.fixture
def fake_nats(request: pytest.FixtureRequest) -> Iterator[FakeNats]:
    server = FakeNats(request.param)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop.set()
        server.shutdown()
        server.server_close()


def start(settings: ClientSettings, **kwargs: object) -> tuple[KvClient, float]:
    started = time.monotonic()
    kv = KvClient(settings, SPEC, **kwargs)  # type: ignore[arg-type]
    return kv, time.monotonic() - started


def fallbacks(kv: KvClient) -> dict[str, float]:
    return {
        s.labels["cause"]: s.value
        for metric in kv.metrics.fallbacks.collect()
        for s in metric.samples
        if s.name.endswith("_total")
    }


def lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """What the client and nats-py logged (asyncio's debug chatter aside)."""
    return [r for r in caplog.records if r.name.startswith(("kvfabric", "nats"))]


def assert_disabled(kv: KvClient, cause: str, caplog: pytest.LogCaptureFixture, level: int) -> None:
    assert kv.status.state == "disabled" and kv.status.cause == cause, kv.status
    assert not kv.enabled
    assert fallbacks(kv) == {cause: 1.0}
    hit = kv.lookup(prompt(64))
    assert hit.tokens == 0 and hit.cause == "closed"
    assert kv.save_async(prompt(32), objects_for(prompt(32), 0, 2)) is None
    (line,) = lines(caplog)  # one line, no traceback
    assert line.levelno == level and line.exc_info is None
    assert cause in line.getMessage() and kv.status.detail in line.getMessage()


def test_a_missing_password_file_disables_the_client_instead_of_raising(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    missing = tmp_path / "run" / "password"
    settings = ClientSettings(nats_url=f"nats://127.0.0.1:{free_port()}", nats_password_file=str(missing))
    kv, took_s = start(settings)
    try:
        assert_disabled(kv, "config_error", caplog, logging.ERROR)
        assert "nats_password_file" in kv.status.detail and str(missing) in kv.status.detail
        assert took_s < SLACK_S  # nothing to wait for
    finally:
        kv.close()


@pytest.mark.parametrize("pem", [None, b"not a certificate"])
def test_an_unusable_data_tls_ca_disables_the_client_instead_of_raising(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, pem: bytes | None
) -> None:
    """The data plane's TLS context was built in the constructor: a CA file missing or not PEM
    raised `FileNotFoundError` / `ssl.SSLError` out of `KvClient()`, into vLLM's or SGLang's
    start (review, stop 68)."""
    caplog.set_level(logging.INFO)
    ca = tmp_path / "ca.pem"
    if pem is not None:
        ca.write_bytes(pem)
    settings = ClientSettings(nats_url=f"nats://127.0.0.1:{free_port()}", data_tls_ca=str(ca))
    kv, took_s = start(settings)
    try:
        assert_disabled(kv, "config_error", caplog, logging.ERROR)
        assert "data_tls_ca" in kv.status.detail and str(ca) in kv.status.detail
        assert took_s < SLACK_S
    finally:
        kv.close()


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:4222", "nats://127.0.0.1:notaport", "", "nats://no-such-host.invalid:4222"]
)
def test_a_bad_url_is_a_config_error(url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    kv, took_s = start(ClientSettings(nats_url=url, connect_timeout_ms=CONNECT_TIMEOUT_MS))
    try:
        assert_disabled(kv, "config_error", caplog, logging.ERROR)
        assert "nats_url" in kv.status.detail
        assert took_s < CONNECT_TIMEOUT_MS / 1000 + SLACK_S
    finally:
        kv.close()


def test_a_cluster_down_at_start_costs_at_most_the_connect_timeout_and_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    url = f"nats://127.0.0.1:{free_port()}"
    kv, took_s = start(ClientSettings(nats_url=url, connect_timeout_ms=CONNECT_TIMEOUT_MS))
    try:
        assert_disabled(kv, "nats_unreachable", caplog, logging.WARNING)
        assert "Connection refused" in kv.status.detail or "Connect call failed" in kv.status.detail
        assert took_s < CONNECT_TIMEOUT_MS / 1000 + SLACK_S
    finally:
        kv.close()


@pytest.mark.parametrize("fake_nats", ["frozen"], indirect=True)
def test_a_stopped_server_at_start_costs_at_most_the_connect_timeout(
    fake_nats: FakeNats, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    kv, took_s = start(ClientSettings(nats_url=fake_nats.url, connect_timeout_ms=CONNECT_TIMEOUT_MS))
    try:
        assert_disabled(kv, "nats_timeout", caplog, logging.WARNING)
        assert CONNECT_TIMEOUT_MS / 1000 - 0.1 < took_s < CONNECT_TIMEOUT_MS / 1000 + SLACK_S
    finally:
        kv.close()


@pytest.mark.parametrize("fake_nats", ["refuse_auth"], indirect=True)
def test_refused_credentials_end_the_start_at_once(
    fake_nats: FakeNats, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    settings = ClientSettings(
        nats_url=fake_nats.url, nats_user="u", nats_password="wrong", connect_timeout_ms=5000
    )
    kv, took_s = start(settings)
    try:
        assert_disabled(kv, "auth_refused", caplog, logging.ERROR)
        assert "Authorization Violation" in kv.status.detail and "nats_password_file" in kv.status.detail
        assert took_s < SLACK_S  # retrying cannot help: not the 5 s connect timeout
    finally:
        kv.close()


@pytest.mark.parametrize("fake_nats", ["deny_subjects"], indirect=True)
def test_a_tenant_nats_does_not_know_is_refused_at_start(
    fake_nats: FakeNats, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    settings = ClientSettings(
        nats_url=fake_nats.url, nats_tenant="nobody", connect_timeout_ms=CONNECT_TIMEOUT_MS
    )
    kv, took_s = start(settings)
    try:
        assert_disabled(kv, "auth_refused", caplog, logging.ERROR)
        assert "permissions violation" in kv.status.detail.lower() and "nats_tenant" in kv.status.detail
        assert took_s < CONNECT_TIMEOUT_MS / 1000 + SLACK_S
    finally:
        kv.close()


@pytest.mark.parametrize("fake_nats", ["ok"], indirect=True)
def test_a_server_that_lets_the_client_in_enables_it_silently(
    fake_nats: FakeNats, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    kv, took_s = start(ClientSettings(nats_url=fake_nats.url, connect_timeout_ms=CONNECT_TIMEOUT_MS))
    try:
        assert kv.status == ClientStatus("enabled") and kv.enabled
        assert lines(caplog) == [] and fallbacks(kv) == {}
        assert took_s < CONNECT_TIMEOUT_MS / 1000 + SLACK_S  # no directory: the access check is bounded
    finally:
        kv.close()
    # closed: a miss and a dropped save, not a RuntimeError from a closed loop (review, 2026-12-05)
    assert kv.status == ClientStatus("disabled", "closed", "closed") and not kv.enabled
    hit = kv.lookup(prompt(64))
    assert hit.tokens == 0 and hit.cause == "closed"
    assert kv.save_async(prompt(32), objects_for(prompt(32), 0, 2)) is None


@pytest.mark.parametrize("fake_nats", ["ok"], indirect=True)
def test_a_comma_list_of_servers_connects_through_one_that_answers(
    fake_nats: FakeNats, caplog: pytest.LogCaptureFixture
) -> None:
    """The servers of a NATS cluster, as services and kvctl take them: a comma list was refused
    as a bad URL (`config_error`; stop 70's list). One server down: the client uses another."""
    caplog.set_level(logging.INFO)
    down = f"nats://127.0.0.1:{free_port()}"
    for url in (f"{down},{fake_nats.url}", f"{fake_nats.url}, {down}"):
        kv, took_s = start(ClientSettings(nats_url=url, connect_timeout_ms=CONNECT_TIMEOUT_MS))
        try:
            assert kv.status == ClientStatus("enabled"), kv.status
            assert took_s < CONNECT_TIMEOUT_MS / 1000 + SLACK_S
        finally:
            kv.close()


@pytest.mark.parametrize("fake_nats", ["ok"], indirect=True)
@pytest.mark.parametrize("first", ["nats://no-such-host.invalid:4222", "frozen"])
def test_a_listed_server_unresolvable_or_silent_leaves_the_next_one_its_turn(
    fake_nats: FakeNats, first: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review, stop 71: the first server tried (nats-py shuffles; kept in order here) whose name
    does not resolve ended the start as a setting error, and one that accepts and never answers
    took the whole `connect_timeout_ms`: either way the client was disabled for the engine's
    life while the next server was up."""
    monkeypatch.setattr(nats.aio.client, "shuffle", lambda servers: None)
    caplog.set_level(logging.INFO)
    frozen = FakeNats("frozen")
    thread = threading.Thread(target=frozen.serve_forever, daemon=True)
    thread.start()
    try:
        head = frozen.url if first == "frozen" else first
        kv, took_s = start(ClientSettings(nats_url=f"{head},{fake_nats.url}", connect_timeout_ms=2000))
        try:
            assert kv.status == ClientStatus("enabled"), kv.status
            assert took_s < 2 + SLACK_S
        finally:
            kv.close()
    finally:
        frozen.stop.set()
        frozen.shutdown()
        frozen.server_close()


@pytest.mark.parametrize(
    "url", ["nats://127.0.0.1:4222,http://127.0.0.1:4223", "nats://127.0.0.1:4222,ws://127.0.0.1:4223"]
)
def test_a_comma_list_with_a_bad_url_is_a_config_error(url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    kv, took_s = start(ClientSettings(nats_url=url, connect_timeout_ms=CONNECT_TIMEOUT_MS))
    try:
        assert_disabled(kv, "config_error", caplog, logging.ERROR)
        assert "nats_url" in kv.status.detail and took_s < SLACK_S
    finally:
        kv.close()


@pytest.mark.parametrize("fake_nats", ["frozen"], indirect=True)
def test_a_background_start_returns_at_once_and_misses_until_it_ends(
    fake_nats: FakeNats, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    settings = ClientSettings(nats_url=fake_nats.url, connect_timeout_ms=CONNECT_TIMEOUT_MS)
    kv, took_s = start(settings, background_start=True)
    try:
        assert took_s < 0.1
        assert kv.status.state == "starting"
        assert kv.lookup(prompt(64)).cause == "starting"
        assert kv.lookup_async(prompt(64)).result(1).cause == "starting"
        deadline = time.monotonic() + CONNECT_TIMEOUT_MS / 1000 + SLACK_S
        while kv.status.state == "starting" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert kv.status.cause == "nats_timeout"
        assert [r.levelno for r in lines(caplog)] == [logging.WARNING]
    finally:
        kv.close()
    # Closed while still starting: no line, and the start ends.
    caplog.clear()
    kv, _ = start(settings, background_start=True)
    kv.close()
    assert kv.status == ClientStatus("disabled", "closed", "closed before it started")
    assert lines(caplog) == []


def test_a_disabled_client_for_settings_that_could_not_be_read(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    kv = KvClient.disabled(SPEC, "config_error", "KVF_CLIENT_LOOKUP_TIMEOUT_MS is not an integer: 'x'")
    try:
        assert_disabled(kv, "config_error", caplog, logging.ERROR)
    finally:
        kv.close()


def test_settings_from_env_names_a_variable_that_is_not_an_integer() -> None:
    with pytest.raises(BadRequest, match="KVF_CLIENT_LOOKUP_TIMEOUT_MS is not an integer: 'soon'"):
        settings_from_env({"KVF_CLIENT_NATS_URL": "nats://x:1", "KVF_CLIENT_LOOKUP_TIMEOUT_MS": "soon"})


def test_start_errors_and_their_causes() -> None:
    import nats.errors

    url = "nats://h:1"
    cases: list[tuple[BaseException | None, type[BaseException], str]] = [
        (None, Indeterminate, "nats_timeout"),
        (TimeoutError(), Indeterminate, "nats_timeout"),
        (ConnectionRefusedError(111, "refused"), Unavailable, "nats_unreachable"),
        (socket.gaierror(-2, "Name or service not known"), BadRequest, "config_error"),
        (nats.errors.Error("nats: 'Authorization Violation'"), Unauthorized, "auth_refused"),
        (nats.errors.Error("nats: invalid connect url option"), BadRequest, "config_error"),
        (BadRequest("cannot read nats_password_file"), BadRequest, "config_error"),
    ]
    for exc, kind, cause in cases:
        error = start_error(url, exc, 1000)
        assert isinstance(error, kind), (exc, error)
        assert start_cause(error) == cause
    bug = KeyError("x")
    assert start_error(url, bug, 1000) is bug and start_cause(bug) == "client_error"
    for exc, _, _ in cases:  # a password in the URL is never in the message
        if not isinstance(exc, BadRequest):
            assert "s3cret" not in str(start_error("nats://u:s3cret@h:1", exc, 1000))
    assert start_cause(OSError("port in use")) == "config_error"


def test_a_layout_of_more_group_members_than_the_directory_takes_is_a_config_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """tp x pp x layer groups above 255 (`GROUP_MEMBERS_MAX`): every lookup and save would be
    refused `bad_request`; the client says so once, at start (review, 2026-12-06)."""
    import dataclasses

    import msgspec

    caplog.set_level(logging.INFO)
    layout = msgspec.structs.replace(SPEC.layout, tp_size=8, pp_size=4, layer_group_count=8)
    spec = dataclasses.replace(SPEC, layout=layout)
    kv = KvClient(ClientSettings(nats_url=f"nats://127.0.0.1:{free_port()}"), spec)
    try:
        assert_disabled(kv, "config_error", caplog, logging.ERROR)
        assert "at most 255 members" in kv.status.detail
    finally:
        kv.close()


@pytest.mark.parametrize("fake_nats", ["ok"], indirect=True)
def test_a_metrics_port_in_use_disables_the_client_before_it_connects(
    fake_nats: FakeNats, caplog: pytest.LogCaptureFixture
) -> None:
    """The metrics server was started after NATS connected: a port in use failed the start with
    the connection left open, reconnecting for the client's life while the client was disabled
    (review, stop 68). It is started first now."""
    caplog.set_level(logging.INFO)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        settings = ClientSettings(nats_url=fake_nats.url, metrics_port=taken.getsockname()[1])
        kv, _ = start(settings)
        try:
            assert kv.status.cause == "config_error" and not kv.enabled
            assert kv.aio.nc is None  # never connected
        finally:
            kv.close()
