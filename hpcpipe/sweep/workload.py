"""The sweep workload: build the problem and the KBA plan, source-iterate, write flux.h5.

Reads top to bottom: problem -> plan (validated, simulated) -> executor -> (resume) -> solve,
checkpointing as it goes -> trace, flux.h5 and status.json. A scheduler's time-limit signal
(SIGUSR1 / SIGTERM) ends the solve after the current iteration with a checkpoint and exit 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hpcpipe.config import ConfigError, dump_toml
from hpcpipe.faults import maybe_fail
from hpcpipe.io.ckpt_config import CheckpointConfig
from hpcpipe.io.trace import EventKind, Recorder, write_trace
from hpcpipe.io.trace_config import TraceConfig
from hpcpipe.jobcontrol import StopSignal, find_checkpoint, write_status
from hpcpipe.mpi import Comm
from hpcpipe.mpi.idle import idle_barrier
from hpcpipe.mpi.watchdog import Watchdog
from hpcpipe.sweep import checkpointing, compiled
from hpcpipe.sweep.blocking import describe_blocking
from hpcpipe.sweep.config import SweepConfig
from hpcpipe.sweep.kernel import resolve_kernel
from hpcpipe.sweep.mesh import build_problem
from hpcpipe.sweep.output import write_flux, write_slice_png, write_xdmf
from hpcpipe.sweep.parallel import KBASweeper
from hpcpipe.sweep.plan import SweepPlan, blocking_for, plan_for, validate
from hpcpipe.sweep.solver import ConvergenceError, Iterate, LocalCells, SolveResult, solve

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
    stop = StopSignal()
    try:
        run_sweep(
            cfg,
            ctx.comms.world,
            Path(ctx.output),
            xp=ctx.xp,
            log=ctx.log,
            config_text=dump_toml(ctx.config),
            device_buffers=bool(getattr(backend, "cuda_aware", False)),
            log_every=ctx.config.run.log_every,
            checkpoint=ctx.config.checkpoint,
            trace=ctx.config.trace,
            resume=ctx.resume,
            stop=stop,
            watchdog=ctx.watchdog,
        )
    finally:
        stop.restore()


def run_sweep(
    cfg: SweepConfig,
    comm: Comm,
    output: Path | None,
    *,
    xp: Any = np,
    log: Callable[[str], None] = print,
    config_text: str = "",
    device_buffers: bool = False,
    log_every: int = 1,
    checkpoint: CheckpointConfig | None = None,
    trace: TraceConfig | None = None,
    resume: str | None = None,
    stop: StopSignal | None = None,
    watchdog: Watchdog | None = None,
) -> SolveResult:
    """Solve one [sweep] problem on `comm`; rank 0 writes outputs under `output` (if given).

    Checkpoints (into `checkpoint.directory(output)`) are written every `checkpoint.every`
    iterations, after the last one when `every` > 0, and when `stop` caught a signal; `resume`
    ("latest" or a checkpoint path) continues from one. `trace` records events into trace.h5.
    `watchdog` (armed per iteration) turns a hung iteration into a report and an abort.
    With an `output`, status.json tells the job script how the run ended. Raises
    ConvergenceError on every rank (after writing) when the tolerance was not reached.
    """
    if cfg.px * cfg.py != comm.size:
        raise ValueError(
            f"sweep.px * sweep.py = {cfg.px * cfg.py} must equal the number of ranks ({comm.size})"
        )
    trace = trace or TraceConfig()
    settings = checkpoint or CheckpointConfig()
    if trace.enabled and output is None and not trace.path:
        raise ValueError("tracing needs an output directory or trace.path")
    directory = settings.directory(output) if output is not None or settings.dir else None

    problem = build_problem(cfg)
    kernel = resolve_kernel(cfg.kernel, xp)
    blocking = blocking_for(cfg, problem, kernel)
    plan = plan_for(cfg, problem, blocking)
    predicted = validate(plan)
    log(plan.describe())
    log(describe_blocking(blocking))
    log(
        f"sweep quadrature={problem.quadrature.name} directions={problem.quadrature.total} "
        f"groups={problem.groups} scheme={problem.scheme} kernel={kernel} "
        f"predicted_stages={predicted.stages} predicted_efficiency={predicted.efficiency:.3f}"
    )

    if kernel == "numba":
        seconds, fresh = compiled.prepare()
        how = "compiled (cached for later runs)" if fresh else "loaded from numba's cache"
        log(f"sweep kernel: numba loops {how} in {seconds:.1f} s")
    rec = trace.recorder(comm.rank)
    if rec.enabled:
        rec.align_clock(comm)
    sweeper = KBASweeper(
        problem,
        plan,
        comm,
        xp,
        device_buffers=device_buffers,
        recorder=rec if rec.enabled else None,
    )
    cells = LocalCells(problem, sweeper.x_cells, sweeper.y_cells, xp)
    owned = (sweeper.x_cells, sweeper.y_cells)
    start = None
    if resume is not None:
        path = find_checkpoint(comm, resume, directory)
        start, attrs = checkpointing.restore(path, cfg, owned, xp, comm=comm)
        _check_resumable(path, start, cfg)
        grid = attrs.get("grid", {})
        log(
            f"resumed from {path} at iteration {start.iterations} (written by a "
            f"{grid.get('px')} x {grid.get('py')} run)"
        )
    control = _Control(comm, cfg, owned, settings, directory, rec, stop, config_text, log)
    control.watchdog, control.where = watchdog or Watchdog(0), sweeper.where
    result = solve(
        problem,
        cells,
        sweeper,
        tolerance=cfg.tolerance,
        max_iterations=cfg.max_iterations,
        log=log,
        log_every=log_every,
        start=start,
        control=control,
    )
    if result.stopped:
        log(
            f"stopping on signal after iteration {result.iterations}/{cfg.max_iterations}: "
            f"checkpoint {control.last}; resume with --resume"
        )
    else:
        log(
            f"sweep done iterations={result.iterations} "
            f"converged={str(result.converged).lower()} "
            f"balance={result.balance.relative_error:.2e} grind_ns={result.grind_ns:.2f} "
            f"core_grind_ns={result.core_grind_ns:.2f} "
            f"efficiency={result.efficiency:.3f} predicted={predicted.efficiency:.3f}"
        )

    if rec.enabled:
        path = trace.resolve_path(output if output is not None else ".")
        write_trace(comm, path, rec, _trace_metadata(plan, config_text))
        log(f"trace: {path} ({len(rec.events)} events on rank 0); hpcpipe trace summary {path}")
    if not result.stopped:  # every rank agreed on stopping, so all skip the gather together
        _write_outputs(cfg, problem, plan, predicted, sweeper, cells, result, output, config_text)
        if output is not None and comm.rank == 0:
            log(f"sweep wrote {output / 'flux.h5'} and flux.xmf")
    if output is not None and comm.rank == 0:
        state = (
            "preempted" if result.stopped else "finished" if result.converged else "not-converged"
        )
        write_status(output, state, result.iterations, control.last)
    sweeper.free()
    idle_barrier(comm)  # rank 0 writes flux.h5 and status.json
    if not result.converged and not result.stopped:
        raise ConvergenceError(result.message)
    return result


def _check_resumable(path: Path, start: Iterate, cfg: SweepConfig) -> None:
    """Refuse a checkpoint with nothing left to do, saying which deck key to change."""
    n, last = start.iterations, start.history[-1] if start.history else math.inf
    if n >= cfg.max_iterations:
        raise ConfigError(
            "--resume",
            "",
            f"{path} is at iteration {n} and sweep.max_iterations = {cfg.max_iterations}: "
            "raise sweep.max_iterations to iterate further",
        )
    if last <= cfg.tolerance:
        raise ConfigError(
            "--resume",
            "",
            f"{path} has already converged (dphi={last:.3e} <= sweep.tolerance="
            f"{cfg.tolerance:g}); lower sweep.tolerance to iterate further",
        )


class _Control:
    """The workload's side of each iteration (solver.Control): fault injection, the trace
    step and its STEP event, checkpoints on cadence, at the end and on the stop signal."""

    def __init__(
        self,
        comm: Comm,
        cfg: SweepConfig,
        owned: tuple[slice, slice],
        settings: CheckpointConfig,
        directory: Path | None,
        rec: Recorder,
        stop: StopSignal | None,
        config_text: str,
        log: Callable[[str], None],
    ):
        self.comm, self.cfg, self.owned = comm, cfg, owned
        self.settings, self.directory = settings, directory
        self.rec, self.stop, self.config_text, self.log = rec, stop, config_text, log
        self.last: Path | None = None
        self._t0 = 0
        self.watchdog = Watchdog(0)
        self.where: Callable[[], str] = lambda: "(unknown)"

    def begin(self, iteration: int) -> None:
        self.watchdog.arm(f"sweep iteration {iteration}", self.where)
        maybe_fail(f"sweep-iteration:{iteration}", self.comm.rank)
        self.rec.begin_step(iteration)  # numbered from 1, like the log's "iter N"
        self._t0 = self.rec.now()

    def stop_requested(self) -> bool:
        return self.stop is not None and self.stop.received is not None

    def end(self, iterate: Iterate, final: bool, stopping: bool) -> None:
        """Checkpoint when due, still under the iteration's watchdog; then disarm it."""
        try:
            self._end(iterate, final, stopping)
        finally:
            self.watchdog.disarm()

    def _end(self, iterate: Iterate, final: bool, stopping: bool) -> None:
        rec, dphi = self.rec, iterate.history[-1]
        if rec.enabled:
            rec.record(EventKind.STEP, -1, -1, self._t0, rec.now(), value=dphi)
        every, n = self.settings.every, iterate.iterations
        due = stopping or (every > 0 and (n % every == 0 or final))
        if not due or self.directory is None or not math.isfinite(dphi):
            return
        t0 = rec.now()
        self.last = checkpointing.save(
            self.comm,
            self.directory,
            iterate,
            self.cfg,
            self.owned,
            self.settings,
            converged=dphi <= self.cfg.tolerance,
            config_text=self.config_text,
        )
        if rec.enabled:
            rec.record(EventKind.CHECKPOINT, -1, -1, t0, rec.now())
        self.log(f"checkpoint: {self.last}")


def _trace_metadata(plan: SweepPlan, config_text: str) -> dict[str, Any]:
    """Root attributes of a sweep trace: enough to rebuild the plan the events follow."""
    ranks = range(plan.ranks)
    return {
        "config": config_text,
        "workload": "sweep",
        "topology": {
            "world": plan.ranks,
            "dims": {"px": plan.px, "py": plan.py},
            "coords": {
                "x": [plan.coords(r)[0] for r in ranks],
                "y": [plan.coords(r)[1] for r in ranks],
            },
        },
        "sweep_plan": plan.describe(),
        "sweep_octants": list(plan.octants),
        "sweep_order": plan.order,
        "sweep_angle_blocks": plan.angle_blocks,
        "sweep_z_blocks": plan.z_blocks,
    }


def _write_outputs(
    cfg: SweepConfig,
    problem: Any,
    plan: SweepPlan,
    predicted: Any,
    sweeper: KBASweeper,
    cells: LocalCells,
    result: SolveResult,
    output: Path | None,
    config_text: str,
) -> None:
    """Collective: gather the flux to rank 0, which writes flux.h5, flux.xmf and the PNG."""
    full = sweeper.gather(result.phi.reshape(*cells.shape, problem.groups))
    if output is None or sweeper.rank != 0:
        return
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
        "core_grind_ns": result.core_grind_ns,
        "efficiency_measured": result.efficiency,
        "efficiency_predicted": predicted.efficiency,
        "predicted_stages": predicted.stages,
        "ranks": plan.ranks,
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
