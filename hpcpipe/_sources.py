"""Which of this repository's source files a figure ran, so that a figure goes stale only when
code it ran changes (benchmarks/report.py), not whenever any code does.

A result records the files of every module loaded by the process that writes it and by every
hpcpipe process it started (mpiexec ranks, `hpcpipe run` children): the harness names a log
file in $HPCPIPE_SOURCES_LOG (`start_log`), every hpcpipe process appends its modules' files
to it when it exits (`log_at_exit`, armed by importing hpcpipe while the variable is set), and
`collect` joins them when the result is written. A module's file records the module, not
what else it could have run: code that a figure reaches only through a new module is caught
because its caller's file changed too.

Only the standard library is imported here: hpcpipe/__init__.py imports this module in every
process of a measured figure, and importing numpy that early started its BLAS threads before
the CLI limits them per rank (the sweep figure's "2 x 1 rank" row ran at half speed).
"""

from __future__ import annotations

import atexit
import os
import sys
import tempfile
from pathlib import Path

__all__ = ["ENV", "collect", "loaded_sources", "log_at_exit", "start_log"]

ENV = "HPCPIPE_SOURCES_LOG"
"""The environment variable naming the log file a figure's processes append to."""

ROOT = Path(__file__).resolve().parents[1]
"""The directory holding the hpcpipe package (the repository root in a development install)."""

_TOP = ("hpcpipe", "benchmarks")


def loaded_sources() -> set[str]:
    """Root-relative paths of this process's loaded modules under hpcpipe/ and benchmarks/."""
    found = set()
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path:
            continue
        try:
            rel = Path(path).resolve().relative_to(ROOT)
        except ValueError:
            continue
        if rel.parts and rel.parts[0] in _TOP and rel.suffix == ".py":
            found.add(rel.as_posix())
    return found


def _append(path: str, sources: set[str]) -> None:
    # one write in append mode: lines from concurrent ranks do not interleave
    with open(path, "a", encoding="utf-8") as fh:
        fh.write("".join(f"{s}\n" for s in sorted(sources)))


def log_at_exit() -> None:
    """Append this process's sources to $HPCPIPE_SOURCES_LOG when it exits (if set)."""
    path = os.environ.get(ENV)
    if path:
        atexit.register(lambda: _append(path, loaded_sources()))


def start_log() -> None:
    """Name a fresh log for this process and its children (unless a parent already did), with
    what this process has loaded so far (the figure's script)."""
    if os.environ.get(ENV):
        return
    fd, path = tempfile.mkstemp(prefix="hpcpipe-sources-", suffix=".txt")
    os.close(fd)
    os.environ[ENV] = path
    _append(path, loaded_sources())
    atexit.register(lambda: Path(path).unlink(missing_ok=True))


def collect() -> list[str]:
    """This process's sources and those its children logged, sorted."""
    found = loaded_sources()
    path = os.environ.get(ENV)
    if path and Path(path).is_file():
        found |= {line for line in Path(path).read_text(encoding="utf-8").split() if line}
    return sorted(found)
