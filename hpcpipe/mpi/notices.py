"""Round-end notices between data-parallel replicas: rounds that end when the first replica
is done (`[async] round_end = "first"`).

Each rank talks to its counterparts in the other replicas (its dp group). When a replica ends
round c it sends every counterpart a one-word notice tagged c; a replica still inside round c
tests for a notice after each step and, once one has arrived, ends its round after that step.
A replica is never more than one round ahead of another (the averaging of round c completes
only once all have ended it), so tags cycle safely, and the notices of round c are complete
once this rank's averaging of round c is: every replica sends its notice before it starts
that averaging.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

__all__ = ["RoundNotices"]

_TAGS = 1 << 14
"""Rounds in flight are at most two apart: tags cycle well below MPI's guaranteed 32767."""


class _Round:
    __slots__ = ("arrived", "buffers", "receives", "sends")

    def __init__(self) -> None:
        self.arrived = False
        self.receives: list[MPI.Request] = []
        self.sends: list[MPI.Request] = []
        self.buffers: list[np.ndarray] = []


class RoundNotices:
    """One rank's notices over `comm` (its counterparts in the other replicas)."""

    def __init__(self, comm: MPI.Comm):
        self.comm = comm.Dup()  # its own tag space: nothing else matches a notice
        self.peers = [r for r in range(self.comm.size) if r != self.comm.rank]
        self._rounds: dict[int, _Round] = {}

    def _round(self, c: int) -> _Round:
        """Round c's requests, its receives posted on first use."""
        if c not in self._rounds:
            state = self._rounds[c] = _Round()
            for peer in self.peers:
                buf = np.zeros(1, dtype=np.int64)
                state.buffers.append(buf)
                state.receives.append(self.comm.Irecv(buf, source=peer, tag=c % _TAGS))
        return self._rounds[c]

    def arrived(self, c: int) -> bool:
        """Whether another replica has ended round c (never blocks)."""
        state = self._round(c)
        if not state.arrived and state.receives:
            state.arrived = MPI.Request.Testany(state.receives)[1]
        return state.arrived

    def announce(self, c: int) -> None:
        """This replica has ended round c: tell the others."""
        state = self._round(c)
        word = np.array([c], dtype=np.int64)
        state.buffers.append(word)
        state.sends = [self.comm.Isend(word, dest=peer, tag=c % _TAGS) for peer in self.peers]

    def close(self, c: int) -> None:
        """Complete round c's notices: call once this rank's averaging of round c is done."""
        state = self._rounds.pop(c, None)
        if state is not None:
            MPI.Request.Waitall(state.receives + state.sends)

    def free(self) -> None:
        for c in list(self._rounds):
            self.close(c)
        self.comm.Free()
