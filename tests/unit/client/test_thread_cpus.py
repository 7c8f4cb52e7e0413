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
    assert client_thread_cpus("", frozenset({1}), ALL) is None
    assert client_thread_cpus("inherit", frozenset({1}), ALL) is None


def test_auto_moves_off_a_pinned_creator() -> None:
    assert client_thread_cpus("auto", frozenset({1}), ALL) == frozenset({0, 2, 3})
    assert client_thread_cpus(" auto", frozenset({0, 1}), ALL) == frozenset({2, 3})


def test_auto_keeps_an_unpinned_creator_where_it_is() -> None:
    assert client_thread_cpus("auto", ALL, ALL) is None
    assert client_thread_cpus("auto", frozenset({0, 5}), ALL) is None  # not within the parent's
    assert client_thread_cpus("auto", frozenset({0}), frozenset({0})) is None  # nowhere else


def test_explicit_list() -> None:
    assert client_thread_cpus("2-3", frozenset({1}), ALL) == frozenset({2, 3})


def test_settings_refuse_a_bad_list() -> None:
    ClientSettings(nats_url="nats://x:1", thread_cpus="auto")
    ClientSettings(nats_url="nats://x:1", thread_cpus="0,2-3")
    with pytest.raises(BadRequest):
        ClientSettings(nats_url="nats://x:1", thread_cpus="cores 1 and 2")


def test_placement_moves_new_threads_off_a_pinned_creator() -> None:
    """The shell: decided in a thread pinned to one CPU, applied by the threads it starts."""
    parent = frozenset(os.sched_getaffinity(os.getppid()))
    pin = min(parent)
    seen: dict[str, frozenset[int]] = {}

    def engine_thread() -> None:
        os.sched_setaffinity(0, {pin})
        for mode in ("auto", ""):
            place = thread_placement(mode)

            def client_thread(mode: str = mode, place: Callable[[], None] = place) -> None:
                place()
                seen[mode] = frozenset(os.sched_getaffinity(0))

            started = threading.Thread(target=client_thread)
            started.start()
            started.join(10)

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join(30)
    assert seen[""] == {pin}  # inherited
    assert seen["auto"] == ((parent - {pin}) or {pin})  # a 1-CPU machine has nowhere else
