"""Save memory: memory an engine fills with KV before it saves it (issue 20).

A co-located save goes through a staging file: the client copies each object into it and the
segment copies it from there into the slot (`kvfabric.dataplane.staging`). When the engine
writes its KV into memory the segment can map in the first place, the first copy goes: a
`SaveMemory` is a sealed memfd of this client's (a staging file the segment maps, as the
connection's own), and a write whose bytes lie inside one is staged by reference
(`StagedBytes` naming the memfd and the object's offset), not copied. Mooncake Store's
`register_buffer` + `batch_put_from` and LMCache's allocator-owned memory objects are the same
idea: the cache hands out the memory the engine gathers KV into.

Everything else is unchanged: the segment copies and hashes the slot, and that hash becomes the
object's checksum (the client names none at put_begin: docs/segment.md "Write"); a remote
segment, or one that cannot map the memfd (`SegmentPool._memfd_refused`, a `StagingRefusals`),
gets the bytes sent (with their hash, checked there) or staged by copy, as for any other
memory. So save memory is only ever faster, never required.

Ownership: the engine owns a `SaveMemory`. It must not change an object's bytes until the save
of them has finished (the rule for any save). Nothing catches a change made while the segment
copies a staged object: it stores what it copied, under the object's key, and readers get
those bytes (verified against that copy's hash). The engines here gather into save slots and
give a slot back only once its save has finished (`SaveSlots.give_back_when_done`).
`close` gives the memory back; it refuses (`BufferError`) while a
save or the engine still holds views of it (`view` makes a new one each time). The client's
`close` closes what its engine left open and no longer views.

Bounds: each is 1..`STAGING_BYTES_MAX` bytes, at most `SAVE_MEMORY_MAX` open per client; a
segment holds a bounded number of staging files per connection (`FILES_PER_CONNECTION_MAX`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from kvfabric.dataplane.staging import STAGING_BYTES_MAX, STAGING_HEADER_BYTES, StagingFile
from kvfabric.format.errors import BadRequest, KvfError
from kvfabric.proto.dataplane import StagedBytes

if TYPE_CHECKING:
    from kvfabric.client.sync import KvClient

__all__ = ["SAVE_MEMORY_MAX", "SaveMemory", "SaveMemoryRegistry", "SaveSlots", "client_save_slots"]

log = logging.getLogger("kvfabric.client.save_memory")

# Save memories one client holds open at once: a connection's segment keeps at most
# FILES_PER_CONNECTION_MAX (8) staging files open, one of them the connection's own.
SAVE_MEMORY_MAX: Final = 4


def address_of(data: memoryview) -> int:
    """Where `data`'s first byte is in this process (a C-contiguous byte view)."""
    return int(np.frombuffer(data, np.uint8).ctypes.data)


class SaveMemory:
    """`nbytes` of memory for an engine to fill and save from (`view`, writable)."""

    def __init__(self, registry: SaveMemoryRegistry, nbytes: int) -> None:
        if not 0 < nbytes <= STAGING_BYTES_MAX:
            raise BadRequest(f"save memory is 1..{STAGING_BYTES_MAX} bytes, not {nbytes}")
        self._registry = registry
        self._file = StagingFile("", nbytes, save_memory=True)
        self.nbytes = nbytes
        self.start = address_of(self._file.data_view())  # the temporary view is gone after this line
        self.closed = False

    @property
    def view(self) -> memoryview:
        """The memory, writable: a new view each time (the engine releases its views, or drops
        them, before `close`). `ValueError` once closed."""
        if self.closed:
            raise ValueError("this save memory is closed")
        return self._file.data_view()

    def staged(self, data: memoryview) -> StagedBytes | None:
        """`data` by reference if it lies wholly in this memory, else None."""
        return self.reference(address_of(data), len(data))

    def reference(self, address: int, size: int) -> StagedBytes | None:
        """The `size` bytes at `address` by reference if they lie wholly in this memory."""
        at = address - self.start
        if self.closed or at < 0 or at + size > self.nbytes:
            return None
        return StagedBytes(path=self._file.path, nonce=self._file.nonce, offset=STAGING_HEADER_BYTES + at)

    def close(self) -> None:
        """Give the memory back (once every holder let go: a segment keeps its file open until
        the connection's least recently used files are closed, or the connection). `BufferError`
        while views of it are still held (a save in progress, or the engine's own): nothing is
        closed then, and the memory stays usable."""
        with self._registry.lock:
            if self.closed:
                return
            self._file.close()  # BufferError while views are held
            self.closed = True
        self._registry.forget(self)

    def __enter__(self) -> SaveMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SaveMemoryRegistry:
    """A client's open save memories, which its writes look their bytes up in (any thread)."""

    def __init__(self) -> None:
        self._open: tuple[SaveMemory, ...] = ()  # replaced, never changed: read without the lock
        self.lock = threading.RLock()  # allocations, closes (one memory's close runs once)
        self._closed = False

    def allocate(self, nbytes: int) -> SaveMemory:
        with self.lock:
            if self._closed:
                raise BadRequest("the client is closed")
            if len(self._open) >= SAVE_MEMORY_MAX:
                raise BadRequest(f"a client holds at most {SAVE_MEMORY_MAX} save memories: close one")
            memory = SaveMemory(self, nbytes)
            self._open = (*self._open, memory)
        return memory

    def forget(self, memory: SaveMemory) -> None:
        with self.lock:
            self._open = tuple(m for m in self._open if m is not memory)

    def staged(self, data: memoryview) -> StagedBytes | None:
        """`data` by reference into the save memory holding it, or None (not in any)."""
        memories = self._open
        if not memories:
            return None
        address = address_of(data)  # once, not once a memory
        for memory in memories:
            ref = memory.reference(address, len(data))
            if ref is not None:
                return ref
        return None

    def close(self) -> None:
        """Close every save memory nobody views any more, and allocate no more (at the client's
        close). One still viewed stays open until the engine closes it, or the process ends."""
        with self.lock:
            self._closed = True
        for memory in self._open:
            with contextlib.suppress(BufferError):
                memory.close()


def client_save_slots(client: KvClient, slot_bytes: int) -> SaveSlots | None:
    """An engine's save slots of `slot_bytes` each, in save memory as large as `client`'s
    in-flight save bytes (`save_inflight_bytes_max`, at most `STAGING_BYTES_MAX`); None (logged)
    where none can be had: the engine then gathers into memory of its own, as without."""
    try:
        size = min(client.settings.save_inflight_bytes_max, STAGING_BYTES_MAX)
        return SaveSlots(client.save_memory(size - size % slot_bytes), slot_bytes)
    except (KvfError, OSError) as exc:
        log.warning("kvfabric: no save memory (%s): saves gather into memory of their own", exc)
        return None


class SaveSlots:
    """Fixed-size slots of one save memory, for an engine whose objects are all one size (vLLM's
    block of every layer): `take` a slot, gather an object into it (`array`), save it, and
    `give_back` the slot once that save is done (from the save future's callback: any thread).
    No slot free means the caller gathers into memory of its own, as without save memory. Slots
    are reused last-in first-out, so a memory larger than the saves in flight need is only ever
    touched (given pages) where they ran."""

    def __init__(self, memory: SaveMemory, slot_bytes: int) -> None:
        if not 0 < slot_bytes <= memory.nbytes:
            raise BadRequest(f"slots of {slot_bytes} bytes in a save memory of {memory.nbytes}")
        self.memory = memory
        self.slot_bytes = slot_bytes
        self.count = memory.nbytes // slot_bytes
        self._free = list(range(self.count - 1, -1, -1))  # a stack: slot 0 first
        self._closed = False
        self._lock = threading.Lock()

    def take(self) -> int | None:
        with self._lock:
            return self._free.pop() if self._free and not self._closed else None

    def array(self, slot: int) -> np.ndarray:
        """Slot `slot`'s bytes, writable (only between its `take` and its `give_back`). Its own
        view of the memory: once every slot's array is dropped, nothing holds the memory open
        (the client's close can close it)."""
        if self._closed or not 0 <= slot < self.count:
            raise ValueError("these save slots are closed" if self._closed else f"no slot {slot}")
        return np.frombuffer(self.memory.view, np.uint8, self.slot_bytes, slot * self.slot_bytes)

    def give_back(self, slots: list[int]) -> None:
        with self._lock:
            self._free.extend(reversed(slots))

    def give_back_when_done(self, future: concurrent.futures.Future[Any] | None, slots: list[int]) -> None:
        """`slots` back once the save that reads them is done (`future`: `save_async`'s; None, a
        save the client dropped, gives them back at once)."""
        if not slots:
            return
        if future is None:
            self.give_back(slots)
        else:
            future.add_done_callback(lambda _: self.give_back(slots))

    def free(self) -> int:
        with self._lock:
            return len(self._free)

    def close(self) -> None:
        """Take no more slots and close the memory (`BufferError` while a save still views it:
        the client's close then closes it, once nothing does)."""
        with self._lock:
            self._closed = True
        self.memory.close()
