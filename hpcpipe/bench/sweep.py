"""Sweep grind time and KBA parallel efficiency: measured, fitted model and plan simulator.

Problem: n^3 cells, S8 (80 directions), 8 groups with downscatter, no fix-ups. Grind time =
sweep wall time x ranks / (cells x directions x groups), the figure Kripke and SNAP report.
Rank 0 first sweeps the whole mesh alone (the other ranks sleep, leaving it a core), once with
the whole octant as one task and once with small blocks; then all ranks sweep it as a
px = ranks, py = 1 KBA pipeline for each blocking.

    measured  T(1 rank) / (ranks x T(ranks))
    model     the same with the ranks' sweep time predicted by the plan simulator, each task
              costed a * hyperplanes + b * unknowns (a, b fitted to the two 1-rank runs: small
              blocks mean short vectors, which the unit-task model ignores)
    busy      the kernel's share of the parallel sweep time (mean over ranks)
    plan      the simulator's efficiency with unit tasks (the KBA stage-count model)
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from hpcpipe.bench.harness import idle_barrier, median
from hpcpipe.bench.table import Column, Report
from hpcpipe.config import ConfigError
from hpcpipe.sweep.config import SweepConfig
from hpcpipe.sweep.mesh import build_problem
from hpcpipe.sweep.parallel import KBASweeper
from hpcpipe.sweep.plan import PlanError, build_plan, simulate

__all__ = ["make_config", "run"]

GROUPS = 8
ORDER = 8  # S8: 80 directions, 10 per octant

COLUMNS = [
    Column("ranks", "ranks", "d", 5),
    Column("z_block", "zblk", "d", 4),
    Column("angle_block", "ablk", "d", 4),
    Column("tasks_per_octant", "M", "d", 4),
    Column("sweep_s", "sweep s", ".3f", 8),
    Column("grind_ns", "grind ns", ".2f", 8),
    Column("measured", "eff meas", ".3f", 8),
    Column("model", "model", ".3f", 6),
    Column("busy", "busy", ".3f", 6),
    Column("predicted", "plan", ".3f", 6),
]


def make_config(n: int, px: int = 1) -> SweepConfig:
    """The benchmark problem on px x 1 ranks."""
    sigma_t = tuple(0.5 + 0.1 * g for g in range(GROUPS))
    sigma_s = tuple(
        tuple(
            0.3 * sigma_t[g] if gp == g else (0.02 if gp == g + 1 else 0.0) for gp in range(GROUPS)
        )
        for g in range(GROUPS)
    )
    return SweepConfig(
        px=px,
        nx=n,
        ny=n,
        nz=n,
        lengths=(10.0, 10.0, 10.0),
        groups=GROUPS,
        sigma_t=(sigma_t,),
        sigma_s=(sigma_s,),
        source=((1.0,) * GROUPS,),
        order=ORDER,
        fixup=False,
    )


def time_sweeps(
    cfg: SweepConfig, comm: MPI.Comm, z_block: int, angle_block: int, sweeps: int
) -> dict[str, Any]:
    """Median sweep wall time (slowest rank), busy share, and the plan's unit-task prediction."""
    from hpcpipe.sweep.solver import LocalCells

    problem = build_problem(cfg)
    plan = build_plan(
        cfg.px, cfg.py, problem.mesh.shape, problem.quadrature.per_octant, z_block, angle_block
    )
    sweeper = KBASweeper(problem, plan, comm)
    cells = LocalCells(problem, sweeper.x_cells, sweeper.y_cells)
    q = cells.source(np.zeros((cells.cells, GROUPS)))
    walls, busy = [], []
    for i in range(sweeps + 1):  # the first sweep warms caches and index arrays
        comm.Barrier()
        t0 = time.perf_counter()
        sweeper.sweep(q, cells.sigma_t)
        wall = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        b = comm.allreduce(sweeper.timing.busy, op=MPI.SUM)
        if i:
            walls.append(wall)
            busy.append(b / (comm.size * wall))
    unknowns = problem.mesh.cells * problem.quadrature.total * GROUPS
    wall = median(walls)
    bx, by, _ = plan.local_shape
    sweeper.free()
    return {
        "ranks": comm.size,
        "planes_per_task": bx + by + plan.z_block - 2,
        "unknowns_per_task": bx * by * plan.z_block * plan.angle_block * GROUPS,
        "tasks": len(plan.tasks[0]),
        "per_octant": problem.quadrature.per_octant,
        "layout": [cfg.px, cfg.py],
        "z_block": plan.z_block,
        "angle_block": plan.angle_block,
        "tasks_per_octant": plan.tasks_per_octant,
        "sweep_s": wall,
        "sweeps_s": walls,
        "grind_ns": wall * comm.size / unknowns * 1e9,
        "busy": median(busy),
        "predicted": simulate(plan).efficiency,
    }


def fit_kernel_cost(whole: dict[str, Any], small: dict[str, Any]) -> tuple[float, float]:
    """Seconds per hyperplane (a) and per unknown (b) from two 1-rank blockings."""
    rows = [
        [r["tasks"] * r["planes_per_task"], r["tasks"] * r["unknowns_per_task"]]
        for r in (whole, small)
    ]
    busy = [r["sweep_s"] * r["busy"] for r in (whole, small)]
    a, b = np.linalg.solve(np.array(rows, dtype=float), np.array(busy))
    return float(a), float(b)


def model_efficiency(rec: dict[str, Any], cost: tuple[float, float], t_one: float, n: int) -> float:
    """T(1 rank) / (ranks x simulated sweep), tasks costed by the fitted kernel model."""
    a, b = cost
    plan = build_plan(
        rec["layout"][0],
        rec["layout"][1],
        (n, n, n),
        rec["per_octant"],
        rec["z_block"],
        rec["angle_block"],
    )
    task = a * rec["planes_per_task"] + b * rec["unknowns_per_task"]
    return t_one / (rec["ranks"] * simulate(plan, task_time=task).makespan)


def _blockings(text: str) -> list[tuple[int, int]]:
    try:
        out = [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]
    except ValueError:
        out = []
    if not out or any(len(b) != 2 or min(b) < 0 for b in out):
        raise ConfigError("--blockings", "", f"= {text!r}: expected ZxA pairs like 0x0,8x10")
    return [(b[0], b[1]) for b in out]


def run(comm: MPI.Comm, args: argparse.Namespace) -> Report:
    p, n = comm.size, args.n
    blockings = _blockings(args.blockings)
    if n < 2 or n % p:
        raise ConfigError("--n", "", f"= {n} cells per side must be divisible by {p} ranks")
    unknowns = n**3 * 80 * GROUPS
    report = Report(
        "sweep",
        [
            f"sweep grind: {n}^3 cells, S8 (80 directions), {GROUPS} groups, "
            f"{unknowns / 1e6:.1f} M unknowns per sweep; median of {args.repeats} sweeps",
            f"1 rank (the others asleep), then {p} ranks as a {p} x 1 KBA pipeline per "
            "blocking; eff meas = T1 / (ranks x T); model = fitted kernel cost in the plan "
            "simulator; busy = kernel share of the parallel sweep; plan = unit-task simulator",
        ],
        COLUMNS,
        params={"n": n, "groups": GROUPS, "order": ORDER, "repeats": args.repeats},
        stream=comm.rank == 0,
    )
    report.start()
    one = small = None
    if comm.rank == 0:
        one = time_sweeps(make_config(n), MPI.COMM_SELF, 0, 0, args.repeats)
        small = time_sweeps(make_config(n), MPI.COMM_SELF, 2, 2, max(1, args.repeats - 2))
    idle_barrier(comm)
    one, small = comm.bcast((one, small), root=0)
    assert one is not None and small is not None
    cost = fit_kernel_cost(one, small)
    for rec in (one, small):  # efficiencies compare with these: none of their own
        report.add({**rec, "measured": None, "model": None})
    for z_block, angle_block in blockings:
        try:
            rec = time_sweeps(make_config(n, px=p), comm, z_block, angle_block, args.repeats)
        except PlanError as exc:
            report.note(f"blocking {z_block}x{angle_block} skipped: {exc}")
            continue
        rec["measured"] = one["sweep_s"] / (p * rec["sweep_s"])
        rec["model"] = model_efficiency(rec, cost, one["sweep_s"], n)
        report.add(rec)
    report.summary["kernel_model"] = {"s_per_plane": cost[0], "s_per_unknown": cost[1]}
    report.note(
        f"kernel model: {cost[0] * 1e6:.2f} us per hyperplane + {cost[1] * 1e9:.2f} ns per "
        f"unknown; 1-rank grind {one['grind_ns']:.2f} ns"
    )
    return report
