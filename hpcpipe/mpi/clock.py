"""Trace support that talks MPI: each rank's clock offset against rank 0, and the world rank of
every rank of a group (so events name their peers by world rank)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

__all__ = ["estimate_offsets", "world_ranks"]


def estimate_offsets(comm: Any, rounds: int = 8) -> tuple[int, int, int]:
    """Collective: (local time, offset, round trip) of this rank against rank 0, in ns, by
    ping-pong with rank 0.

    Rank 0 exchanges `rounds` messages with each rank in turn and keeps the round trip with the
    smallest latency, assuming it was symmetric: offset = remote time - midpoint of the trip.
    The error is at most half that round trip (a few microseconds on one node). The work is on
    a duplicate of `comm`, so no message of the application can match these.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    now = time.perf_counter_ns
    dup = comm.Dup()
    try:
        rank, size = dup.Get_rank(), dup.Get_size()
        buf = np.zeros(3, dtype=np.int64)
        dup.Barrier()
        if rank == 0:
            for r in range(1, size):
                best = None
                for _ in range(rounds):
                    t_a = now()
                    dup.Send(buf[:1], dest=r, tag=1)
                    dup.Recv(buf[:1], source=r, tag=2)
                    t_b = now()
                    rtt = t_b - t_a
                    if best is None or rtt < best[2]:
                        best = (int(buf[0]), int(buf[0]) - (t_a + t_b) // 2, rtt)
                buf[:] = best
                dup.Send(buf, dest=r, tag=3)
            sample = (now(), 0, 0)
        else:
            for _ in range(rounds):
                dup.Recv(buf[:1], source=0, tag=1)
                buf[0] = now()
                dup.Send(buf[:1], dest=0, tag=2)
            dup.Recv(buf, source=0, tag=3)
            sample = (int(buf[0]), int(buf[1]), int(buf[2]))
        dup.Barrier()
    finally:
        dup.Free()
    return sample


def world_ranks(comm: Any, world: Any = None) -> np.ndarray:
    """World rank of each rank of `comm`: record `peer` as a world rank, translated once."""
    if world is None:
        from mpi4py import MPI

        world = MPI.COMM_WORLD
    ranks = np.arange(comm.Get_size(), dtype=np.int64)
    # unbound call: an instance method in mpi4py 4, a classmethod in mpi4py 3
    out = type(comm.Get_group()).Translate_ranks(
        comm.Get_group(), ranks.tolist(), world.Get_group()
    )
    return np.asarray(out, dtype=np.int64)
