"""The run directory's policy: a new run never writes over an earlier one by accident.

A run directory (`run.output`) holds what one run wrote: `config.toml`, `status.json`,
`metrics.h5`, `trace.h5`, `params.h5`, `flux.h5`, `flux.xmf`, `flux_slice.png` and
`checkpoints/`. A run started where such files already are would overwrite some and leave
others (an old `trace.h5` beside new metrics), so it is refused before any work, unless it
continues that run (`--resume`) or is told to start afresh (`--overwrite`), which deletes
exactly those names and nothing else of the directory's. Pure file-system code, no MPI.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from hpcpipe.io.ckpt_store import owned_names

__all__ = ["RUN_FILES", "clear_run", "previous_run"]

RUN_FILES = (
    "config.toml",
    "status.json",
    "metrics.h5",
    "trace.h5",
    "params.h5",
    "flux.h5",
    "flux.xmf",
    "flux_slice.png",
)
"""Files a run writes into run.output (checkpoints go to `checkpoints/` or checkpoint.dir)."""


def previous_run(output: Path, checkpoints: Path, trace: Path) -> list[Path]:
    """What an earlier run left that a new one would mix with: its files in `output`, its
    checkpoints in `checkpoints`, and the trace file (when trace.path puts it elsewhere)."""
    found = [output / name for name in RUN_FILES if (output / name).exists()]
    found += owned_names(checkpoints)
    if trace.exists() and trace not in found:
        found.append(trace)
    return found


def clear_run(paths: list[Path]) -> None:
    """Delete what `previous_run` found (and `checkpoints/` itself when that leaves it empty)."""
    parents = set()
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
        parents.add(path.parent)
    for parent in parents:
        if parent.name == "checkpoints" and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()


def describe(paths: list[Path], output: Path) -> str:
    """`config.toml, metrics.h5, checkpoints/step_000004, ...` relative to `output`."""
    names = []
    for p in paths[:6]:
        try:
            names.append(str(p.relative_to(output)))
        except ValueError:
            names.append(str(p))
    more = f" and {len(paths) - 6} more" if len(paths) > 6 else ""
    return ", ".join(names) + more
