"""docs/README.md indexes every page in docs/ (issue 26), and every page it links exists."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final

DOCS: Final = Path(__file__).resolve().parents[2] / "docs"
LINK: Final = re.compile(r"\]\(([^)#]+)\)")


def test_every_doc_is_in_the_index_and_every_link_resolves() -> None:
    index = (DOCS / "README.md").read_text()
    linked = set(LINK.findall(index))
    pages = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    assert sorted(pages - linked) == [], "pages missing from docs/README.md"
    assert sorted(t for t in linked if not (DOCS / t).exists()) == [], "links to nothing"
