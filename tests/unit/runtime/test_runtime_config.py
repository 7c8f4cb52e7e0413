"""Settings: flags over `KVF_*` env over defaults, validated; the shared typer command."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvfabric.runtime.cli import service_cli
from kvfabric.runtime.config import (
    NATS_URL_DEFAULT,
    RuntimeSettings,
    SettingsError,
    env_name,
    load_settings,
)


def test_defaults() -> None:
    settings = load_settings({}, {})
    assert settings.nats_url == NATS_URL_DEFAULT
    assert settings.metrics_port == 0
    assert settings.metrics_host == "127.0.0.1"
    assert settings.log_json is None
    assert settings.metrics_enabled
    assert len(settings.instance_id) == 12
    assert load_settings({}, {}).instance_id != settings.instance_id, "random per instance"


def test_env_fallbacks_are_parsed() -> None:
    settings = load_settings(
        {},
        {
            "KVF_NATS_URL": "nats://10.0.0.1:4333",
            "KVF_INSTANCE_ID": "seg-7",
            "KVF_METRICS_PORT": "-1",
            "KVF_INFLIGHT_MAX": " 8 ",
            "KVF_LOG_LEVEL": "DEBUG",
            "KVF_LOG_JSON": "false",
            "KVF_SHUTDOWN_GRACE_MS": "250",
            "KVF_NATS_RECONNECT_ATTEMPTS_MAX": "3",
            "NATS_URL": "nats://ignored:1",
        },
    )
    assert settings == RuntimeSettings(
        nats_url="nats://10.0.0.1:4333",
        instance_id="seg-7",
        metrics_port=-1,
        inflight_max=8,
        log_level="debug",
        log_json=False,
        shutdown_grace_ms=250,
        nats_reconnect_attempts_max=3,
    )
    assert not settings.metrics_enabled


def test_flags_win_over_env_and_none_means_not_given() -> None:
    env = {"KVF_NATS_URL": "nats://from-env:1", "KVF_INFLIGHT_MAX": "8"}
    settings = load_settings({"nats_url": "nats://from-flag:2", "inflight_max": None}, env)
    assert (settings.nats_url, settings.inflight_max) == ("nats://from-flag:2", 8)


@pytest.mark.parametrize(("text", "expected"), [("true", True), ("1", True), ("no", False), ("auto", None)])
def test_log_json_env_values(text: str, expected: bool | None) -> None:
    assert load_settings({}, {"KVF_LOG_JSON": text}).log_json is expected


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"KVF_INFLIGHT_MAX": "lots"}, "KVF_INFLIGHT_MAX"),
        ({"KVF_INFLIGHT_MAX": "0"}, "--inflight-max / KVF_INFLIGHT_MAX"),
        ({"KVF_METRICS_PORT": "70000"}, "KVF_METRICS_PORT"),
        ({"KVF_LOG_LEVEL": "loud"}, "KVF_LOG_LEVEL"),
        ({"KVF_LOG_JSON": "maybe"}, "KVF_LOG_JSON"),
        ({"KVF_INSTANCE_ID": "has space"}, "KVF_INSTANCE_ID"),
        ({"KVF_INSTANCE_ID": "_dir0"}, "KVF_INSTANCE_ID"),  # no instance subject takes it (stop 68)
        ({"KVF_INSTANCE_ID": "-dir0"}, "KVF_INSTANCE_ID"),
        ({"KVF_NATS_URL": " "}, "KVF_NATS_URL"),
        ({"KVF_SHUTDOWN_GRACE_MS": "-1"}, "KVF_SHUTDOWN_GRACE_MS"),
        ({"KVF_NATS_RECONNECT_ATTEMPTS_MAX": "0"}, "reconnects are bounded"),
        ({"KVF_NATS_RECONNECT_WAIT_MS": "0"}, "KVF_NATS_RECONNECT_WAIT_MS"),  # burnt out in ms
        ({"KVF_NATS_CONNECT_TIMEOUT_MS": "99999999"}, "KVF_NATS_CONNECT_TIMEOUT_MS"),
    ],
)
def test_invalid_values_name_the_setting(env: dict[str, str], names: str) -> None:
    with pytest.raises(SettingsError, match=names):
        load_settings({}, env)


def test_unknown_flag_is_rejected() -> None:
    with pytest.raises(SettingsError, match="unknown settings"):
        load_settings({"nats_uri": "x"}, {})


def test_env_name() -> None:
    assert env_name("nats_url") == "KVF_NATS_URL"


def test_cli_merges_flags_over_env_and_exits_with_main_code(json_logs: object) -> None:
    seen: list[RuntimeSettings] = []

    async def main(settings: RuntimeSettings) -> int:
        seen.append(settings)
        return 3

    app = service_cli(name="t", help="test", main=main)
    result = CliRunner().invoke(
        app,
        ["--nats-url", "nats://flag:1", "--metrics-port", "-1", "--no-log-json", "--log-level", "WARNING"],
        env={"KVF_NATS_URL": "nats://env:1", "KVF_INFLIGHT_MAX": "5", "KVF_INSTANCE_ID": "cli-1"},
    )
    assert result.exit_code == 3, result.output
    (settings,) = seen
    assert settings.nats_url == "nats://flag:1"
    assert (settings.metrics_port, settings.inflight_max, settings.instance_id) == (-1, 5, "cli-1")
    assert (settings.log_json, settings.log_level) == (False, "warning")


def test_cli_bad_setting_is_a_usage_error(json_logs: object) -> None:
    async def main(settings: RuntimeSettings) -> int:
        raise AssertionError("must not run")

    result = CliRunner().invoke(service_cli(name="t", help="test", main=main), ["--inflight-max", "0"])
    assert result.exit_code == 2
    assert "KVF_INFLIGHT_MAX" in result.output


def test_an_instance_id_with_a_trailing_newline_is_refused() -> None:
    """`$` also matches before a final newline: `re.match` let "dir0\n" through (stop 68)."""
    with pytest.raises(SettingsError, match="instance_id"):
        RuntimeSettings(instance_id="dir0\n")


def test_a_nats_server_list_is_checked_and_printed_without_passwords() -> None:
    """`KVF_NATS_URL` may list a NATS cluster's servers; a list nats-py would refuse (a websocket
    URL among others, a scheme it does not speak) is a setting error at start, its message without
    the URL's password (it was reported `Unavailable` when connecting, and the service restarted
    for good; review, stop 71)."""
    ok = load_settings({}, {"KVF_NATS_URL": "nats://u:pw@a:4222, nats://u:pw@b:4222"})
    assert ok.nats_url.startswith("nats://u:pw@a")
    for bad in ("nats://u:secret@a:4222,ws://u:secret@b:4222", "nats://u:secret@a:4222,http://b:1", " "):
        with pytest.raises(SettingsError, match="nats_url") as refused:
            load_settings({}, {"KVF_NATS_URL": bad})
        assert "secret" not in str(refused.value)
