"""Every NATS subject kvfabric uses, built by the functions here and nowhere else.

Subjects are versioned: `kvf.v<PROTOCOL_VERSION>.<service>.<verb>` for request/reply endpoints
(served with `nats.micro`, one queue group per service so instances share load) and
`kvf.v1.events.<service>.<kind>` for events kept in JetStream.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Final

__all__ = [
    "PREFIX",
    "PROTOCOL_VERSION",
    "Service",
    "check_segment_id",
    "endpoint_subject",
    "event_subject",
    "events_wildcard",
    "segment_subject",
    "service_group",
]

PREFIX: Final = "kvf"
PROTOCOL_VERSION: Final = 1
_TOKEN = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
_SEGMENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


class Service(StrEnum):
    """Service names: the `<service>` token of a subject and the `nats.micro` service name."""

    ECHO = "echo"  # the minimal example service of the runtime lib
    DIRECTORY = "directory"
    SEGMENT = "segment"
    EVICTION = "eviction"
    REPAIR = "repair"
    PREFETCH = "prefetch"


def _check_token(kind: str, token: str) -> str:
    if not _TOKEN.match(token):
        raise ValueError(f"invalid subject {kind} {token!r}: want lower snake_case, ≤ 63 chars")
    return token


def service_group(service: Service, version: int = PROTOCOL_VERSION) -> str:
    """The subject prefix under which a service's endpoints live: `kvf.v1.<service>`."""
    return f"{PREFIX}.v{version}.{_check_token('service', service.value)}"


def endpoint_subject(service: Service, verb: str, version: int = PROTOCOL_VERSION) -> str:
    """A request/reply subject: `kvf.v1.<service>.<verb>`."""
    return f"{service_group(service, version)}.{_check_token('verb', verb)}"


def event_subject(service: Service, kind: str, version: int = PROTOCOL_VERSION) -> str:
    """An event subject kept in JetStream: `kvf.v1.events.<service>.<kind>`."""
    return f"{PREFIX}.v{version}.events.{_check_token('service', service.value)}.{_check_token('kind', kind)}"


def events_wildcard(service: Service | None = None, version: int = PROTOCOL_VERSION) -> str:
    """Wildcard over one service's events, or every service's: for stream subjects and consumers."""
    middle = "*" if service is None else _check_token("service", service.value)
    return f"{PREFIX}.v{version}.events.{middle}.>"


def check_segment_id(segment_id: str) -> str:
    """Segment ids appear in subjects: letters, digits, `_` and `-`, at most 64 characters."""
    if not _SEGMENT_ID.match(segment_id):
        raise ValueError(f"invalid segment id {segment_id!r}: want [A-Za-z0-9][A-Za-z0-9_-]{{0,63}}")
    return segment_id


def segment_subject(segment_id: str, verb: str, version: int = PROTOCOL_VERSION) -> str:
    """A subject addressed to one segment instance: `kvf.v1.segment.<verb>.<segment_id>`."""
    return f"{endpoint_subject(Service.SEGMENT, verb, version)}.{check_segment_id(segment_id)}"
