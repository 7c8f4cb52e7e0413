"""Which packages each kvfabric package imports, measured from the code (the "imports" column of
docs/architecture.md's package table).

    .venv/bin/python tools/package_imports.py

Builds the import graph with grimp (what `lint-imports` uses) and prints, per top-level package
of `kvfabric`, the other kvfabric packages it imports directly and the third-party libraries of
note (stdlib left out, except asyncio: whether a package does event-loop I/O).
"""

from __future__ import annotations

import grimp

NOTABLE_EXTERNAL = frozenset(
    {
        "asyncio",
        "blake3",
        "httpx",
        "msgspec",
        "nats",
        "numpy",
        "prometheus_client",
        "redis",
        "rich",
        "sglang",
        "starlette",
        "structlog",
        "torch",
        "transformers",
        "typer",
        "ucxx",
        "uvicorn",
        "vllm",
        "xxhash",
    }
)


def package_imports() -> dict[str, tuple[list[str], list[str]]]:
    """package -> (kvfabric packages it imports, notable external libraries it imports)."""
    graph = grimp.build_graph("kvfabric", include_external_packages=True, cache_dir=None)
    out: dict[str, tuple[list[str], list[str]]] = {}
    packages = sorted({m.split(".")[1] for m in graph.modules if m.startswith("kvfabric.")})
    for package in packages:
        own = f"kvfabric.{package}"
        internal: set[str] = set()
        external: set[str] = set()
        for module in graph.modules:
            if module != own and not module.startswith(own + "."):
                continue
            for imported in graph.find_modules_directly_imported_by(module):
                if imported.startswith("kvfabric."):
                    if imported.split(".")[1] != package:
                        internal.add(imported.split(".")[1])
                elif imported.split(".")[0] in NOTABLE_EXTERNAL:
                    external.add(imported.split(".")[0])
        out[package] = (sorted(internal), sorted(external))
    return out


def main() -> None:
    print("| package | kvfabric packages it imports | libraries of note |")
    print("|---|---|---|")
    for package, (internal, external) in package_imports().items():
        print(f"| `kvfabric.{package}` | {', '.join(internal) or '—'} | {', '.join(external) or '—'} |")


if __name__ == "__main__":
    main()
