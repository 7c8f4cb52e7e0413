"""Quota settings: strict JSON parsing, clear messages naming the variable."""

from __future__ import annotations

import json

import pytest

from kvfabric.core.quotas import TenantQuota
from kvfabric.directory.settings import load_directory_settings
from kvfabric.runtime.config import SettingsError

BASE = {"KVF_CLUSTER_SECRET": "0123456789abcdef0123"}
DIGEST = "ab" * 16


def test_defaults_are_unlimited() -> None:
    core = load_directory_settings(BASE).core
    assert core.tenant_quotas == {} and core.tenant_quota_default == TenantQuota()
    assert core.tenants_max == 10_000


def test_quotas_per_tenant_and_default() -> None:
    core = load_directory_settings(
        {
            **BASE,
            "KVF_DIRECTORY_TENANT_QUOTAS": json.dumps(
                {DIGEST.upper(): {"bytes_max": 1000, "requests_per_s": 2.5, "burst": 5}}
            ),
            "KVF_DIRECTORY_TENANT_DEFAULT_QUOTA": '{"objects_max": 7}',
            "KVF_DIRECTORY_TENANTS_MAX": "50",
            "KVF_DIRECTORY_SHARDS": "1",
        }
    ).core
    assert core.tenant_quotas == {
        bytes.fromhex(DIGEST): TenantQuota(bytes_max=1000, requests_per_s=2.5, burst=5)
    }
    assert core.tenant_quota_default == TenantQuota(objects_max=7)
    assert core.tenants_max == 50
    assert not core.segments_shared


def test_sharded_cores_enforce_a_share_of_byte_and_object_quotas() -> None:
    settings = load_directory_settings(
        {
            **BASE,
            "KVF_DIRECTORY_TENANT_QUOTAS": json.dumps({DIGEST: {"bytes_max": 1000, "requests_per_s": 2.5}}),
            "KVF_DIRECTORY_TENANT_DEFAULT_QUOTA": '{"objects_max": 7}',
            "KVF_DIRECTORY_SHARDS": "16",
        }
    )
    assert settings.shards == 16 and settings.core.segments_shared
    # ceil(1000 / 16) bytes, ceil(7 / 16) objects per shard; request rates stay per shard
    assert settings.core.tenant_quotas[bytes.fromhex(DIGEST)] == TenantQuota(bytes_max=63, requests_per_s=2.5)
    assert settings.core.tenant_quota_default == TenantQuota(objects_max=1)


@pytest.mark.parametrize(
    ("var", "value", "message"),
    [
        ("KVF_DIRECTORY_TENANT_QUOTAS", "{nope", "not valid JSON"),
        ("KVF_DIRECTORY_TENANT_QUOTAS", "[]", "want a JSON object"),
        ("KVF_DIRECTORY_TENANT_QUOTAS", '{"abcd": {}}', "not a domain digest"),
        ("KVF_DIRECTORY_TENANT_QUOTAS", f'{{"{DIGEST}": 5}}', "want a JSON object"),
        ("KVF_DIRECTORY_TENANT_QUOTAS", f'{{"{DIGEST}": {{"bytes": 5}}}}', "unknown field"),
        ("KVF_DIRECTORY_TENANT_QUOTAS", f'{{"{DIGEST}": {{"bytes_max": -1}}}}', "bytes_max=-1"),
        ("KVF_DIRECTORY_TENANT_QUOTAS", f'{{"{DIGEST}": {{"objects_max": 1.5}}}}', "objects_max=1.5"),
        ("KVF_DIRECTORY_TENANT_QUOTAS", f'{{"{DIGEST}": {{"objects_max": true}}}}', "objects_max=True"),
        ("KVF_DIRECTORY_TENANT_DEFAULT_QUOTA", '{"requests_per_s": "fast"}', "requests_per_s='fast'"),
        ("KVF_DIRECTORY_TENANT_DEFAULT_QUOTA", '{"burst": 3}', "burst needs requests_per_s"),
        ("KVF_DIRECTORY_TENANTS_MAX", "0", "KVF_DIRECTORY_TENANTS_MAX=0"),
    ],
)
def test_bad_quota_settings_are_refused_with_the_variable_named(var: str, value: str, message: str) -> None:
    with pytest.raises(SettingsError, match=var) as caught:
        load_directory_settings({**BASE, var: value})
    assert message in str(caught.value)
