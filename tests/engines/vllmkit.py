"""Running fresh vLLM engine processes (tests.engines.vllm_run) from tests and benchmarks."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
ENGINE_TIMEOUT_S = 300.0


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
        "tests.engines.vllm_run",
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
        proc = subprocess.Popen(
            argv, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            proc.wait(ENGINE_TIMEOUT_S)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode != 0 or not out.exists():
        tail = log.read_text()[-6000:]
        raise AssertionError(f"engine {name} exited {proc.returncode}:\n{tail}")
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def by_name(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {step["name"]: step for step in report["steps"]}
