"""Mooncake Store, the peer measured next to kvfabric by `python -m bench.client`: its own venv and a run.

- `setup()` makes `.venv-mooncake` (gitignored) with the pinned non-CUDA wheel and numpy, installing
  libibverbs1 with apt-get when the library is missing (the wheel links it even without RDMA). Returns
  the venv's python, or a reason string when it cannot (the caller prints "Mooncake not measured:
  <reason>"). A stamp file naming the pins makes a second call instant.
- `measure(...)` runs `bench/mooncake_peer.py` with that python inside a fresh network namespace that
  holds only `lo` (`unshare -n`, then `ip link set lo up`: every Mooncake transfer engine listens on
  0.0.0.0 and [::]) and returns its JSON as a dict, or the reason it failed as a string (never raises
  for an operating error). The peer's docstring says what it measures and how.

CLI (from the repository root, the project's venv): `python -m bench.mooncake setup` (what
`make mooncake-setup` runs) and `python -m bench.mooncake measure --mode remote --procs 1 [--json OUT]`,
which prints the peer's table.
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from bench.peerstats import (
    DEFAULT_OBJECTS,
    DEFAULT_REPEATS,
    DEFAULT_SIZES,
    DEFAULT_WORKING_SET_BYTES,
    MAX_PROCS,
    MODES,
    parse_args,
    parse_sizes,
    peer_argv,
    table,
)

REPO: Final = Path(__file__).resolve().parents[1]
VENV: Final = REPO / ".venv-mooncake"
PEER: Final = REPO / "bench" / "mooncake_peer.py"
FILL: Final = REPO / "bench" / "mooncake_fill.py"
PINS: Final = ("mooncake-transfer-engine-non-cuda==0.3.13.post1", "numpy==2.4.6")
STAMP_NAME: Final = ".mooncake-stamp"
APT_TIMEOUT_S: Final = 300
VENV_TIMEOUT_S: Final = 120
PIP_TIMEOUT_S: Final = 900
IMPORT_TIMEOUT_S: Final = 60
DEFAULT_MEASURE_TIMEOUT_S: Final = 1800
PEER_TIMEOUT_MARGIN_S: Final = 30  # the peer stops itself this much before measure() kills it
KILL_WAIT_S: Final = 20
REASON_CHARS: Final = 3000
GLOG_INFO: Final = re.compile(r"^I\d{4} ")


def _run(argv: Sequence[str], timeout_s: float, env: dict[str, str] | None = None) -> str | None:
    """None when `argv` exits 0 within `timeout_s`, else why (its output's tail)."""
    try:
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout_s, env=env, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`{shlex.join(argv)}` failed: {e}"
    if proc.returncode == 0:
        return None
    return (
        f"`{shlex.join(argv)}` exited with {proc.returncode}: {(proc.stdout + proc.stderr)[-REASON_CHARS:]}"
    )


def libibverbs_present() -> bool:
    return ctypes.util.find_library("ibverbs") is not None


def _install_libibverbs() -> str | None:
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return (
            "libibverbs.so.1 is missing (the Mooncake wheel links it); installing it needs root and apt-get"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "libibverbs1"]
    err = _run(install, APT_TIMEOUT_S, env)
    if err is not None:  # a stale package list: update once, then try again
        err = _run(["apt-get", "update", "-q"], APT_TIMEOUT_S, env) or _run(install, APT_TIMEOUT_S, env)
    if err is None and not libibverbs_present():
        err = "apt-get installed libibverbs1 but libibverbs is still not found"
    return err


def setup(venv: Path = VENV) -> Path | str:
    """The Mooncake venv's python, creating the venv if needed; a reason string if it cannot."""
    python = venv / "bin" / "python"
    stamp = venv / STAMP_NAME
    want = " ".join(PINS)
    if python.exists() and stamp.exists() and stamp.read_text().strip() == want and libibverbs_present():
        return python
    if not libibverbs_present() and (err := _install_libibverbs()) is not None:
        return err
    if not python.exists():
        base = shutil.which("python3") or sys.executable
        if (err := _run([base, "-m", "venv", str(venv)], VENV_TIMEOUT_S)) is not None:
            return err
    if (err := _run([str(python), "-m", "pip", "install", "-q", *PINS], PIP_TIMEOUT_S)) is not None:
        return err
    check = "import mooncake.store, numpy; mooncake.store.MooncakeDistributedStore()"
    if (err := _run([str(python), "-c", check], IMPORT_TIMEOUT_S)) is not None:
        return err
    stamp.write_text(want + "\n")
    return python


def _reason(text: str) -> str:
    """The tail of the peer's stderr without glog's INFO lines."""
    lines = [line for line in text.splitlines() if not GLOG_INFO.match(line)]
    return "\n".join(lines)[-REASON_CHARS:]


def measure(
    sizes: Sequence[int] = DEFAULT_SIZES,
    objects: int = DEFAULT_OBJECTS,
    repeats: int = DEFAULT_REPEATS,
    mode: str = "remote",
    procs: int = 1,
    timeout_s: float = DEFAULT_MEASURE_TIMEOUT_S,
    *,
    working_set_bytes: int = DEFAULT_WORKING_SET_BYTES,
    python: Path | None = None,
) -> dict[str, Any] | str:
    """Run the peer once (one mode, one process count, every size); its JSON, or why there is none.

    Bad arguments are programmer errors (ValueError); anything the machine does wrong is a string."""
    if mode not in MODES or not 1 <= procs <= MAX_PROCS or timeout_s <= PEER_TIMEOUT_MARGIN_S:
        raise ValueError(f"mode={mode!r} procs={procs} timeout_s={timeout_s}")
    python = python or VENV / "bin" / "python"
    missing = _cannot_run(python)
    if missing:
        return missing
    with tempfile.TemporaryDirectory(prefix="mooncake-measure-") as tmp:
        out = Path(tmp) / "mooncake.json"
        args = peer_argv(
            sizes,
            objects,
            repeats,
            mode,
            procs,
            working_set_bytes,
            str(out),
            int(timeout_s) - PEER_TIMEOUT_MARGIN_S,
        )
        parse_args(args)  # the peer would refuse them too (SystemExit): fail here, before any process
        stdout, failed = _run_in_netns(python, PEER, args, timeout_s, "Mooncake peer")
        if failed:
            return failed
        try:
            result: dict[str, Any] = json.loads(out.read_text())
        except (OSError, ValueError) as e:
            return f"Mooncake peer wrote no readable JSON ({e}): {stdout[-REASON_CHARS:]}"
        return result


def measure_fill(
    args: Sequence[str], timeout_s: float = 300.0, *, python: Path | None = None
) -> dict[str, Any] | str:
    """Run `bench/mooncake_fill.py` with `args` in its own network namespace (as `measure`): its JSON,
    or why there is none (never raises for an operating error)."""
    python = python or VENV / "bin" / "python"
    missing = _cannot_run(python)
    if missing:
        return missing
    stdout, failed = _run_in_netns(python, FILL, args, timeout_s, "Mooncake fill")
    if failed:
        return failed
    try:
        result: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    except (IndexError, ValueError) as e:
        return f"Mooncake fill printed no JSON ({e}): {stdout[-REASON_CHARS:]}"
    return result


def _cannot_run(python: Path) -> str | None:
    """Why a peer script cannot run here (None: it can)."""
    if not python.exists():
        return f"{python} is missing (run `make mooncake-setup`)"
    if os.geteuid() != 0:
        return "the peer runs in its own network namespace (unshare -n), which needs root"
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    return None


def _run_in_netns(
    python: Path, script: Path, args: Sequence[str], timeout_s: float, what: str
) -> tuple[str, str | None]:
    """`script` with `args` in a fresh network namespace holding only `lo` (every Mooncake
    transfer engine listens on 0.0.0.0 and [::]): (its stdout, None), or (what it printed, why it
    failed); killed as a group on timeout or interruption, so no orphan stays."""
    inner = shlex.join([str(python), str(script), *args])
    argv = ["unshare", "-n", "sh", "-c", f"ip link set lo up && exec {inner}"]
    proc = subprocess.Popen(
        argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stdout, stderr = _kill_group(proc)
        return stdout, f"{what} timed out after {timeout_s:.0f} s: {_reason(stderr)}"
    except BaseException:  # interrupted (Ctrl-C, SIGTERM turned into an exception): no orphans
        _kill_group(proc)
        raise
    if proc.returncode != 0:
        return stdout, f"{what} exited with {proc.returncode}: {_reason(stderr) or stdout[-REASON_CHARS:]}"
    return stdout, None


def _kill_group(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """SIGTERM the peer's session (it cleans up), then SIGKILL whatever is left; its output so far."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            return proc.communicate(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            continue
    return proc.communicate(timeout=KILL_WAIT_S)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.mooncake", description=__doc__.split("\n", 1)[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("setup", help="create .venv-mooncake if needed")
    m = sub.add_parser("measure", help="run the peer once and print its table")
    m.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES))
    m.add_argument("--objects", type=int, default=DEFAULT_OBJECTS)
    m.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    m.add_argument("--mode", choices=MODES, default="remote")
    m.add_argument("--procs", type=int, default=1)
    m.add_argument("--working-set-bytes", type=int, default=DEFAULT_WORKING_SET_BYTES)
    m.add_argument("--timeout-s", type=float, default=DEFAULT_MEASURE_TIMEOUT_S)
    m.add_argument("--json", default=None, help="also write the peer's JSON here")
    args = parser.parse_args(argv)
    python = setup()
    if isinstance(python, str):
        print(f"Mooncake not measured: {python}", flush=True)
        return 1
    if args.command == "setup":
        print(f"Mooncake venv ready: {python}", flush=True)
        return 0
    res = measure(
        parse_sizes(args.sizes),
        args.objects,
        args.repeats,
        args.mode,
        args.procs,
        args.timeout_s,
        working_set_bytes=args.working_set_bytes,
        python=python,
    )
    if isinstance(res, str):
        print(f"Mooncake not measured: {res}", flush=True)
        return 1
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    print(table(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
