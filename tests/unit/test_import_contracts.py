"""The import contracts `make lint` runs (pyproject.toml, `[tool.importlinter]`) fail on a violating
import (issue 26).

Every package's sources (libs/*/src, proto_schemas/src, services/*/src) and tests/, bench/, tools/
are copied into a temporary directory, and `lint-imports` runs there with the repository's
pyproject.toml on that copy alone (the editable installs are taken off sys.path). The copy as it
is keeps the contracts; the copy with one added import per contract breaks that contract, and the
report names the added import.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Final

import pytest

REPO: Final = Path(__file__).resolve().parents[2]
CONFIG: Final = REPO / "pyproject.toml"
LINT_TIMEOUT_S: Final = 120.0

LAYERS = (
    "Library layers: format <- proto <- core | dataplane <- cluster <- client | runtime; client <- engines"
)
SERVICES = (
    "Services never import the client library (what engines link): shared caller code lives in "
    "kvfabric.cluster"
)
RUNTIME = "The client and engines do not import the service runtime, not even indirectly"
TESTS = "Nothing imports tests (helpers shared with bench and tools live in kvfabric.testing)"

# (contract, file of the copy, relative to the copy's root, that gets the import, the import, the
# import as the report names it); the layers once downwards (format -> client) and once from cluster
# into the runtime beside the client; "nothing imports tests" once from each of bench/, tools/ and a
# lib.
VIOLATIONS: Final = (
    (
        LAYERS,
        "src/kvfabric/format/errors.py",
        "import kvfabric.client",
        "kvfabric.format.errors -> kvfabric.client",
    ),
    (
        LAYERS,
        "src/kvfabric/cluster/replicas.py",
        "import kvfabric.runtime.service",
        "kvfabric.cluster.replicas -> kvfabric.runtime.service",
    ),
    (
        RUNTIME,
        "src/kvfabric/client/settings.py",
        "import kvfabric.runtime.service",
        "kvfabric.client.settings -> kvfabric.runtime.service",
    ),
    (
        SERVICES,
        "src/kvfabric/repair/shell.py",
        "import kvfabric.client.aio",
        "kvfabric.repair.shell -> kvfabric.client.aio",
    ),
    (
        TESTS,
        "bench/tenancy.py",
        "import tests.integration.clientkit",
        "bench.tenancy -> tests.integration.clientkit",
    ),
    (
        TESTS,
        "tools/engine_start_time.py",
        "import tests.engines.tinymodel",
        "tools.engine_start_time -> tests.engines.tinymodel",
    ),
    (
        TESTS,
        "src/kvfabric/testing/vllmkit.py",
        "import tests.engines.status_connector",
        "kvfabric.testing.vllmkit -> tests.engines.status_connector",
    ),
)

# Run lint-imports on the copy only: drop the editable installs' src directories from sys.path.
_DRIVER: Final = """
import sys
root, src, config = sys.argv[1:4]
sys.path[:] = [src, root] + [p for p in sys.path[1:] if not p.endswith("/src")]
sys.argv = ["lint-imports", "--no-cache", "--no-logo", "--config", config]
from importlinter.cli import lint_imports_command
lint_imports_command()
"""


def _ignore(directory: str, names: list[str]) -> set[str]:
    return {n for n in names if n == "__pycache__" or n.endswith(".egg-info") or n in ("results", "corpus")}


def _copy_tree(root: Path) -> None:
    src = root / "src"
    for package_src in [*REPO.glob("libs/*/src"), *REPO.glob("services/*/src"), REPO / "proto_schemas/src"]:
        shutil.copytree(package_src / "kvfabric", src / "kvfabric", ignore=_ignore, dirs_exist_ok=True)
    for top in ("tests", "bench", "tools"):
        shutil.copytree(REPO / top, root / top, ignore=_ignore)


def _lint(root: Path) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(root), str(root / "src"), str(CONFIG)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=LINT_TIMEOUT_S,
    )
    return done.returncode, " ".join((done.stdout + done.stderr).split())  # undo the line wrapping


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    _copy_tree(tmp_path)
    return tmp_path


def test_the_tree_as_it_is_keeps_the_contracts(tree: Path) -> None:
    _, report = _lint(tree)
    for contract, *_ in VIOLATIONS:
        assert f"{contract} KEPT" in report, report


def test_each_contract_fails_on_a_violating_import(tree: Path) -> None:
    for _, path, line, _ in VIOLATIONS:
        with (tree / path).open("a") as f:
            f.write(f"\n{line}  # a violation the contract must catch\n")
    code, report = _lint(tree)
    assert code != 0, report
    for contract, _, _, named in VIOLATIONS:
        assert f"{contract} BROKEN" in report, report
        assert f"- {named} (l." in report, report
