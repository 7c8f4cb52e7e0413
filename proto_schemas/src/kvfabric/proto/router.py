"""Messages of the `router` service (subjects `kvf.v1.router.<verb>`).

| verb | request | reply |
|---|---|---|
| `route` | `RouteRequest` | `RouteReply` |

`route` only answers (other proxies ask where a prompt should go): nothing is admitted or
queued, and the answer is the router's view at that moment. `instance` is empty when no
instance is eligible (`reason` says why). Every eligible instance's estimate comes with it, best
first, so a caller can weigh them itself.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from kvfabric.proto.codec import FamilyDecoder

__all__ = [
    "ROUTE_PROMPT_TOKENS_MAX",
    "InstanceEstimate",
    "RouteReply",
    "RouteRequest",
    "RouterMessage",
    "router_decoder",
]

ROUTE_PROMPT_TOKENS_MAX: Final = 1 << 20  # tokens in one route request


class RouteRequest(msgspec.Struct, frozen=True, kw_only=True, tag="router.route.v1", tag_field="t"):
    tokens: Annotated[list[int], msgspec.Meta(max_length=ROUTE_PROMPT_TOKENS_MAX)]
    tenant: str = ""


class InstanceEstimate(msgspec.Struct, frozen=True, kw_only=True):
    instance: str
    ttft_s: float
    engine_tokens: int
    colocated_tokens: int
    remote_tokens: int
    compute_tokens: int
    queued_prefill_tokens: int
    queue: int


class RouteReply(msgspec.Struct, frozen=True, kw_only=True, tag="router.route_reply.v1", tag_field="t"):
    instance: str  # empty: none eligible
    # cache_aware | tie_cache | tie_load | tie_hash | round_robin | least_loaded | no_instance | queues_full
    reason: str
    estimates: list[InstanceEstimate] = msgspec.field(default_factory=list)


RouterMessage = RouteRequest | RouteReply
router_decoder: FamilyDecoder[RouterMessage] = FamilyDecoder(RouterMessage, "router")
