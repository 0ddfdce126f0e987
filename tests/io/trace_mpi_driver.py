"""Run under mpiexec by test_trace_mpi.py: record a small forward chain on real ranks, align
clocks, and write it twice (gathered to rank 0, then through per-rank shards), plus a write
into an impossible place that must fail on every rank. Rank 0 prints one JSON line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hpcpipe.io.trace import EventKind, Recorder, write_trace
from hpcpipe.mpi.clock import world_ranks

STEPS, MICROBATCHES = 3, 4


def main(out: Path) -> int:
    world = MPI.COMM_WORLD
    comm = world.Split(0, world.size - 1 - world.rank)  # reversed: peers need translating
    to_world = world_ranks(comm)
    rank, size = comm.rank, comm.size
    rec = Recorder(world.rank, capacity=4)  # small on purpose: it must grow
    rec.align_clock(world)
    buf = np.zeros(256)
    for step in range(STEPS):
        rec.begin_step(step)
        t_step = rec.now()
        for mb in range(MICROBATCHES):
            if rank > 0:
                t0 = rec.now()
                comm.Recv(buf, source=rank - 1, tag=mb)
                if rec.enabled:
                    rec.record(
                        EventKind.RECV_F,
                        rank,
                        mb,
                        t0,
                        rec.now(),
                        buf.nbytes,
                        int(to_world[rank - 1]),
                    )
            t0 = rec.now()
            buf += 1.0
            if rec.enabled:
                rec.record(EventKind.F, rank, mb, t0, rec.now())
            if rank < size - 1:
                t0 = rec.now()
                comm.Send(buf, dest=rank + 1, tag=mb)
                if rec.enabled:
                    rec.record(
                        EventKind.SEND_F,
                        rank,
                        mb,
                        t0,
                        rec.now(),
                        buf.nbytes,
                        int(to_world[rank + 1]),
                    )
        rec.record(EventKind.STEP, -1, -1, t_step, rec.now(), nbytes=1 << 20)
    meta = {"workload": "trace-test", "topology": {"coords": {"pp": list(range(size))}}}
    write_trace(world, out / "gather.h5", rec, meta)
    write_trace(world, out / "shard.h5", rec, meta, gather_limit=0)
    blocker = out / "blocker"
    if world.rank == 0:
        blocker.write_text("a file, so nothing can be created under it")
    world.Barrier()
    try:
        write_trace(world, blocker / "x.h5", rec, meta)
        failed = False
    except OSError as exc:
        failed = "write_trace" in str(exc)
    every = world.allgather(failed)
    if world.rank == 0:
        print(json.dumps({"failed_everywhere": all(every), "events": len(rec), "grown": rec.grown}))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
