"""Repair's replica target defaults to the directory's: with neither set, repair wanted 2 while
the directory (default 1) listed only groups below 1, so a drain kept copies on the draining
segment that repair could never retire (review, stop 70)."""

from __future__ import annotations

from kvfabric.repair.settings import load_repair_settings


def test_the_repair_target_defaults_to_the_directorys() -> None:
    assert load_repair_settings({}).replicas_target == 1
    assert load_repair_settings({"KVF_DIRECTORY_REPLICAS_DEFAULT": "3"}).replicas_target == 3
    both = {"KVF_DIRECTORY_REPLICAS_DEFAULT": "3", "KVF_REPAIR_REPLICAS_TARGET": "2"}
    assert load_repair_settings(both).replicas_target == 2
