"""The real training runtime inside a benchmark: a quiet run context, synchronized step starts
and the per-step results of the interpreter.

Benchmarks build `hpcpipe.train.workload.Trainer` exactly as `hpcpipe run` does, so what they
time is the runtime users run; only logging is silenced and each pipeline step is started at
the same instant on every rank (see `StepClock`), so that one rank's data loading or optimizer
work is not counted as another rank's pipeline time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpi4py import MPI

from hpcpipe.backend import make_backend
from hpcpipe.config import Config, ConfigError, load_config
from hpcpipe.mpi.idle import idle_barrier
from hpcpipe.preflight import build_rankmap
from hpcpipe.runtime import RunContext
from hpcpipe.sleeps import sleep_until
from hpcpipe.train.pipeline import PipelineRank, StepResult

__all__ = [
    "QuietContext",
    "StepClock",
    "StepLog",
    "bench_config",
    "load_or_skip",
    "schedule_names",
    "world_context",
]

START_LEAD_S = 0.005
"""How far ahead of rank 0's clock a synchronized step start is set: enough for the start
time to reach every rank first, even on a loaded machine."""


@dataclass
class QuietContext(RunContext):
    """A RunContext whose progress lines are dropped: the benchmark prints its own table."""

    def log(self, message: str) -> None:
        return None


def bench_config(deck: str, overrides: Sequence[str], world: int, *extra: str) -> Config:
    """The deck on `world` pipeline ranks (pp = world, dp = 1) with the user's overrides."""
    sets = [*overrides, f"topology.pp={world}", "topology.dp=1", *extra]
    return load_config(deck, sets)


def schedule_names(text: str) -> list[str]:
    """`--schedules a,b,c` checked against the known schedules (bad input exits 2)."""
    from hpcpipe.schedules import SCHEDULE_NAMES

    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SCHEDULE_NAMES]
    if unknown or not names:
        raise ConfigError(
            "--schedules",
            "",
            f"unknown {', '.join(map(repr, unknown)) or 'empty list'}; known: "
            + ", ".join(SCHEDULE_NAMES),
        )
    return names


def world_context(comm: MPI.Comm, config: Config) -> QuietContext:
    """What `hpcpipe run` builds before it calls a workload: layout, communicators, backend."""
    from hpcpipe.mpi.comms import build_comms, discover_nodes

    node_info, node_comm = discover_nodes(comm, config.topology.ranks_per_node)
    rankmap = build_rankmap(config, comm.size, node_info.ranks_per_node)
    dev = config.device
    backend = make_backend(dev.kind, dev.dtype, node_info.local_rank, dev.cuda_aware)
    comms = build_comms(comm, rankmap, node_comm, node_info)
    return QuietContext(config, rankmap, comms, backend, Path(config.run.output))


class StepClock:
    """Starts each step at one instant on every rank: rank 0 picks a time a few ms ahead and
    every rank sleeps until it. This needs one clock, so only when all ranks share a node
    (perf_counter is CLOCK_MONOTONIC, one per node); across nodes it falls back to a barrier.
    """

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.one_clock = bool(comm.allreduce(int(node.size == comm.size), op=MPI.MIN))
        node.Free()

    def start(self) -> float:
        """Block until the common start; returns it (this rank's clock)."""
        idle_barrier(self.comm, 1e-4)
        if not self.one_clock:
            self.comm.Barrier()
            return time.perf_counter()
        t0 = self.comm.bcast(time.perf_counter() + START_LEAD_S if self.comm.rank == 0 else None)
        sleep_until(t0)
        return t0


@dataclass
class StepLog:
    """Every `PipelineRank.step` of one runner, started by a `StepClock`, with its wall span.

    Installed over the runner's bound `step` method (the runtime itself is not changed), so
    the trainer calls it as usual.
    """

    runner: PipelineRank
    clock: StepClock
    results: list[StepResult] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)
    """The common start of each step (this rank's clock)."""
    spans: list[tuple[float, float]] = field(default_factory=list)
    """When this rank's interpreter began and ended each step."""
    _step: Callable[..., StepResult] | None = None

    def __post_init__(self) -> None:
        self._step = self.runner.step
        self.runner.step = self  # type: ignore[method-assign]

    def __call__(self, *args: Any, **kwargs: Any) -> StepResult:
        assert self._step is not None
        self.starts.append(self.clock.start())
        begin = time.perf_counter()
        result = self._step(*args, **kwargs)
        self.spans.append((begin, time.perf_counter()))
        self.results.append(result)
        return result


def load_or_skip(build: Callable[[], Any]) -> tuple[Any, str | None]:
    """(built, None), or (None, why) when the deck cannot run this way: a ConfigError, which
    every rank raises alike (anything else is a bug and propagates)."""
    try:
        return build(), None
    except ConfigError as exc:
        return None, str(exc).splitlines()[0]


def build_trainer(
    comm: MPI.Comm,
    deck: str,
    overrides: Sequence[str],
    schedule: str,
    steps: int,
    *extra: str,
) -> tuple[RunContext, Any]:
    """A `Trainer` for `schedule`, built as `hpcpipe run` builds it (no verify, no outputs);
    frees its communicators again when the deck cannot run that schedule (ConfigError).
    `extra` settings come last (another layout than pp = world)."""
    from hpcpipe.train.workload import Trainer

    config = bench_config(
        deck,
        overrides,
        comm.size,
        f"pipeline.schedule={schedule}",
        f"run.steps={steps}",
        "train.verify=false",
        *extra,
    )
    ctx = world_context(comm, config)
    try:
        return ctx, Trainer(ctx)
    except ConfigError:
        ctx.comms.free()
        raise
