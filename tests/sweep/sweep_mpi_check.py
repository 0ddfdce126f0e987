"""Run under mpiexec by test_sweep_mpi.py: KBA sweeps on every layout that fits the world,
several blockings each, compared on rank 0 with the serial reference. One JSON line per case.

Both solves run a fixed number of source iterations (tolerance 0), so they do the same work and
any difference is round-off from the order of the angular sums.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hpcpipe.config import load_config
from hpcpipe.sweep.mesh import build_problem
from hpcpipe.sweep.parallel import KBASweeper
from hpcpipe.sweep.plan import build_plan, validate
from hpcpipe.sweep.solver import LocalCells, SerialSweeper, solve

TINY = Path(__file__).resolve().parents[2] / "inputs" / "sweep_tiny.toml"
LAYOUTS = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 4: [(2, 2)], 6: [(3, 2)], 8: [(4, 2)]}
MESH = {6: ["sweep.nx=12"]}  # 3 ranks along x: the tiny deck's 8 cells do not split
ORDERS = ("auto", "yx", "xy")  # auto = nearest: each rank from its own corners; the others too
BLOCKINGS = [(0, 0), (2, 1), (1, 3), (4, 1)]  # (z_block, angle_block); S4: 3 per octant
PHYSICS = {
    "tiny": [],
    "thick-fixup": ["sweep.sigma_t=[[10.0, 15.0], [20.0, 40.0]]"],
    "thick-fixup-numpy-kernel": [
        "sweep.sigma_t=[[10.0, 15.0], [20.0, 40.0]]",
        "sweep.kernel='numpy'",
    ],
    "step-product-all-faces": [
        "sweep.scheme='step'",
        "sweep.quadrature='product'",
        "sweep.order=4",
        "sweep.azimuthal=3",
        "sweep.incident_faces=['x-', 'x+', 'y-', 'y+', 'z-', 'z+']",
        "sweep.incident_flux=[0.5, 0.2]",
    ],
}
ITERATIONS = 8


def _solve(problem, cells, sweeper):
    return solve(problem, cells, sweeper, tolerance=0.0, max_iterations=ITERATIONS)


def _cases(name: str, size: int):
    """(px, py, z_block, angle_block, order) to run for one physics on `size` ranks: every
    blocking of the tiny deck in the default order, two of them in the yx / xy orders, and
    two blockings of the other decks."""
    for (px, py), (z_block, angle_block), order in itertools.product(
        LAYOUTS[size], BLOCKINGS, ORDERS
    ):
        if name != "tiny" and (z_block, angle_block) not in ((0, 0), (1, 3)):
            continue
        if order != "auto" and (name != "tiny" or (z_block, angle_block) not in ((0, 0), (2, 1))):
            continue
        if name.startswith("step-product"):  # product set: 6 directions per octant
            angle_block = 2 if angle_block else 0
        yield px, py, z_block, angle_block, order


def main() -> int:
    comm = MPI.COMM_WORLD
    failures = 0
    for name, overrides in PHYSICS.items():
        reference = None
        for px, py, z_block, angle_block, order in _cases(name, comm.size):
            sets = [*overrides, *MESH.get(comm.size, []), f"sweep.px={px}", f"sweep.py={py}"]
            sets += [f"sweep.z_block={z_block}", f"sweep.angle_block={angle_block}"]
            cfg = load_config(TINY, sets).sweep
            problem = build_problem(cfg)
            shape, per_octant = problem.mesh.shape, problem.quadrature.per_octant
            plan = build_plan(px, py, shape, per_octant, z_block, angle_block, order)
            predicted = validate(plan)
            sweeper = KBASweeper(problem, plan, comm)
            cells = LocalCells(problem, sweeper.x_cells, sweeper.y_cells)
            result = _solve(problem, cells, sweeper)
            full = sweeper.gather(result.phi.reshape(*cells.shape, problem.groups))
            sweeper.free()
            if comm.rank == 0:
                if reference is None:
                    serial = _solve(problem, LocalCells(problem), SerialSweeper(problem))
                    reference = (serial.phi.reshape(full.shape), serial.balance)
                ref_phi, ref_balance = reference
                diff = float(np.abs(full - ref_phi).max() / np.abs(ref_phi).max())
                record = {
                    "physics": name,
                    "kernel": sweeper.kernel,
                    "layout": [px, py],
                    "order": plan.order,
                    "z_block": z_block,
                    "angle_block": angle_block,
                    "tasks_per_octant": plan.tasks_per_octant,
                    "max_rel_diff": diff,
                    "outflow_rel_diff": abs(result.balance.outflow - ref_balance.outflow)
                    / ref_balance.outflow,
                    "iterations": result.iterations,
                    "predicted_stages": predicted.stages,
                    "efficiency": result.efficiency,
                }
                failures += diff > 1e-12
                print(json.dumps(record), flush=True)
    return int(comm.bcast(failures, root=0) > 0)


if __name__ == "__main__":
    sys.exit(main())
