"""`kvctl auth init`: NATS users, subject permissions, share domains and (optionally) TLS for a cluster.

One call writes everything a cluster needs to run authenticated (used by `make up`, the tests and
compose):

| file | what |
|---|---|
| `nats-auth.conf` | included by the nats-server config: users (bcrypt hashes only), permissions, TLS |
| `passwords/<user>` (0600) | each user's password |
| `env/<user>.env` | the `KVF_*` variables that process needs (credentials, TLS, grants or domain) |
| `grants.json` | the directory's tenant grants (`KVF_DIRECTORY_TENANT_GRANTS_FILE`) |
| `auth.json` (0600) | the whole plan, machine readable (tests, localcluster) |
| `tls/` | CA, server certificate and key (only with `--tls`) |

Users: one per service kind (`svc-directory`, `svc-segment`, `svc-eviction`, `svc-repair`,
`svc-prefetch`) and `admin` (kvctl), all with the service profile; one `tenant-<name>` per tenant
with the tenant profile (see `permissions`). Services are trusted with every subject (the threat
model, docs/security.md, keeps compromised service hosts out of scope); separate users still let
one be revoked alone and show in `$SYS` connection events who is who.

Share domains: each tenant gets its own (tenant id = its name, a fresh 32-byte salt); a shared
domain `--shared NAME=a,b` is one more domain granted to each tenant listed. The directory's grants
(`KVF_DIRECTORY_TENANT_GRANTS`) list digests only: salts go to the tenants' env files alone.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import secrets
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kvfabric.format.key import ShareDomain
from kvfabric.proto.subjects import (
    Service,
    check_tenant,
    tenant_inbox_prefix,
    tenant_wildcard,
)

__all__ = [
    "SERVICE_USERS",
    "AuthPlan",
    "DomainPlan",
    "UserPlan",
    "permissions",
    "plan_auth",
    "read_env_file",
    "render_nats_conf",
    "write_auth",
]

SERVICE_USERS: Final = ("svc-directory", "svc-segment", "svc-eviction", "svc-repair", "svc-prefetch", "admin")
TENANT_USER_PREFIX: Final = "tenant-"
SALT_BYTES: Final = 32
PASSWORD_BYTES: Final = 24
# nats-server checks a user's bcrypt hash on every connection attempt, right or wrong, on its own
# cores: at cost 8 (~8 ms of its CPU here) 121 wrong passwords/s from anyone took both cores and
# alice's lookup p50 went ~100x (issue 21 row 8, `python -m bench.nats_storm`). Cost 4, bcrypt's
# minimum, costs ~1 ms. No loss: every password is PASSWORD_BYTES random bytes (192 bits), which no
# hash cost is needed to keep from brute force; the cost only slows guessing of human passwords.
BCRYPT_COST: Final = 4


@dataclass(frozen=True, slots=True)
class DomainPlan:
    name: str  # the ShareDomain tenant id
    salt_hex: str
    digest_hex: str
    tenants: tuple[str, ...]  # who may use it


@dataclass(frozen=True, slots=True)
class UserPlan:
    user: str
    password: str
    tenant: str = ""  # empty: a service user


@dataclass(frozen=True, slots=True)
class AuthPlan:
    users: tuple[UserPlan, ...]
    domains: tuple[DomainPlan, ...]

    def grants(self) -> dict[str, list[str]]:
        """Tenant -> domain digests (hex): `KVF_DIRECTORY_TENANT_GRANTS`."""
        out: dict[str, list[str]] = {}
        for domain in self.domains:
            for tenant in domain.tenants:
                out.setdefault(tenant, []).append(domain.digest_hex)
        return out

    def own_domain(self, tenant: str) -> DomainPlan:
        return next(d for d in self.domains if d.name == tenant and d.tenants == (tenant,))


def permissions(tenant: str) -> dict[str, Any]:
    """NATS permissions of a user: the service profile (tenant empty) or one tenant's profile:
    publish only to its own tenant request subjects, subscribe only to its own reply inbox."""
    if not tenant:
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    return {
        "publish": {"allow": [tenant_wildcard(Service.DIRECTORY, tenant)]},
        "subscribe": {"allow": [f"{tenant_inbox_prefix(tenant)}.>"]},
    }


def plan_auth(
    tenants: Sequence[str],
    shared: Mapping[str, Sequence[str]] | None = None,
    *,
    token: Callable[[int], bytes] = secrets.token_bytes,
) -> AuthPlan:
    """Users, passwords and share domains for `tenants` plus `shared` domains (name -> tenants)."""
    shared = shared or {}
    names = [check_tenant(t) for t in tenants]
    if len(set(names)) != len(names):
        raise ValueError("a tenant is listed twice")
    for name, members in shared.items():
        if name in names or name in SERVICE_USERS:
            raise ValueError(f"shared domain {name!r} collides with a tenant or user name")
        unknown = sorted(set(members) - set(names))
        if unknown or not members:
            raise ValueError(f"shared domain {name!r} names unknown or no tenants: {unknown}")
    users = [UserPlan(u, token(PASSWORD_BYTES).hex()) for u in SERVICE_USERS]
    users += [UserPlan(TENANT_USER_PREFIX + t, token(PASSWORD_BYTES).hex(), tenant=t) for t in names]
    domains = [_domain(t, (t,), token) for t in names]
    domains += [_domain(name, tuple(members), token) for name, members in sorted(shared.items())]
    return AuthPlan(users=tuple(users), domains=tuple(domains))


def _domain(name: str, tenants: tuple[str, ...], token: Callable[[int], bytes]) -> DomainPlan:
    salt = token(SALT_BYTES)
    digest = ShareDomain(name, salt).digest()
    return DomainPlan(name=name, salt_hex=salt.hex(), digest_hex=bytes(digest).hex(), tenants=tenants)


def render_nats_conf(plan: AuthPlan, hashes: Mapping[str, str], tls_dir: Path | None) -> str:
    """The nats-server config fragment: no plaintext password, only `hashes` (user -> bcrypt)."""
    users = [
        {"user": u.user, "password": hashes[u.user], "permissions": permissions(u.tenant)} for u in plan.users
    ]
    lines = ["# written by `kvctl auth init`: users, permissions (docs/security.md)"]
    lines.append(f"authorization {{\n  users = {json.dumps(users, indent=2)}\n}}")
    if tls_dir is not None:
        lines.append(
            "tls {\n"
            f'  cert_file: "{tls_dir / "server.pem"}"\n'
            f'  key_file: "{tls_dir / "server.key"}"\n'
            f'  ca_file: "{tls_dir / "ca.pem"}"\n'
            "  timeout: 2\n}"
        )
    return "\n".join(lines) + "\n"


def _bcrypt(password: str, cost: int = BCRYPT_COST) -> str:
    import bcrypt

    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(cost)).decode()
    return "$2a$" + hashed[4:]  # nats-server documents the 2a prefix; same algorithm as 2b


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(text)


def _env_file(values: Mapping[str, str]) -> str:
    """`KEY=value` lines, each value shell-quoted where it needs it: sourced as the docs say
    (`set -a; . file`), an unquoted JSON value lost its quotes (`{alice:[...]}`) and the
    directory refused to start (review, 2026-12-05). `read_env_file` reads them back."""
    return "".join(f"{k}={shlex.quote(v)}\n" for k, v in values.items())


def read_env_file(text: str) -> dict[str, str]:
    """The variables of an env file `_env_file` wrote (shell quoting undone)."""
    env: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key and not key.startswith("#"):
            env[key] = "".join(shlex.split(value)) if value else ""
    return env


def write_auth(
    out: Path, plan: AuthPlan, *, tls: bool = False, bcrypt_cost: int = BCRYPT_COST
) -> dict[str, Any]:
    """Write the files of the module docstring under `out`; returns the `auth.json` document.
    `bcrypt_cost`: of the password hashes in `nats-auth.conf` (benchmarks compare costs)."""
    out = out.resolve()
    tls_dir = out / "tls" if tls else None
    if tls_dir is not None:
        write_tls(tls_dir)
    hashes = {u.user: _bcrypt(u.password, bcrypt_cost) for u in plan.users}
    _write_private(out / "nats-auth.conf", render_nats_conf(plan, hashes, tls_dir))
    tls_env = {"KVF_NATS_TLS_CA": str(tls_dir / "ca.pem")} if tls_dir is not None else {}
    grants = json.dumps(plan.grants(), separators=(",", ":"))
    doc: dict[str, Any] = {
        "conf": str(out / "nats-auth.conf"),
        "tls_ca": tls_env.get("KVF_NATS_TLS_CA", ""),
        "grants": plan.grants(),
        "users": {},
        "tenants": {},
        "domains": {d.name: {"digest": d.digest_hex, "tenants": list(d.tenants)} for d in plan.domains},
    }
    for u in plan.users:
        password_file = out / "passwords" / u.user
        _write_private(password_file, u.password + "\n")
        doc["users"][u.user] = {"password_file": str(password_file), "tenant": u.tenant}
        if u.tenant:
            domain = plan.own_domain(u.tenant)
            env = {
                "KVF_CLIENT_NATS_TENANT": u.tenant,
                "KVF_CLIENT_NATS_USER": u.user,
                "KVF_CLIENT_NATS_PASSWORD_FILE": str(password_file),
                "KVF_CLIENT_TENANT_ID": domain.name,
                "KVF_CLIENT_DOMAIN_SALT_HEX": domain.salt_hex,
            }
            if tls_dir is not None:
                env["KVF_CLIENT_NATS_TLS_CA"] = str(tls_dir / "ca.pem")
                env["KVF_CLIENT_DATA_TLS_CA"] = str(tls_dir / "ca.pem")
            shared = {
                d.name: d.salt_hex for d in plan.domains if u.tenant in d.tenants and d.name != u.tenant
            }
            doc["tenants"][u.tenant] = {"user": u.user, "env": env, "shared_salts": shared}
        else:
            env = {"KVF_NATS_USER": u.user, "KVF_NATS_PASSWORD_FILE": str(password_file), **tls_env}
            if u.user == "svc-directory":
                env["KVF_DIRECTORY_TENANT_GRANTS"] = grants
            if u.user == "svc-segment" and tls_dir is not None:  # the data plane over TLS too
                env["KVF_SEGMENT_TLS_CERT"] = str(tls_dir / "server.pem")
                env["KVF_SEGMENT_TLS_KEY"] = str(tls_dir / "server.key")
                env["KVF_SEGMENT_TLS_CA"] = str(tls_dir / "ca.pem")
        doc["users"][u.user]["env"] = env
        _write_private(out / "env" / f"{u.user}.env", _env_file(env))
    _write_private(out / "grants.json", grants + "\n")  # KVF_DIRECTORY_TENANT_GRANTS_FILE
    _write_private(out / "auth.json", json.dumps(doc, indent=2) + "\n")
    return doc


def write_tls(tls_dir: Path, hosts: Sequence[str] = ("127.0.0.1", "localhost")) -> None:
    """A private CA and one server certificate for `hosts` (IP addresses or DNS names)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvfabric local CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvfabric nats")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    tls_dir.mkdir(parents=True, exist_ok=True)
    (tls_dir / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (tls_dir / "server.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(
        tls_dir / "server.key",
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ).decode(),
    )
