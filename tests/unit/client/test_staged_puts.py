"""Staged puts (issue 20; `kvfabric.dataplane.staging`): a co-located client's writes reach the
arena through a staging file of its own, not a socket; the segment stores them under the same
ticket checks and verification as a sent PUT, and refuses a staging file it should not read.
A real `ArenaBackend` served over TCP, confirms answered in process (no NATS)."""

from __future__ import annotations

import os
import time

import msgspec
import pytest

from kvfabric.client.transfers import REFUSAL_RETRY_S, SegmentPool, StagingRefusals
from kvfabric.dataplane.shm import ShmReader
from kvfabric.dataplane.staging import STAGING_HEADER_BYTES, StagingFile, StagingFiles, _Held
from kvfabric.dataplane.tcp import TcpDataClient
from kvfabric.format.errors import BadRequest, ChecksumMismatch, KvfError, Unauthorized
from kvfabric.proto.dataplane import MapReply, StagedBytes, dataplane_decoder
from tests.unit.client.conftest import NoMemfds, Segment


def test_a_co_located_write_goes_through_the_staging_file_and_reads_back(segment: Segment) -> None:
    pool = SegmentPool(connections_per_segment_max=2, timeout_s=5.0, use_shm=True)
    try:
        blobs = [os.urandom(n) for n in (3000, 1 << 20, 6 << 20)]  # the last one grows the file
        for i, data in enumerate(blobs):
            assert pool.store(segment.ticket(data, key=b"k%d" % i), memoryview(data)) == "ok"
        assert pool.staged_puts == 3
        # Named only until the segment holds it open: a client killed now leaves nothing behind.
        assert not [p for p in segment.dir.iterdir() if p.name.startswith("kvf-stage-")]
    finally:
        pool.close()


@pytest.mark.parametrize("memfd", [True, False])
def test_a_staging_file_is_the_writers_own(memfd: bool) -> None:
    staging = StagingFile("/dev/shm", 4096, memfd=memfd)
    try:
        info = os.stat(staging.path)
        assert info.st_mode & 0o777 == 0o600 and info.st_uid == os.getuid()
    finally:
        staging.close()
    assert not os.path.exists(staging.path)


def test_the_bytes_stored_are_the_ones_staged(segment: Segment) -> None:
    data = os.urandom(100_000)
    with TcpDataClient.connect(segment.server.address) as client:
        reader = ShmReader(client, ticket=segment.ticket(data))
        assert reader.staged_puts and reader.arena_dir == str(segment.dir)
        staging = StagingFile(reader.arena_dir, len(data))
        try:
            reply = client.put(segment.ticket(data), b"", staged=staging.stage(memoryview(data)))
            assert reply.confirmed
            assert segment.read(reply.slot, reply.slot_generation, len(data)) == data
            # bytes that do not match the ticket's checksum are refused, nothing stored
            other = os.urandom(len(data))
            with pytest.raises(ChecksumMismatch):
                client.put(segment.ticket(data, key=b"x"), b"", staged=staging.stage(memoryview(other)))
        finally:
            staging.close()
            reader.close()


def staged_put_refused(segment: Segment, staged: StagedBytes, size: int = 10) -> KvfError:
    data = b"x" * size
    with TcpDataClient.connect(segment.server.address) as client:
        with pytest.raises(KvfError) as caught:
            client.put(segment.ticket(data), b"", staged=staged)
        # the connection is still in step: a sent PUT works after the refusal
        # (a ticket of its own: one ticket holds one slot)
        assert client.put(segment.ticket(data, key=b"after-" + os.urandom(4).hex().encode()), data).confirmed
    assert caught.value.details.get("staging") is True
    return caught.value


@pytest.mark.parametrize("memfd", [True, False])
def test_another_writers_staging_file_is_refused_without_its_nonce(segment: Segment, memfd: bool) -> None:
    victim = StagingFile(str(segment.dir), 4096, memfd=memfd)
    try:
        victim.stage(memoryview(b"x" * 10))
        forged = StagedBytes(path=victim.path, nonce=b"\0" * 16, offset=STAGING_HEADER_BYTES)
        assert isinstance(staged_put_refused(segment, forged), Unauthorized)
    finally:
        victim.close()


def test_files_the_segment_must_not_read_are_refused(
    segment: Segment, tmp_path_factory: pytest.TempPathFactory
) -> None:
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    outside = StagingFile(str(elsewhere), 4096, memfd=False)
    mine = StagingFile(str(segment.dir), 4096, memfd=False)
    link = segment.dir / ("kvf-stage-" + "ab" * 16)
    os.symlink(mine.path, link)
    try:
        cases = [
            StagedBytes(
                path=outside.path, nonce=outside.nonce, offset=STAGING_HEADER_BYTES
            ),  # not beside the arena
            StagedBytes(path=str(segment.backend.arena.path), nonce=b"", offset=0),  # the arena itself
            StagedBytes(path=str(link), nonce=mine.nonce, offset=STAGING_HEADER_BYTES),  # a symlink
            StagedBytes(path=mine.path, nonce=mine.nonce, offset=0),  # the header
            StagedBytes(path=mine.path, nonce=mine.nonce, offset=STAGING_HEADER_BYTES + 4090),  # past its end
        ]
        for staged in cases:
            assert isinstance(staged_put_refused(segment, staged), BadRequest), staged
    finally:
        os.unlink(link)
        outside.close()
        mine.close()


@pytest.mark.parametrize("streamed", [False, True])
def test_a_segment_that_refuses_memfds_reads_files_beside_the_arena(segment: Segment, streamed: bool) -> None:
    """A refused memfd: that write is sent, the next ones are staged in a file beside the arena
    (`write` one at a time, or a stream of them, `write_many`)."""
    segment.server._staging = NoMemfds(str(segment.dir))
    pool = SegmentPool(connections_per_segment_max=2, timeout_s=5.0, use_shm=True)
    try:
        for round_ in range(3):
            blobs = [os.urandom(5000) for _ in range(2)]
            tickets = [segment.ticket(data, key=b"%d-%d" % (round_, i)) for i, data in enumerate(blobs)]
            if streamed:
                writes = [(t, memoryview(d), "", 0) for t, d in zip(tickets, blobs, strict=True)]
                assert [code for code, _ in pool.write_many(writes)] == ["ok", "ok"]
            else:
                for ticket, data in zip(tickets, blobs, strict=True):
                    assert pool.store(ticket, memoryview(data)) == "ok"
        assert pool._memfd_refused.addresses() == {segment.server.address}
        assert not pool._staging_refused.addresses()
        assert pool.staged_puts == (4 if streamed else 5)  # all but the first round / first write
    finally:
        pool.close()


def test_a_refusal_is_remembered_for_its_segments_incarnation_and_for_a_while() -> None:
    refusals = StagingRefusals()
    refusals.add("tcp://a", incarnation=7, now_s=100.0)
    assert refusals.refuses("tcp://a", 7, 100.0 + REFUSAL_RETRY_S - 1)
    assert not refusals.refuses("tcp://b", 7, 100.0)
    assert not refusals.refuses("tcp://a", 8, 101.0)  # restarted: tried again, and forgotten
    assert not refusals.refuses("tcp://a", 7, 101.0)
    refusals.add("tcp://a", incarnation=7, now_s=100.0)
    assert not refusals.refuses("tcp://a", 7, 100.0 + REFUSAL_RETRY_S)  # long enough: tried again
    assert refusals.addresses() == set()
    # a write placed before the restart (its ticket names the older incarnation) neither asks
    # the restarted segment nor forgets what it refused
    refusals.add("tcp://a", incarnation=9, now_s=100.0)
    assert not refusals.refuses("tcp://a", 8, 101.0)
    assert refusals.refuses("tcp://a", 9, 101.0)


class MemfdsLater(NoMemfds):
    """A segment that refuses memfds until told otherwise."""

    refusing = True

    def _open_memfd(self, staged: StagedBytes) -> _Held:
        if self.refusing:
            return super()._open_memfd(staged)
        return StagingFiles._open_memfd(self, staged)


def test_a_segment_that_refused_memfds_is_asked_again_later(segment: Segment) -> None:
    """A segment that refused a memfd (here: it could not map ours for a while) is written
    through a file beside the arena, until `REFUSAL_RETRY_S` have passed: then memfds again."""
    staging = MemfdsLater(str(segment.dir))
    segment.server._staging = staging
    pool = SegmentPool(connections_per_segment_max=1, timeout_s=5.0, use_shm=True)
    skew = [0.0]
    pool._refusal_clock = lambda: time.monotonic() + skew[0]
    try:
        for key in (b"a", b"b"):
            data = os.urandom(5000)
            assert pool.store(segment.ticket(data, key=key), memoryview(data)) == "ok"
        assert pool._memfd_refused.addresses() == {segment.server.address}
        staging.refusing = False  # it maps memfds now
        data = os.urandom(5000)
        assert pool.store(segment.ticket(data, key=b"c"), memoryview(data)) == "ok"
        assert pool._memfd_refused.addresses() == {segment.server.address}  # not asked yet
        skew[0] = REFUSAL_RETRY_S
        data = os.urandom(5000)
        assert pool.store(segment.ticket(data, key=b"d"), memoryview(data)) == "ok"
        assert pool._memfd_refused.addresses() == set()
        assert pool.staged_puts == 3  # b and c beside the arena, d in a memfd
    finally:
        pool.close()


def test_a_segment_that_refuses_staging_gets_the_bytes_sent(segment: Segment) -> None:
    """The segment offers staged puts but can read neither kind of the client's staging files
    (another user, say: here it refuses memfds and looks in another folder): the writes are
    sent instead, and that segment's writes are not staged again."""
    segment.server._staging = NoMemfds(str(segment.dir / "not-here"))
    pool = SegmentPool(connections_per_segment_max=2, timeout_s=5.0, use_shm=True)
    try:
        for key in (b"a", b"b", b"c"):
            data = os.urandom(5000)
            assert pool.store(segment.ticket(data, key=key), memoryview(data)) == "ok"
        assert pool.staged_puts == 0
        address = segment.server.address
        assert pool._memfd_refused.addresses() == pool._staging_refused.addresses() == {address}
    finally:
        pool.close()


def test_an_older_segment_is_never_sent_a_staged_put(segment: Segment) -> None:
    """A segment without staged puts (no `staged_puts` in its MapReply, as before this field):
    the bytes are sent."""
    old = msgspec.msgpack.encode(
        {"t": "dp.map_reply.v1", "arena_path": "/dev/shm/a", "arena_bytes": 1, "incarnation": 1}
    )
    reply = dataplane_decoder.decode(old)
    assert isinstance(reply, MapReply) and reply.staged_puts is False
    segment.server._staging_files = lambda: None  # type: ignore[method-assign]
    pool = SegmentPool(connections_per_segment_max=2, timeout_s=5.0, use_shm=True)
    try:
        data = os.urandom(5000)
        assert pool.store(segment.ticket(data), memoryview(data)) == "ok"
        assert pool.staged_puts == 0 and not pool._staging_refused.addresses()
    finally:
        pool.close()


def test_a_staged_file_the_segment_cannot_read_is_a_staging_refusal(
    segment: Segment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review, 2026-12-05: an OSError reading the writer's staged bytes (mmap ENOMEM, a pread
    error) closed the connection, so the writer saw `Indeterminate` and never fell back to
    sending: now it is a staging refusal on a connection still in step, the slot aborted."""
    import errno

    mine = StagingFile(str(segment.dir), 4096, memfd=False)
    try:
        staged = mine.stage(memoryview(b"x" * 10))
        files = segment.server._staging_files()
        assert files is not None

        def unreadable(*_: object, **__: object) -> bytes:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")

        monkeypatch.setattr(files, "read_into", unreadable)
        refusal = staged_put_refused(segment, staged)
        assert isinstance(refusal, BadRequest) and "could not be read" in refusal.message
    finally:
        mine.close()
