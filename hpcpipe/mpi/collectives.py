"""Reductions: the data-parallel gradient reduction in buckets, and the small reductions the
workloads make (metrics, flags, agreement), named by operation so no workload needs mpi4py.

Gradients of a stage live in one flat buffer (the per-parameter gradients are views into it),
cut into buckets of about `bucket_bytes`. A stage's buckets are reduced as soon as its last W
has run, so the reduction overlaps the backward work left on other stages; the optimizer waits
for all of them at the end of the step. The buffers live for the whole run, so on host memory
each bucket gets an MPI-4 persistent allreduce (`Allreduce_init`) once and every step only
starts them: no per-call argument handling, and the MPI library may plan the reduction once.
Where the library or mpi4py has no persistent collectives (MPI 3, mpi4py 3) each step issues
`Iallreduce` instead. Device buffers always take that path, without blocking the backward that
starts them: staged buckets queue their device-to-host copies on the copy stream, direct ones
(CUDA-aware MPI) record an event after the kernels that wrote them, and each bucket's reduction
starts once its data is ready, checked between actions (`progress`) and waited for only at the
end of the step (`wait`).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import numpy as np
from mpi4py import MPI

from hpcpipe.backend import Backend
from hpcpipe.faults import maybe_fail

__all__ = [
    "BucketedAllreduce",
    "FlatBuffer",
    "Reduction",
    "allreduce",
    "allreduce_value",
    "exchange_objects",
]

_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


def allreduce(comm: Any, values: Any, op: str = "sum") -> np.ndarray:
    """The element-wise reduction of `values` (a NumPy array or sequence) over `comm`; `op` is
    "sum", "max" or "min"."""
    send = np.ascontiguousarray(values)
    out = np.empty_like(send)
    comm.Allreduce(send, out, op=_op(op))
    return out


def allreduce_value(comm: Any, value: Any, op: str = "sum") -> Any:
    """The reduction of one Python value (a number) over `comm`."""
    return comm.allreduce(value, op=_op(op))


MOVE_TAG = 32767
"""The tag of `exchange_objects` (MPI guarantees tags up to 32767): a re-plan moves layers
between steps, when the pipeline's own messages are all complete."""


def exchange_objects(comm: Any, outgoing: dict[int, Any], sources: Any) -> dict[int, Any]:
    """Send each `outgoing[dest]` to rank `dest` and receive one object from each of `sources`.

    Every rank derives both from the same plan (who holds what before and after), so no count
    needs exchanging first. Sends are posted before any receive, so no order of pairs can
    deadlock; objects travel pickled (host arrays: mpi4py ships their buffers out of band)."""
    requests = [comm.isend(obj, dest=dest, tag=MOVE_TAG) for dest, obj in outgoing.items()]
    received = {src: comm.recv(source=src, tag=MOVE_TAG) for src in sorted(sources)}
    MPI.Request.waitall(requests)
    return received


def _op(name: str) -> MPI.Op:
    try:
        return _OPS[name]
    except KeyError:
        raise ValueError(f"reduction {name!r} is not one of {', '.join(_OPS)}") from None


@dataclass
class FlatBuffer:
    """One contiguous array with named views, so a bucket is a slice and needs no packing."""

    flat: Any
    views: dict[Any, Any]
    offsets: dict[Any, tuple[int, int]]

    @classmethod
    def like(cls, xp: Any, shapes: dict[Any, tuple[int, ...]], dtype: Any) -> FlatBuffer:
        sizes = {k: int(_prod(s)) for k, s in shapes.items()}
        flat = xp.zeros(sum(sizes.values()), dtype=dtype)
        views, offsets, start = {}, {}, 0
        for k, shape in shapes.items():
            n = sizes[k]
            views[k] = flat[start : start + n].reshape(shape)
            offsets[k] = (start, start + n)
            start += n
        return cls(flat, views, offsets)

    def zero(self) -> None:
        self.flat[...] = 0


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


@dataclass
class Reduction:
    """One started buffer's reduction: when it started and when it was seen complete.

    MPI gives no completion time: `done` is the first check that found every bucket complete
    (between two actions, or in `wait`), so it is late by at most the action that ran between
    checks; a reduction still running at `wait` is timed exactly by it."""

    key: str
    start: int
    nbytes: int
    done: int = -1


@dataclass
class BucketedAllreduce:
    """In-place SUM of flat buffers in buckets over a communicator; `wait` completes all."""

    comm: MPI.Comm
    backend: Backend
    bucket_bytes: int = 4 << 20
    persistent: bool | None = None
    """Persistent collectives for host buffers: None uses them where the MPI library has them,
    False never (the fallback path, also what MPI 3 gets)."""
    clock: Callable[[], int] | None = None
    """Times each started buffer's reduction (`reductions`), e.g. a trace recorder's `now`."""
    _pending: list[tuple[MPI.Request, Any, Any, str, int]] = field(default_factory=list)
    _active: list[MPI.Request] = field(default_factory=list)
    _owner: list[int] = field(default_factory=list)  # per active request: its `reductions` row
    _requests: dict[int, tuple[FlatBuffer, list[MPI.Request]]] = field(default_factory=dict)
    _queued: list[tuple[Any, Any, Any, str, Any, int]] = field(default_factory=list)
    _left: list[int] = field(default_factory=list)  # per row: requests not yet complete
    _seen: int = 0  # device path: leading `_pending` requests known complete
    _open: dict[int, tuple[int, int]] = field(default_factory=dict)  # buffer: row, next bucket
    _closed: set[int] = field(default_factory=set)  # rows whose every bucket has started
    _edges: dict[int, tuple[FlatBuffer, list[int]]] = field(default_factory=dict)
    reductions: list[Reduction] = field(default_factory=list)
    """One row per buffer started since the last `wait` (readable after it, until the next
    start; a reader may clear it)."""
    host_waits: int = 0  # device buckets whose data the host had to wait for (at `wait`)

    def __post_init__(self) -> None:
        if self.persistent is None:
            self.persistent = hasattr(self.comm, "Allreduce_init")
        self._alone = self.comm.size == 1
        self._host = not self.backend.on_gpu

    @property
    def path(self) -> str:
        """How host buffers are reduced: "persistent" or "nonblocking" (for logs and tables)."""
        return "persistent" if self.persistent else "nonblocking"

    def start(self, buffer: FlatBuffer, key: str = "", upto: int | None = None) -> None:
        """Begin reducing `buffer` in place; no-op on a communicator of one rank.

        With `upto`, only the buckets that end at or before element `upto` (and were not started
        yet): a buffer filled piece by piece (a stage's last W, unit by unit) starts each bucket
        as soon as it is final, as DDP does in the backward. Later calls for the same buffer in
        the same step continue where the last one stopped; without `upto` they start the rest.
        Every rank of the communicator must start the same buckets in the same order."""
        if self._alone or not buffer.flat.size:
            return
        if not self._left:  # the first start after a `wait`: a new step's rows
            self.reductions.clear()
        bounds = self._bounds(buffer)
        state = self._open.get(id(buffer))
        if state is None:
            maybe_fail("allreduce")
            row, first = len(self.reductions), 0
            self.reductions.append(Reduction(key, -1, int(buffer.flat.nbytes)))
            self._left.append(0)
        else:
            row, first = state
        buckets = len(bounds) - 1
        last = buckets if upto is None else min(buckets, bisect_right(bounds, upto) - 1)
        if last <= first:
            self._open[id(buffer)] = (row, first)
            return
        self._open[id(buffer)] = (row, last)
        if self.reductions[row].start < 0:  # its first bucket starts now
            self.reductions[row].start = self.clock() if self.clock else 0
        self._left[row] += last - first
        if last == buckets:
            self._closed.add(row)
        if self._host:  # host memory: MPI reads and writes the buffer itself
            requests = self._host_requests(buffer, bounds)
            if requests is None:  # nonblocking fallback: new requests every step
                flat = buffer.flat
                started = [
                    self.comm.Iallreduce(MPI.IN_PLACE, flat[bounds[b] : bounds[b + 1]], op=MPI.SUM)
                    for b in range(first, last)
                ]
            else:  # the hot path: this buffer's persistent requests
                started = requests[first:last]
                MPI.Prequest.Startall(started)
            self._active += started
            self._owner += [row] * len(started)
            return
        flat = buffer.flat
        chunks = [flat[bounds[b] : bounds[b + 1]] for b in range(first, last)]
        slots = [f"ar{key}.{b}" for b in range(first, last)]
        if self.backend.staged:  # every bucket's copy queued at once on the copy stream
            for chunk, slot in zip(chunks, slots, strict=True):
                copy = self.backend.stage_out(chunk, slot)
                self._queued.append((copy.event, chunk, copy.host, slot, copy, row))
        else:  # MPI reads the device buffer itself once its kernels are done
            event = self.backend.record_event()
            for chunk, slot in zip(chunks, slots, strict=True):
                self._queued.append((event, chunk, chunk, slot, None, row))
        self.progress()

    def _bounds(self, buffer: FlatBuffer) -> list[int]:
        """Bucket edges of `buffer` in elements: bucket b is [bounds[b], bounds[b + 1])."""
        known = self._edges.get(id(buffer))
        if known is None:
            flat = buffer.flat
            per = max(1, self.bucket_bytes // flat.itemsize)
            # the buffer is kept alive with its edges, so its id cannot be reused
            known = self._edges[id(buffer)] = (buffer, [*range(0, flat.size, per), flat.size])
        return known[1]

    def _host_requests(self, buffer: FlatBuffer, bounds: list[int]) -> list[MPI.Request] | None:
        """The buffer's persistent requests, one per bucket, created on first use (None on the
        nonblocking path)."""
        if not self.persistent:
            return None
        known = self._requests.get(id(buffer))
        if known is not None:
            return known[1]
        flat = buffer.flat
        try:
            reqs = [
                self.comm.Allreduce_init(MPI.IN_PLACE, flat[lo:hi], op=MPI.SUM)
                for lo, hi in pairwise(bounds)
            ]
        except NotImplementedError:  # mpi4py 4 over an MPI-3 library
            self.persistent = False
            return None
        self._requests[id(buffer)] = (buffer, reqs)
        return reqs

    def _completed(self, row: int) -> None:
        self._left[row] -= 1
        if not self._left[row] and row in self._closed:
            self.reductions[row].done = self.clock() if self.clock else 0

    def progress(self) -> None:
        """Let started reductions advance while the backward goes on (MPI moves a nonblocking
        collective only inside MPI calls), and start the queued device buckets whose data is
        ready, in order (every rank starts its collectives in the same order); never blocks."""
        active = self._active
        while active and active[0].Test():  # one by one: MPICH 5's Testall fails on
            active.pop(0)  # persistent collectives (MPI_ERR_IN_STATUS); done ones go inactive
            self._completed(self._owner.pop(0))
        if self._queued:
            self._start_queued(block=False)
        pending = self._pending
        while self._seen < len(pending) and pending[self._seen][0].Test():
            self._completed(pending[self._seen][4])  # copied back to the device in `wait`
            self._seen += 1

    @property
    def busy(self) -> bool:
        """Reductions started or queued and not known to be complete."""
        return bool(self._active or self._queued or self._pending)

    def _start_queued(self, block: bool) -> None:
        while self._queued:
            event, chunk, buf, slot, copy, row = self._queued[0]
            if event is not None and not event.done:
                if not block:
                    return
                self.host_waits += 1
                event.synchronize()
            if copy is not None:
                copy.wait()  # landed: drops its hold on the device source
            self._queued.pop(0)
            req = self.comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            self._pending.append((req, chunk, buf, slot, row))

    def wait(self) -> None:
        """Complete every started bucket, after starting the buckets of any buffer started only
        in part (and copy staged ones back to the device)."""
        for bid, (row, _) in list(self._open.items()):
            if row not in self._closed:
                self.start(self._edges[bid][0], self.reductions[row].key)
        active = self._active
        if active:
            MPI.Request.Waitall(active)  # persistent ones stay allocated, inactive
            for row in self._owner:
                self._completed(row)
            active.clear()
            self._owner.clear()
        if not self._host:
            self._wait_device()
        self._left.clear()
        self._closed.clear()
        self._open.clear()

    def _wait_device(self) -> None:
        if self._queued:
            self._start_queued(block=True)
        if not self._pending:
            return
        MPI.Request.Waitall([p[0] for p in self._pending])
        done = self.clock() if self.clock else 0
        for *_, row in self._pending[self._seen :]:
            if self.reductions[row].done < 0:
                self.reductions[row].done = done
        for _, chunk, buf, slot, _ in self._pending:
            self.backend.finish_recv(chunk, buf, slot)  # staged: back to the device, async
        self._pending.clear()
        self._seen = 0

    def free(self) -> None:
        """Release the persistent requests (after the last step)."""
        self.wait()
        for _, reqs in self._requests.values():
            for req in reqs:
                req.Free()
        self._requests.clear()
        self._edges.clear()
