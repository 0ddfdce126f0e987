"""The benchmark registry: a decorator binds a name to its options and its (lazy) runner.

Like `mpi4py.bench`, benchmarks are registered by a decorator; unlike it, the runner is named by
`"module:function"` and imported only when chosen, so building the CLI parser never imports
mpi4py (which would start MPI in `hpcpipe plan`).

    @benchmark("p2p", "ping-pong latency and bandwidth", "hpcpipe.bench.p2p:run")
    def _p2p(p: argparse.ArgumentParser) -> None:
        p.add_argument("--max-bytes", ...)

The runner is `run(comm, args) -> Report`; it is collective over `comm` and returns the full
report on rank 0 (other ranks may return None).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["BENCHMARKS", "Benchmark", "benchmark"]

Configure = Callable[[argparse.ArgumentParser], None]


@dataclass(frozen=True)
class Benchmark:
    """One subcommand: its name, one-line help, option declarations and runner location."""

    name: str
    help: str
    configure: Configure
    target: str
    """`"module:function"` of the runner, imported on first use."""

    def runner(self) -> Callable[..., Any]:
        module, _, func = self.target.partition(":")
        return getattr(importlib.import_module(module), func)


BENCHMARKS: dict[str, Benchmark] = {}
"""Registered benchmarks in registration order (the order `bench --help` lists them)."""


def benchmark(name: str, help_text: str, target: str) -> Callable[[Configure], Configure]:
    """Register the decorated `configure(parser)` as benchmark `name` run by `target`."""

    def wrap(configure: Configure) -> Configure:
        if name in BENCHMARKS:
            raise ValueError(f"benchmark {name!r} is registered twice")
        if ":" not in target:
            raise ValueError(f"benchmark {name!r}: target {target!r} is not 'module:function'")
        BENCHMARKS[name] = Benchmark(name, help_text, configure, target)
        return configure

    return wrap
