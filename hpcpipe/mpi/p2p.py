"""Point-to-point transport for pipeline activations and gradients.

Nonblocking sends are fire-and-forget until `drain`; receives are posted ahead of time (a window
of the next receives a rank's schedule will need), so a sender never waits for its receiver to
reach the matching action. Tags encode (stage, microbatch, direction) and so cannot collide.
Device buffers go through the backend: directly to a CUDA-aware MPI (after the producing stream
is synchronised), else via pinned host buffers reused across steps, copied on the backend's copy
stream. With `overlap`, a staged send whose copy has not landed yet is posted later (by
`progress` between actions, or before this rank blocks), so the host goes on queueing compute
while the copy engine works; receives are copied back to the device without blocking the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mpi4py import MPI

from hpcpipe.backend import Backend, StagedCopy

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
    slot: str = ""  # the staging slot of `buffer` (busy until its copy to the device lands)


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
    overlap: bool = False
    """Defer the Isend of a staged send until its copy has landed instead of waiting for it.
    Safe only where this rank makes no blocking MPI call between actions other than through
    this mailbox (which posts deferred sends before it blocks): the interpreter turns it on
    for dense models, off when MoE all-to-alls run inside F and B."""
    _deferred: list[tuple[StagedCopy, int, int]] = field(default_factory=list)
    sends_deferred: int = 0  # staged sends posted after their action (overlap at work)

    def __post_init__(self) -> None:
        # TAG_UB is guaranteed on COMM_WORLD only (Open MPI does not copy it to derived comms)
        self.tag_ub = int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB))
        self._host = not self.backend.on_gpu

    def send(self, array: Any, peer: int, stage: int, microbatch: int, direction: int) -> None:
        """Start sending `array` (for `stage` on `peer`); it must not change until `drain`."""
        tag = message_tag(stage, microbatch, direction, self.n_stages, self.tag_ub)
        self.bytes_sent += array.nbytes
        if self._host:  # CPU: the array itself goes to MPI (no staging slot, no backend call)
            buf = array
        elif self.backend.staged:
            copy = self.backend.stage_out(array, f"send{stage}.{microbatch}.{direction}")
            if self.overlap and not copy.ready():
                self._deferred.append((copy, peer, tag))
                self.sends_deferred += 1
                return
            buf = copy.wait()
        else:
            buf = self.backend.mpi_send_buffer(array)  # synchronises the producing stream
        self._sends.append((self.comm.Isend(buf, dest=peer, tag=tag), buf))
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
            buf, slot = array, ""
        else:
            slot = f"recv{stage}.{microbatch}.{direction}"
            buf = self.backend.mpi_recv_buffer(array, slot=slot)
        self._recvs[key] = _Pending(
            self.comm.Irecv(buf, source=peer, tag=tag), array, buf, array.nbytes, slot
        )

    def is_posted(self, stage: int, microbatch: int, direction: int) -> bool:
        return (stage, microbatch, direction) in self._recvs

    def wait_recv(self, stage: int, microbatch: int, direction: int) -> Any:
        """Block until the posted receive completes and return its array."""
        pending = self._recvs.pop((stage, microbatch, direction))
        if self._deferred:  # the peer may be waiting for one of them: never block on those
            self._post_deferred(block=True)
        pending.request.Wait()
        if not self._host:
            self.backend.finish_recv(pending.array, pending.buffer, pending.slot)
        self.bytes_received += pending.nbytes
        return pending.array

    def progress(self) -> None:
        """Let MPI move outstanding messages while this rank is between actions.

        Large messages use a rendezvous protocol that advances only inside MPI calls on both
        sides; without this poke a receiver can wait a whole compute action for a sender that
        has already posted its Isend. Deferred staged sends whose copy has landed go out here.
        """
        if self._deferred:
            self._post_deferred(block=False)
        if self._sends:
            self._reap()
        elif self._recvs:
            next(iter(self._recvs.values())).request.Test()

    def describe_pending(self) -> str:
        """Outstanding traffic in words (read from the watchdog's thread: counts only)."""
        deferred = f", {len(self._deferred)} staged sends copying" if self._deferred else ""
        return f"{len(self._sends)} sends in flight, {len(self._recvs)} receives posted{deferred}"

    def _post_deferred(self, block: bool) -> None:
        """Isend the deferred staged sends whose copy has landed (all of them when `block`)."""
        left = []
        for copy, peer, tag in self._deferred:
            if block or copy.ready():
                buf = copy.wait()
                self._sends.append((self.comm.Isend(buf, dest=peer, tag=tag), buf))
            else:
                left.append((copy, peer, tag))
        self._deferred = left

    def _reap(self) -> None:
        self._sends = [(r, b) for r, b in self._sends if not r.Test()]

    def drain(self) -> None:
        """Complete every outstanding send (end of step); receives must all have been consumed."""
        if self._deferred:
            self._post_deferred(block=True)
        if self._sends:
            MPI.Request.Waitall([r for r, _ in self._sends])
            self._sends.clear()
        if self._recvs:
            left = ", ".join(
                f"stage {s} mb {m} {'F' if d == FORWARD else 'B'}" for s, m, d in self._recvs
            )
            raise RuntimeError(f"receives posted but never consumed: {left}")
