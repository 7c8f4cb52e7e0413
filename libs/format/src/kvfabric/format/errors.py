"""One error hierarchy for the whole project, with wire codes.

Every expected (operating) error is a `KvfError` subclass with:

- `code`: a stable snake_case wire code. Frozen forever once released; never reuse one.
- `retryable`: whether the same request may succeed if sent again later (after backoff).
- `status`: the NATS service-error code (HTTP-like) sent in the `Nats-Service-Error-Code` header.

`Indeterminate` is special: the outcome is unknown (e.g. a timeout after the request left).
A caller must treat an indeterminate mutation as "may or may not have happened" and resolve it
by a read or an idempotent retry with the same request id — never as "failed".

Programmer errors are not here: they are `InvariantViolation` (see `invariant.py`).
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "BadRequest",
    "BatchTooLarge",
    "Busy",
    "ChecksumMismatch",
    "Conflict",
    "Exists",
    "InFlight",
    "Indeterminate",
    "KvfError",
    "NoCapacity",
    "NotFound",
    "QuotaExceeded",
    "RateLimited",
    "StaleGeneration",
    "Unauthorized",
    "Unavailable",
    "UnsupportedVersion",
    "WrongShard",
    "error_class_for_code",
    "error_from_wire",
]

_REGISTRY: dict[str, type[KvfError]] = {}


class KvfError(Exception):
    """Root of all expected kvfabric errors."""

    code: ClassVar[str] = "internal"
    retryable: ClassVar[bool] = False
    status: ClassVar[int] = 500

    def __init__(self, message: str, /, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        # Structured context, sent on the wire (must be msgspec-encodable scalars/lists/dicts).
        self.details: dict[str, Any] = details

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.code in _REGISTRY and _REGISTRY[cls.code] is not cls:
            raise TypeError(f"duplicate wire code {cls.code!r}: {cls.__name__}")
        _REGISTRY[cls.code] = cls

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, code={self.code!r}, details={self.details!r})"


_REGISTRY[KvfError.code] = KvfError


class BadRequest(KvfError):
    """Malformed or invalid input. Fix the request; retrying as is will fail again."""

    code = "bad_request"
    status = 400


class UnsupportedVersion(BadRequest):
    """A format or protocol version this build cannot read."""

    code = "unsupported_version"

    def __init__(self, what: str, found: int, supported: tuple[int, ...]) -> None:
        super().__init__(
            f"unsupported {what} version {found}; this build reads {', '.join(map(str, supported))}",
            what=what,
            found=found,
            supported=list(supported),
        )
        self.found = found
        self.supported = supported


class BatchTooLarge(BadRequest):
    code = "batch_too_large"
    status = 413


class Unauthorized(KvfError):
    code = "unauthorized"
    status = 403


class NotFound(KvfError):
    code = "not_found"
    status = 404


class Conflict(KvfError):
    code = "conflict"
    status = 409


class Exists(Conflict):
    """The key is already published: nothing to write (idempotent put)."""

    code = "exists"


class InFlight(Conflict):
    """Another writer holds the key; details carry its deadline."""

    code = "in_flight"
    retryable = True


class StaleGeneration(Conflict):
    """A message carried an old epoch/incarnation/slot generation: rejected, never applied."""

    code = "stale_generation"

    def __init__(self, kind: str, seen: int, current: int) -> None:
        super().__init__(
            f"stale {kind}: saw {seen}, current is {current}", kind=kind, seen=seen, current=current
        )


class ChecksumMismatch(KvfError):
    code = "checksum_mismatch"
    status = 422


class NoCapacity(KvfError):
    code = "no_capacity"
    status = 507
    retryable = True


class QuotaExceeded(KvfError):
    code = "quota_exceeded"
    status = 429
    retryable = True


class RateLimited(KvfError):
    """The caller's tenant sent more requests than its rate allows: nothing was applied.
    Retry after `retry_after_ms` (in details)."""

    code = "rate_limited"
    status = 429
    retryable = True

    def __init__(self, message: str, /, *, retry_after_ms: int, **details: Any) -> None:
        super().__init__(message, retry_after_ms=retry_after_ms, **details)

    @property
    def retry_after_ms(self) -> int:
        """How long to wait before sending again (also when rebuilt from the wire)."""
        return int(self.details.get("retry_after_ms", 0))


class Busy(KvfError):
    """A bounded queue or in-flight limit is full. Back off and retry."""

    code = "busy"
    status = 503
    retryable = True
    # Not on the wire: True where the refusal is the tenant's own doing (its share of the
    # in-flight slots, its queue or budget at the directory), which a service counts towards the
    # tenant's tarpit (`kvfabric.runtime.tarpit_core`); a refusal for all (a full service, a full
    # table) is not the tenant's doing and never counts.
    tenants_own: bool = False
    # Not on the wire: how long the service holds this refusal before answering it (a tenant's
    # request only; 0: at once). The runtime holds it off the request's in-flight lane
    # (`kvfabric.runtime.service`, "Held refusals"): a handler that slept on its refusal kept a
    # lane slot for the hold, and four flooding tenants filled the give-back lane that segments'
    # heartbeats share (review, stop 67).
    hold_s: float = 0.0

    @classmethod
    def own(cls, message: str, /, **details: Any) -> Busy:
        """A refusal of the tenant's own doing (`tenants_own`): its share of a bound is spent."""
        busy = cls(message, **details)
        busy.tenants_own = True
        return busy


class Unavailable(KvfError):
    """The service (or a peer it needs) is not reachable or not ready."""

    code = "unavailable"
    status = 503
    retryable = True


class WrongShard(Unavailable):
    """This directory instance does not lead the request's shard (any more): refresh the shard
    map and ask the leader. Also a request naming keys of several shards (a caller bug)."""

    code = "wrong_shard"
    status = 421


class Indeterminate(KvfError):
    """The outcome is unknown: the request may or may not have taken effect."""

    code = "indeterminate"
    status = 504
    retryable = True


def error_class_for_code(code: str) -> type[KvfError]:
    """The class registered for a wire code; unknown codes map to the root class."""
    return _REGISTRY.get(code, KvfError)


def error_from_wire(
    code: str, message: str, details: dict[str, Any] | None = None, *, retryable: bool = False
) -> KvfError:
    """Rebuild an error received on the wire, keeping its type where this build knows it. A code
    it does not know (a newer peer's) is the root class, retryable as the wire says (`retryable`:
    the sender's flag; it was dropped; review, stop 68). Only callers that read `.retryable`
    (cause labels, repair's give-up) see it: the retry helpers branch by class (`Busy`,
    `Unavailable`), so such an error is not retried by them."""
    cls = error_class_for_code(code)
    err = KvfError.__new__(cls)
    KvfError.__init__(err, message, **(details or {}))
    if cls is KvfError and code != KvfError.code and retryable:
        err.__dict__["retryable"] = True  # this instance only (a class attribute otherwise)
    return err
