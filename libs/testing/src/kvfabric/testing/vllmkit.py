"""Running fresh vLLM engine processes (`kvfabric.testing.vllm_run`) from tests, benchmarks and
tools.

The runner starts in the caller's working directory, which is on its `sys.path` (`python -m`):
a `--kvfabric-class` module outside the installed packages (the tests' connectors,
`tests.engines.status_connector`) is found there, so run from the repository root."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvfabric.testing.terminate import terminate_session

ENGINE_TIMEOUT_S = 300.0
ENGINE_STOP_TIMEOUT_S = 15.0  # SIGTERM to SIGKILL for what the runner leaves (its engine core)


def run_engine(
    model_dir: Path,
    steps: list[dict[str, Any]],
    workdir: Path,
    name: str,
    *,
    connector: str = "none",
    nats_url: str = "",
    example_dir: Path | None = None,
    extra_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One fresh engine instance (its own processes) over `steps`; returns its JSON report."""
    plan = workdir / f"{name}-plan.json"
    out = workdir / f"{name}-out.json"
    log = workdir / f"{name}.log"
    plan.write_text(json.dumps({"steps": steps}))
    argv = [
        sys.executable,
        "-m",
        "kvfabric.testing.vllm_run",
        "--model",
        str(model_dir),
        "--plan",
        str(plan),
        "--out",
        str(out),
        "--connector",
        connector,
    ]
    if nats_url:
        argv += ["--nats-url", nats_url]
    if example_dir is not None:
        argv += ["--example-dir", str(example_dir)]
    argv += extra_args
    with open(log, "w") as log_file:  # a file, not a pipe: vLLM writes a lot
        # Its own session: vLLM's engine-core and worker processes are killed with it afterwards
        # (the runner exits with os._exit, which does not wait for them).
        # vLLM's ZMQ socket files, which it leaves behind: a short path (at most 107 bytes).
        rpc_dir = tempfile.mkdtemp(prefix="kvf-vllm-rpc-")
        env = dict(os.environ, VLLM_RPC_BASE_PATH=rpc_dir)
        proc = subprocess.Popen(
            argv, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            proc.wait(ENGINE_TIMEOUT_S)
        finally:  # SIGTERM first: vLLM's processes then unlink their /dev/shm queues
            terminate_session(proc, ENGINE_STOP_TIMEOUT_S)
            shutil.rmtree(rpc_dir, ignore_errors=True)
    if proc.returncode != 0 or not out.exists():
        tail = log.read_text()[-6000:]
        raise AssertionError(f"engine {name} exited {proc.returncode}:\n{tail}")
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def by_name(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {step["name"]: step for step in report["steps"]}
