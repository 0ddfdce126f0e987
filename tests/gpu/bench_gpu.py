"""GPU benchmarks for the device check (tests/gpu/run_device_checks.sh); JSON out, table on stdout.

    mpiexec -n 2 python tests/gpu/bench_gpu.py p2p --json p2p.json [--min 1Mi --max 256Mi]
    mpiexec -n 1 python tests/gpu/bench_gpu.py sweep --json sweep.json [--n 32]
    mpiexec -n 2 python tests/gpu/bench_gpu.py sweep --json sweep2.json

p2p: `hpcpipe.bench.p2p` in device mode (device -> device ping-pong through the Mailbox,
CUDA-aware direct vs staged through pinned memory, next to host buffers); until `hpcpipe bench
p2p` has `--device`, this is its entry point. sweep: the `hpcpipe bench sweep` problem (Kripke's,
n^3 zones, S8, 8 groups) swept on the GPU (the NumPy kernel on CuPy arrays) and on the CPU (the
default kernel there, numba when installed) with the whole octant as one task (the GPU's best
case: the longest vectors); grind_ns here = sweep time x ranks / unknowns (core time).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
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


def _sweep_time(cfg: Any, comm: MPI.Comm, xp: Any, sweeps: int) -> dict[str, Any]:
    from hpcpipe.sweep.mesh import build_problem
    from hpcpipe.sweep.parallel import KBASweeper
    from hpcpipe.sweep.plan import build_plan
    from hpcpipe.sweep.solver import LocalCells

    problem = build_problem(cfg)
    plan = build_plan(cfg.px, cfg.py, problem.mesh.shape, problem.quadrature.per_octant, 0, 0)
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
        "sweep_s": wall,
        "sweeps_s": walls,
        "grind_ns": wall * comm.size / unknowns * 1e9,
        "unknowns": unknowns,
    }


def sweep(args: argparse.Namespace) -> None:
    from hpcpipe.sweep.problems import kripke_config

    comm = MPI.COMM_WORLD
    device = make_backend("cuda", "float64", comm.rank, "off")
    name = os.environ.get(TEST_ARRAY_MODULE_ENV) or "cupy"
    xp = importlib.import_module(name)
    assert device.xp is xp
    cfg = kripke_config(args.n, px=comm.size)
    rows = []
    for label, mod in (("gpu", xp), ("cpu", np)):
        if label == "cpu" and args.no_cpu:
            continue
        row = _sweep_time(cfg, comm, mod, args.sweeps)
        row["device"] = label
        rows.append(row)
        if comm.rank == 0:
            print(
                f"sweep n={args.n} ranks={comm.size} device={label} "
                f"sweep_s={row['sweep_s']:.4f} grind_ns={row['grind_ns']:.3f}",
                flush=True,
            )
    if comm.rank == 0 and args.json:
        out = {"benchmark": "sweep-gpu", "n": args.n, "groups": 8, "order": 8, "rows": rows}
        if len(rows) == 2:
            out["gpu_speedup"] = rows[1]["sweep_s"] / rows[0]["sweep_s"]
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")


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
    args = parser.parse_args()
    {"p2p": p2p, "sweep": sweep}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
