"""Every NATS subject kvfabric uses, built by the functions here and nowhere else.

Subjects are versioned: `kvf.v<PROTOCOL_VERSION>.<service>.<verb>` for request/reply endpoints
(served with `nats.micro`, one queue group per service so instances share load) and
`kvf.v1.events.<service>.<kind>` for events kept in JetStream.

Tenants (authenticated NATS users, see docs/security.md) call `kvf.v1.<service>.t.<tenant>.<verb>`
and receive replies under `_INBOX.t.<tenant>.`; NATS permissions allow a tenant exactly those
two, so the service reads the tenant from the subject: it cannot be forged by a message field.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Final

__all__ = [
    "INBOX_ROOT",
    "PREFIX",
    "PROTOCOL_VERSION",
    "TENANT_TOKEN",
    "Service",
    "check_segment_id",
    "check_tenant",
    "endpoint_subject",
    "event_subject",
    "events_wildcard",
    "instance_subject",
    "segment_subject",
    "service_group",
    "tenant_from_subject",
    "tenant_inbox_prefix",
    "tenant_instance_subject",
    "tenant_subject",
    "tenant_wildcard",
]

PREFIX: Final = "kvf"
PROTOCOL_VERSION: Final = 1
_TOKEN = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
_TENANT = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
TENANT_TOKEN: Final = "t"
INBOX_ROOT: Final = "_INBOX"
_SEGMENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
# (checked with `fullmatch`: `$` also matches before a final newline, so "seg1\n" passed `match`
# and went into a subject the directory published; review, stop 68)


class Service(StrEnum):
    """Service names: the `<service>` token of a subject and the `nats.micro` service name."""

    ECHO = "echo"  # the minimal example service of the runtime lib
    DIRECTORY = "directory"
    SEGMENT = "segment"
    EVICTION = "eviction"
    REPAIR = "repair"
    PREFETCH = "prefetch"
    ROUTER = "router"


def _check_token(kind: str, token: str) -> str:
    if not _TOKEN.fullmatch(token):
        raise ValueError(f"invalid subject {kind} {token!r}: want lower snake_case, ≤ 63 chars")
    return token


def service_group(service: Service, version: int = PROTOCOL_VERSION) -> str:
    """The subject prefix under which a service's endpoints live: `kvf.v1.<service>`."""
    return f"{PREFIX}.v{version}.{_check_token('service', service.value)}"


def endpoint_subject(service: Service, verb: str, version: int = PROTOCOL_VERSION) -> str:
    """A request/reply subject: `kvf.v1.<service>.<verb>`."""
    return f"{service_group(service, version)}.{_check_token('verb', verb)}"


def instance_subject(service: Service, verb: str, instance: str, version: int = PROTOCOL_VERSION) -> str:
    """A request subject addressed to one instance: `kvf.v1.<service>.<verb>.<instance>` (a
    directory instance serves its shards there; a segment its slots)."""
    return f"{endpoint_subject(service, verb, version)}.{check_segment_id(instance)}"


def event_subject(service: Service, kind: str, version: int = PROTOCOL_VERSION) -> str:
    """An event subject kept in JetStream: `kvf.v1.events.<service>.<kind>`."""
    return f"{PREFIX}.v{version}.events.{_check_token('service', service.value)}.{_check_token('kind', kind)}"


def events_wildcard(service: Service | None = None, version: int = PROTOCOL_VERSION) -> str:
    """Wildcard over one service's events, or every service's: for stream subjects and consumers."""
    middle = "*" if service is None else _check_token("service", service.value)
    return f"{PREFIX}.v{version}.events.{middle}.>"


def check_segment_id(segment_id: str) -> str:
    """Segment ids appear in subjects: letters, digits, `_` and `-`, at most 64 characters."""
    if not _SEGMENT_ID.fullmatch(segment_id):
        raise ValueError(f"invalid segment id {segment_id!r}: want [A-Za-z0-9][A-Za-z0-9_-]{{0,63}}")
    return segment_id


def segment_subject(segment_id: str, verb: str, version: int = PROTOCOL_VERSION) -> str:
    """A subject addressed to one segment instance: `kvf.v1.segment.<verb>.<segment_id>`."""
    return instance_subject(Service.SEGMENT, verb, segment_id, version)


def check_tenant(tenant: str) -> str:
    """Tenant names appear in subjects and permissions: lower snake_case, at most 32 characters."""
    if not _TENANT.fullmatch(tenant):
        raise ValueError(f"invalid tenant name {tenant!r}: want [a-z][a-z0-9_]{{0,31}}")
    return tenant


def tenant_subject(service: Service, tenant: str, verb: str, version: int = PROTOCOL_VERSION) -> str:
    """A tenant's request subject: `kvf.v1.<service>.t.<tenant>.<verb>`."""
    verb = _check_token("verb", verb)
    return f"{service_group(service, version)}.{TENANT_TOKEN}.{check_tenant(tenant)}.{verb}"


def tenant_instance_subject(
    service: Service, tenant: str, verb: str, instance: str, version: int = PROTOCOL_VERSION
) -> str:
    """A tenant's request to one instance: `kvf.v1.<service>.t.<tenant>.<verb>.<instance>`."""
    return f"{tenant_subject(service, tenant, verb, version)}.{check_segment_id(instance)}"


def tenant_wildcard(service: Service, tenant: str, version: int = PROTOCOL_VERSION) -> str:
    """Every request subject of one tenant at one service (a NATS publish permission)."""
    return f"{service_group(service, version)}.{TENANT_TOKEN}.{check_tenant(tenant)}.>"


def tenant_from_subject(subject: str, service: Service, version: int = PROTOCOL_VERSION) -> str:
    """The tenant token of a tenant request subject; `ValueError` for any other subject."""
    prefix = f"{service_group(service, version)}.{TENANT_TOKEN}."
    if not subject.startswith(prefix):
        raise ValueError(f"not a tenant subject: {subject!r}")
    return check_tenant(subject[len(prefix) :].split(".", 1)[0])


def tenant_inbox_prefix(tenant: str) -> str:
    """Where a tenant's replies go (`inbox_prefix` of its NATS connection; a subscribe permission)."""
    return f"{INBOX_ROOT}.{TENANT_TOKEN}.{check_tenant(tenant)}"
