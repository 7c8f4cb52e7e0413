"""A segment's stop runs every step even when its UCX server's stop fails (review, stop 68): the
UCX stop past its bound raised, and the TCP server stop, the arena's unlink, the disk tier's close
and the id lock's release were skipped (and exit 75 after a declared-down stop was lost)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

from kvfabric.segment_storage.settings import load_segment_settings
from kvfabric.segment_storage.shell import SegmentShell


class _StuckUcx:
    def stop(self) -> None:
        raise TimeoutError("the UCX server did not stop in time")


def test_a_failed_ucx_stop_does_not_skip_the_other_steps(tmp_path: Path) -> None:
    env = {
        "KVF_SEGMENT_ID": "seg-stop",
        "KVF_CLUSTER_SECRET": "s" * 32,
        "KVF_SEGMENT_SHM_DIR": str(tmp_path),
        "KVF_SEGMENT_BYTES": str(1 << 20),
        "KVF_SEGMENT_ARENA_PREFAULT": "0",
    }
    shell = SegmentShell(load_segment_settings(env))
    shell.ucx = cast(Any, _StuckUcx())
    asyncio.run(shell.stop())
    assert not shell.arena.path.exists()  # the arena was closed and unlinked
    assert shell._id_lock_fd == -1  # the id is free for the next incarnation
