"""Averaging parameters over data-parallel replicas, nonblocking: one round in flight.

`start` copies this rank's stage parameters into one flat buffer and starts its in-place sum
over the replicas (the same bucketed reductions as the gradients', so persistent requests,
staging and CUDA-aware paths are the gradients' too), with the round's figures beside it in two
small reductions (sums and maxima). `wait` completes the reductions and gives the figures;
`finish` (waiting first if need be) gives the parameters back: the mean itself (delay 0), or
the caller's newer parameters plus the correction they missed, mean - snapshot (delay 1).
Between `start` and `wait`, `progress` lets MPI advance the round. A round that has been waited
for but not applied is what a checkpoint keeps (`pending`) and a resume puts back (`resume`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from hpcpipe.backend import Backend
from hpcpipe.mpi.collectives import BucketedAllreduce, FlatBuffer

Params = dict[Any, dict[str, Any]]  # a stage's parameter tree: unit -> name -> array

__all__ = ["ReplicaAverager"]


class ReplicaAverager:
    """The mean over `comm` (this rank's stages' replicas) of parameter trees keyed by stage."""

    def __init__(
        self,
        comm: MPI.Comm,
        backend: Backend,
        params: dict[int, Params],
        *,
        delay: int,
        bucket_bytes: int = 4 << 20,
    ):
        self.comm, self.backend, self.delay = comm, backend, delay
        shapes = {
            (s, i, k): tuple(v.shape)
            for s, tree in params.items()
            for i, p in tree.items()
            for k, v in p.items()
        }
        self.sum = FlatBuffer.like(backend.xp, shapes, backend.dtype)
        # delay 1: the round's own parameters, kept while `sum` becomes the replicas' total
        self.snap = FlatBuffer.like(backend.xp, shapes, backend.dtype) if delay else None
        self.reducer = BucketedAllreduce(comm, backend, bucket_bytes)
        self._figures: list[Any] = []  # send/receive arrays and requests of the round
        self.in_flight = False  # a round started and not applied yet
        self.ready = False  # ... and its reductions are complete
        self.rounds = 0

    def start(self, params: dict[int, Params], sums: np.ndarray, maxima: np.ndarray) -> None:
        """Begin the round: every replica calls it with its own parameters and figures."""
        assert not self.in_flight, "one averaging round at a time"
        for (s, i, k), view in self.sum.views.items():
            view[...] = params[s][i][k]
        if self.snap is not None:
            self.snap.flat[...] = self.sum.flat
        self.reducer.start(self.sum, key="avg")
        sums = np.ascontiguousarray(sums, dtype=np.float64)
        maxima = np.ascontiguousarray(maxima, dtype=np.float64)
        out_s, out_m = np.empty_like(sums), np.empty_like(maxima)
        requests = [
            self.comm.Iallreduce(sums, out_s, op=MPI.SUM),
            self.comm.Iallreduce(maxima, out_m, op=MPI.MAX),
        ]
        self._figures = [sums, maxima, out_s, out_m, requests]
        self.in_flight, self.ready = True, False

    def progress(self) -> None:
        """Let the round advance inside MPI (never blocks)."""
        if self.in_flight and not self.ready:
            self.reducer.progress()
            for req in self._figures[4]:
                req.Test()

    def wait(self) -> tuple[np.ndarray, np.ndarray]:
        """Complete the round's reductions (blocking); the figures' sums and maxima over the
        replicas. The parameters are not touched: `finish` applies the round."""
        assert self.in_flight and not self.ready, "no averaging round to wait for"
        self.reducer.wait()
        MPI.Request.Waitall(self._figures[4])
        _, _, sums, maxima, _ = self._figures
        self._figures, self.ready = [], True
        return sums, maxima

    def finish(self, params: dict[int, Params], *, at_once: bool = False) -> dict[int, Params]:
        """Apply the round (waiting for it first unless `wait` did): the new parameters (see
        the module docstring; `at_once`: the mean itself, for a round finished before any
        further step). The figures are `wait`'s."""
        assert self.in_flight, "no averaging round started"
        if not self.ready:
            self.wait()
        self.in_flight = self.ready = False
        self.rounds += 1
        n = self.comm.size
        out: dict[int, Params] = {s: {i: dict(p) for i, p in t.items()} for s, t in params.items()}
        for (s, i, k), total in self.sum.views.items():
            mean = total / n
            if self.snap is None or at_once:
                out[s][i][k] = mean
            else:
                out[s][i][k] = params[s][i][k] + (mean - self.snap.views[(s, i, k)])
        return out

    def pending(self) -> dict[tuple[int, int, str], Any]:
        """A waited-for round's totals over the replicas, keyed (stage, unit, name): with the
        parameters it was started from (its snapshot) all a checkpoint needs to apply it."""
        assert self.in_flight and self.ready, "pending: wait for the round first"
        return dict(self.sum.views)

    def resume(self, params: dict[int, Params], totals: dict[tuple[int, int, str], Any]) -> None:
        """Put back a checkpoint's round (delay 1): started from `params` (the snapshot), its
        totals already reduced, to be applied by the next `finish`."""
        assert self.snap is not None and not self.in_flight
        for (s, i, k), view in self.sum.views.items():
            view[...] = totals[(s, i, k)]
            self.snap.views[(s, i, k)][...] = params[s][i][k]
        self.in_flight = self.ready = True

    def free(self) -> None:
        self.reducer.free()
