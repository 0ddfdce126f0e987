"""The workloads `hpcpipe run` knows: for each, the function that runs it on an MPI world and
the pure function that checks a deck for it before any rank communicates.

A workload is a package (or module) of its own; adding one means writing its `run(ctx)` and
`check(config, rankmap, files)` and one line here. Modules are imported only when chosen, and
checks never import MPI (they also run in `plan` and `--dry-run`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["WORKLOADS", "workload_check", "workload_run"]

WORKLOADS: dict[str, tuple[str, str | None]] = {
    "topology": ("hpcpipe.topology_check:run", None),
    "train": ("hpcpipe.train.entry:run", "hpcpipe.train.checks:check"),
    "sweep": ("hpcpipe.sweep.workload:run", "hpcpipe.sweep.checks:check"),
}
"""Workload name -> (`module:function(ctx)` that runs it, `module:function(config, rankmap,
files)` that checks its deck, or None)."""


def _resolve(target: str) -> Callable[..., Any]:
    module, _, func = target.partition(":")
    return getattr(importlib.import_module(module), func)


def workload_run(name: str) -> Callable[..., Any]:
    return _resolve(WORKLOADS[name][0])


def workload_check(name: str) -> Callable[..., Any] | None:
    target = WORKLOADS[name][1]
    return _resolve(target) if target else None
