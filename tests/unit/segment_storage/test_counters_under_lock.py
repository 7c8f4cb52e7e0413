"""The arena backend's counters are written from the transports' connection threads, the UCX
thread and the copy pool at once: `_count` (a read, then a write of the dict) must run under
`backend.lock`, or increments are lost (`puts_total` and the refusal counts were, before
2026-12-03: `backend_writes.py` called `_count` outside the lock). This test reads the source:
every `self._count(...)` is inside a `with self.lock:` block, or in a method whose docstring
says it runs "Under the lock"; everything else calls `count`, which takes the lock."""

from __future__ import annotations

import ast
from pathlib import Path

import kvfabric.segment_storage as package


def _unlocked_counts(folder: Path) -> list[str]:
    found = []
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "_count"
                and ast.unparse(node.func.value) == "self"
            ):
                continue
            locked, function = False, None
            at: ast.AST = node
            while at in parents and not locked:
                at = parents[at]
                if isinstance(at, ast.With):
                    locked = any(ast.unparse(item.context_expr) == "self.lock" for item in at.items)
                if isinstance(at, ast.FunctionDef) and function is None:
                    function = at
            doc = (ast.get_docstring(function) or "") if function is not None else ""
            if not locked and not doc.startswith("Under the lock"):
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_every_backend_counter_write_holds_the_lock() -> None:
    assert _unlocked_counts(Path(package.__file__).parent) == []


def test_the_check_finds_an_unlocked_count(tmp_path: Path) -> None:
    """The check can fail: of three counts, the one outside the lock is found."""
    (tmp_path / "bad.py").write_text(
        "class B:\n"
        "    def unlocked(self):\n"
        "        self._count('x')\n"
        "    def locked(self):\n"
        "        with self.lock:\n"
        "            self._count('x')\n"
        "    def helper(self):\n"
        '        """Under the lock: ..."""\n'
        "        self._count('x')\n"
    )
    assert _unlocked_counts(tmp_path) == ["bad.py:3"]
