"""GPU benchmarks for the device check (tests/gpu/run_device_checks.sh); JSON out, table on stdout.

    mpiexec -n 2 python tests/gpu/bench_gpu.py p2p --json p2p.json [--min 1Mi --max 256Mi]
    mpiexec -n 1 python tests/gpu/bench_gpu.py sweep --json sweep.json [--n 32]
    mpiexec -n 2 python tests/gpu/bench_gpu.py sweep --json sweep2.json

p2p: `hpcpipe.bench.p2p` in device mode (device -> device ping-pong through the Mailbox,
CUDA-aware direct vs staged through pinned memory, next to host buffers); until `hpcpipe bench
p2p` has `--device`, this is its entry point. sweep: the `hpcpipe bench sweep` problem (Kripke's,
n^3 zones, S8, 8 groups) swept on the GPU (its default kernel, cuda, and the NumPy kernel on
CuPy arrays) and on the CPU (its default kernel, numba when installed) with the whole octant
as one task (the GPU's best case: the most work per launch); grind_ns here = sweep time x
ranks / unknowns (core time).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpcpipe.backend import TEST_ARRAY_MODULE_ENV, make_backend  # noqa: E402
from hpcpipe.bench.sizes import parse_bytes  # noqa: E402


def p2p(args: argparse.Namespace) -> None:
    from hpcpipe.bench.harness import machine
    from hpcpipe.bench.p2p import run

    ns = argparse.Namespace(
        device="cuda",
        cuda_aware=args.cuda_aware,
        min_bytes=args.min,
        max_bytes=args.max,
        factor=2,
        repeats=args.repeats,
        budget_mib=args.budget_mib,
    )
    comm = MPI.COMM_WORLD
    info = machine(comm)
    report = run(comm, ns)
    if comm.rank == 0 and args.json:
        report.write(args.json, command=" ".join(sys.argv), machine=info)


def _sweep_time(
    cfg: Any, comm: MPI.Comm, xp: Any, sweeps: int, blocking: tuple[int, int] = (0, 0)
) -> dict[str, Any]:
    from hpcpipe.sweep.mesh import build_problem
    from hpcpipe.sweep.parallel import KBASweeper
    from hpcpipe.sweep.plan import build_plan
    from hpcpipe.sweep.solver import LocalCells

    problem = build_problem(cfg)
    plan = build_plan(cfg.px, cfg.py, problem.mesh.shape, problem.quadrature.per_octant, *blocking)
    sweeper = KBASweeper(problem, plan, comm, xp=xp, device_buffers=False)
    cells = LocalCells(problem, sweeper.x_cells, sweeper.y_cells, xp=xp)
    q = cells.source(xp.zeros((cells.cells, problem.groups)))
    walls = []
    for i in range(sweeps + 1):  # the first sweep compiles kernels and warms the pool
        comm.Barrier()
        t0 = time.perf_counter()
        sweeper.sweep(q, cells.sigma_t)  # ends with a device-to-host copy: synchronised
        wall = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if i:
            walls.append(wall)
    sweeper.free()
    unknowns = problem.mesh.cells * problem.quadrature.total * problem.groups
    wall = float(np.median(walls))
    return {
        "ranks": comm.size,
        "z_block": plan.z_block,
        "angle_block": plan.angle_block,
        "sweep_ms": wall * 1e3,
        "sweeps_s": walls,
        "grind_ns": wall / unknowns * 1e9,
        "core_ns": wall * comm.size / unknowns * 1e9,
        "unknowns": unknowns,
    }


BLOCKINGS = ((0, 0), (16, 0), (8, 0), (4, 0), (0, 5), (0, 2))
"""(z_block, angle_block) the cuda kernel is timed at on one rank (0: whole): the cost model's
per-task, per-plane and per-unknown terms are fitted to them."""


def _fit_cuda(rows: list[dict[str, Any]], shape: tuple[int, int, int], groups: int) -> Any:
    """Least-squares per-task, per-plane and per-unknown costs from the 1-rank cuda rows."""
    from hpcpipe.sweep.blocking import KERNEL_COSTS, SweepCost

    bx, by, nz = shape
    design, seconds = [], []
    for r in rows:
        zb, ab = r["z_block"], r["angle_block"]
        tasks = 8 * (nz // zb) * (r["directions"] // ab)
        design.append([tasks, tasks * (bx + by + zb - 2), tasks * bx * by * zb * ab * groups])
        seconds.append(r["sweep_ms"] * 1e-3)
    (task, plane, unknown), *_ = np.linalg.lstsq(np.array(design), np.array(seconds), rcond=None)
    built_in = KERNEL_COSTS["cuda"]
    return SweepCost(
        per_unknown=max(0.0, float(unknown)),
        per_task=max(0.0, float(task)),
        per_plane=max(0.0, float(plane)),
        message=built_in.message,
        per_byte=built_in.per_byte,
        copy_per_byte=built_in.copy_per_byte,
    )


def sweep(args: argparse.Namespace) -> None:
    from hpcpipe.bench.harness import machine
    from hpcpipe.bench.table import Column, Report, provenance
    from hpcpipe.sweep.blocking import KERNEL_COSTS, predict_makespan
    from hpcpipe.sweep.kernel import resolve_kernel
    from hpcpipe.sweep.mesh import build_problem
    from hpcpipe.sweep.problems import kripke_config

    comm = MPI.COMM_WORLD
    info = machine(comm)
    device = make_backend("cuda", "float64", comm.rank, "off")
    name = os.environ.get(TEST_ARRAY_MODULE_ENV) or "cupy"
    xp = importlib.import_module(name)
    assert device.xp is xp
    try:  # the GPU's name for the report (CuPy's; a stand-in module may not have it)
        gpu = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)["name"]
        info["gpu"] = gpu.decode() if isinstance(gpu, bytes) else str(gpu)
        info["cupy"] = xp.__version__
    except (AttributeError, KeyError, RuntimeError):
        pass
    cfg = kripke_config(args.n, px=comm.size)
    directions = build_problem(cfg).quadrature.per_octant
    fits = [(z, a) for z, a in BLOCKINGS if z < args.n and args.n % max(z, 1) == 0]
    cases = [("GPU", xp, "auto", b) for b in (fits if comm.size == 1 else fits[:1])]
    cases.append(("GPU, numpy", xp, "numpy", (0, 0)))
    if not args.no_cpu:
        cases.append(("CPU", np, "auto", (0, 0)))
    report = Report(
        "sweep_gpu",
        [
            f"Kripke's problem ({args.n}^3 zones, S8: 80 directions, 8 groups, 3 materials, "
            "diamond difference with the fix-up), one sweep from phi = 0, "
            f"{comm.size} rank(s) on {info.get('gpu', 'the GPU')}; medians of {args.sweeps} "
            "sweeps after one warm-up",
            "grind = sweep wall time / unknowns of the whole problem (as Kripke prints it), "
            "core = grind x ranks; blocking 0 = whole (one task per octant); model = the KBA "
            "cost model's sweep time, its cuda costs fitted to the cuda rows",
        ],
        [
            Column("case", "case", "", 16, "<"),
            Column("ranks", "ranks", "d", 5),
            Column("z_block", "zblk", "d", 4),
            Column("angle_block", "ablk", "d", 4),
            Column("kernel", "kernel", "", 6, "<"),
            Column("sweep_ms", "sweep ms", ".3f", 9),
            Column("grind_ns", "grind ns", ".3f", 8),
            Column("core_ns", "core ns", ".3f", 8),
            Column("model_ms", "model ms", ".3f", 8),
        ],
        params={"n": args.n, "sweeps": args.sweeps, "ranks": comm.size},
        stream=comm.rank == 0,
    )
    report.start()
    for label, mod, kernel, blocking in cases:
        zb, ab = blocking
        run_cfg = dataclasses.replace(cfg, kernel=kernel)
        row = {"case": label, "kernel": resolve_kernel(kernel, mod), "directions": directions}
        row.update(_sweep_time(run_cfg, comm, mod, args.sweeps, (zb or args.n, ab or directions)))
        report.add(row)
    cuda_rows = [r for r in report.rows if r["kernel"] == "cuda"]
    shape = (args.n // comm.size, args.n, args.n)
    if len(cuda_rows) >= 3:
        fitted = _fit_cuda(cuda_rows, shape, 8)
        for r in cuda_rows:
            r["model_ms"] = 1e3 * predict_makespan(
                comm.size, 1, shape, directions, 8, r["z_block"], r["angle_block"], fitted
            )
        built = KERNEL_COSTS["cuda"]
        report.summary["fitted_cuda_cost"] = fitted.__dict__
        report.note(
            f"cuda cost model fitted to the {len(cuda_rows)} cuda rows: "
            f"{fitted.per_task * 1e6:.1f} us per task + {fitted.per_plane * 1e6:.2f} us per "
            f"hyperplane + {fitted.per_unknown * 1e12:.2f} ps per unknown (built-in: "
            f"{built.per_task * 1e6:.0f} us + {built.per_plane * 1e6:.1f} us + "
            f"{built.per_unknown * 1e12:.0f} ps)"
        )
    by_case = {r["case"]: r for r in report.rows}
    whole = report.rows[0]  # the default kernel, whole octants
    for other, key in (("GPU, numpy", "speedup_over_numpy_on_gpu"), ("CPU", "speedup_over_cpu")):
        if other in by_case:
            ratio = by_case[other]["sweep_ms"] / whole["sweep_ms"]
            report.summary[key] = ratio
            report.note(
                f"sweep time of {other} ({by_case[other]['kernel']} kernel) / GPU "
                f"({whole['kernel']} kernel), whole octants: {ratio:.3g}"
            )
    report.finish()
    if comm.rank == 0 and args.json:
        measured = provenance(ROOT)
        if measured.get("commit") is None and args.commit:  # a copy of the tree without .git
            measured = {**measured, "commit": args.commit, "dirty": None}
        report.write(args.json, command=args.command or " ".join(sys.argv),
                     machine=info, measured=measured)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("p2p")
    p.add_argument("--min", type=parse_bytes, default=parse_bytes("1Mi"))
    p.add_argument("--max", type=parse_bytes, default=parse_bytes("256Mi"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget-mib", type=int, default=512)
    p.add_argument("--cuda-aware", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--json", default=None)
    s = sub.add_parser("sweep")
    s.add_argument("--n", type=int, default=32)
    s.add_argument("--sweeps", type=int, default=3)
    s.add_argument("--no-cpu", action="store_true", help="skip the CPU comparison")
    s.add_argument("--json", default=None)
    s.add_argument("--commit", default=None, help="the commit measured, where git is absent")
    s.add_argument("--command", default=None, help="the command to record (default: argv)")
    args = parser.parse_args()
    {"p2p": p2p, "sweep": sweep}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
