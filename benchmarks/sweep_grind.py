"""Sweep benchmark: grind time on 1 rank and measured vs predicted KBA efficiency on 2 ranks.

    python benchmarks/sweep_grind.py                  # both parts; 2-rank part via mpiexec
    python benchmarks/sweep_grind.py --n 48 --sweeps 5 --json out.json

Problem: n^3 cells (default 32^3), S8 (80 directions), 8 groups, downscatter, no fix-ups.
Grind time = sweep wall time x ranks / (cells x directions x groups), the figure Kripke and
SNAP report. Measured efficiency = T(1 rank) / (2 x T(2 ranks)); "busy" is the kernel's share
of the 2-rank sweep time; predicted is the plan simulator's unit-task efficiency.
"model" adds the kernel's cost per hyperplane (small blocks mean short vectors): a task costs
a * planes + b * unknowns, with a and b fitted from two 1-rank runs, and the simulator turns
that into a 2-rank sweep time. BLAS runs one thread per rank, as in an MPI job.
On a shared or oversubscribed machine the 2-rank figures partly measure the machine.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hpcpipe.sweep.config import SweepConfig
from hpcpipe.sweep.mesh import build_problem
from hpcpipe.sweep.parallel import KBASweeper
from hpcpipe.sweep.plan import SweepPlan, build_plan, simulate

GROUPS = 8
BLOCKINGS_2 = [(0, 0), (8, 10), (8, 5), (4, 5), (2, 2)]  # (z_block, angle_block); S8: 10/octant


def make_config(n: int, px: int = 1) -> SweepConfig:
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
        order=8,
    )


def time_sweeps(cfg: SweepConfig, comm: MPI.Comm, z_block: int, angle_block: int, sweeps: int):
    """Median sweep wall time (max over ranks), busy fraction, and the plan's prediction."""
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
    wall = statistics.median(walls)
    bx, by, _ = plan.local_shape
    return {
        "ranks": comm.size,
        "planes_per_task": bx + by + plan.z_block - 2,
        "unknowns_per_task": bx * by * plan.z_block * plan.angle_block * GROUPS,
        "tasks": len(plan.tasks[0]),
        "layout": [cfg.px, cfg.py],
        "z_block": plan.z_block,
        "angle_block": plan.angle_block,
        "tasks_per_octant": plan.tasks_per_octant,
        "sweep_s": wall,
        "grind_ns": wall * comm.size / unknowns * 1e9,
        "busy": statistics.median(busy),
        "predicted": simulate(plan).efficiency,
    }


def fit_kernel_cost(whole: dict, small: dict) -> tuple[float, float]:
    """Seconds per hyperplane (a) and per unknown (b) from two 1-rank blockings."""
    rows = [
        [r["tasks"] * r["planes_per_task"], r["tasks"] * r["unknowns_per_task"]]
        for r in (whole, small)
    ]
    busy = [r["sweep_s"] * r["busy"] for r in (whole, small)]
    a, b = np.linalg.solve(np.array(rows, dtype=float), np.array(busy))
    return float(a), float(b)


def model_efficiency(rec: dict, cost: tuple[float, float], t_one: float, n: int) -> float:
    """T(1 rank) / (2 x simulated 2-rank sweep) with tasks costed by the fitted kernel model."""
    a, b = cost
    plan: SweepPlan = build_plan(
        rec["layout"][0], rec["layout"][1], (n, n, n), 10, rec["z_block"], rec["angle_block"]
    )
    task = a * rec["planes_per_task"] + b * rec["unknowns_per_task"]
    return t_one / (2 * simulate(plan, task_time=task).makespan)


def worker(n: int, sweeps: int) -> None:
    """The 2-rank part, run under mpiexec; rank 0 prints one JSON line per blocking."""
    comm = MPI.COMM_WORLD
    cfg = make_config(n, px=comm.size)
    for z_block, angle_block in BLOCKINGS_2:
        rec = time_sweeps(cfg, comm, z_block, angle_block, sweeps)
        if comm.rank == 0:
            print(json.dumps(rec), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=32, help="cells per side (default 32)")
    p.add_argument("--sweeps", type=int, default=3, help="timed sweeps per case (median)")
    p.add_argument("--json", default="runs/bench/sweep_grind.json", help="where to write results")
    p.add_argument("--mpiexec", default=os.environ.get("HPCPIPE_MPIEXEC", ""), help="launcher")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.n, args.sweeps)
        return 0

    one = time_sweeps(make_config(args.n), MPI.COMM_SELF, 0, 0, args.sweeps)
    small = time_sweeps(make_config(args.n), MPI.COMM_SELF, 2, 2, max(1, args.sweeps - 1))
    cost = fit_kernel_cost(one, small)
    launcher = args.mpiexec.split() or [str(Path(sys.executable).parent / "mpiexec")]
    cmd = [*launcher, "-n", "2", sys.executable, __file__, "--worker"]
    cmd += ["--n", str(args.n), "--sweeps", str(args.sweeps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        print(proc.stdout + proc.stderr, file=sys.stderr)
        return 1
    two = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    for rec in two:
        rec["measured"] = one["sweep_s"] / (2 * rec["sweep_s"])
        rec["model"] = model_efficiency(rec, cost, one["sweep_s"], args.n)

    unknowns = args.n**3 * 80 * GROUPS
    print(f"# sweep grind: {args.n}^3 cells, S8 (80 directions), {GROUPS} groups")
    print(f"# {unknowns / 1e6:.1f} M unknowns per sweep, median of {args.sweeps} sweeps")
    a, b = cost
    print(f"# kernel model: {a * 1e6:.2f} us per hyperplane + {b * 1e9:.2f} ns per unknown")
    print(
        f"{'ranks':>5} {'zblk':>5} {'ablk':>5} {'M':>4} {'sweep s':>9} {'grind ns':>9} "
        f"{'eff meas':>9} {'model':>6} {'busy':>6} {'eff pred':>9}"
    )
    for rec in [one, small, *two]:
        meas = f"{rec['measured']:9.3f}" if "measured" in rec else f"{'-':>9}"
        model = f"{rec['model']:6.3f}" if "model" in rec else f"{'-':>6}"
        print(
            f"{rec['ranks']:>5} {rec['z_block']:>5} {rec['angle_block']:>5} "
            f"{rec['tasks_per_octant']:>4} {rec['sweep_s']:9.3f} {rec['grind_ns']:9.2f} "
            f"{meas} {model} {rec['busy']:6.3f} {rec['predicted']:9.3f}"
        )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "n": args.n,
                "groups": GROUPS,
                "directions": 80,
                "one_rank": one,
                "one_rank_small_blocks": small,
                "kernel_model": {"s_per_plane": cost[0], "s_per_unknown": cost[1]},
                "two_ranks": two,
            },
            indent=2,
        )
    )
    print(f"# wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
