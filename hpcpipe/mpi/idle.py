"""Waiting without spinning, for ranks that wait while another rank works.

MPI's blocking calls poll at full speed. Where ranks share cores (an oversubscribed test run, a
laptop, a node given more ranks than cores) the waiting ranks take the CPU from the one rank
doing the work, such as rank 0 writing files or retraining the single-process reference, and
make it several times slower. Used only outside timed regions: a sleeping rank answers up to
`poll_s` late.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # importing mpi4py.MPI starts MPI: this module is importable without it
    from mpi4py import MPI

__all__ = ["idle_barrier", "idle_bcast"]


def idle_barrier(comm: MPI.Comm, poll_s: float = 1e-3) -> None:
    """A barrier that sleeps while it waits."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(poll_s)


def idle_bcast(obj: Any, comm: MPI.Comm, root: int = 0) -> Any:
    """`comm.bcast` for a value that `root` spends a while computing: the others sleep until
    it is ready, then the broadcast itself is short."""
    idle_barrier(comm)
    return comm.bcast(obj, root=root)
