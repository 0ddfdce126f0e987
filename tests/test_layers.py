"""The package's layering, checked statically: one MPI layer, no import cycles, no import of a
name that does not exist."""

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


def _top_level_names(tree: ast.Module) -> set[str] | None:
    """Names a module binds at its top level (None: a module `__getattr__` makes any name)."""
    names: set[str] = set()
    if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body):
        return None
    for node in tree.body:
        stack = [node]
        while stack:  # top level includes the bodies of if/try/with (TYPE_CHECKING, fallbacks)
            n = stack.pop()
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(n.name)
            elif isinstance(n, ast.Import | ast.ImportFrom):
                names.update((a.asname or a.name).split(".")[0] for a in n.names)
            elif isinstance(n, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                for t in targets:
                    names.update(x.id for x in ast.walk(t) if isinstance(x, ast.Name))
            elif isinstance(n, ast.If | ast.Try | ast.With | ast.For):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    stack.extend(getattr(n, field, []))
            elif isinstance(n, ast.ExceptHandler):
                stack.extend(n.body)
    return names


def test_every_imported_name_exists():
    """`from hpcpipe.x import name` (in the package, its tests and benchmarks) names something x
    defines, also for the imports done lazily inside functions, which only the code path that
    runs them would otherwise catch."""
    modules = _modules()
    trees = {m: ast.parse(p.read_text(encoding="utf-8")) for m, p in modules.items()}
    defined = {m: _top_level_names(t) for m, t in trees.items()}
    importers = {str(p.relative_to(ROOT)): trees[m] for m, p in modules.items()}
    for folder in ("tests", "benchmarks"):  # what the tests and benchmarks import of hpcpipe
        for path in (ROOT / folder).rglob("*.py"):
            importers[str(path.relative_to(ROOT))] = ast.parse(path.read_text(encoding="utf-8"))
    missing = []
    for where, tree in importers.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.module in modules):
                continue
            have = defined[node.module]
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if have is not None and alias.name not in have and sub not in modules:
                    missing.append(f"{where}:{node.lineno}: {sub}")
    assert missing == [], "imported names that do not exist:\n" + "\n".join(missing)
