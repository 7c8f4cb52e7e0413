"""The directory's CPU priority: what lets it keep its CPU when tenants flood it (issue 21 row 2).

A flooded directory is CPU-bound on its one event loop; with the kernel's default share it loses
the CPU to whatever else runs on its cores (the flooding clients, NATS, other services), and a
victim tenant's request waits out whole scheduling rounds in the middle of a 2-7 ms core call
(measured: core calls of 1.6-7 ms CPU taking 50-1,161 ms of wall time, docs/security.md). Fair
admission bounds what a tenant makes the directory do; this bounds how long the directory waits
for the CPU to do it.

`KVF_DIRECTORY_CPU_PRIORITY` (`parse`):
- `nice:N` (default `nice:-10`): every thread of the process at nice N (-20..19), unless it
  already runs at a higher priority (a lower nice). Against a nice-0 competitor on its core the
  directory then gets ~90 % of it (CFS weights 9,548 : 1,024) when it wants it, and whatever it
  does not use goes to the others.
- `rr:P`: real-time round robin at priority P (1..99): the directory runs whenever it is
  runnable, ahead of every ordinary process; the kernel's real-time throttling
  (`/proc/sys/kernel/sched_rt_runtime_us`, 95 % by default) is then all that keeps the CPU for
  the others should it spin. For a host whose cores are the directory's anyway.
- `off`: the priority it was started with.

Raising a priority needs CAP_SYS_NICE (root, or a container given it, e.g. compose's
`cap_add: [SYS_NICE]`). Without it the directory runs on at the priority it was started with and
says so: `apply` returns what it did and why not (`directory_cpu_priority`, logged by the
service at start). Linux only (per-thread nice: every thread in /proc/self/task is set, and
threads started later inherit it); elsewhere `unsupported`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from kvfabric.runtime.config import SettingsError

__all__ = ["CPU_PRIORITY_DEFAULT", "CpuPriority", "Outcome", "apply", "parse"]

CPU_PRIORITY_DEFAULT: Final = "nice:-10"
NICE_MIN: Final = -20
NICE_MAX: Final = 19
RR_PRIORITY_MIN: Final = 1
RR_PRIORITY_MAX: Final = 99
TASKS_DIR: Final = Path("/proc/self/task")


@dataclass(frozen=True, slots=True)
class CpuPriority:
    kind: Literal["nice", "rr", "off"]
    value: int = 0  # the nice (nice), the real-time priority (rr)

    def __str__(self) -> str:
        return "off" if self.kind == "off" else f"{self.kind}:{self.value}"


@dataclass(frozen=True, slots=True)
class Outcome:
    """What `apply` did: `applied` to how many threads, or why it kept the priority it had."""

    wanted: str
    applied: bool
    threads: int = 0
    reason: str = ""  # when not applied: off, already_higher, not_permitted, unsupported


def parse(text: str) -> CpuPriority:
    """`nice:N`, `rr:P` or `off` (module docstring); SettingsError otherwise."""
    text = text.strip().lower()
    if text == "off":
        return CpuPriority("off")
    kind, _, number = text.partition(":")
    try:
        value = int(number)
    except ValueError:
        value = None
    if kind == "nice" and value is not None and NICE_MIN <= value <= NICE_MAX:
        return CpuPriority("nice", value)
    if kind == "rr" and value is not None and RR_PRIORITY_MIN <= value <= RR_PRIORITY_MAX:
        return CpuPriority("rr", value)
    raise SettingsError(
        f"KVF_DIRECTORY_CPU_PRIORITY must be nice:N ({NICE_MIN}..{NICE_MAX}), "
        f"rr:P ({RR_PRIORITY_MIN}..{RR_PRIORITY_MAX}) or off, got {text!r}"
    )


def _threads() -> list[int]:
    try:
        return sorted(int(name) for name in os.listdir(TASKS_DIR))
    except OSError:
        return [0]  # no /proc: the calling thread alone


def apply(priority: CpuPriority) -> Outcome:
    """Give every thread of this process `priority` where permitted; never raises for a refusal."""
    wanted = str(priority)
    if priority.kind == "off":
        return Outcome(wanted, applied=False, reason="off")
    if not hasattr(os, "sched_setscheduler") or not hasattr(os, "setpriority"):
        return Outcome(wanted, applied=False, reason="unsupported")
    threads = _threads()
    done = 0
    for tid in threads:
        try:
            if priority.kind == "nice":
                if os.getpriority(os.PRIO_PROCESS, tid) <= priority.value:
                    continue  # already at this priority or a higher one: never lowered
                os.setpriority(os.PRIO_PROCESS, tid, priority.value)
            else:
                policy = os.sched_getscheduler(tid) & ~getattr(os, "SCHED_RESET_ON_FORK", 0)
                realtime = policy in (os.SCHED_RR, os.SCHED_FIFO)
                if realtime and os.sched_getparam(tid).sched_priority >= priority.value:
                    continue  # already real time at this priority or a higher one: never lowered
                os.sched_setscheduler(tid, os.SCHED_RR, os.sched_param(priority.value))
        except PermissionError:
            return Outcome(wanted, applied=done > 0, threads=done, reason="not_permitted")
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        done += 1
    if done == 0:
        return Outcome(wanted, applied=False, reason="already_higher")
    return Outcome(wanted, applied=True, threads=done)
