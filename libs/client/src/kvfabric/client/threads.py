"""Where the client's threads run (`ClientSettings.thread_cpus`).

A thread inherits the CPU affinity of the thread that creates it. An engine's compute thread is
often pinned (vLLM's CPU worker binds it through OpenMP to its cores), and a client created from
it would run its loop, transfer and save threads on the very cores the engine computes on. That
is right for a load (the engine thread waits for it: its CPU is idle) and wrong for a save (it
runs in the background, during the next forward passes: decode slows down).

`thread_cpus`:
- `""` (default) or `"inherit"`: keep the creating thread's affinity.
- `"auto"`: when the creating thread is pinned to fewer CPUs than its process may use (its
  main thread's affinity: the set an engine launcher divided among its compute threads), the
  background threads (`kvf-save`) run on the process's CPUs minus the creating thread's, and
  the foreground ones (the loop, `kvf-transfer`: loads the engine waits for) on all of the
  process's; otherwise inherit. (It read the parent process's set: under `taskset` the client's
  threads ran on CPUs the operator had excluded; review, stop 70.) For machines with cores to
  spare: on the 2-core dev VM it measured slower for vLLM (docs/engines.md, "Client threads"),
  so the connector keeps the default.
- a CPU list such as `"2-3,6"`: every client thread on exactly those.

`client_thread_cpus` decides (pure); `thread_placement` reads the affinities once, in the thread
creating the client, and returns what each client thread calls first (Linux; elsewhere a no-op).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from kvfabric.format.errors import BadRequest

__all__ = ["client_thread_cpus", "parse_cpu_list", "thread_placement"]

CPU_ID_MAX = 1 << 16  # larger ids in a CPU list are typos


def parse_cpu_list(text: str) -> frozenset[int]:
    """`"0-3,6"` -> {0, 1, 2, 3, 6}; raises BadRequest for anything else (or an empty list)."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            low, high = int(first), int(last or first)
            if not 0 <= low <= high < CPU_ID_MAX:
                raise ValueError(part)
            cpus.update(range(low, high + 1))
    except ValueError:
        raise BadRequest(f"not a CPU list (like 0-3,6): {text!r}") from None
    return frozenset(cpus)


def client_thread_cpus(
    setting: str, creator_cpus: frozenset[int], parent_cpus: frozenset[int], *, background: bool
) -> frozenset[int] | None:
    """The CPUs a client thread should run on; None: keep the inherited affinity. `background`:
    its work runs while the engine computes (saves), not while the engine waits (loads)."""
    setting = setting.strip()
    if setting in ("", "inherit"):
        return None
    if setting == "auto":
        if not creator_cpus < parent_cpus:
            return None  # the creating thread is not pinned within what the process may use
        return (parent_cpus - creator_cpus) if background else parent_cpus
    return parse_cpu_list(setting)


def _noop() -> None:
    return None


def thread_placement(setting: str, *, background: bool) -> Callable[[], None]:
    """Call in the thread that creates the client; each client thread calls the result first."""
    if not hasattr(os, "sched_setaffinity"):
        return _noop
    creator = frozenset(os.sched_getaffinity(0))
    try:
        parent = frozenset(os.sched_getaffinity(os.getpid()))  # the main thread's: the process's
    except OSError:  # (not allowed): nothing to compare against
        parent = creator
    cpus = client_thread_cpus(setting, creator, parent, background=background)
    if cpus is None:
        return _noop
    target = cpus

    def place() -> None:
        try:
            os.sched_setaffinity(0, target)
        except OSError:  # none of them allowed (cpuset): stay where inherited
            return

    return place
