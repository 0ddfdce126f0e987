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

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI

from hpcpipe.backend import Backend
from hpcpipe.faults import maybe_fail

__all__ = ["BucketedAllreduce", "FlatBuffer", "allreduce", "allreduce_value"]

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
class BucketedAllreduce:
    """In-place SUM of flat buffers in buckets over a communicator; `wait` completes all."""

    comm: MPI.Comm
    backend: Backend
    bucket_bytes: int = 4 << 20
    persistent: bool | None = None
    """Persistent collectives for host buffers: None uses them where the MPI library has them,
    False never (the fallback path, also what MPI 3 gets)."""
    _pending: list[tuple[MPI.Request, Any, Any, str]] = field(default_factory=list)
    _active: list[MPI.Request] = field(default_factory=list)
    _requests: dict[int, tuple[FlatBuffer, list[MPI.Request]]] = field(default_factory=dict)
    _queued: list[tuple[Any, Any, Any, str, Any]] = field(default_factory=list)
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

    def start(self, buffer: FlatBuffer, key: str = "") -> None:
        """Begin reducing `buffer` in place; no-op on a communicator of one rank."""
        if self._alone:
            return
        maybe_fail("allreduce")
        if self._host:  # host memory: MPI reads and writes the buffer itself
            known = self._requests.get(id(buffer))
            if known is not None:  # the hot path: this buffer's persistent requests
                requests = known[1]
                MPI.Prequest.Startall(requests)
                self._active += requests
            else:
                self._start_host(buffer)
            return
        flat = buffer.flat
        per = max(1, self.bucket_bytes // flat.itemsize)
        chunks = [flat[lo : lo + per] for lo in range(0, flat.size, per)]
        slots = [f"ar{key}.{b}" for b in range(len(chunks))]
        if self.backend.staged:  # every bucket's copy queued at once on the copy stream
            for chunk, slot in zip(chunks, slots, strict=True):
                copy = self.backend.stage_out(chunk, slot)
                self._queued.append((copy.event, chunk, copy.host, slot, copy))
        else:  # MPI reads the device buffer itself once its kernels are done
            event = self.backend.record_event()
            for chunk, slot in zip(chunks, slots, strict=True):
                self._queued.append((event, chunk, chunk, slot, None))
        self.progress()

    def progress(self) -> None:
        """Let started reductions advance while the backward goes on (MPI moves a nonblocking
        collective only inside MPI calls), and start the queued device buckets whose data is
        ready, in order (every rank starts its collectives in the same order); never blocks."""
        active = self._active
        while active and active[0].Test():  # one by one: MPICH 5's Testall fails on
            active.pop(0)  # persistent collectives (MPI_ERR_IN_STATUS); done ones go inactive
        if self._queued:
            self._start_queued(block=False)
        for request, _, _, _ in self._pending:
            if not request.Test():
                break

    @property
    def busy(self) -> bool:
        """Reductions started or queued and not known to be complete."""
        return bool(self._active or self._queued or self._pending)

    def _start_queued(self, block: bool) -> None:
        while self._queued:
            event, chunk, buf, slot, copy = self._queued[0]
            if event is not None and not event.done:
                if not block:
                    return
                self.host_waits += 1
                event.synchronize()
            if copy is not None:
                copy.wait()  # landed: drops its hold on the device source
            self._queued.pop(0)
            req = self.comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            self._pending.append((req, chunk, buf, slot))

    def _start_host(self, buffer: FlatBuffer) -> None:
        if self.persistent:
            known = self._requests.get(id(buffer))
            if known is None:
                try:
                    reqs = [
                        self.comm.Allreduce_init(MPI.IN_PLACE, chunk, op=MPI.SUM)
                        for chunk in self._chunks(buffer)
                    ]
                except NotImplementedError:  # mpi4py 4 over an MPI-3 library
                    self.persistent = False
                    self._start_host(buffer)
                    return
                # the buffer is kept alive with its requests, so its id cannot be reused
                known = self._requests[id(buffer)] = (buffer, reqs)
            MPI.Prequest.Startall(known[1])
            self._active.extend(known[1])
            return
        for chunk in self._chunks(buffer):
            self._active.append(self.comm.Iallreduce(MPI.IN_PLACE, chunk, op=MPI.SUM))

    def _chunks(self, buffer: FlatBuffer) -> list[Any]:
        flat = buffer.flat
        per = max(1, self.bucket_bytes // flat.itemsize)
        return [flat[lo : lo + per] for lo in range(0, flat.size, per)]

    def wait(self) -> None:
        """Complete every started bucket (and copy staged ones back to the device)."""
        active = self._active
        if active:
            MPI.Request.Waitall(active)  # persistent ones stay allocated, inactive
            active.clear()
        if self._host:
            return
        if self._queued:
            self._start_queued(block=True)
        if not self._pending:
            return
        MPI.Request.Waitall([r for r, _, _, _ in self._pending])
        for _, chunk, buf, slot in self._pending:
            self.backend.finish_recv(chunk, buf, slot)  # staged: back to the device, async
        self._pending.clear()

    def free(self) -> None:
        """Release the persistent requests (after the last step)."""
        self.wait()
        for _, reqs in self._requests.values():
            for req in reqs:
                req.Free()
        self._requests.clear()
