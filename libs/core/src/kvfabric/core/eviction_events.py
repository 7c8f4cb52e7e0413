"""The events of `EvictionCore.step(event, now_ms)` (the shape of `kvfabric.core.step`): one per
entry point of `kvfabric.core.eviction`, each the method of the same meaning.

    SetCapacity -> set_capacity    Seen -> seen    Removed -> removed
    Insert -> insert(now_ms): [Admitted | Refused]    Access -> access(now_ms)
    EvictRefused -> refused(now_ms)    DropPool -> drop_pool: [Reply([removed ids])]
    AddPool -> add_pool    Retiered -> retiered(now_ms)    Unpinned -> unpinned(now_ms)
    Tick -> tick(now_ms): [EvictBatch, ...]
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from kvfabric.core.step import Reply, Tick

if TYPE_CHECKING:
    from kvfabric.core.eviction import EvictionCore
    from kvfabric.core.eviction_model import Effect, ObjectId

__all__ = [
    "Access",
    "AddPool",
    "DropPool",
    "EvictRefused",
    "EvictionEvent",
    "EvictionOutput",
    "Insert",
    "Removed",
    "Retiered",
    "Seen",
    "SetCapacity",
    "Tick",
    "Unpinned",
    "dispatch",
]


@dataclass(frozen=True, slots=True)
class SetCapacity:
    """A pool's capacity (`set_capacity`)."""

    pool: Hashable
    capacity_bytes: int


@dataclass(frozen=True, slots=True)
class Seen:
    """A request asked for an object, hit or miss (`seen`)."""

    object_id: ObjectId


@dataclass(frozen=True, slots=True)
class Insert:
    """A new object is (about to be) stored (`insert`: answers Admitted or Refused)."""

    object_id: ObjectId
    tenant: Hashable
    parent: ObjectId | None
    chunk_index: int
    pool: Hashable | None = None
    size: int = 0
    pools: Mapping[Any, int] | None = None  # Any: keys are pools (Hashable); Mapping is invariant
    prompt_chunks: int | None = None


@dataclass(frozen=True, slots=True)
class Access:
    """An object was read (`access`)."""

    object_id: ObjectId


@dataclass(frozen=True, slots=True)
class Removed:
    """An object is gone (`removed`)."""

    object_id: ObjectId


@dataclass(frozen=True, slots=True)
class EvictRefused:
    """The directory refused to evict a victim: leased or pinned (`refused`; a pinned one backs
    off)."""

    object_id: ObjectId
    pinned: bool = False


@dataclass(frozen=True, slots=True)
class DropPool:
    """A pool is gone (`drop_pool`; answers `Reply([ids of the objects removed with it])`)."""

    pool: Hashable


@dataclass(frozen=True, slots=True)
class AddPool:
    """A copy of an object's bytes in another pool, its other replicas kept (`add_pool`)."""

    object_id: ObjectId
    pool: Hashable
    nbytes: int


@dataclass(frozen=True, slots=True)
class Retiered:
    """The same object, its bytes in other pools now: a tier move (`retiered`)."""

    object_id: ObjectId
    pools: Mapping[Any, int]
    parent: ObjectId | None


@dataclass(frozen=True, slots=True)
class Unpinned:
    """The directory says the object's last pin ended (`unpinned`: a victim cooling down after a
    refusal is asked again at once)."""

    object_id: ObjectId


EvictionEvent: TypeAlias = (
    SetCapacity
    | Seen
    | Insert
    | Access
    | Removed
    | EvictRefused
    | DropPool
    | AddPool
    | Retiered
    | Unpinned
    | Tick
)
EvictionOutput: TypeAlias = "Effect | Reply[list[ObjectId]]"


def dispatch(core: EvictionCore, event: EvictionEvent, now_ms: int) -> list[EvictionOutput]:
    """`event` as the method of the same meaning (`EvictionCore.step` checked the time)."""
    if isinstance(event, Tick):
        return list(core.tick(now_ms))
    if isinstance(event, Insert):
        return list(
            core.insert(
                event.object_id,
                tenant=event.tenant,
                pool=event.pool,
                size=event.size,
                pools=event.pools,
                parent=event.parent,
                chunk_index=event.chunk_index,
                now_ms=now_ms,
                prompt_chunks=event.prompt_chunks,
            )
        )
    if isinstance(event, DropPool):
        return [Reply(core.drop_pool(event.pool))]
    if isinstance(event, SetCapacity):
        core.set_capacity(event.pool, event.capacity_bytes)
    elif isinstance(event, Seen):
        core.seen(event.object_id)
    elif isinstance(event, Access):
        core.access(event.object_id, now_ms)
    elif isinstance(event, Removed):
        core.removed(event.object_id)
    elif isinstance(event, AddPool):
        core.add_pool(event.object_id, event.pool, event.nbytes)
    elif isinstance(event, Retiered):
        core.retiered(event.object_id, pools=event.pools, parent=event.parent, now_ms=now_ms)
    elif isinstance(event, Unpinned):
        core.unpinned(event.object_id, now_ms)
    else:
        core.refused(event.object_id, now_ms, pinned=event.pinned)
    return []
