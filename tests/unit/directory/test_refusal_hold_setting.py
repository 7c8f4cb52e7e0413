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
