"""The local path: a client on the segment's host maps the arena read-only and copies out.

The segment's `/dev/shm` arena file is mapped once (read-only, `PROT_READ`). A read asks the
segment over the data connection to pin the slots (`PIN_LOCAL`: a transfer reference per slot,
held by that connection, so a free that arrives meanwhile is deferred and the memory cannot be
reused under the copy), copies each object out of the map into the caller's buffer (one memcpy,
no socket), then unpins. The stored checksum comes back with the offsets; the caller verifies
it (`verify`) before handing bytes to an engine. If the connection dies, the segment drops the
pins itself.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence

from kvfabric.dataplane.tcp import TcpDataClient, destination_views
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import Unavailable
from kvfabric.proto.dataplane import ObjectResult, ReadRef

__all__ = ["ShmReader", "verify"]


def verify(results: Sequence[ObjectResult], dests: Sequence[memoryview | bytearray]) -> list[bool]:
    """Per object: True when it was read (`ok`) and its bytes match the stored checksum."""
    return [r.status == "ok" and checksum(d) == r.checksum for r, d in zip(results, dests, strict=True)]


class ShmReader:
    """Reads a co-located segment's objects from its shared-memory arena. Not thread-safe."""

    def __init__(self, control: TcpDataClient) -> None:
        self.control = control
        info = control.map_info()
        try:
            fd = os.open(info.arena_path, os.O_RDONLY)
        except OSError as exc:
            raise Unavailable(f"cannot open the segment arena {info.arena_path!r}: {exc}") from exc
        try:
            self._map = mmap.mmap(fd, info.arena_bytes, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._view = memoryview(self._map)
        self.incarnation = info.incarnation

    def close(self) -> None:
        self._view.release()
        self._map.close()

    def get(self, reads: list[ReadRef], dests: Sequence[memoryview | bytearray]) -> list[ObjectResult]:
        views = destination_views(reads, dests)
        pinned = self.control.pin_local(reads)
        try:
            for ref, grant, view in zip(reads, pinned.grants, views, strict=True):
                if grant.status == "ok":
                    view[:] = self._view[grant.offset : grant.offset + ref.size_bytes]
        finally:
            self.control.unpin_local(pinned.grant_id)
        return [ObjectResult(g.status, g.checksum) for g in pinned.grants]
