"""The sweep's messages: face fluxes between KBA neighbours, and the solver's reductions.

A `FaceChannel` works on a private duplicate of the communicator, so no other traffic can match
its messages. Receives are posted ahead into fresh buffers; sends are nonblocking and completed
in batches; the reductions and the final gather go through the same communicator. On a GPU the
faces stay on the device when MPI is CUDA-aware (the producing stream is synchronised first:
CuPy does not do it for MPI) and go through host copies otherwise. Tags are the plan's: the
channel checks once that they fit the MPI library's `MPI_TAG_UB`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from hpcpipe.backend import active_backend
from hpcpipe.mpi.clock import world_ranks

__all__ = ["FaceChannel", "PostedFace"]

SEND_BATCH = 8
"""Completed sends are reaped once more than this many are in flight."""


@dataclass
class PostedFace:
    """A receive posted for one face: its request and the buffer MPI writes into."""

    request: Any
    buffer: Any


class FaceChannel:
    """Face messages and reductions of one sweep rank (see the module's docstring)."""

    def __init__(self, comm: Any, max_tag: int, xp: Any = np, device_buffers: bool = False):
        tag_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)  # guaranteed on COMM_WORLD only
        if tag_ub is not None and max_tag > tag_ub:
            raise ValueError(
                f"the plan needs message tags up to {max_tag} but this MPI allows {tag_ub}: "
                "use larger z_block or angle_block"
            )
        self.comm = comm.Dup()
        self.rank, self.size = self.comm.rank, self.comm.size
        self.xp = xp
        self.staged = xp is not np and not device_buffers
        self._device = xp is not np and not self.staged
        self._sends: list[tuple[Any, Any]] = []

    def world_ranks(self) -> list[int]:
        """World rank of each rank of the channel (traces name peers by world rank)."""
        return world_ranks(self.comm).tolist()

    def post(self, peer: int, tag: int, shape: tuple[int, ...], *, sync: bool) -> PostedFace:
        """Post the receive of one face from `peer`. `sync`: synchronise the device first (MPI
        writes outside stream order, so no queued kernel may still use the memory `empty`
        hands out); once per task is enough."""
        buf = np.empty(shape) if self.staged or self.xp is np else self.xp.empty(shape)
        if sync and self._device:
            self.xp.cuda.get_current_stream().synchronize()
        return PostedFace(self.comm.Irecv(buf, source=peer, tag=tag), buf)

    def wait(self, posted: PostedFace) -> tuple[Any, int]:
        """The face a posted receive delivers (on the device when the sweep runs there) and
        its size in bytes."""
        posted.request.Wait()
        buf = posted.buffer
        return (self.xp.asarray(buf) if self.staged else buf), int(buf.nbytes)

    def send(self, face: Any, peer: int, tag: int) -> int:
        """Start sending a face downwind; returns its size in bytes."""
        if self.staged:  # a blocking device-to-host copy (the stream is waited for)
            backend = active_backend()
            buf = backend.to_host(face) if backend is not None else self.xp.asnumpy(face)
        else:
            buf = face
            if self._device:  # CuPy does not synchronise for MPI: the kernels must be done
                self.xp.cuda.get_current_stream().synchronize()
        self._sends.append((self.comm.Isend(buf, dest=peer, tag=tag), buf))
        if len(self._sends) > SEND_BATCH:
            done = set(MPI.Request.Testsome([s[0] for s in self._sends]) or ())
            self._sends = [s for i, s in enumerate(self._sends) if i not in done]
        return int(buf.nbytes)

    def progress(self) -> None:
        """Let MPI move the messages in flight (and reap the sends that finished): called
        between slabs of a block, since a large message moves only while both ranks are
        inside MPI."""
        if self._sends:
            done = MPI.Request.Testsome([s[0] for s in self._sends]) or ()
            if done:
                done = set(done)
                self._sends = [s for i, s in enumerate(self._sends) if i not in done]

    def drain(self) -> None:
        """Complete every send (the end of a sweep)."""
        MPI.Request.Waitall([s[0] for s in self._sends])
        self._sends = []

    def allreduce(self, values: np.ndarray, op: str) -> np.ndarray:
        """Element-wise "sum" or "max" of `values` over the sweep's ranks."""
        send = np.ascontiguousarray(values, dtype=np.float64)
        out = np.empty_like(send)
        self.comm.Allreduce(send, out, op={"sum": MPI.SUM, "max": MPI.MAX}[op])
        return out

    def free(self) -> None:
        """Release the private communicator (after the last sweep)."""
        self.drain()
        self.comm.Free()

    def gather(self, local: np.ndarray) -> np.ndarray | None:
        """Every rank's `local` stacked on rank 0 (None elsewhere)."""
        local = np.ascontiguousarray(local)
        out = np.empty((self.size, *local.shape)) if self.rank == 0 else None
        self.comm.Gather(local, out, root=0)
        return out
