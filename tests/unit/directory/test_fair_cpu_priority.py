"""The directory's CPU priority (`kvfabric.directory.cpu_priority`, issue 21 row 2): every thread
of the process raised where permitted, the priority kept (and said) where not. Each case runs in
a child process of its own (a priority once raised is the process's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvfabric.directory.cpu_priority import CPU_PRIORITY_DEFAULT, CpuPriority, parse
from kvfabric.directory.settings import load_directory_settings
from kvfabric.runtime.config import SettingsError

CHILD = """
import json, os, sys, threading, time
from kvfabric.directory.cpu_priority import apply, parse
if sys.argv[2] == "drop":
    os.setgid(65534); os.setuid(65534)  # nobody: no CAP_SYS_NICE
stop = threading.Event()
worker = threading.Thread(target=stop.wait)  # a thread started before: raised too
worker.start()
outcome = apply(parse(sys.argv[1]))
tasks = sorted(int(t) for t in os.listdir("/proc/self/task"))
nices = [os.getpriority(os.PRIO_PROCESS, t) for t in tasks]
policies = [os.sched_getscheduler(t) for t in tasks]
stop.set(); worker.join()
print(json.dumps({"outcome": [outcome.applied, outcome.threads, outcome.reason], "nices": nices,
                  "policies": policies, "rr": os.SCHED_RR}))
"""


def _child(priority: str, drop: bool = False) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, priority, "drop" if drop else "keep"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return dict(json.loads(out.stdout))


def test_settings_parse_the_priority_and_default_to_nice_minus_10() -> None:
    assert parse("nice:-10") == CpuPriority("nice", -10) and parse(" RR:5 ") == CpuPriority("rr", 5)
    assert parse("off") == CpuPriority("off")
    for bad in ("nice:-21", "rr:0", "rr:100", "fifo:1", "nice", ""):
        with pytest.raises(SettingsError, match="KVF_DIRECTORY_CPU_PRIORITY"):
            parse(bad)
    env = {"KVF_CLUSTER_SECRET": "x" * 32}
    assert (
        load_directory_settings(env).cpu_priority == parse(CPU_PRIORITY_DEFAULT) == CpuPriority("nice", -10)
    )
    assert load_directory_settings({**env, "KVF_DIRECTORY_CPU_PRIORITY": "off"}).cpu_priority.kind == "off"


ROOT = os.geteuid() == 0  # root can become nobody (the not-permitted case)


def _may_raise() -> bool:
    """CAP_SYS_NICE in this process's effective set (bit 23 of CapEff): what raising a
    priority needs. Root alone is not enough: a container's root usually lacks it."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 23 & 1)
    return False


def _real_time_allowed() -> bool:
    """Whether this host lets a process run real-time (a cgroup may give it no RT budget)."""
    probe = "import os; os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, check=False).returncode == 0


MAY_RAISE = _may_raise()  # without it: the next test's case


def test_every_thread_is_raised_where_permitted() -> None:
    if not MAY_RAISE:
        test_not_permitted_keeps_the_priority_and_says_so()
        return
    nice = _child("nice:-10")
    threads = len(nice["nices"])  # type: ignore[arg-type]
    assert threads >= 2 and nice["outcome"] == [True, threads, ""], nice
    assert nice["nices"] == [-10] * threads, nice
    rr = _child("rr:3")
    if _real_time_allowed():
        assert rr["outcome"] == [True, threads, ""] and rr["policies"] == [rr["rr"]] * threads, rr
    else:  # no real-time budget here: kept, and said
        assert rr["outcome"] == [False, 0, "not_permitted"], rr
    off = _child("off")
    assert off["outcome"] == [False, 0, "off"] and off["nices"] == [0] * threads, off


def test_not_permitted_keeps_the_priority_and_says_so() -> None:
    for priority in ("nice:-10", "rr:3"):
        kept = _child(priority, drop=ROOT)  # root becomes nobody first
        threads = len(kept["nices"])  # type: ignore[arg-type]
        assert kept["outcome"] == [False, 0, "not_permitted"], kept
        assert kept["nices"] == [os.getpriority(os.PRIO_PROCESS, 0)] * threads, kept
        assert kept["policies"] == [os.SCHED_OTHER] * threads, kept


def test_a_higher_real_time_priority_is_never_lowered() -> None:
    """`rr:1` on a process already real time at 5 leaves it at 5 (it lowered it to 1: review)."""
    if not (MAY_RAISE and _real_time_allowed()):
        test_not_permitted_keeps_the_priority_and_says_so()
        return
    code = (
        "import os\n"
        "os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(5))\n"
        "from kvfabric.directory.cpu_priority import apply, parse\n"
        "outcome = apply(parse('rr:1'))\n"
        "print(outcome.reason, os.sched_getparam(0).sched_priority)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30)
    assert out.stdout.split() == ["already_higher", "5"], out
