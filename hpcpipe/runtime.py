"""The MPI job shell: start MPI, check the world against the deck, build the context, run it.

Deck and topology checks run identically on every rank, so bad input exits 2 everywhere with one
message; anything unexpected on any rank aborts the whole job (see hpcpipe.mpi.guard).
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcpipe.backend import Backend, make_backend
from hpcpipe.config import Config, ConfigError, dump_toml
from hpcpipe.topology import RankMap, TopologyError

__all__ = ["WORKLOADS", "RunContext", "build_rankmap", "run_job"]

WORKLOADS: dict[str, str] = {
    "topology": "hpcpipe.topology_check:run",
    "train": "hpcpipe.train.workload:run",
    "sweep": "hpcpipe.sweep.workload:run",
}
"""Workload name -> `module:function(ctx)`; imported only when chosen."""


@dataclass
class RunContext:
    """What a workload gets: config, rank layout, communicators, arrays, output, logging."""

    config: Config
    rankmap: RankMap
    comms: Any  # hpcpipe.mpi.Comms
    backend: Backend
    output: Path
    verbose: bool = False
    resume: str | None = None
    """None, "latest" (the run directory's latest checkpoint) or a checkpoint path."""
    started: float = field(default_factory=time.perf_counter)

    @property
    def rank(self) -> int:
        return self.comms.rank

    @property
    def size(self) -> int:
        return self.comms.size

    @property
    def xp(self) -> Any:
        return self.backend.xp

    def log(self, message: str) -> None:
        """Progress on rank 0 only (others too with --verbose, prefixed by their rank)."""
        if self.rank == 0:
            print(message, flush=True)
        elif self.verbose:
            print(f"[rank {self.rank}] {message}", flush=True)

    def log_all(self, message: str) -> None:
        print(f"[rank {self.rank}] {message}", flush=True)


def build_rankmap(config: Config, world: int, ranks_per_node: int) -> RankMap:
    """The deck's degrees on this world; errors name the deck key to change."""
    topo = config.topology
    try:
        rankmap = RankMap.build(
            world, ranks_per_node, pp=topo.pp, dp=topo.dp, ep=topo.ep, order=topo.order
        )
    except TopologyError as exc:
        raise ConfigError(
            config.source,
            f"topology.{exc.dim}" if exc.dim else "topology",
            f"{exc.detail} (launch a matching number of ranks or change [topology])",
        ) from None
    problems = rankmap.check_intra_node(topo.intra_node)
    if problems and topo.cross_node == "error":
        raise ConfigError(config.source, "topology.intra_node", "; ".join(problems))
    return rankmap


def _check_launcher(world_size: int) -> None:
    """Catch the classic misconfigured launch: N copies of a 1-rank job under srun."""
    step_tasks = os.environ.get("SLURM_STEP_NUM_TASKS")
    if step_tasks and step_tasks.isdigit() and world_size == 1 and int(step_tasks) > 1:
        raise ConfigError(
            "launcher",
            "SLURM_STEP_NUM_TASKS",
            f"= {step_tasks} but MPI reports a world of 1 rank: every task started "
            "its own single-rank job. The MPI library does not speak srun's PMI; "
            "use srun --mpi=pmi2 (or pmix), or launch with mpiexec",
        )


def _resolve_workload(name: str) -> Callable[[RunContext], Any]:
    module, _, func = WORKLOADS[name].partition(":")
    return getattr(importlib.import_module(module), func)


def run_job(
    config: Config, *, dry_run: bool = False, verbose: bool = False, resume: str | None = None
) -> int:
    """Run `config`'s workload on the current MPI world; returns the exit code."""
    from mpi4py import MPI

    from hpcpipe.mpi.comms import build_comms, discover_nodes
    from hpcpipe.mpi.guard import prepare

    prepare()
    world = MPI.COMM_WORLD
    _check_launcher(world.size)
    topo = config.topology
    node_info, node_comm = discover_nodes(world, topo.ranks_per_node)
    rankmap = build_rankmap(config, world.size, node_info.ranks_per_node)
    if world.rank == 0:
        for problem in rankmap.check_intra_node(topo.intra_node):
            if topo.cross_node == "warn":
                print(f"WARNING: {problem}", file=sys.stderr, flush=True)
        if not node_info.uniform and not node_info.virtual:
            print(
                "WARNING: ranks are not placed block-wise on nodes (or nodes hold different "
                "counts); node-aware grouping assumes consecutive ranks per node. Use block "
                "placement (srun --distribution=block) or set topology.ranks_per_node",
                file=sys.stderr,
                flush=True,
            )
    if dry_run:
        if world.rank == 0:
            print(dump_toml(config), end="")
            print(rankmap.describe())
        return 0

    device = config.device
    backend = make_backend(device.kind, device.dtype, node_info.local_rank, device.cuda_aware)
    comms = build_comms(world, rankmap, node_comm, node_info)
    output = Path(config.run.output)
    if world.rank == 0:
        try:
            output.mkdir(parents=True, exist_ok=True)
            (output / "config.toml").write_text(dump_toml(config), encoding="utf-8")
        except OSError as exc:
            raise RuntimeError(
                f"cannot write the run directory {output} (run.output): {exc.strerror}"
            ) from None
    world.Barrier()
    ctx = RunContext(
        config=config,
        rankmap=rankmap,
        comms=comms,
        backend=backend,
        output=output,
        verbose=verbose,
        resume=resume,
    )
    workload = _resolve_workload(config.run.workload)
    ctx.log(
        f"hpcpipe: workload={config.run.workload} world={world.size} "
        f"pp={rankmap.pp} dp={rankmap.dp} ep={rankmap.ep} nodes={node_info.nodes}"
        f"{' (virtual)' if node_info.virtual else ''} device={backend.kind} "
        f"mpi_cuda_aware={int(backend.cuda_aware)} output={output}"
    )
    workload(ctx)
    world.Barrier()
    ctx.log(f"done in {time.perf_counter() - ctx.started:.2f}s")
    comms.free()
    return 0
