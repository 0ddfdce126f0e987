"""The `topology` workload: print where every rank sits and prove each group communicator works.

It is the first thing to run on a new allocation: it shows the node / pp / dp / ep layout the
deck produces and checks, on every group, that membership matches the pure RankMap and that a
collective and a ring exchange complete.
"""

from __future__ import annotations

import time

import numpy as np

from hpcpipe.faults import maybe_fail
from hpcpipe.mpi.collectives import allreduce, allreduce_value
from hpcpipe.runtime import RunContext
from hpcpipe.topology import DIMS


def _comm_and_members(ctx: RunContext, dim: str):
    """The communicator of `dim` and the members the pure RankMap says it must have."""
    if dim == "node":
        node = ctx.rankmap.node_of(ctx.rank)
        return ctx.comms.node, tuple(r for r in range(ctx.size) if ctx.rankmap.node_of(r) == node)
    if dim == "edp":
        return ctx.comms.expert_dp, ctx.rankmap.expert_data_group(ctx.rank)
    return ctx.comms.group(dim), ctx.rankmap.group(ctx.rank, dim)


def _check_group(ctx: RunContext, dim: str) -> tuple[float, str]:
    """Membership, Allreduce and a ring Sendrecv on one dim; returns (seconds, problem or '')."""
    comm, expected = _comm_and_members(ctx, dim)
    t0 = time.perf_counter()
    members = tuple(comm.allgather(ctx.rank))
    total = allreduce(comm, np.array([ctx.rank], dtype=np.int64))
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    got = np.zeros(1, dtype=np.int64)
    comm.Sendrecv(np.array([ctx.rank], dtype=np.int64), dest=right, recvbuf=got, source=left)
    elapsed = time.perf_counter() - t0
    if members != expected:
        return elapsed, f"{dim} group is {members}, the RankMap says {expected}"
    if int(total[0]) != sum(expected):
        return elapsed, f"{dim} Allreduce gave {int(total[0])}, expected {sum(expected)}"
    if int(got[0]) != members[left]:
        return (
            elapsed,
            f"{dim} ring Sendrecv got {int(got[0])} from the left, expected {members[left]}",
        )
    return elapsed, ""


def run(ctx: RunContext) -> None:
    info = ctx.comms.node_info
    coords = ctx.rankmap.coords(ctx.rank)
    row = (
        ctx.rank,
        info.hostname,
        info.node,
        info.local_rank,
        coords["pp"],
        coords["dp"],
        coords["ep"],
    )
    rows = ctx.comms.world.gather(row, root=0)
    if ctx.rank == 0:
        ctx.log(f"{'rank':>5} {'host':<16} {'node':>4} {'local':>5} {'pp':>3} {'dp':>3} {'ep':>3}")
        for r in rows:
            ctx.log(f"{r[0]:>5} {r[1][:16]:<16} {r[2]:>4} {r[3]:>5} {r[4]:>3} {r[5]:>3} {r[6]:>3}")
    maybe_fail("topology", ctx.rank)
    problems = []
    for dim in (*DIMS, "edp", "node"):
        elapsed, problem = _check_group(ctx, dim)
        slowest = allreduce_value(ctx.comms.world, elapsed, "max")
        failed = ctx.comms.world.allgather(problem)
        bad = [f"rank {r}: {p}" for r, p in enumerate(failed) if p]
        problems += bad
        size = _comm_and_members(ctx, dim)[0].size
        ctx.log(
            f"check {dim:<4} size={size:<4} allgather+allreduce+ring "
            f"{'OK' if not bad else 'FAILED'} ({slowest * 1e6:.0f} us)"
        )
    if problems:
        raise RuntimeError("group communicator check failed:\n  " + "\n  ".join(problems))
    ctx.log(
        f"topology OK: {ctx.size} ranks, {info.nodes} node(s), "
        f"pp={ctx.rankmap.pp} dp={ctx.rankmap.dp} ep={ctx.rankmap.ep}"
    )
