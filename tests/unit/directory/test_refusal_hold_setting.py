"""`KVF_DIRECTORY_TENANT_REFUSAL_HOLD_MS`: the runtime's hold on a tenant's refusals past its
in-flight share (`kvfabric.runtime.service`), 250 ms by default, 0 answers at once."""

from __future__ import annotations

import pytest

from kvfabric.directory.settings import load_directory_settings
from kvfabric.runtime.config import SettingsError
from kvfabric.runtime.service import TENANT_REFUSAL_HOLD_MS_DEFAULT

BASE = {"KVF_CLUSTER_SECRET": "0123456789abcdef0123"}


def test_the_hold_defaults_to_the_runtimes_and_can_be_turned_off() -> None:
    assert load_directory_settings(BASE).tenant_refusal_hold_ms == TENANT_REFUSAL_HOLD_MS_DEFAULT == 250
    env = {**BASE, "KVF_DIRECTORY_TENANT_REFUSAL_HOLD_MS": "0"}
    assert load_directory_settings(env).tenant_refusal_hold_ms == 0


@pytest.mark.parametrize("value", ["-1", "10001", "soon"])
def test_a_bad_hold_is_refused_naming_the_variable(value: str) -> None:
    with pytest.raises(SettingsError, match="KVF_DIRECTORY_TENANT_REFUSAL_HOLD_MS"):
        load_directory_settings({**BASE, "KVF_DIRECTORY_TENANT_REFUSAL_HOLD_MS": value})


def test_the_tarpit_is_on_by_default_and_can_be_tuned_or_turned_off() -> None:
    """`KVF_DIRECTORY_TENANT_TARPIT_REFUSALS` / `_MS` (`kvfabric.runtime.tarpit`)."""
    default = load_directory_settings(BASE).tarpit
    assert default is not None and (default.refusals_max, default.duration_s) == (48, 2.0)
    env = {**BASE, "KVF_DIRECTORY_TENANT_TARPIT_REFUSALS": "100", "KVF_DIRECTORY_TENANT_TARPIT_MS": "500"}
    tuned = load_directory_settings(env).tarpit
    assert tuned is not None and (tuned.refusals_max, tuned.duration_s) == (100, 0.5)
    assert load_directory_settings({**BASE, "KVF_DIRECTORY_TENANT_TARPIT_REFUSALS": "0"}).tarpit is None


@pytest.mark.parametrize(
    ("name", "value"),
    [("KVF_DIRECTORY_TENANT_TARPIT_REFUSALS", "-1"), ("KVF_DIRECTORY_TENANT_TARPIT_MS", "0")],
)
def test_a_bad_tarpit_setting_is_refused_naming_the_variable(name: str, value: str) -> None:
    with pytest.raises(SettingsError, match=name):
        load_directory_settings({**BASE, name: value})
