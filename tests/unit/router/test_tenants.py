"""Who a router request is from (`kvfabric.router.tenants`): the `X-Kvf-Tenant` header as sent
when no API keys are configured; with `KVF_ROUTER_API_KEYS`, only the tenant a known bearer key
was issued to (the header ignored); malformed key configurations stop the router."""

from __future__ import annotations

import json

import pytest

from kvfabric.router.settings import load_router_settings
from kvfabric.router.tenants import api_keys_from, key_digest, tenant_of
from kvfabric.runtime.config import SettingsError
from tests.unit.router.test_settings_refit import ENV

HEADER = "x-kvf-tenant"
KEYS = {key_digest("alice-key"): "alice", key_digest("bob-key"): "bob"}


def test_without_keys_the_header_names_the_tenant() -> None:
    assert tenant_of({}, None, HEADER) == "default"
    assert tenant_of({HEADER: "alice"}, None, HEADER) == "alice"
    assert tenant_of({HEADER: "a" * 500}, None, HEADER) == "a" * 64


def test_with_keys_only_a_known_bearer_key_names_the_tenant() -> None:
    assert tenant_of({"authorization": "Bearer alice-key", HEADER: "bob"}, KEYS, HEADER) == "alice"
    assert tenant_of({"authorization": "bearer  bob-key "}, KEYS, HEADER) == "bob"
    for refused in (
        {HEADER: "alice"},
        {"authorization": "Bearer"},
        {"authorization": "Basic alice-key"},
        {"authorization": "Bearer carol-key"},
        {"authorization": "Bearer " + "x" * 10_000},
        {"authorization": f"Bearer {key_digest('alice-key')}"},  # the digest is not the key
    ):
        assert tenant_of(refused, KEYS, HEADER) is None, refused


def test_key_configuration_is_strict() -> None:
    assert api_keys_from(None) is None
    two_tenants = {"alice": [key_digest("k1"), key_digest("k2")], "bob": [key_digest("k3")]}
    got = api_keys_from(json.dumps(two_tenants))
    assert got == {key_digest("k1"): "alice", key_digest("k2"): "alice", key_digest("k3"): "bob"}
    for bad in (
        "not json",
        "[]",
        "{}",
        json.dumps({"alice": []}),
        json.dumps({"alice": key_digest("k1")}),
        json.dumps({"alice": ["k1"]}),  # a key in the clear, not its digest
        json.dumps({"alice": [key_digest("k1").upper()]}),
        json.dumps({"": [key_digest("k1")]}),
        json.dumps({"a" * 65: [key_digest("k1")]}),
        json.dumps({"alice": [key_digest("k1")], "bob": [key_digest("k1")]}),
    ):
        with pytest.raises(SettingsError, match="KVF_ROUTER_API_KEYS"):
            api_keys_from(bad)


def test_router_settings_carry_the_keys_and_the_engine_key() -> None:
    plain = load_router_settings(ENV)
    assert plain.api_keys is None and plain.engine_api_key == ""
    keyed = load_router_settings(
        {
            **ENV,
            "KVF_ROUTER_API_KEYS": json.dumps({"alice": [key_digest("alice-key")]}),
            "KVF_ROUTER_ENGINE_API_KEY": "s3cret",
        }
    )
    assert keyed.api_keys == {key_digest("alice-key"): "alice"} and keyed.engine_api_key == "s3cret"
    assert "s3cret" not in repr(keyed)
    with pytest.raises(SettingsError, match="KVF_ROUTER_ENGINE_API_KEY"):
        load_router_settings({**ENV, "KVF_ROUTER_ENGINE_API_KEY": "two words"})
