"""Helpers of the hostile-peer suite: a victim's save and load through the real directory and
segment, raw data-plane frames, and the segment process's anonymous memory."""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket
import struct
from pathlib import Path
from typing import Final

import msgspec
from nats.aio.client import Client as NatsClient

from kvfabric.client.transfers import read_ref
from kvfabric.dataplane.addresses import pick_stream, split_host_port
from kvfabric.dataplane.frames import HEADER, Op, pack_header, unpack_header
from kvfabric.dataplane.tcp import TcpDataClient
from kvfabric.format.checksum import checksum
from kvfabric.format.ids import ObjectKey, group_id_in_key
from kvfabric.proto import directory as m
from kvfabric.proto.codec import FamilyDecoder, encode
from kvfabric.proto.common import ErrorReply
from kvfabric.proto.dataplane import ReadRef, dataplane_decoder
from tests.integration.cluster import directory_call, directory_router
from tests.unit.core.dirkit import groups, key

OBJECT_BYTES: Final = 64 << 10
_SIOCGIFADDR: Final = 0x8915
_error_decoder: Final = FamilyDecoder[ErrorReply](ErrorReply, "error frame")


def frame(op: Op, meta: msgspec.Struct, request_id: int = 1) -> bytes:
    body = encode(meta)
    return pack_header(op, request_id, len(body)) + body


def read_frame(sock: socket.socket) -> tuple[Op, object] | None:
    """One reply frame (op, decoded meta: an `ErrorReply` for ERROR), or None at EOF/reset."""
    try:
        head = _recv_exact(sock, HEADER.size)
        if head is None:
            return None
        header = unpack_header(head)
        body = _recv_exact(sock, header.meta_bytes)
    except (ConnectionResetError, BrokenPipeError):
        return None
    if body is None:
        return None
    if header.op is Op.ERROR:
        return header.op, _error_decoder.decode(body)
    return header.op, dataplane_decoder.decode(body)


def _recv_exact(sock: socket.socket, size: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def closed_by_peer(sock: socket.socket) -> bool:
    """True once the peer closed: EOF or a reset (reads and drops anything sent before)."""
    try:
        while True:
            chunk = sock.recv(1 << 16)
            if not chunk:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except (BlockingIOError, TimeoutError):
        return False


def connect(data_addr: str, source: str = "127.0.0.1", timeout_s: float = 5.0) -> socket.socket:
    """A raw TCP connection to a segment's data port from local address `source`."""
    host, port = split_host_port(pick_stream(data_addr))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.settimeout(timeout_s)
    sock.connect((host, port))
    return sock


def other_local_address() -> str:
    """An IPv4 address of this host outside loopback (where a segment bound to 127.0.0.1 must
    not answer). UCX does not connect over 127.0.0.2, so another interface's address it is."""
    for _, name in socket.if_nameindex():
        if name == "lo":
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        address = socket.inet_ntoa(packed[20:24])
        if not address.startswith("127."):
            return address
    raise AssertionError("this host has no IPv4 address outside loopback to probe the UCX listener on")


def anon_rss_bytes(pid: int) -> int:
    """Private anonymous memory of a process (its heap; the arena is shared memory, not counted)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no RssAnon for pid {pid}")


async def save(nc: NatsClient, seed: int, size: int = OBJECT_BYTES) -> tuple[ObjectKey, bytes]:
    """The victim saves one object (put_begin, PUT over a new data connection, put_commit).
    Returns (key, bytes)."""
    (g,) = groups(1, seed=seed)
    k, data = key(g), os.urandom(size)
    begun = await directory_call(
        nc,
        "put_begin",
        m.PutBegin(
            writer_id="victim",
            request_id=f"b{seed}",
            objects=[m.ObjectSpec(key=k, size_bytes=size, checksum=checksum(data))],
        ),
    )
    assert isinstance(begun, m.PutBeginReply) and begun.results[0].status == "placed", begun
    ticket = begun.results[0].tickets[0]

    def put() -> object:
        with TcpDataClient.connect(ticket.data_addr, timeout_s=10.0) as client:
            return client.put(ticket, data)

    reply = await asyncio.to_thread(put)
    assert getattr(reply, "confirmed", False), reply
    commit = await directory_call(
        nc, "put_commit", m.PutCommit(writer_id="victim", request_id=f"c{seed}", keys=[k])
    )
    assert isinstance(commit, m.PutCommitReply) and commit.results[0].status == "published", commit
    return k, data


async def lookup(nc: NatsClient, k: ObjectKey) -> tuple[str, ReadRef]:
    """The victim's lookup: (data address, reference with the directory's read token)."""
    group = group_id_in_key(k)
    hit = await directory_call(nc, "lookup", m.Lookup(holder_id="victim", groups=[group]))
    assert isinstance(hit, m.LookupReply) and hit.hit_chunks == 1, hit
    shard = (await directory_router(nc)).shard_of(group)
    await directory_call(
        nc, "lease_release", m.LeaseRelease(holder_id="victim", lease_id=hit.lease_id, shard=shard)
    )
    location = hit.objects[0]
    replica = location.replicas[0]
    return replica.data_addr, read_ref(replica, location.size_bytes)


async def load(nc: NatsClient, k: ObjectKey, data: bytes) -> None:
    """The victim loads `k` over a new data connection and checks the bytes."""
    addr, ref = await lookup(nc, k)

    def get() -> bytes:
        dest = bytearray(len(data))
        with TcpDataClient.connect(addr, timeout_s=10.0) as client:
            assert client.get_verified([ref], [dest]) == [True]
        return bytes(dest)

    assert await asyncio.to_thread(get) == data
