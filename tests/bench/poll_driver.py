"""Rank 1 of a 2-rank sleeping pipeline mostly waits for rank 0, whose forwards sleep 50 ms:
with the polling mailbox its wait sleeps, so its CPU time stays far below the wall time.

    mpiexec -n 2 python tests/bench/poll_driver.py poll|mpi
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    from mpi4py import MPI

    from hpcpipe.bench.synthetic import sleeping_runner
    from hpcpipe.schedules import CostModel, build_schedule, validate

    comm = MPI.COMM_WORLD
    lowered = validate(build_schedule("gpipe", 2, 4))
    costs = CostModel(t_f=[0.05, 0.001], t_b=[0.001, 0.001], t_w=[0.001, 0.001])
    poll_s = 20e-6 if sys.argv[1] == "poll" else 0.0
    runner, pp = sleeping_runner(comm, lowered, costs, 1024, poll_s)
    comm.Barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    runner.step(0, [None] * 4, [None] * 4, 0.25)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    runner.free()
    pp.Free()
    if comm.rank == 1:
        print(json.dumps({"wall": wall, "cpu": cpu, "mailbox": type(runner.mailbox).__name__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
