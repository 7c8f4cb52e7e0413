"""Every event a directory shard's shell publishes names its core's shard and epoch in the NATS
header `Kvf-Shard-Epoch` (`kvfabric.proto.directory.shard_epoch_header`), so the followers can drop
the late events of a core a newer epoch replaced. A handover drains the old core's queued events
while its lease key is released (and nats-py may flush a cancelled publish on reconnect): an old
core's publication landed after the new core's `shard_started`, past the listing the marker asked
for, and the router's index then held a group the new core does not have, with no marker after
it. Against a fake JetStream that holds one instance's publishes back (no NATS here)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from kvfabric.core.routing_index import ListedSegment, RoutingIndex
from kvfabric.directory.shell import DirectoryShell
from kvfabric.proto import directory as m
from tests.unit.directory.test_shell_events_dropped import DRAINED_S, KEY, SHARD, published, shell_of


class Stream:
    """The events stream: every instance's appends with their headers, numbered in order."""

    def __init__(self) -> None:
        self.messages: list[tuple[int, str, bytes, dict[str, str] | None]] = []


class Connection:
    """One instance's NATS connection: while `up` is False its publishes wait (then land late)."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.up = True
        self.is_connected = True

    def jetstream(self, **_: Any) -> Connection:
        return self

    async def publish(
        self, subject: str, payload: bytes, *, headers: dict[str, str] | None = None, **_: Any
    ) -> Any:
        while not self.up:  # noqa: ASYNC110 (a JetStream that does not answer for now)
            await asyncio.sleep(0.01)
        seq = len(self.stream.messages) + 1
        self.stream.messages.append((seq, subject, payload, dict(headers) if headers is not None else None))
        return type("Ack", (), {"seq": seq})()


def follow(index: RoutingIndex, stream: Stream) -> None:
    """The router's follower: every event after the index's last, with its header's origin."""
    for seq, _, data, headers in stream.messages[index.last_seq :]:
        index.apply(seq, m.event_decoder.decode(data), m.shard_epoch_of(headers))


def test_every_event_of_a_shell_names_its_shard_and_epoch() -> None:
    stream = Stream()
    nc = Connection(stream)

    async def main() -> DirectoryShell:
        shell = shell_of(7, cast(Any, nc))
        await shell.start(cast(Any, nc))
        await shell.perform([published(), published()])
        await shell.drain_events(DRAINED_S)
        await shell.stop(1.0)
        return shell

    asyncio.run(main())
    kinds = [type(m.event_decoder.decode(data)).__name__ for _, _, data, _ in stream.messages]
    assert kinds == ["ShardStarted", "GroupsPublished", "GroupsPublished"]
    assert [headers for *_, headers in stream.messages] == [{m.SHARD_EPOCH_HEADER: f"{SHARD}.7"}] * 3
    assert {m.shard_epoch_of(headers) for *_, headers in stream.messages} == {(SHARD, 7)}


def test_an_old_cores_publication_landing_after_the_new_cores_marker_is_fenced() -> None:
    stream = Stream()
    instance_a, instance_b = Connection(stream), Connection(stream)
    index = RoutingIndex()

    async def main() -> None:
        old = shell_of(1, cast(Any, instance_a))
        await old.start(cast(Any, instance_a))
        await old.drain_events(DRAINED_S)
        index.resync([ListedSegment("s1", 1, True)], [], at_seq=len(stream.messages))
        follow(index, stream)
        # JetStream holds instance A's publish back; its core publishes a group, then hands over.
        instance_a.up = False
        await old.perform([published()])
        old.may_act = lambda: False
        await old.drain_events(0.05)  # (the drain goes on in the background, as in a handover)
        # The next leader's core (which does not hold the group) starts on instance B; the
        # router lists the directory on its marker.
        new = shell_of(2, cast(Any, instance_b))
        await new.start(cast(Any, instance_b))
        await new.drain_events(DRAINED_S)
        follow(index, stream)
        assert index.resync_wanted
        index.resync([ListedSegment("s1", 1, True)], [], at_seq=index.last_seq)
        # Then the old core's publication lands: after the marker, past the listing.
        instance_a.up = True
        await old.drain_events(DRAINED_S)
        await old.stop(1.0)
        await new.stop(1.0)

    asyncio.run(main())
    seq, subject, data, headers = stream.messages[-1]
    assert isinstance(m.event_decoder.decode(data), m.GroupsPublished) and subject.endswith(".published")
    assert m.shard_epoch_of(headers) == (SHARD, 1)
    follow(index, stream)
    assert index.last_seq == seq and index.synced and not index.resync_wanted
    assert index.available_run([KEY], 0) == []  # the new core holds nothing: nor does the index
    assert index.counters["events_fenced"] == 1


def test_an_event_names_the_epoch_its_core_had_when_it_was_queued() -> None:
    """A live shell's core may have its epoch raised between steps (`kvfabric.core.directory.base`,
    a new term of the same core): the events emitted after it name the new epoch (a header built
    once at the shell's start named the old one for good, and the followers, their fence raised
    by the new term's other events, dropped them), and those queued before it keep the epoch they
    were emitted under (one published late under the new epoch would pass the fence of a core
    that replaced it meanwhile)."""
    stream = Stream()
    nc = Connection(stream)

    async def main() -> None:
        shell = shell_of(7, cast(Any, nc))
        await shell.start(cast(Any, nc))
        await shell.drain_events(DRAINED_S)
        nc.up = False  # JetStream holds the next events back: published after the raise
        await shell.perform([published()])
        await shell.perform([published()])
        shell.core.epoch = 9  # the shard won again, another term
        await shell.perform([published()])
        nc.up = True
        await shell.drain_events(DRAINED_S)
        await shell.stop(1.0)

    asyncio.run(asyncio.wait_for(main(), 30.0))
    assert [m.shard_epoch_of(headers) for *_, headers in stream.messages] == [
        (SHARD, 7),  # the marker
        (SHARD, 7),  # emitted before the raise, published after it
        (SHARD, 7),
        (SHARD, 9),  # emitted after it
    ]
