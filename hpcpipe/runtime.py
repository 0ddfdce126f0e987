"""The MPI job shell: start MPI, check the world against the deck, build the context, run it.

Deck and topology checks run identically on every rank, so bad input exits 2 everywhere with one
message; anything unexpected on any rank aborts the whole job (see hpcpipe.mpi.guard).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcpipe.backend import Backend, make_backend
from hpcpipe.config import Config, ConfigError, dump_toml
from hpcpipe.console import say
from hpcpipe.faults import maybe_fail
from hpcpipe.mpi.watchdog import Watchdog
from hpcpipe.topology import RankMap
from hpcpipe.workloads import workload_run

__all__ = ["RunContext", "RunOptions", "layout_text", "run_job"]


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
    allow_changes: tuple[str, ...] = ()
    """Identity keys (or sections) a resume may find changed: `--allow-change`."""
    changed: tuple[str, ...] = ()
    """Identity keys the resumed checkpoint had other values of (allowed by --allow-change)."""
    started: float = field(default_factory=time.perf_counter)
    watchdog: Watchdog = field(default_factory=lambda: Watchdog(0))
    """Arm it around each step (`with ctx.watchdog.phase(...)`): a hang becomes a report."""

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
        """Progress on rank 0 only; with --verbose every rank, each line prefixed by its rank
        (rank 0 included, so interleaved lines can always be told apart)."""
        if self.verbose:
            say(f"[rank {self.rank}] {message}")
        elif self.rank == 0:
            say(message)

    def log_all(self, message: str) -> None:
        say(f"[rank {self.rank}] {message}")


def layout_text(config: Config, rankmap: RankMap) -> str:
    """What a dry run shows of the layout: the KBA plan for a sweep, else the rank map."""
    if config.run.workload == "sweep":
        from hpcpipe.sweep.plan_view import deck_plan_text

        return deck_plan_text(config.sweep)
    return rankmap.describe()


def _check_slurm(world: Any, config: Config) -> Any:
    """Compare the world and topology.ranks_per_node with what Slurm allocated (see
    hpcpipe.preflight.check_slurm); every rank raises the same ConfigError. Returns Slurm's
    layout of this launch (None when there is none, or it cannot be told)."""
    from mpi4py import MPI

    from hpcpipe.preflight import check_slurm, slurm_layout

    procid = os.environ.get("SLURM_PROCID", "")
    srun = world.allreduce(int(procid.isdigit() and int(procid) == world.rank), op=MPI.MIN)
    layout = slurm_layout(os.environ, srun_launched=bool(srun))
    layouts = world.allgather(layout)
    if any(other != layouts[0] for other in layouts):
        return None  # ranks see different allocations (mixed environments): nothing to tell
    for warning in check_slurm(layout, world.size, config.topology.ranks_per_node, config.source):
        if world.rank == 0:
            say(f"WARNING: {warning}", err=True)
    return layout


def _prepare_output(
    config: Config, world: Any, node_comm: Any, *, resume: bool, overwrite: bool
) -> Path:
    """Rank 0 creates the run directories and writes config.toml; then one rank per node checks
    it can write there. Any failure (a file in the way, read-only or full file system, no
    permission) is bad input naming the key, raised on every rank before any work."""
    from hpcpipe.mpi.idle import idle_bcast
    from hpcpipe.preflight import check_output, prepare_output

    mine = prepare_output(config, resume=resume, overwrite=overwrite) if world.rank == 0 else None
    problem = idle_bcast(mine, world, root=0)
    if problem is None and node_comm.rank == 0 and world.rank != 0:
        problem = check_output(config)
    found = [p for p in world.allgather(problem) if p is not None]
    if found:
        raise ConfigError(config.source, *found[0])
    return Path(config.run.output)


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


@dataclass(frozen=True)
class RunOptions:
    """How `hpcpipe run` was asked to run the deck (its command-line flags)."""

    dry_run: bool = False
    verbose: bool = False
    resume: str | None = None
    """None, "latest" or a checkpoint path (--resume)."""
    overwrite: bool = False
    allow_changes: tuple[str, ...] = ()


def run_job(config: Config, options: RunOptions | None = None) -> int:
    """Run `config`'s workload on the current MPI world; returns the exit code."""
    from hpcpipe.mpi.guard import prepare

    prepare()
    with Watchdog(config.run.watchdog_s) as watchdog:
        # start-up is collectives only (no rank computes): a minute covers any sane launch
        watchdog.arm("start-up", _startup_where, limit_s=max(60.0, config.run.watchdog_s))
        return _start_and_run(config, watchdog, options or RunOptions())


def _startup_where() -> str:
    return "start-up: MPI set-up, deck and allocation checks, run directory (collectives)"


def _start_and_run(config: Config, watchdog: Watchdog, options: RunOptions) -> int:
    from mpi4py import MPI

    from hpcpipe.mpi.comms import build_comms, discover_nodes
    from hpcpipe.mpi.idle import idle_barrier
    from hpcpipe.preflight import check_deck, slurm_nodes_warning

    maybe_fail("startup")
    world = MPI.COMM_WORLD
    _check_launcher(world.size)
    slurm = _check_slurm(world, config)
    topo = config.topology
    node_info, node_comm = discover_nodes(world, topo.ranks_per_node)
    rankmap = check_deck(config, world.size, node_info.ranks_per_node, files=options.dry_run)
    if world.rank == 0:
        if not node_info.virtual:
            warning = slurm_nodes_warning(slurm, node_info.nodes)
            if warning:
                say(f"WARNING: {warning}", err=True)
        for problem in rankmap.check_intra_node(topo.intra_node):
            if topo.cross_node == "warn":
                say(f"WARNING: {problem}", err=True)
        if not node_info.uniform and not node_info.virtual:
            say(
                "WARNING: ranks are not placed block-wise on nodes (or nodes hold different "
                "counts); node-aware grouping assumes consecutive ranks per node. Use block "
                "placement (srun --distribution=block) or set topology.ranks_per_node",
                err=True,
            )
    if options.dry_run:
        if world.rank == 0:
            print(dump_toml(config), end="")
            print(layout_text(config, rankmap))
        return 0

    output = _prepare_output(
        config, world, node_comm, resume=options.resume is not None, overwrite=options.overwrite
    )
    device = config.device
    try:
        backend = make_backend(device.kind, device.dtype, node_info.local_rank, device.cuda_aware)
    except RuntimeError as exc:  # no CuPy, no visible GPU: the deck asks what the node lacks
        raise ConfigError(config.source, "device.kind", f"cannot be used here: {exc}") from None
    comms = build_comms(world, rankmap, node_comm, node_info)
    ctx = RunContext(
        config=config,
        rankmap=rankmap,
        comms=comms,
        backend=backend,
        output=output,
        verbose=options.verbose,
        resume=options.resume,
        allow_changes=options.allow_changes,
    )
    workload = workload_run(config.run.workload)
    if config.run.workload == "sweep":  # a sweep's layout is its KBA grid, not pp/dp/ep
        layout = f"grid={config.sweep.px}x{config.sweep.py}"
    else:
        layout = f"pp={rankmap.pp} dp={rankmap.dp} ep={rankmap.ep}"
    ctx.log(
        f"hpcpipe: workload={config.run.workload} world={world.size} {layout} "
        f"nodes={node_info.nodes}"
        f"{' (virtual)' if node_info.virtual else ''} device={backend.kind} "
        f"mpi_cuda_aware={int(backend.cuda_aware)} output={output}"
    )
    if backend.on_gpu:  # the decision decides the data path: say why it was made
        ctx.log(f"device: {backend.describe()}")
    watchdog.disarm()
    ctx.watchdog = watchdog
    workload(ctx)
    with watchdog.phase("the final barrier", lambda: "MPI_Barrier after the workload"):
        idle_barrier(world)  # some ranks finish long before others (rank 0 writes the outputs)
    ctx.log(f"done in {time.perf_counter() - ctx.started:.2f}s")
    comms.free()
    return 0
