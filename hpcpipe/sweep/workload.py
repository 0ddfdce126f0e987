"""The sweep workload: build the problem and the KBA plan, source-iterate, write flux.h5.

Reads top to bottom: problem -> plan (validated, simulated) -> executor -> solve -> outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from hpcpipe.config import ConfigError, dump_toml
from hpcpipe.sweep.config import SweepConfig
from hpcpipe.sweep.mesh import build_problem
from hpcpipe.sweep.output import write_flux, write_slice_png, write_xdmf
from hpcpipe.sweep.parallel import KBASweeper
from hpcpipe.sweep.plan import build_plan, validate
from hpcpipe.sweep.solver import ConvergenceError, LocalCells, SolveResult, solve

__all__ = ["run", "run_sweep"]


def run(ctx: Any) -> None:
    """Entry point called by the runtime with the resolved config, communicators and logger."""
    cfg: SweepConfig = ctx.config.sweep
    if cfg.px * cfg.py != ctx.size:
        raise ConfigError(
            ctx.config.source,
            "sweep.px",
            f"* sweep.py = {cfg.px} * {cfg.py} = {cfg.px * cfg.py} ranks, but "
            f"this run has {ctx.size}: launch with mpiexec -n {cfg.px * cfg.py} "
            "or set sweep.px / sweep.py to match",
        )
    backend = getattr(ctx, "backend", None)
    run_sweep(
        cfg,
        ctx.comms.world,
        Path(ctx.output),
        xp=ctx.xp,
        log=ctx.log,
        config_text=dump_toml(ctx.config),
        device_buffers=bool(getattr(backend, "cuda_aware", False)),
        log_every=ctx.config.run.log_every,
    )


def run_sweep(
    cfg: SweepConfig,
    comm: MPI.Comm,
    output: Path | None,
    *,
    xp: Any = np,
    log: Callable[[str], None] = print,
    config_text: str = "",
    device_buffers: bool = False,
    log_every: int = 1,
) -> SolveResult:
    """Solve one [sweep] problem on `comm`; rank 0 writes outputs under `output` (if given).

    Raises ConvergenceError on every rank (after writing) when the tolerance was not reached.
    """
    if cfg.px * cfg.py != comm.size:
        raise ValueError(
            f"sweep.px * sweep.py = {cfg.px * cfg.py} must equal the number of ranks ({comm.size})"
        )
    problem = build_problem(cfg)
    plan = build_plan(
        cfg.px,
        cfg.py,
        problem.mesh.shape,
        problem.quadrature.per_octant,
        cfg.z_block,
        cfg.angle_block,
        cfg.octant_order,
    )
    predicted = validate(plan)
    log(plan.describe())
    log(
        f"sweep quadrature={problem.quadrature.name} directions={problem.quadrature.total} "
        f"groups={problem.groups} scheme={problem.scheme} predicted_stages={predicted.stages} "
        f"predicted_efficiency={predicted.efficiency:.3f}"
    )

    sweeper = KBASweeper(problem, plan, comm, xp, device_buffers=device_buffers)
    cells = LocalCells(problem, sweeper.x_cells, sweeper.y_cells, xp)
    result = solve(
        problem,
        cells,
        sweeper,
        tolerance=cfg.tolerance,
        max_iterations=cfg.max_iterations,
        log=log,
        log_every=log_every,
    )
    log(
        f"sweep done iterations={result.iterations} converged={str(result.converged).lower()} "
        f"balance={result.balance.relative_error:.2e} grind_ns={result.grind_ns:.1f} "
        f"efficiency={result.efficiency:.3f} predicted={predicted.efficiency:.3f}"
    )

    full = sweeper.gather(result.phi.reshape(*cells.shape, problem.groups))
    if output is not None and comm.rank == 0:
        assert full is not None
        attrs = {
            "iterations": result.iterations,
            "converged": result.converged,
            "balance_relative_error": result.balance.relative_error,
            "balance_source": result.balance.source,
            "balance_inflow": result.balance.inflow,
            "balance_absorption": result.balance.absorption,
            "balance_outflow": result.balance.outflow,
            "grind_ns": result.grind_ns,
            "efficiency_measured": result.efficiency,
            "efficiency_predicted": predicted.efficiency,
            "predicted_stages": predicted.stages,
            "ranks": comm.size,
            "plan": plan.describe(),
        }
        output.mkdir(parents=True, exist_ok=True)
        write_flux(
            output / "flux.h5",
            problem,
            full,
            config_text=config_text,
            history=result.history,
            sweep_seconds=np.array(result.sweep_seconds),
            attrs=attrs,
        )
        write_xdmf(output / "flux.xmf", "flux.h5", problem)
        if cfg.plot:
            write_slice_png(output / "flux_slice.png", problem, full)
        log(f"sweep wrote {output / 'flux.h5'} and flux.xmf")
    comm.Barrier()
    if not result.converged:
        raise ConvergenceError(result.message)
    return result
