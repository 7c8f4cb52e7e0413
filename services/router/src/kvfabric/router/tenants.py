"""Who a request to the router's HTTP front is from.

Without API keys (`KVF_ROUTER_API_KEYS` unset) the tenant is the `X-Kvf-Tenant` header, as
the caller says: fit for a router behind a gateway that authenticates and sets the header, not
for one open to tenants (any caller could take another tenant's in-flight share, or dodge its
own bound by naming a new tenant per request; review, 2026-12-05).

With API keys, a request to `/v1/*` must carry `Authorization: Bearer <key>`; the tenant is the
one the key was issued to and `X-Kvf-Tenant` is ignored. Keys are configured by their SHA-256
digest (hex), never in the clear: `{"alice": ["<sha256 hex>", ...], ...}`. A key's digest is
looked up in a dict (the lookup's time depends on the digest, not on the key's bytes).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Final

from kvfabric.runtime.config import SettingsError

__all__ = ["TENANT_CHARS_MAX", "ApiKeys", "api_keys_from", "key_digest", "tenant_of"]

TENANT_CHARS_MAX: Final = 64
KEY_CHARS_MAX: Final = 512  # a longer Authorization value is refused before it is hashed
_DIGEST = re.compile(r"[0-9a-f]{64}")

ApiKeys = Mapping[str, str]  # sha256 hex digest of a key -> its tenant


def api_keys_from(text: str | None) -> ApiKeys | None:
    """`KVF_ROUTER_API_KEYS`: None when unset (the header is trusted), else digest -> tenant.
    Strict: a malformed digest, an empty or over-long tenant, or one digest given to two
    tenants stops the router with a `SettingsError`."""
    if text is None:
        return None
    name = "KVF_ROUTER_API_KEYS"
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SettingsError(f"{name}: not JSON ({exc})") from None
    if not isinstance(raw, dict) or not raw:
        raise SettingsError(f'{name}: a non-empty JSON object {{"tenant": ["<sha256 hex>", ...]}}')
    keys: dict[str, str] = {}
    for tenant, digests in raw.items():
        if not 0 < len(tenant) <= TENANT_CHARS_MAX:
            raise SettingsError(f"{name}: tenant names are 1-{TENANT_CHARS_MAX} characters")
        if not isinstance(digests, list) or not digests:
            raise SettingsError(f"{name}: {tenant}: a non-empty list of SHA-256 hex digests")
        for digest in digests:
            if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
                raise SettingsError(f"{name}: {tenant}: not a lowercase SHA-256 hex digest: {digest!r}")
            if keys.setdefault(digest, tenant) != tenant:
                raise SettingsError(f"{name}: one key digest given to {keys[digest]} and {tenant}")
    return keys


def key_digest(key: str) -> str:
    """What `KVF_ROUTER_API_KEYS` holds for `key` (`python -m kvfabric.router.tenants KEY`)."""
    return hashlib.sha256(key.encode()).hexdigest()


def tenant_of(headers: Mapping[str, str], api_keys: ApiKeys | None, tenant_header: str) -> str | None:
    """The request's tenant; None when API keys are configured and its key is missing or not
    one of them (the caller answers 401)."""
    if api_keys is None:
        return (headers.get(tenant_header) or "default")[:TENANT_CHARS_MAX]
    auth = headers.get("authorization") or ""
    scheme, _, key = auth.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key or len(key) > KEY_CHARS_MAX:
        return None
    return api_keys.get(key_digest(key))


if __name__ == "__main__":
    import sys

    for arg in sys.argv[1:]:
        print(key_digest(arg))
