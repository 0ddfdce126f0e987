"""Run under mpiexec by test_collectives_mpi.py: the bucketed allreduce, persistent and not.

    mpiexec -n 3 python tests/mpi/collectives_driver.py

Each rank reduces integer-valued float32 gradients (every order of summation is exact) over
three steps with new data each step, on two buffers (as two stages would), with persistent
collectives where the MPI library has them and with the nonblocking fallback; in the second
step the reductions must complete through `progress` alone (as the interpreter calls it between
actions); in the third one a buffer is started in parts and finished by `wait`. Each step's
reductions are timed: one row per started buffer, started before it was
seen complete, rows of the step only. Rank 0 prints one JSON line with the checks.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mpi4py import MPI

from hpcpipe.backend import make_backend
from hpcpipe.mpi.collectives import BucketedAllreduce, FlatBuffer


def contribution(rank: int, step: int, n: int) -> np.ndarray:
    return np.random.default_rng(1000 * step + rank).integers(-64, 64, n).astype(np.float32)


def run(comm: MPI.Comm, persistent: bool | None) -> dict:
    backend = make_backend("cpu", "float32", 0)
    reducer = BucketedAllreduce(
        comm, backend, bucket_bytes=4096, persistent=persistent, clock=time.perf_counter_ns
    )
    shapes = {"a": {"w": (2497,), "b": (3,)}, "b": {"w": (1500,)}}  # 3 and 2 buckets of 4 KiB
    buffers = {k: FlatBuffer.like(np, s, np.float32) for k, s in shapes.items()}
    exact, seen, progressed, timed = True, [], True, True
    for step in range(3):
        t_step = time.perf_counter_ns()
        for k, buf in buffers.items():
            buf.flat[...] = contribution(comm.rank, step + 10 * ord(k), buf.flat.size)
            if step == 2 and k == "a":  # in parts, as a stage's last W starts it; `wait`
                reducer.start(buf, key=k, upto=500)  # no bucket final yet: nothing starts
                t_first = time.perf_counter_ns()
                for upto in (1100, 2100):  # must start the bucket left out
                    reducer.start(buf, key=k, upto=upto)
            else:
                reducer.start(buf, key=k)
        if step == 1:  # completed by progress alone, as between a rank's actions
            deadline = time.monotonic() + 30
            while reducer.busy and time.monotonic() < deadline:
                reducer.progress()
            progressed &= not reducer.busy
        reducer.wait()
        t_end = time.perf_counter_ns()
        rows = reducer.reductions
        timed &= [(r.key, r.nbytes) for r in rows] == [
            (k, b.flat.nbytes) for k, b in buffers.items()
        ]
        timed &= all(t_step <= r.start <= r.done <= t_end for r in rows)
        if step == 2 and comm.size > 1:  # a row starts with its first bucket, not its first call
            timed &= rows[0].start >= t_first
        for k, buf in buffers.items():
            want = sum(contribution(r, step + 10 * ord(k), buf.flat.size) for r in range(comm.size))
            exact &= bool(np.array_equal(buf.flat, want))
        seen.append([id(r) for _, reqs in reducer._requests.values() for r in reqs])
    record = {
        "path": reducer.path,
        "exact": comm.allreduce(int(exact), op=MPI.MIN) == 1,
        "requests": len(seen[-1]),
        "reused": all(s == seen[0] for s in seen),
        "progressed": comm.allreduce(int(progressed), op=MPI.MIN) == 1,
        "timed": comm.allreduce(int(timed), op=MPI.MIN) == 1,
    }
    reducer.free()
    return record


def main() -> int:
    comm = MPI.COMM_WORLD
    records = {"auto": run(comm, None), "fallback": run(comm, False)}
    records["mpi4"] = hasattr(MPI.Intracomm, "Allreduce_init") and MPI.Get_version() >= (4, 0)
    if comm.rank == 0:
        print(json.dumps(records), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
