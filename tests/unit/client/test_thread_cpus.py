"""Where the client's threads run (`ClientSettings.thread_cpus`, issue 20 item 7): created from a
pinned engine thread (vLLM's compute thread), "auto" keeps them off its CPUs."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import pytest

from kvfabric.client import ClientSettings
from kvfabric.client.threads import client_thread_cpus, parse_cpu_list, thread_placement
from kvfabric.format.errors import BadRequest

ALL = frozenset({0, 1, 2, 3})


def test_parse_cpu_list() -> None:
    assert parse_cpu_list("0-2,6") == {0, 1, 2, 6}
    assert parse_cpu_list(" 3 ") == {3}
    for bad in ("", "a", "3-1", "-1", "1,,2", "70000"):
        with pytest.raises(BadRequest, match="not a CPU list"):
            parse_cpu_list(bad)


def test_inherit_is_the_default() -> None:
    for background in (False, True):
        assert client_thread_cpus("", frozenset({1}), ALL, background=background) is None
        assert client_thread_cpus("inherit", frozenset({1}), ALL, background=background) is None


def test_auto_moves_background_threads_off_a_pinned_creator() -> None:
    """Saves run while the engine computes: off its CPUs. Loads are waited for by the engine
    thread (its CPU idle): anywhere the parent may run, the creator's CPUs included."""
    assert client_thread_cpus("auto", frozenset({1}), ALL, background=True) == frozenset({0, 2, 3})
    assert client_thread_cpus(" auto", frozenset({0, 1}), ALL, background=True) == frozenset({2, 3})
    assert client_thread_cpus("auto", frozenset({1}), ALL, background=False) == ALL


def test_auto_keeps_an_unpinned_creator_where_it_is() -> None:
    for background in (False, True):
        assert client_thread_cpus("auto", ALL, ALL, background=background) is None
        # not within the parent's CPUs / nowhere else to go
        assert client_thread_cpus("auto", frozenset({0, 5}), ALL, background=background) is None
    assert client_thread_cpus("auto", frozenset({0}), frozenset({0}), background=True) is None


def test_explicit_list() -> None:
    for background in (False, True):
        assert client_thread_cpus("2-3", frozenset({1}), ALL, background=background) == frozenset({2, 3})


def test_settings_refuse_a_bad_list() -> None:
    ClientSettings(nats_url="nats://x:1", thread_cpus="auto")
    ClientSettings(nats_url="nats://x:1", thread_cpus="0,2-3")
    with pytest.raises(BadRequest):
        ClientSettings(nats_url="nats://x:1", thread_cpus="cores 1 and 2")


def test_placement_moves_new_threads_off_a_pinned_creator() -> None:
    """The shell: decided in a thread pinned to one CPU, applied by the threads it starts."""
    parent = frozenset(os.sched_getaffinity(os.getpid()))  # the process's (its main thread's)
    pin = min(parent)
    seen: dict[tuple[str, bool], frozenset[int]] = {}

    def engine_thread() -> None:
        os.sched_setaffinity(0, {pin})
        for mode in ("auto", ""):
            for background in (False, True):
                place = thread_placement(mode, background=background)

                def client_thread(
                    key: tuple[str, bool] = (mode, background), place: Callable[[], None] = place
                ) -> None:
                    place()
                    seen[key] = frozenset(os.sched_getaffinity(0))

                started = threading.Thread(target=client_thread)
                started.start()
                started.join(10)

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join(30)
    assert seen["", False] == seen["", True] == {pin}  # inherited
    assert seen["auto", True] == ((parent - {pin}) or {pin})  # a 1-CPU machine has nowhere else
    assert seen["auto", False] == (parent if len(parent) > 1 else {pin})


def test_auto_never_moves_threads_outside_the_process_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `taskset -c 0` (the process may use CPU 0; its parent shell more), `auto` compared
    with the parent's set and ran the save threads on CPUs the operator had excluded (review,
    stop 70). The process's own set (its main thread's) is the bound. The affinities are faked
    (as `taskset` would set them), so the test needs neither two CPUs nor the main thread."""
    me, parent = os.getpid(), os.getppid()
    affinity = {0: {0}, me: {0}, parent: {0, 1}}  # calling thread, the process, its parent
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: affinity[pid])
    applied: list[object] = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: applied.append(cpus))
    for background in (False, True):
        thread_placement("auto", background=background)()
    assert applied == []  # the creating thread is not pinned within the process: inherited
    affinity[me] = {0, 1}  # a process that may use both, its creating thread pinned to CPU 0
    thread_placement("auto", background=True)()
    thread_placement("auto", background=False)()
    assert applied == [frozenset({1}), frozenset({0, 1})]
