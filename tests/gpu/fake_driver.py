"""MPI driver: the GPU code paths on the fake device, counting host copies per step and checking
that every buffer reaches MPI only when it is safe. Rank 0 prints one JSON line per case.

    HPCPIPE_TEST_ARRAY_MODULE=fake_device mpiexec -n 4 python tests/gpu/fake_driver.py train
    ... mpiexec -n 4 python tests/gpu/fake_driver.py moe
    ... mpiexec -n 2 python tests/gpu/fake_driver.py sweep

Each training case builds the `Trainer` exactly as `hpcpipe run` does (device.kind = "cuda"),
wraps its pipeline, data-parallel and expert communicators in `fake_mpi.RecordingComm`, and runs
a few steps, resetting the counters before each: per rank and step it reports the fake device's
device-to-host copies (every one, hidden or not), the backend's counted ones, the bound the
runtime promises (see `expected_d2h`), pinned allocations and MPI-ordering violations.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
os.environ.setdefault("HPCPIPE_TEST_ARRAY_MODULE", "fake_device")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import fake_device  # noqa: E402
import fake_mpi  # noqa: E402
import numpy as np  # noqa: E402
from d2h_budget import expected_d2h  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpcpipe.bench.training import world_context  # noqa: E402
from hpcpipe.config import load_config  # noqa: E402

STEPS = 3
PP4 = ["topology.pp=4", "topology.dp=1"]
PAIRS = ["pipeline.schedule='dualpipe-v'", "pipeline.overlap_pairs=true"]
CASES = {  # name -> (deck, cuda_aware, events that answer "not done" first, extra overrides)
    "train": [
        ("direct", "train_tiny", "on", 0, []),
        ("staged", "train_tiny", "off", 0, []),
        ("staged-overlap", "train_tiny", "off", 2, []),
        ("staged-zbv", "train_tiny", "off", 1, ["pipeline.schedule='zb-v'", *PP4]),
    ],
    "moe": [
        ("moe-direct", "moe_tiny", "on", 0, []),
        ("moe-staged", "moe_tiny", "off", 1, []),
        # overlapped F&B pairs with an MoE block in every stage: two exchanges in flight at
        # once, each through its own staging buffers
        ("moe-direct-pairs", "moe_tiny", "on", 0, [*PAIRS, "moe.every=1"]),
        ("moe-staged-pairs", "moe_tiny", "off", 1, [*PAIRS, "moe.every=1"]),
    ],
}


def train_case(name: str, deck: str, aware: str, delay: int, extra: list[str]) -> dict:
    comm = MPI.COMM_WORLD
    from hpcpipe.train.workload import Trainer

    sets = [
        'device.kind="cuda"',
        f'device.cuda_aware="{aware}"',
        f"run.output='{Path(tempfile.gettempdir()) / 'hpcpipe-fake-device'}'",
        "train.verify=false",
        f"run.steps={STEPS}",
        *extra,
    ]
    config = load_config(ROOT / "inputs" / f"{deck}.toml", sets)
    ctx = world_context(comm, config)
    trainer = Trainer(ctx)
    runner = trainer.runner
    runner.mailbox.comm = fake_mpi.RecordingComm(runner.mailbox.comm)
    runner.reducer.comm = fake_mpi.RecordingComm(runner.reducer.comm)
    runner.expert_reducer.comm = fake_mpi.RecordingComm(runner.expert_reducer.comm)
    group = trainer.group
    if group is not None:
        group.comm = fake_mpi.RecordingComm(group.comm)
    backend = ctx.backend
    fake_device.Event.delay_queries = delay
    fake_mpi.VIOLATIONS.clear()
    steps = []
    for step in range(STEPS):
        fake_device.reset()
        backend.transfers.reset()
        trainer.step(step)
        log = fake_device.STATS.log
        steps.append(
            {
                "fake_d2h": fake_device.STATS.d2h,
                "backend_d2h": backend.transfers.d2h,
                "sites": sorted(set(fake_device.STATS.d2h_sites)),
                "pinned": backend.pinned_allocations,
                "mpi_device": sum(1 for e in log if e[0] == "mpi" and "device" in e[2]),
                # host buffers other than the MoE per-expert counts (host integers by design)
                "mpi_host": sum(
                    1 for e in log if e[0] == "mpi" and e[2] == "host" and e[1] != "Alltoall"
                ),
                "syncs": sum(1 for e in log if e[0] in ("sync", "event_sync")),
                "stream_syncs": sum(1 for e in log if e[0] == "sync"),
                "host_waits": runner.mailbox.host_waits,
                "receives": len(runner.messages.receives),
                "deferred": runner.mailbox.sends_deferred,
            }
        )
    fake_device.Event.delay_queries = 0
    expected = expected_d2h(trainer, backend.staged)
    mine = {
        "rank": comm.rank,
        "steps": steps,
        "expected": expected,
        "expected_total": sum(expected.values()),
        "violations": list(fake_mpi.VIOLATIONS),
        "loss": trainer.history.get("loss", []),
        "overlap": runner.mailbox.overlap,
        "staged": backend.staged,
        "a2a_slots": sorted(k for k in backend._pinned if k.startswith("a2a.")),
        "exchanges_in_flight": sorted(group._slots_busy) if group is not None else [],
    }
    everyone = comm.gather(mine, root=0)
    if group is not None:
        group.free()
    ctx.comms.free()
    return {"case": name, "ranks": everyone}


def sweep_case(aware: str) -> dict:
    """One KBA sweep per iteration on 2 ranks: host copies per iteration, MPI ordering, and the
    flux against the same sweep on NumPy."""
    from hpcpipe.backend import make_backend
    from hpcpipe.sweep.mesh import build_problem
    from hpcpipe.sweep.parallel import KBASweeper
    from hpcpipe.sweep.plan import plan_for
    from hpcpipe.sweep.solver import LocalCells, solve

    comm = MPI.COMM_WORLD
    sets = [
        f"sweep.px={comm.size}",
        "sweep.sigma_t=[[10.0, 15.0], [20.0, 40.0]]",  # thick: negative fluxes, fix-ups
    ]
    cfg = load_config(ROOT / "inputs" / "sweep_tiny.toml", sets).sweep
    problem = build_problem(cfg)
    plan = plan_for(cfg, problem)
    backend = make_backend("cuda", "float64", 0, aware)
    results = {}
    for label, xp in (("device", fake_device), ("host", np)):
        sweeper = KBASweeper(
            problem,
            plan,
            fake_mpi.RecordingComm(comm) if xp is fake_device else comm,
            xp=xp,
            device_buffers=backend.cuda_aware,
        )
        cells = LocalCells(problem, sweeper.x_cells, sweeper.y_cells, xp=xp)
        q = cells.source(xp.zeros((cells.cells, problem.groups)))
        fake_mpi.VIOLATIONS.clear()
        fake_device.reset()
        backend.transfers.reset()
        _, outflow, inflow = sweeper.sweep(q, cells.sigma_t)
        log = list(fake_device.STATS.log)
        one_sweep = {
            "sweep_d2h": fake_device.STATS.d2h,
            "sweep_backend_d2h": backend.transfers.d2h,
            "face_sends": sum(1 for e in log if e[:2] == ("mpi", "Isend")),
        }
        fake_device.reset()
        result = solve(problem, cells, sweeper, tolerance=0.0, max_iterations=3)
        results[label] = {
            "phi": np.asarray(result.phi),
            "flows": np.array([outflow, inflow]),
            **one_sweep,
            "solve_d2h_per_iteration": fake_device.STATS.d2h / 3,
            "violations": list(fake_mpi.VIOLATIONS),
        }
        sweeper.free()
    dev, host = results["device"], results["host"]
    scale = max(float(np.max(np.abs(host["phi"]))), 1e-300)
    mine = {
        "rank": comm.rank,
        "staged": backend.staged,
        "max_rel_phi": float(np.max(np.abs(dev["phi"] - host["phi"]))) / scale,
        "flows_equal": bool(np.allclose(dev["flows"], host["flows"], rtol=1e-13, atol=0)),
        **{k: v for k, v in dev.items() if k not in ("phi", "flows")},
    }
    name = f"sweep-{'direct' if backend.cuda_aware else 'staged'}"
    return {"case": name, "ranks": comm.gather(mine, root=0)}


def main() -> int:
    what = sys.argv[1]
    comm = MPI.COMM_WORLD
    if what == "sweep":
        records = [sweep_case("on"), sweep_case("off")]
    else:
        records = [train_case(*case) for case in CASES[what]]
    if comm.rank == 0:
        for record in records:
            print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
