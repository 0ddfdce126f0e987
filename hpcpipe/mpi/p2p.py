"""Point-to-point transport for pipeline activations and gradients.

Nonblocking sends are fire-and-forget until `drain`; receives are posted ahead of time (a window
of the next receives a rank's schedule will need), so a sender never waits for its receiver to
reach the matching action. Tags encode (stage, microbatch, direction) and so cannot collide.
Device buffers go through the backend: directly to a CUDA-aware MPI, else via pinned host memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mpi4py import MPI

from hpcpipe.backend import Backend

__all__ = ["Mailbox", "message_tag"]

FORWARD, BACKWARD = 0, 1


def message_tag(stage: int, microbatch: int, direction: int, n_stages: int, tag_ub: int) -> int:
    """Unique tag per (receiving stage, microbatch, direction); checked against MPI_TAG_UB."""
    tag = (microbatch * n_stages + stage) * 2 + direction
    if tag > tag_ub:
        raise ValueError(
            f"message tag {tag} exceeds this MPI's MPI_TAG_UB = {tag_ub} "
            f"({n_stages} stages x microbatch {microbatch}); use fewer microbatches "
            "per step"
        )
    return tag


@dataclass
class _Pending:
    request: MPI.Request
    array: Any  # the destination (device) array
    buffer: Any  # what MPI writes into (the array itself, or a host staging buffer)
    nbytes: int


@dataclass
class Mailbox:
    """Sends and pre-posted receives of one rank on the pipeline communicator."""

    comm: MPI.Comm
    backend: Backend
    n_stages: int
    _sends: list[tuple[MPI.Request, Any]] = field(default_factory=list)
    _recvs: dict[tuple[int, int, int], _Pending] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0

    def __post_init__(self) -> None:
        # TAG_UB is guaranteed on COMM_WORLD only (Open MPI does not copy it to derived comms)
        self.tag_ub = int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB))
        self._host = not self.backend.on_gpu

    def send(self, array: Any, peer: int, stage: int, microbatch: int, direction: int) -> None:
        """Start sending `array` (for `stage` on `peer`); it must not change until `drain`."""
        tag = message_tag(stage, microbatch, direction, self.n_stages, self.tag_ub)
        if self._host:  # CPU: the array itself goes to MPI (no staging slot, no backend call)
            buf = array
        else:
            buf = self.backend.mpi_send_buffer(array, slot=f"send{stage}.{microbatch}.{direction}")
        self._sends.append((self.comm.Isend(buf, dest=peer, tag=tag), buf))
        self.bytes_sent += array.nbytes
        if len(self._sends) >= 64:
            self._reap()

    def post_recv(
        self, make: Callable[[], Any], peer: int, stage: int, microbatch: int, direction: int
    ) -> None:
        """Post a receive for (stage, microbatch, direction) into a fresh array from `make()`."""
        key = (stage, microbatch, direction)
        if key in self._recvs:
            return
        tag = message_tag(stage, microbatch, direction, self.n_stages, self.tag_ub)
        array = make()
        if self._host:
            buf = array
        else:
            buf = self.backend.mpi_recv_buffer(array, slot=f"recv{stage}.{microbatch}.{direction}")
        self._recvs[key] = _Pending(
            self.comm.Irecv(buf, source=peer, tag=tag), array, buf, array.nbytes
        )

    def is_posted(self, stage: int, microbatch: int, direction: int) -> bool:
        return (stage, microbatch, direction) in self._recvs

    def wait_recv(self, stage: int, microbatch: int, direction: int) -> Any:
        """Block until the posted receive completes and return its array."""
        pending = self._recvs.pop((stage, microbatch, direction))
        pending.request.Wait()
        if not self._host:
            self.backend.finish_recv(pending.array, pending.buffer)
        self.bytes_received += pending.nbytes
        return pending.array

    def progress(self) -> None:
        """Let MPI move outstanding messages while this rank is between actions.

        Large messages use a rendezvous protocol that advances only inside MPI calls on both
        sides; without this poke a receiver can wait a whole compute action for a sender that
        has already posted its Isend.
        """
        if self._sends:
            self._reap()
        elif self._recvs:
            next(iter(self._recvs.values())).request.Test()

    def _reap(self) -> None:
        self._sends = [(r, b) for r, b in self._sends if not r.Test()]

    def drain(self) -> None:
        """Complete every outstanding send (end of step); receives must all have been consumed."""
        if self._sends:
            MPI.Request.Waitall([r for r, _ in self._sends])
            self._sends.clear()
        if self._recvs:
            left = ", ".join(
                f"stage {s} mb {m} {'F' if d == FORWARD else 'B'}" for s, m, d in self._recvs
            )
            raise RuntimeError(f"receives posted but never consumed: {left}")
