"""`ShardHost.stop_shard`: a stopped shard's shell acts no more (no request, tick or free) from
the moment it is stopped, whether its events drain in the background (a handover) or before
the call returns (a rebuild for a missing segment, where a new core of the same epoch follows:
two cores of one shard and epoch must never act together)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import pytest

from kvfabric.core.directory import DirectoryConfig
from kvfabric.directory.shard_host import ShardHost


class FakeShell:
    def __init__(self) -> None:
        # counters: a stopped shell's are folded into the host's (`ShardHost.retired`)
        self.core = SimpleNamespace(epoch=7, counters={}, quotas=SimpleNamespace(stats=OrderedDict()))
        self.events_published = 0
        self.events_dropped = 0
        self.events_stream = None  # a folded shell's stream is kept (`ShardHost.retired`)
        self.may_act: Callable[[], bool] = lambda: True
        self.acting_while_draining: list[bool] = []
        self.stopped = False

    async def drain_events(self, timeout_s: float) -> None:
        self.acting_while_draining.append(self.may_act())
        await asyncio.sleep(0)

    async def stop(self) -> None:
        self.stopped = True


@pytest.mark.parametrize("background", [True, False])
def test_a_stopped_shell_acts_no_more(background: bool) -> None:
    host = ShardHost(
        "dir-a",
        2,
        DirectoryConfig(ticket_secret=b"s" * 32),
        registry=cast(Any, None),
        make_shell=cast(Any, None),
    )
    shell = FakeShell()
    host.shells[1] = cast(Any, shell)

    async def go() -> None:
        await host.stop_shard(1, drain_s=1.0, background=background)
        assert 1 not in host.shells and not shell.may_act()
        assert shell.stopped is not background  # drained before returning unless in background
        await asyncio.gather(*host._retiring)
        assert shell.stopped and shell.acting_while_draining == [False]

    asyncio.run(go())
