"""Source iteration: scattering source, sweep, convergence check; then the particle balance.

The loop is the same for the serial reference and the KBA executor: both are "sweepers" with
`sweep(q, sigma_t) -> (phi, outflow, inflow)` plus global `allsum` / `allmax` and a `timing`
record, so the solver never touches MPI and the two can be compared cell by cell.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from hpcpipe.sweep.kernel import resolve_kernel, sweep_domain
from hpcpipe.sweep.mesh import Problem

__all__ = [
    "Balance",
    "Control",
    "ConvergenceError",
    "Iterate",
    "LocalCells",
    "SerialSweeper",
    "SolveResult",
    "Sweeper",
    "solve",
]


class ConvergenceError(RuntimeError):
    """Source iteration stopped at its limit (or blew up) before reaching the tolerance."""


class Sweeper(Protocol):
    """What the solver needs from a sweep strategy (serial reference or KBA pipeline)."""

    timing: Any
    ranks: int

    def sweep(self, q: Any, sigma_t: Any) -> tuple[Any, np.ndarray, np.ndarray]: ...

    def allsum(self, values: np.ndarray) -> np.ndarray: ...

    def allmax(self, values: np.ndarray) -> np.ndarray: ...


@dataclass
class _Timing:
    wall: float = 0.0
    busy: float = 0.0
    wait: float = 0.0


class SerialSweeper:
    """The single-process oracle: `kernel.sweep_domain` over the whole mesh, no blocks, no MPI."""

    def __init__(self, problem: Problem, xp: Any = np):
        self.problem, self.xp = problem, xp
        self.kernel = resolve_kernel(problem.kernel, xp)
        self.timing = _Timing()
        self.ranks = 1

    def sweep(self, q: Any, sigma_t: Any) -> tuple[Any, np.ndarray, np.ndarray]:
        t0 = time.perf_counter()
        phi, outflow, inflow = sweep_domain(self.xp, self.problem, q, sigma_t, self.kernel)
        wall = time.perf_counter() - t0
        self.timing = _Timing(wall=wall, busy=wall)
        host = (lambda a: a) if self.xp is np else self.xp.asnumpy
        return phi, host(outflow), host(inflow)

    def allsum(self, values: np.ndarray) -> np.ndarray:
        return np.asarray(values, dtype=np.float64)

    def allmax(self, values: np.ndarray) -> np.ndarray:
        return np.asarray(values, dtype=np.float64)


class LocalCells:
    """One rank's cells [x_cells, y_cells, all z]: per-cell sigma_t and fixed source, and the
    cells of each material, for the scattering source and the absorption rate."""

    def __init__(
        self,
        problem: Problem,
        x_cells: slice = slice(None),
        y_cells: slice = slice(None),
        xp: Any = np,
    ):
        self.xp = xp
        self.ids = problem.material_ids(x_cells, y_cells)
        self.shape = self.ids.shape
        flat = self.ids.ravel()
        mats = problem.materials
        self.volume = problem.mesh.cell_volume
        self.sigma_t = xp.asarray(mats.sigma_t[flat])
        self.fixed = xp.asarray(mats.source[flat])
        self._sigma_a = xp.asarray(mats.sigma_a[flat])
        used = np.unique(flat)
        self._scatter = [
            (xp.asarray(np.flatnonzero(flat == m)), xp.asarray(mats.sigma_s[m]))
            for m in used
            if mats.sigma_s[m].any()
        ]

    @property
    def cells(self) -> int:
        return int(self.ids.size)

    def source(self, phi: Any, out: Any = None) -> Any:
        """q = fixed + sum_g sigma_s[g -> g'] phi_g, per cell and group g' (into `out`, when
        given: the solver's buffer, so an iteration allocates no (cells, G) array for it)."""
        if out is None:
            q = self.fixed.copy()
        else:
            q = out
            q[...] = self.fixed
        for cells, matrix in self._scatter:
            q[cells] += phi[cells] @ matrix
        return q

    def absorption(self, phi: Any) -> np.ndarray:
        """Per-group absorption rate in these cells (particles per second)."""
        return _host(self.xp, (self._sigma_a * phi).sum(axis=0) * self.volume)

    def emission(self) -> np.ndarray:
        return _host(self.xp, self.fixed.sum(axis=0) * self.volume)


@dataclass(frozen=True)
class Balance:
    """Global particle balance (particles per second, summed over groups):
    source + inflow = absorption + outflow at convergence."""

    source: float
    inflow: float
    absorption: float
    outflow: float

    @property
    def relative_error(self) -> float:
        produced = self.source + self.inflow
        lost = self.absorption + self.outflow
        return abs(produced - lost) / max(produced, lost, np.finfo(float).tiny)


@dataclass
class Iterate:
    """Where source iteration stands: this rank's flux after `iterations` sweeps and the global
    history that led there. A checkpoint holds exactly this, so a solve continued from it
    repeats an uninterrupted one bit for bit."""

    phi: Any
    """Local scalar flux (cells, G) on the array backend."""
    history: list[float] = field(default_factory=list)
    """max|dphi| / max|phi| of each iteration so far."""
    scales: list[float] = field(default_factory=list)
    """max|phi| of each iteration (tells divergence from slow convergence)."""
    seconds: list[float] = field(default_factory=list)
    """Sweep wall time of each iteration (max over ranks)."""

    @property
    def iterations(self) -> int:
        return len(self.history)


class Control(Protocol):
    """Job control around each iteration, supplied by the workload so the solver stays MPI-free
    (fault injection, trace steps, checkpoints, the scheduler's stop signal)."""

    def begin(self, iteration: int) -> None:
        """Iteration `iteration` (1-based, as the progress line counts) is about to start."""

    def stop_requested(self) -> bool:
        """This rank was asked to stop; the solver agrees on it over ranks in its allmax."""

    def end(self, iterate: Iterate, final: bool, stopping: bool) -> None:
        """The iteration is complete on every rank; `final`: the solve ends here (converged,
        out of iterations or diverged); `stopping`: every rank stops here on a signal."""


@dataclass
class SolveResult:
    """What a solve produced on this rank: local scalar flux (cells, G) and global figures."""

    phi: np.ndarray
    iterations: int
    converged: bool
    history: np.ndarray
    balance: Balance
    grind_ns: float
    """Kripke's grind time: wall time of an iteration (median over this run's iterations after
    its first) per unknown of the whole problem (cells x directions x groups), in ns."""
    efficiency: float
    """Measured: kernel time summed over ranks / (ranks x sweep wall time), last sweep."""
    sweep_seconds: list[float] = field(default_factory=list)
    iteration_seconds: list[float] = field(default_factory=list)
    """Wall time of each iteration of this run (source, sweep, convergence reduction)."""
    message: str = ""
    stopped: bool = False
    """Stopped early on a signal (not converged, not failed): continue with --resume."""
    ranks: int = 1

    @property
    def core_grind_ns(self) -> float:
        """`grind_ns` x ranks: the core time an unknown costs (constant under perfect scaling)."""
        return self.grind_ns * self.ranks


def solve(
    problem: Problem,
    cells: LocalCells,
    sweeper: Sweeper,
    *,
    tolerance: float,
    max_iterations: int,
    log: Callable[[str], None] = lambda _msg: None,
    log_every: int = 1,
    start: Iterate | None = None,
    control: Control | None = None,
) -> SolveResult:
    """Source iteration from phi = 0 (or from `start`) until max|dphi| / max|phi| <= tolerance.

    `max_iterations` counts the iterations of `start` too (which is continued in place). The
    stop request travels in the iteration's allmax, so every rank leaves after the same one.
    """
    xp = cells.xp
    ranks = sweeper.ranks
    unknowns = problem.mesh.cells * problem.quadrature.total * problem.groups
    state = start if start is not None else Iterate(xp.zeros((cells.cells, problem.groups)))
    if state.iterations >= max_iterations:
        raise ValueError(
            f"the solve already has {state.iterations} iterations, max_iterations is "
            f"{max_iterations}: nothing left to iterate"
        )
    outflow = inflow = np.zeros(problem.groups)
    converged = stopping = False
    walls: list[float] = []
    q, diff = xp.empty_like(state.phi), xp.empty_like(state.phi)  # reused every iteration
    for it in range(state.iterations + 1, max_iterations + 1):
        if control is not None:
            control.begin(it)
        t0 = time.perf_counter()
        phi = state.phi
        new, outflow, inflow = sweeper.sweep(cells.source(phi, out=q), cells.sigma_t)
        asked = 1.0 if control is not None and control.stop_requested() else 0.0
        xp.subtract(new, phi, out=diff)
        local = [_abs_max(diff), _abs_max(new), sweeper.timing.wall]
        change, scale, wall, stop = (float(v) for v in sweeper.allmax(np.array([*local, asked])))
        walls.append(time.perf_counter() - t0)  # the allmax ends the iteration on every rank
        dphi = change / scale if scale > 0 else change
        state.phi = new
        state.history.append(dphi)
        state.scales.append(scale)
        state.seconds.append(wall)
        grind = walls[-1] / unknowns * 1e9
        converged = dphi <= tolerance
        final = converged or it == max_iterations or not np.isfinite(dphi)
        stopping = stop > 0 and not final
        if it % log_every == 0 or final or stopping:
            log(f"iter {it} dphi={dphi:.3e} grind_ns={grind:.2f}")
        if control is not None:
            control.end(state, final, stopping)
        if final or stopping:
            break
    phi, history, seconds = state.phi, state.history, state.seconds
    busy = float(sweeper.allsum(np.array([sweeper.timing.busy]))[0])
    efficiency = busy / (ranks * seconds[-1]) if seconds[-1] > 0 else 1.0
    sums = sweeper.allsum(
        np.array([cells.emission().sum(), inflow.sum(), cells.absorption(phi).sum(), outflow.sum()])
    )
    balance = Balance(*(float(v) for v in sums))
    # grind time over the iterations after the first (which pays one-off setup: compiling or
    # loading the kernel, first-touch of the face buffers)
    steady = walls[1:] or walls
    grind_ns = float(np.median(steady)) / unknowns * 1e9
    message = ""
    if not converged and not stopping:
        message = _not_converged(problem, history, state.scales, tolerance)
    return SolveResult(
        _host(xp, phi),
        len(history),
        converged,
        np.array(history),
        balance,
        grind_ns,
        efficiency,
        list(seconds),
        walls,
        message,
        stopped=stopping,
        ranks=ranks,
    )


def _not_converged(
    problem: Problem, history: list[float], scales: list[float], tolerance: float
) -> str:
    """Say why: the last change, how the error or the flux evolves, and materials with c >= 1."""
    last = history[-1]
    msg = (
        f"source iteration did not converge: dphi={last:.3e} > tolerance={tolerance:.1e} "
        f"after {len(history)} iterations"
    )
    if not np.isfinite(last):
        msg += "; the flux overflowed (diverging)"
    elif len(history) >= 3 and scales[-2] > 0:
        growth = scales[-1] / scales[-2]
        rate = history[-1] / history[-2] if history[-2] > 0 else 0.0
        if growth > 1.0 + 0.5 * last and rate > 0.9:
            msg += f"; the flux grows by {growth:.3f} per iteration (diverging)"
        else:
            msg += f"; the error shrinks by {rate:.3f} per iteration"
    c = problem.materials.scattering_ratio
    bad = [
        f"material {m} group {g} (c={c[m, g]:.3g})"
        for m, g in zip(*np.nonzero(c >= 1.0), strict=True)
    ]
    if bad:
        msg += (
            "; scattering >= total cross section in "
            + ", ".join(bad[:4])
            + ": source iteration cannot converge there (sigma_s must be < sigma_t)"
        )
    else:
        msg += "; raise sweep.max_iterations or loosen sweep.tolerance (slow when c is near 1)"
    return msg


def _abs_max(a: Any) -> float:
    """max |a| without the temporary |a| (the same value: negation is exact); NaN if any."""
    return max(float(a.max()), -float(a.min()))


def _host(xp: Any, value: Any) -> np.ndarray:
    return value if xp is np else xp.asnumpy(value)
