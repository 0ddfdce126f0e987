"""The package's layering, checked statically: one MPI layer, no import cycles."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "hpcpipe"
MPI_MAY_BE_NAMED_IN = ("hpcpipe/mpi/", "hpcpipe/bench/", "hpcpipe/runtime.py")
"""The MPI layer, the benchmarks (which time raw mpi4py against it) and the process entry."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def test_only_the_mpi_layer_imports_mpi4py():
    """Workloads ask hpcpipe.mpi for channels and collectives; they never name mpi4py, so
    staging, synchronisation, tags and error handling live in one place."""
    found = sorted(
        str(path.relative_to(ROOT))
        for path in PACKAGE.rglob("*.py")
        if "mpi4py" in path.read_text(encoding="utf-8")
    )
    outside = [f for f in found if not f.startswith(MPI_MAY_BE_NAMED_IN)]
    assert outside == [], f"mpi4py named outside the MPI layer: {outside}"
    assert "hpcpipe/mpi/p2p.py" in found  # the scan sees the layer itself


def test_no_import_cycles():
    """Every hpcpipe module imported by another (at any depth, lazily or not) forms a DAG."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*stack[stack.index(n) :], n]
            if n not in state:
                cycle = visit(n)
                if cycle:
                    return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, " -> ".join(cycle)
