"""Per-tenant budget settings (issue 21): defaults that protect a shared cluster, per-shard shares."""

from __future__ import annotations

import pytest

from kvfabric.directory.settings import load_directory_settings
from kvfabric.runtime.config import SettingsError

BASE = {"KVF_CLUSTER_SECRET": "0123456789abcdef0123"}


def test_defaults_bound_every_tenant_out_of_the_box() -> None:
    one = load_directory_settings({**BASE, "KVF_DIRECTORY_SHARDS": "1"}).core
    assert (one.pending_objects_max, one.tenant_pending_objects_max) == (200_000, 50_000)
    assert one.tenant_pending_capacity_fraction == 0.25
    assert (one.tenant_leases_max, one.tenant_pins_max) == (50_000, 2_500)
    assert one.tenant_pin_ttl_ms_max == 3_600_000 and one.write_ttl_ms_max == 30_000
    assert one.free_bytes_granules == 64
    # 16 shards: each shard's core lets a tenant reserve a 16th of the cluster-wide share
    sharded = load_directory_settings(BASE).core
    assert sharded.tenant_pending_capacity_fraction == 0.25 / 16


def test_budgets_are_configurable() -> None:
    core = load_directory_settings(
        {
            **BASE,
            "KVF_DIRECTORY_SHARDS": "2",
            "KVF_DIRECTORY_PENDING_OBJECTS_MAX": "1000",
            "KVF_DIRECTORY_TENANT_PENDING_OBJECTS_MAX": "100",
            "KVF_DIRECTORY_TENANT_PENDING_CAPACITY_PCT": "50",
            "KVF_DIRECTORY_TENANT_PIN_TTL_MS_MAX": "60000",
            "KVF_DIRECTORY_WRITE_TTL_MS_MAX": "5000",
            "KVF_DIRECTORY_FREE_BYTES_GRANULES": "0",
        }
    ).core
    assert (core.pending_objects_max, core.tenant_pending_objects_max) == (1000, 100)
    assert core.tenant_pending_capacity_fraction == 0.25
    assert (core.tenant_pin_ttl_ms_max, core.write_ttl_ms_max, core.free_bytes_granules) == (60_000, 5_000, 0)


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("KVF_DIRECTORY_TENANT_PENDING_CAPACITY_PCT", "0"),
        ("KVF_DIRECTORY_TENANT_PENDING_CAPACITY_PCT", "101"),
        ("KVF_DIRECTORY_WRITE_TTL_MS_MAX", "600001"),
        ("KVF_DIRECTORY_TENANT_PIN_TTL_MS_MAX", "86400001"),
        ("KVF_DIRECTORY_TENANT_PENDING_OBJECTS_MAX", "0"),
    ],
)
def test_out_of_range_budgets_are_refused_with_the_variable_named(var: str, value: str) -> None:
    with pytest.raises(SettingsError, match=var):
        load_directory_settings({**BASE, var: value})
