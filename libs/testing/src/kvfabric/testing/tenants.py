"""Tenants on an authenticated cluster (NATS users + permissions + TLS from `kvctl auth init`), for
tests, benchmarks and tools (bench/ and tools/ import it from here: nothing imports tests).

- `Secure`: a nats-server started with the auth plan's config and the plan's document
  (`write_auth`'s return value); per tenant its client settings, engine spec, client, NATS
  credentials and a connection; per service user its environment.
- `groups_of`: the chunk group ids (bytes) of a prompt under an engine spec.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, replace
from typing import Any

import nats
from nats.aio.client import Client as NatsClient

from kvfabric.client import ClientSettings, EngineSpec, KvClient
from kvfabric.cluster.natsauth import NatsAuth
from kvfabric.dataplane.tls import client_context
from kvfabric.format.ids import GroupId
from kvfabric.format.key import ShareDomain, chunk_groups_for_prefix
from kvfabric.testing.clientkit import SPEC
from kvfabric.testing.nats_server import NatsServer

__all__ = ["Secure", "groups_of"]


@dataclass
class Secure:
    nats: NatsServer
    doc: dict[str, Any]

    def env(self, user: str) -> dict[str, str]:
        return dict(self.doc["users"][user]["env"])

    def client_settings(self, tenant: str, **overrides: Any) -> ClientSettings:
        env = self.doc["tenants"][tenant]["env"]
        return ClientSettings(
            nats_url=self.nats.url,
            nats_tenant=env["KVF_CLIENT_NATS_TENANT"],
            nats_user=env["KVF_CLIENT_NATS_USER"],
            nats_password_file=env["KVF_CLIENT_NATS_PASSWORD_FILE"],
            nats_tls_ca=env["KVF_CLIENT_NATS_TLS_CA"],
            data_tls_ca=env["KVF_CLIENT_DATA_TLS_CA"],
            **overrides,
        )

    def spec(self, tenant: str, domain: str | None = None) -> EngineSpec:
        env = self.doc["tenants"][tenant]["env"]
        salt = (
            env["KVF_CLIENT_DOMAIN_SALT_HEX"]
            if domain is None
            else self.doc["tenants"][tenant]["shared_salts"][domain]
        )
        return replace(SPEC, domain=ShareDomain(domain or env["KVF_CLIENT_TENANT_ID"], bytes.fromhex(salt)))

    def client(self, tenant: str, domain: str | None = None) -> KvClient:
        return KvClient(self.client_settings(tenant), self.spec(tenant, domain))

    def data_tls(self) -> ssl.SSLContext:
        return client_context(self.doc["tls_ca"])

    def tenant_auth(self, tenant: str) -> NatsAuth:
        return self.client_settings(tenant).nats_auth()

    async def connect(self, auth: NatsAuth, errors: list[str] | None = None) -> NatsClient:
        async def on_error(exc: Exception) -> None:
            if errors is not None:
                errors.append(str(exc))

        return await nats.connect(
            self.nats.url,
            **auth.connect_options(),
            error_cb=on_error,
            allow_reconnect=False,
            connect_timeout=2,
        )


def groups_of(spec: EngineSpec, tokens: list[int]) -> list[GroupId]:
    return [g.group_id() for g in chunk_groups_for_prefix(spec.domain, spec.model, spec.layout, tokens)]
