"""Run under mpiexec by test_p2p_mpi.py: the pipeline transport on its own, over real MPI.

    mpiexec -n 4 python tests/mpi/p2p_driver.py reuse
    mpiexec -n 2 python tests/mpi/p2p_driver.py wrong-size 7

`reuse`: a 1F1B plan on 4 ranks (8 microbatches, 3 steps): every message is checked against
the value its sender wrote (rank, stage, microbatch and step in it), and the persistent
requests are the same objects in every step, fewer than the messages. `wrong-size N`: rank 0
sends N float64 instead of 20 (smaller, or larger: MPI truncates); rank 1 must fail naming the
stage, microbatch and sender.
Rank 0 prints one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mpi4py import MPI

from hpcpipe.backend import make_backend
from hpcpipe.mpi.p2p import Mailbox
from hpcpipe.schedules import build_schedule, validate
from hpcpipe.schedules.ir import Kind
from hpcpipe.schedules.messages import plan_messages

SHAPE = (4, 5)


def payload(stage: int, mb: int, direction: int, step: int) -> np.ndarray:
    return np.full(SHAPE, 1000.0 * step + 10 * stage + mb + 0.5 * direction)


def reuse(comm: MPI.Comm) -> dict:
    sched = validate(build_schedule("1f1b", comm.size, 8))
    plan = plan_messages(sched, comm.rank, lookahead=3)
    box = Mailbox(comm.Dup(), make_backend("cpu", "float64", 0), plan, SHAPE, np.float64)
    actions = sched.rank_actions(comm.rank)
    requests = [id(s.request) for slots in box._slots.values() for s in slots]
    ok, received = True, 0
    for step in range(3):
        n_sent = n_recv = next_post = 0
        for pos, action in enumerate(actions):
            kind = action.kind
            while next_post < len(plan.receives) and plan.receives[next_post].post_at <= pos:
                box.post_recv(next_post)
                next_post += 1
            box.progress()
            if kind in (Kind.SEND_F, Kind.SEND_B):
                d = plan.sends[n_sent]
                box.send(payload(d.stage, d.microbatch, d.direction, step), n_sent)
                n_sent += 1
            elif kind in (Kind.RECV_F, Kind.RECV_B):
                r = plan.receives[n_recv]
                got = box.wait_recv(n_recv)
                ok &= bool(np.array_equal(got, payload(r.stage, r.microbatch, r.direction, step)))
                n_recv += 1
                received += 1
        box.drain()
    same = requests == [id(s.request) for slots in box._slots.values() for s in slots]
    box.free()
    mine = {
        "ok": ok,
        "same_requests": same,
        "buffers": plan.receive_buffers,
        "messages_per_step": len(plan.receives),
    }
    return {"ranks": comm.gather(mine, root=0)}


def wrong_size(comm: MPI.Comm, n: int) -> dict:
    from hpcpipe.schedules.messages import ping_pong

    plan = plan_messages(validate(ping_pong(2)), comm.rank, lookahead=1)
    box = Mailbox(comm.Dup(), make_backend("cpu", "float64", 0), plan, SHAPE, np.float64)
    if comm.rank == 0:
        box.send(np.zeros(n), 0)
        box.drain()
        return {}
    box.post_recv(0)
    try:
        box.wait_recv(0)
    except RuntimeError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return {}
    print(json.dumps({"error": None}), flush=True)
    return {}


def main() -> int:
    comm = MPI.COMM_WORLD
    what = sys.argv[1]
    out = reuse(comm) if what == "reuse" else wrong_size(comm, int(sys.argv[2]))
    if comm.rank == 0 and out:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
