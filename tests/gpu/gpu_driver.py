"""MPI driver for the real-GPU tests (CuPy, one or more CUDA devices): rank 0 prints one JSON
line per case. Direct (CUDA-aware) variants run only where the MPI library says it takes device
pointers (or HPCPIPE_GPU_CUDA_AWARE=on); otherwise they report why they were skipped.

    mpiexec -n 2 python tests/gpu/gpu_driver.py mailbox|allreduce|alltoall|sweep|d2h
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpcpipe.backend import TEST_ARRAY_MODULE_ENV, Backend, make_backend  # noqa: E402

# the fake device (tests/gpu/fake_device.py) can stand in, to check this driver on any machine
cupy = importlib.import_module(os.environ.get(TEST_ARRAY_MODULE_ENV) or "cupy")

COMM = MPI.COMM_WORLD


def local_rank() -> int:
    node = COMM.Split_type(MPI.COMM_TYPE_SHARED)
    rank = node.rank
    node.Free()
    return rank


def backends(dtype: str) -> tuple[Backend, Backend | None, str]:
    """(staged backend, direct backend or None, the CUDA-aware decision's reason)."""
    setting = os.environ.get("HPCPIPE_GPU_CUDA_AWARE", "auto")
    found = make_backend("cuda", dtype, local_rank(), setting)
    staged = Backend("cuda", cupy, found.dtype, found.device_id, False, "staged (test)")
    return staged, (found if found.cuda_aware else None), found.cuda_aware_reason


def mailbox_case() -> dict[str, Any]:
    """Rank 0 sends 4 device activations forward, rank 1 sends them back doubled, through the
    plan of a 1F1B pipeline of 2 stages: direct, staged, and staged with deferred (overlapped)
    sends; every value checked on the device; pinned buffers reused in the second step."""
    from hpcpipe.mpi.p2p import Mailbox
    from hpcpipe.schedules import build_schedule, validate
    from hpcpipe.schedules.ir import Kind
    from hpcpipe.schedules.messages import plan_messages

    staged, direct, reason = backends("float64")
    out: dict[str, Any] = {"case": "mailbox", "reason": reason}
    modes = [("staged", staged, False), ("staged-overlap", staged, True)]
    if direct is not None:
        modes.append(("direct", direct, False))
    n, m = 1 << 16, 4
    sched = validate(build_schedule("1f1b", 2, m))
    plan = plan_messages(sched, COMM.rank, lookahead=2)
    actions = sched.rank_actions(COMM.rank)
    for name, backend, overlap in modes:
        comm = COMM.Dup()
        box = Mailbox(comm, backend, plan, (n,), np.float64, overlap=overlap)
        releases = plan.releases() if box.needs_release else {}
        ok = True
        for _step in range(2):  # the second step reuses every buffer
            sent = received = posted = 0
            for pos, action in enumerate(actions):
                while posted < len(plan.receives) and plan.receives[posted].post_at <= pos:
                    box.post_recv(posted)
                    posted += 1
                box.progress()
                mb = action.microbatch
                if action.kind == Kind.SEND_F:
                    box.send(cupy.arange(n, dtype=np.float64) * (mb + 1), sent)
                    sent += 1
                elif action.kind == Kind.RECV_F:
                    got = box.wait_recv(received) * 2.0  # rank 1: doubled, sent back at SEND_B
                    received += 1
                elif action.kind == Kind.SEND_B:
                    box.send(got, sent)
                    sent += 1
                elif action.kind == Kind.RECV_B:
                    back = box.wait_recv(received)
                    received += 1
                    want = cupy.arange(n, dtype=np.float64) * (mb + 1) * 2.0
                    ok &= bool(cupy.array_equal(back, want))
                if pos in releases:
                    box.release(releases[pos])
            box.drain()
            if _step == 0:
                first_step = backend.pinned_allocations
        backend.record_event().synchronize()
        out[name] = {
            "ok": bool(COMM.allreduce(int(ok), op=MPI.MIN)),
            "pinned": backend.pinned_allocations,
            "pinned_first_step": first_step,
            "overflows": box.send_pool_overflows,
            "deferred": box.sends_deferred,
        }
        out["bound"] = plan.receive_buffers + sum(plan.send_slots.values())
        box.free()
        comm.Free()
    out["has_direct"] = direct is not None
    return out


def allreduce_case() -> dict[str, Any]:
    """BucketedAllreduce of a device FlatBuffer in small buckets: staged and direct equal the
    exact sum (integer-valued floats) and each other, bit for bit."""
    from hpcpipe.mpi.collectives import BucketedAllreduce, FlatBuffer

    staged, direct, reason = backends("float64")
    shapes = {"a": (300, 7), "b": (1000,), "c": (3, 5, 11)}
    results: dict[str, Any] = {}
    for name, backend in (("staged", staged), ("direct", direct)):
        if backend is None:
            continue
        buf = FlatBuffer.like(cupy, shapes, np.float64)
        buf.flat[...] = cupy.arange(buf.flat.size, dtype=np.float64) * (COMM.rank + 1)
        comm = COMM.Dup()
        reducer = BucketedAllreduce(comm, backend, bucket_bytes=4096)
        for key in ("x", "x"):  # twice: pinned buckets are reused
            buf.flat[...] = cupy.arange(buf.flat.size, dtype=np.float64) * (COMM.rank + 1)
            reducer.start(buf, key=key)
            reducer.wait()
        backend.synchronize()
        results[name] = cupy.asnumpy(buf.flat)
        comm.Free()
    want = np.arange(results["staged"].size, dtype=np.float64) * sum(range(1, COMM.size + 1))
    return {
        "case": "allreduce",
        "reason": reason,
        "staged_exact": bool(np.array_equal(results["staged"], want)),
        "has_direct": direct is not None,
        "direct_equal": bool(np.array_equal(results.get("direct", want), results["staged"])),
        "buckets": int(np.ceil(results["staged"].size * 8 / 4096)),
    }


def alltoall_case() -> dict[str, Any]:
    """ExpertGroup.alltoallv of device rows (staged and, where possible, direct) equals the same
    exchange of host rows, bit for bit."""
    from hpcpipe.mpi.experts import ExpertGroup

    _, direct, reason = backends("float64")
    experts, d = 4 * COMM.size, 8
    rng = np.random.default_rng(COMM.rank)
    counts = rng.integers(0, 5, size=experts)
    rows = rng.standard_normal((int(counts.sum()), d))
    out: dict[str, Any] = {"case": "alltoall", "reason": reason, "has_direct": direct is not None}
    reference = None
    for name, aware, xp in (("host", False, np), ("staged", False, cupy), ("direct", True, cupy)):
        if name == "direct" and direct is None:
            continue
        group = ExpertGroup(COMM, experts, cuda_aware=aware)
        plan = group.plan(counts)
        got = group.alltoallv(xp.asarray(rows), plan.forward)
        back = group.alltoallv(got, plan.backward)
        got_h = np.asarray(cupy.asnumpy(got) if xp is cupy else got)
        back_h = np.asarray(cupy.asnumpy(back) if xp is cupy else back)
        if reference is None:
            reference = (got_h, back_h)
        else:
            out[f"{name}_equal"] = bool(
                COMM.allreduce(
                    int(np.array_equal(got_h, reference[0]) and np.array_equal(back_h, rows)),
                    op=MPI.MIN,
                )
            )
        group.free()
    return out


def sweep_case() -> dict[str, Any]:
    """A KBA sweep of the thick (fix-up) tiny problem on 2 ranks: device (staged and direct)
    against NumPy, to round-off."""
    from hpcpipe.config import load_config
    from hpcpipe.sweep.mesh import build_problem
    from hpcpipe.sweep.parallel import KBASweeper
    from hpcpipe.sweep.plan import plan_for
    from hpcpipe.sweep.solver import LocalCells, solve

    _, direct, reason = backends("float64")
    sets = [f"sweep.px={COMM.size}", "sweep.sigma_t=[[10.0, 15.0], [20.0, 40.0]]"]
    cfg = load_config(ROOT / "inputs" / "sweep_tiny.toml", sets).sweep
    problem = build_problem(cfg)
    plan = plan_for(cfg, problem)
    phis = {}
    modes = [("host", np, False), ("staged", cupy, False)]
    if direct is not None:
        modes.append(("direct", cupy, True))
    for name, xp, device_buffers in modes:
        sweeper = KBASweeper(problem, plan, COMM, xp=xp, device_buffers=device_buffers)
        cells = LocalCells(problem, sweeper.x_cells, sweeper.y_cells, xp=xp)
        result = solve(problem, cells, sweeper, tolerance=0.0, max_iterations=5)
        phis[name] = np.asarray(result.phi)
        sweeper.free()
    scale = max(float(np.abs(phis["host"]).max()), 1e-300)
    rel = {k: float(np.abs(v - phis["host"]).max()) / scale for k, v in phis.items() if k != "host"}
    worst = {k: COMM.allreduce(v, op=MPI.MAX) for k, v in rel.items()}
    return {"case": "sweep", "reason": reason, "has_direct": direct is not None, "max_rel": worst}


def d2h_case() -> dict[str, Any]:
    """Host copies per training step with real CuPy: the backend's counter and, on Python
    3.12+, every conversion our code calls (sys.monitoring), against the stated budget."""
    from d2h_budget import expected_d2h
    from d2h_monitor import D2HMonitor, available

    from hpcpipe.bench.training import world_context
    from hpcpipe.config import load_config
    from hpcpipe.train.workload import Trainer

    out: dict[str, Any] = {"case": "d2h", "monitor": available() or "sys.monitoring"}
    for aware in ("off", os.environ.get("HPCPIPE_GPU_CUDA_AWARE", "auto")):
        sets = [
            'device.kind="cuda"',
            f'device.cuda_aware="{aware}"',
            "topology.dp=1",
            "train.verify=false",
            "run.steps=3",
            f"run.output='{ROOT / 'runs' / 'gpu-d2h'}'",
        ]
        config = load_config(ROOT / "inputs" / "train_tiny.toml", sets)
        ctx = world_context(COMM, config)
        if aware != "off" and not ctx.backend.cuda_aware:
            out["direct_reason"] = ctx.backend.cuda_aware_reason
            ctx.comms.free()
            continue
        trainer = Trainer(ctx)
        steps = []
        for step in range(3):
            ctx.backend.transfers.reset()
            if available() is None:
                with D2HMonitor(cupy.ndarray, cupy.asnumpy, library=cupy) as mon:
                    trainer.step(step)
                seen, sites = mon.count, dict(mon.sites)
            else:
                trainer.step(step)
                seen, sites = -1, {}
            steps.append({"backend": ctx.backend.transfers.d2h, "seen": seen, "sites": sites})
        expected = sum(expected_d2h(trainer, ctx.backend.staged).values())
        everyone = COMM.gather({"rank": COMM.rank, "steps": steps, "expected": expected})
        out["staged" if ctx.backend.staged else "direct"] = everyone
        out["loss"] = trainer.history.get("loss", [])
        ctx.comms.free()
    return out


CASES = {
    "mailbox": mailbox_case,
    "allreduce": allreduce_case,
    "alltoall": alltoall_case,
    "sweep": sweep_case,
    "d2h": d2h_case,
}


def main() -> int:
    record = CASES[sys.argv[1]]()
    if COMM.rank == 0:
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
