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

from hpcpipe.sweep.kernel import sweep_domain
from hpcpipe.sweep.mesh import Problem

__all__ = [
    "Balance",
    "ConvergenceError",
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
        self.timing = _Timing()
        self.ranks = 1

    def sweep(self, q: Any, sigma_t: Any) -> tuple[Any, np.ndarray, np.ndarray]:
        t0 = time.perf_counter()
        phi, outflow, inflow = sweep_domain(self.xp, self.problem, q, sigma_t)
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

    def source(self, phi: Any) -> Any:
        """q = fixed + sum_g sigma_s[g -> g'] phi_g, per cell and group g'."""
        q = self.fixed.copy()
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
class SolveResult:
    """What a solve produced on this rank: local scalar flux (cells, G) and global figures."""

    phi: np.ndarray
    iterations: int
    converged: bool
    history: np.ndarray
    balance: Balance
    grind_ns: float
    efficiency: float
    """Measured: kernel time summed over ranks / (ranks x sweep wall time), last sweep."""
    sweep_seconds: list[float] = field(default_factory=list)
    message: str = ""


def solve(
    problem: Problem,
    cells: LocalCells,
    sweeper: Sweeper,
    *,
    tolerance: float,
    max_iterations: int,
    log: Callable[[str], None] = lambda _msg: None,
    log_every: int = 1,
) -> SolveResult:
    """Source iteration from phi = 0 until max|dphi| / max|phi| <= tolerance."""
    xp = cells.xp
    ranks = sweeper.ranks
    unknowns = problem.mesh.cells * problem.quadrature.total * problem.groups
    phi = xp.zeros((cells.cells, problem.groups))
    history: list[float] = []
    scales: list[float] = []
    seconds: list[float] = []
    outflow = inflow = np.zeros(problem.groups)
    for it in range(1, max_iterations + 1):
        new, outflow, inflow = sweeper.sweep(cells.source(phi), cells.sigma_t)
        local = [float(xp.abs(new - phi).max()), float(xp.abs(new).max()), sweeper.timing.wall]
        change, scale, wall = (float(v) for v in sweeper.allmax(np.array(local)))
        phi = new
        dphi = change / scale if scale > 0 else change
        history.append(dphi)
        scales.append(scale)
        seconds.append(wall)
        grind = wall * ranks / unknowns * 1e9
        converged = dphi <= tolerance
        if it % log_every == 0 or converged or it == max_iterations or not np.isfinite(dphi):
            log(f"iter {it} dphi={dphi:.3e} grind_ns={grind:.1f}")
        if converged or not np.isfinite(dphi):
            break
    busy = float(sweeper.allsum(np.array([sweeper.timing.busy]))[0])
    efficiency = busy / (ranks * seconds[-1]) if seconds[-1] > 0 else 1.0
    sums = sweeper.allsum(
        np.array([cells.emission().sum(), inflow.sum(), cells.absorption(phi).sum(), outflow.sum()])
    )
    balance = Balance(*(float(v) for v in sums))
    # grind time over the sweeps after the first (which pays one-off setup)
    steady = seconds[1:] or seconds
    grind_ns = float(np.median(steady)) * ranks / unknowns * 1e9
    message = "" if converged else _not_converged(problem, history, scales, tolerance)
    return SolveResult(
        _host(xp, phi),
        len(history),
        converged,
        np.array(history),
        balance,
        grind_ns,
        efficiency,
        seconds,
        message,
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


def _host(xp: Any, value: Any) -> np.ndarray:
    return value if xp is np else xp.asnumpy(value)
