"""The JetStream store's tmpfs of the jetstream-disk-full drill (tools/chaos_store.py): it fills
to ENOSPC, frees, and close() leaves no mount and no folder behind, also while a file is open
on it (root)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.unit.tools.toolkit import load_tool

pytestmark = [pytest.mark.timeout(60)]

cs = load_tool("chaos_store")


def test_fill_free_and_nothing_left_behind() -> None:
    run = Path(tempfile.mkdtemp(prefix="kvf-chaos-store-test-"))
    store = cs.StoreDisk()
    store.prepare(run, {"nats_store_bytes": 8 << 20})
    held = None
    try:
        assert cs.mounted(run / "nats")
        (run / "nats" / "data").write_bytes(b"x" * 4096)  # what JetStream would have written
        said = store.fire({"action": "fill_store"})
        assert store.free_bytes() == 0 and "0 bytes free" in said
        with pytest.raises(OSError, match="No space left"):
            (run / "nats" / "more").write_bytes(b"y" * 65536)
        assert "filler deleted" in store.fire({"action": "free_store"})
        assert store.free_bytes() > 7 << 20
        held = (run / "nats" / "data").open("rb")  # a process that still has a file open there
    finally:
        left = store.close(run)
        if held is not None:
            held.close()
    assert not cs.mounted(run / "nats") and not run.exists()
    assert left == [f"mount {run / 'nats'} was busy after down (detached lazily)"]


def test_a_drill_without_a_store_tmpfs_mounts_nothing() -> None:
    run = Path(tempfile.mkdtemp(prefix="kvf-chaos-store-test-"))
    store = cs.StoreDisk()
    store.prepare(run, {})
    assert not cs.mounted(run / "nats") and store.close(run) == []
    with pytest.raises(ValueError, match="nats_store_bytes"):
        store.fire({"action": "fill_store"})
    run.rmdir()
