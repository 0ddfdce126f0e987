"""The sweep's messages: face fluxes between KBA neighbours, and the solver's reductions.

A `FaceChannel` works on a private duplicate of the communicator, so no other traffic can match
its messages. Receives are posted ahead; sends are nonblocking and completed in batches; the
reductions and the final gather go through the same communicator.

Face arrays are recycled: receive buffers and the faces a sweep starts at the domain boundary
come from the channel's free lists (`take`), and a face goes back (`give_back`) once the sweep
is done with it, a sent one when its send completes. A fresh array of this size (hundreds of
KB) is fresh pages from the kernel, and faulting them in inside the sweep kernel cost it ~8%
on Kripke's problem; recycled ones are already mapped. On a GPU the
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
        self._free: dict[tuple[int, ...], list[np.ndarray]] = {}

    def take(self, shape: tuple[int, ...], *, zero: bool = False) -> Any:
        """A host face array of `shape` (zeroed with `zero`), recycled when one is free."""
        free = self._free.get(shape)
        if not free:
            return np.zeros(shape) if zero else np.empty(shape)
        out = free.pop()
        if zero:
            out.fill(0.0)
        return out

    def give_back(self, face: Any) -> None:
        """`face` is no longer used: a host array joins the free list of its shape (device
        arrays are left to CuPy's own pool)."""
        if isinstance(face, np.ndarray) and face.flags.c_contiguous and face.base is None:
            self._free.setdefault(face.shape, []).append(face)

    def _reap(self, done: Any) -> None:
        """Drop the completed sends `done` (indices), their buffers back to the free lists."""
        if not done:
            return
        done = set(done)
        for i in done:
            self.give_back(self._sends[i][1])
        self._sends = [s for i, s in enumerate(self._sends) if i not in done]

    def world_ranks(self) -> list[int]:
        """World rank of each rank of the channel (traces name peers by world rank)."""
        return world_ranks(self.comm).tolist()

    def post(self, peer: int, tag: int, shape: tuple[int, ...], *, sync: bool) -> PostedFace:
        """Post the receive of one face from `peer`. `sync`: synchronise the device first (MPI
        writes outside stream order, so no queued kernel may still use the memory `empty`
        hands out); once per task is enough."""
        buf = self.take(shape) if self.staged or self.xp is np else self.xp.empty(shape)
        if sync and self._device:
            self.xp.cuda.get_current_stream().synchronize()
        return PostedFace(self.comm.Irecv(buf, source=peer, tag=tag), buf)

    def wait(self, posted: PostedFace) -> tuple[Any, int]:
        """The face a posted receive delivers (on the device when the sweep runs there) and
        its size in bytes."""
        posted.request.Wait()
        buf = posted.buffer
        if not self.staged:
            return buf, int(buf.nbytes)
        face = self.xp.asarray(buf)
        self.give_back(buf)  # copied to the device
        return face, int(buf.nbytes)

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
            self._reap(MPI.Request.Testsome([s[0] for s in self._sends]))
        return int(buf.nbytes)

    def progress(self) -> None:
        """Let MPI move the messages in flight (and reap the sends that finished): called
        between slabs of a block, since a large message moves only while both ranks are
        inside MPI."""
        if self._sends:
            self._reap(MPI.Request.Testsome([s[0] for s in self._sends]))

    def drain(self) -> None:
        """Complete every send (the end of a sweep)."""
        MPI.Request.Waitall([s[0] for s in self._sends])
        for _, buf in self._sends:
            self.give_back(buf)
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
