"""Authorization of a tenant's directory requests (pure: no clock, no I/O).

## Who is asking
A tenant is an authenticated NATS user. NATS lets it publish only to its own tenant subjects
(`kvf.v1.directory.t.<tenant>.<verb>`, see `kvfabric.proto.subjects.tenant_subject`), so the
directory takes the tenant from the subject a request arrived on, never from a field the
client fills in. Services (directory, segments, eviction, repair, prefetch, kvctl) use the
service subjects, which NATS denies to tenants.

## What a tenant may touch: its grant
`TenantGrant.domains` is the set of share-domain digests the tenant may use (its own domain,
plus any explicitly configured shared domain). A chunk group or key belongs to the domain at
bytes [4:20] (`kvfabric.core.quotas.tenant_of`).

## Rules (`authorize`), per verb in `TENANT_VERBS`
- Names a tenant chooses (`holder_id`, `writer_id`) are scoped as `<tenant>/<name>`, so one
  tenant can never release, renew or unpin another's lease or pin, nor commit or abort its
  writes, even with the ids in hand.
- `lookup`: the groups are cut at the first one outside the grant. The reply is therefore
  exactly the reply to a miss at that position (the reader folds to the longest prefix anyway):
  a probe of another tenant's raw key bytes cannot be told from a miss.
- `pin`: groups outside the grant are dropped before the core sees them: "pinned 0" is also
  what a missing group gives.
- `evict`: groups outside the grant are answered `not_found`, as a missing group is
  (`merge_evict_results` puts them back in request order).
- `list_groups`: a `domain_digest` outside the grant lists nothing; without one, a tenant with
  exactly one domain lists that domain, otherwise it must name one.
- `show_group`: decided before the core sees it (`show_keys`): a chunk group id or group key
  outside the grant is not shown at all, and the caller answers `not_found_error`, the
  `NotFound` a missing group gets, without any work that depends on the group (before issue
  21 the core built the summary first: an existing group of another tenant took +31.6 µs
  longer than a missing one, z = 11.5). A chain hash alone is looked up as the group key of
  each granted domain, never under another's. `check_visible` still cuts the answer.
- `put_begin`, `put_commit`, `put_abort`: any key outside the grant refuses the whole request
  with `Unauthorized` (a write is refused whether or not the object exists, so this answers
  nothing about another tenant's objects).
- Every other verb is service-only: `Unauthorized`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import msgspec

from kvfabric.core.directory.keys import CHAIN_BYTES, GROUP_KEY_BYTES
from kvfabric.core.quotas import tenant_of
from kvfabric.format.errors import BadRequest, NotFound, Unauthorized
from kvfabric.format.ids import (
    DOMAIN_DIGEST_BYTES,
    DOMAIN_SLICE,
    ChainHash,
    DomainDigest,
    GroupId,
    GroupKey,
    domain_in_group_key,
    pack_group_key,
)
from kvfabric.format.invariant import invariant
from kvfabric.proto import directory as m

__all__ = [
    "DOMAIN_DIGEST_BYTES",
    "GIVEBACK_VERBS",
    "TENANT_NAME_MAX_CHARS",
    "TENANT_VERBS",
    "TenantGrant",
    "authorize",
    "charge_home",
    "check_visible",
    "listing_allowed",
    "merge_evict_results",
    "not_found_error",
    "scoped_name",
    "show_keys",
]

TENANT_NAME_MAX_CHARS: Final = 32
SCOPE_SEPARATOR: Final = "/"
NO_HOME: Final = DomainDigest(b"")  # a grant without a home domain

# The directory verbs a tenant may call (on its tenant subjects); every other verb is a service's.
TENANT_VERBS: Final[frozenset[str]] = frozenset(
    {
        "lookup",
        "lease_release",
        "lease_renew",
        "pin",
        "unpin",
        "put_begin",
        "put_commit",
        "put_abort",
        "evict",
        "list_groups",
        "show_group",
    }
)


@dataclass(frozen=True, slots=True)
class TenantGrant:
    """What one authenticated tenant may touch."""

    tenant: str
    domains: frozenset[DomainDigest]
    home: DomainDigest = NO_HOME  # the tenant's own domain: charged for requests that name none (rate limit)

    def __post_init__(self) -> None:
        invariant(
            0 < len(self.tenant) <= TENANT_NAME_MAX_CHARS and SCOPE_SEPARATOR not in self.tenant,
            "bad tenant name",
            tenant=self.tenant,
        )
        invariant(all(len(d) == DOMAIN_DIGEST_BYTES for d in self.domains), "domain digests are 16 bytes")
        invariant(not self.home or self.home in self.domains, "the home domain must be granted")

    def owns(self, raw: bytes) -> bool:
        """Whether a key, chunk group id or namespace lies in one of the granted domains."""
        return len(raw) >= DOMAIN_SLICE.stop and tenant_of(raw) in self.domains


def scoped_name(tenant: str, name: str) -> str:
    """A holder or writer id as the core sees it for `tenant`'s request."""
    return f"{tenant}{SCOPE_SEPARATOR}{name}"


def _refuse(grant: TenantGrant, what: str) -> Unauthorized:
    return Unauthorized(f"{what} outside the share domains of tenant {grant.tenant!r}")


def authorize(message: msgspec.Struct, verb: str, grant: TenantGrant) -> msgspec.Struct:
    """The request the core should see for `grant.tenant` (see the module docstring), or raises
    `Unauthorized`. `verb` is the endpoint the request arrived on; the caller has checked that
    `message` is that verb's type."""
    if verb not in TENANT_VERBS:
        raise Unauthorized(f"{verb} is not a tenant operation")
    t = grant.tenant
    match message:
        case m.Lookup():
            kept: list[bytes] = []
            for group in message.groups:
                if not grant.owns(group):
                    break
                kept.append(group)
            return msgspec.structs.replace(message, groups=kept, holder_id=scoped_name(t, message.holder_id))
        case m.Pin():
            own = [g for g in message.groups if grant.owns(g)]
            return msgspec.structs.replace(message, groups=own, holder_id=scoped_name(t, message.holder_id))
        case m.LeaseRelease() | m.LeaseRenew() | m.Unpin():
            return msgspec.structs.replace(message, holder_id=scoped_name(t, message.holder_id))
        case m.PutBegin():
            if not all(grant.owns(spec.key) for spec in message.objects):
                raise _refuse(grant, "a key")
            return msgspec.structs.replace(message, writer_id=scoped_name(t, message.writer_id))
        case m.PutCommit() | m.PutAbort():
            if not all(grant.owns(key) for key in message.keys):
                raise _refuse(grant, "a key")
            return msgspec.structs.replace(message, writer_id=scoped_name(t, message.writer_id))
        case m.Evict():
            tails = message.tails
            # The core's shape check, before the renumbering walks them: a million tail indexes
            # under one group cost the loop ~36 ms here for one id of fair budget (review,
            # 2026-12-05). The core checks the rest (each index an earlier group's).
            if tails and (len(tails) != len(message.groups) or sum(map(len, tails)) > len(message.groups)):
                raise BadRequest(
                    "evict tails: one list per group, of earlier groups' indexes, as many in all as groups"
                )
            granted = [i for i, g in enumerate(message.groups) if grant.owns(g)]
            if len(tails) == len(message.groups):  # renumbered to the groups kept (else refused)
                position = {old: new for new, old in enumerate(granted)}
                tails = [[position[j] for j in tails[i] if j in position] for i in granted]
            own = [message.groups[i] for i in granted]
            return msgspec.structs.replace(message, groups=own, reason="tenant", tails=tails)
        case m.ListGroups():
            return _authorize_list(message, grant)
        case m.ShowGroup():
            return message  # the caller shows `show_keys`, before the core sees anything else
    raise Unauthorized(f"{type(message).__name__} is not a tenant operation")


def _authorize_list(message: m.ListGroups, grant: TenantGrant) -> m.ListGroups:
    if message.domain_digest:
        return message  # outside the grant: `GroupList` filtered empty by the caller
    if len(grant.domains) != 1:
        raise BadRequest("name a domain_digest: this tenant has several share domains")
    (only,) = grant.domains
    return msgspec.structs.replace(message, domain_digest=only)


# Requests that only give resources back (a read lease, a pin, a write's reservation): never
# refused for load. No rate-limit token (below), and the directory serves them from in-flight
# slots of their own (`ServiceRuntime`'s give-back lane), so new work never crowds them out.
GIVEBACK_VERBS: Final[frozenset[str]] = frozenset({"lease_release", "unpin", "put_abort"})
# Verbs the core rate-limits by the domains of the keys or groups they name.
_CHARGED_BY_CORE: Final = frozenset({"lookup", "pin", "put_begin", "put_commit"})


def charge_home(verb: str, authorized: msgspec.Struct) -> bool:
    """Whether the shell must charge the tenant's home domain for this authorized request: it
    names no domain the core would charge (listing, showing, evicting, renewing, or a lookup/pin
    whose groups were all outside the grant). Every tenant request costs a token somewhere."""
    if verb in GIVEBACK_VERBS:
        return False
    if verb in _CHARGED_BY_CORE:
        return isinstance(authorized, m.Lookup | m.Pin) and not authorized.groups
    return True


def listing_allowed(message: m.ListGroups, grant: TenantGrant) -> bool:
    """Whether an authorized `list_groups` may be answered at all (else: an empty list)."""
    return message.domain_digest in grant.domains


def show_keys(message: m.ShowGroup, grant: TenantGrant) -> tuple[bytes, ...]:
    """What an authorized `show_group` may ask the core for: its chunk group id (domain at bytes
    [4:20]) or group key (domain digest first) when it lies in the grant, a chain hash alone as
    the group key of each granted domain; nothing otherwise (the caller then answers
    `not_found_error` at once: the same answer, and the same work, whether or not it exists)."""
    group = message.group
    if len(group) == CHAIN_BYTES:
        return tuple(pack_group_key(DomainDigest(d), ChainHash(group)) for d in sorted(grant.domains))
    if len(group) == GROUP_KEY_BYTES:
        return (group,) if domain_in_group_key(GroupKey(group)) in grant.domains else ()
    return (group,) if grant.owns(group) else ()


def not_found_error(group: bytes) -> NotFound:
    """What `show_group` answers for a group that is missing (the core's words) or not granted."""
    return NotFound("no such chunk group", group=group[-CHAIN_BYTES:].hex())


def check_visible(reply: m.GroupList, grant: TenantGrant, group: bytes) -> m.GroupList:
    """`show_group`'s reply cut to the groups in the grant; when none is, the same `NotFound` a
    missing group gets."""
    own = [summary for summary in reply.groups if grant.owns(summary.namespace)]
    if own:
        return m.GroupList(epoch=reply.epoch, groups=own, next_after=reply.next_after)
    raise not_found_error(group)


def merge_evict_results(requested: Sequence[GroupId], own: m.EvictReply, grant: TenantGrant) -> m.EvictReply:
    """The core's results for the granted groups, with `not_found` for the others, in request order.
    By position: the core answered the granted groups in their order, one result each, a group
    named twice included (merged by group id, the last result of a group named twice stood for
    both: an evicted group read `not_published`; review, stop 68)."""
    answered = iter(own.results)
    results = []
    for g in requested:
        result = next(answered, None) if grant.owns(g) else None
        results.append(
            result if result is not None and result.group == g else m.EvictResult(group=g, status="not_found")
        )
    return m.EvictReply(epoch=own.epoch, results=results)
