"""The expert-parallel group: which experts this rank holds, and the all-to-alls that move tokens.

`ExpertGroup` wraps the ep communicator (rank order = ep coordinate; rank r holds the contiguous
experts r*E/P .. (r+1)*E/P - 1). Per dispatch it exchanges per-expert counts (`Alltoall`), turns
them into a `DispatchPlan`, and moves rows with one flat `Alltoallv` or the two-phase exchange
of `hpcpipe.moe.plan`. `LocalExperts` is the same interface with every expert on this process
and no communication (`hpcpipe.moe.plan`): the single-process model.

Every rank of a group issues the same collectives in the same order whatever the routing:
counts, (two-phase: node counts,) tokens, outputs in F; gradients out and back in B. Zero-row
messages are still sent.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype

from hpcpipe.backend import active_backend
from hpcpipe.faults import maybe_fail
from hpcpipe.model.layers import array_module
from hpcpipe.model.steps import Steps, run
from hpcpipe.moe.plan import (
    DispatchPlan,
    Exchange,
    LocalExperts,
    NodeLayout,
    RowCounts,
    build_dispatch_plan,
)

__all__ = ["ExpertGroup", "LocalExperts"]


class ExpertGroup:
    """This rank's place in its expert-parallel group and the group's token exchanges."""

    def __init__(
        self,
        comm: MPI.Comm,
        experts: int,
        *,
        node: int = 0,
        hierarchical: bool = False,
        virtual_nodes: bool = False,
        cuda_aware: bool = False,
    ):
        """Collective over `comm`. `node`: this rank's node id (real or virtual)."""
        self.comm = comm
        self.size, self.rank = comm.size, comm.rank
        if experts < 1 or experts % self.size:
            raise ValueError(
                f"moe.experts = {experts} must be a positive multiple of the expert-parallel "
                f"degree {self.size} (each ep rank holds experts / ep of them)"
            )
        self.experts = experts
        self.per_rank = experts // self.size
        self.recorder: Any = None  # a hpcpipe.io.trace.Recorder: ALLTOALL events when enabled
        self.layout = NodeLayout(tuple(comm.allgather(int(node))))
        self.virtual_nodes = virtual_nodes
        self.cuda_aware = cuda_aware
        self.hierarchical = hierarchical
        self.node_comm: MPI.Comm | None = None
        self.cross_comm: MPI.Comm | None = None
        self._types: dict[tuple[Any, tuple[int, ...]], MPI.Datatype] = {}
        self._slots_busy: set[int] = set()  # staging slots of device exchanges not yet done
        if hierarchical:
            if not self.layout.uniform:
                raise ValueError(
                    "moe.hierarchical needs the same number of expert-group ranks on every node; "
                    f"this group has {[len(m) for m in self.layout.members]} per node (set "
                    "topology.ranks_per_node or moe.hierarchical = false)"
                )
            a, i = self.layout.position(self.rank)
            self.node_comm = comm.Split(a, self.rank)
            self.cross_comm = comm.Split(i, a)

    @classmethod
    def from_comms(
        cls, comms: Any, experts: int, *, hierarchical: bool = False, cuda_aware: bool = False
    ) -> ExpertGroup:
        """The group of `comms.group("ep")`, nodes (real or virtual) from `comms.node_info`."""
        info = comms.node_info
        return cls(
            comms.group("ep"),
            experts,
            node=info.node,
            hierarchical=hierarchical,
            virtual_nodes=info.virtual,
            cuda_aware=cuda_aware,
        )

    @property
    def local_experts(self) -> range:
        """Global indices of the experts this rank holds."""
        return range(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)

    def __repr__(self) -> str:
        mode = "two-phase" if self.hierarchical else "flat"
        return (
            f"ExpertGroup(rank {self.rank}/{self.size}, experts {self.local_experts.start}.."
            f"{self.local_experts.stop - 1} of {self.experts}, {self.layout.nodes} "
            f"{'virtual ' if self.virtual_nodes else ''}node(s), {mode})"
        )

    def free(self) -> None:
        """Release the node and cross-node communicators (the ep communicator is not ours) and
        the row datatypes."""
        for c in (self.node_comm, self.cross_comm):
            if c is not None:
                c.Free()
        self.node_comm = self.cross_comm = None
        for t in self._types.values():
            t.Free()
        self._types.clear()

    # ------------------------------------------------------------------ counts

    def plan(self, send_expert: np.ndarray) -> DispatchPlan:
        """Collective: exchange per-expert counts (E,) and build this dispatch's plan."""
        return run(self.plan_steps(send_expert))

    def plan_steps(self, send_expert: np.ndarray) -> Steps[DispatchPlan]:
        """`plan` as steps (`hpcpipe.model.steps`): each count exchange is yielded."""
        send = np.ascontiguousarray(send_expert, dtype=np.int64)
        if send.shape != (self.experts,):
            raise ValueError(
                f"per-expert counts have shape {send.shape}, expected ({self.experts},)"
            )
        recv = np.empty(self.experts, dtype=np.int64)
        yield _Call(self.comm.Alltoall, self.comm.Ialltoall, (send, recv), recv)
        recv_expert = recv.reshape(self.size, self.per_rank)
        if not self.hierarchical:
            return build_dispatch_plan(send, recv_expert)
        assert self.node_comm is not None
        mine = np.concatenate(
            (send.reshape(self.size, self.per_rank).sum(axis=1), recv_expert.sum(axis=1))
        )
        mates = np.empty((self.node_comm.size, mine.size), dtype=np.int64)
        yield _Call(self.node_comm.Allgather, self.node_comm.Iallgather, (mine, mates), mates)
        return build_dispatch_plan(
            send, recv_expert, layout=self.layout, me=self.rank, node_counts=mates
        )

    # ------------------------------------------------------------------ rows

    def alltoallv(self, rows: Any, exchange: Exchange, out: Any = None) -> Any:
        """Collective: send rows[...] (grouped by destination ep rank, exchange.send rows each);
        returns the received rows grouped by source ep rank, in `out` when given (a reusable
        buffer of exchange.rows_in rows; otherwise the result may be `rows` itself when nothing
        moves). Bitwise the same in both modes: the two-phase path only moves rows."""
        maybe_fail("alltoall")
        rec = self.recorder
        if rec is not None and rec.enabled:
            t0 = rec.now()
            result = run(self._exchange(rows, exchange, out))
            self._record(rows, t0)
            return result
        if exchange.hierarchical is None:  # the common path: no generator in the way
            return self._alltoallv(self.comm, rows, exchange.send_spec, exchange.recv_spec, out)
        return run(self._exchange(rows, exchange, out))

    def exchange_steps(self, rows: Any, exchange: Exchange) -> Steps[Any]:
        """`alltoallv` as steps (`hpcpipe.model.steps`): each phase's exchange is yielded, so
        it can be in flight while other work runs. Its trace event spans start to completion."""
        maybe_fail("alltoall")
        rec = self.recorder
        t0 = rec.now() if rec is not None and rec.enabled else None
        result = yield from self._exchange(rows, exchange)
        if t0 is not None:
            self._record(rows, t0)
        return result

    def _record(self, rows: Any, t0: int) -> None:
        from hpcpipe.io.trace import EventKind

        self.recorder.record(
            EventKind.ALLTOALL,
            -1,
            -1,
            t0,
            self.recorder.now(),
            int(getattr(rows, "nbytes", 0)),
            value=float(len(rows)),
        )

    def _exchange(self, rows: Any, exchange: Exchange, out: Any = None) -> Steps[Any]:
        h = exchange.hierarchical
        if h is None:
            return (
                yield self._collective(self.comm, rows, exchange.send_spec, exchange.recv_spec, out)
            )
        assert self.node_comm is not None and self.cross_comm is not None
        mid = yield self._collective(
            self.node_comm, _take(rows, h.index1), h.send1_spec, h.recv1_spec
        )
        last = yield self._collective(
            self.cross_comm,
            _take(mid, h.index2),
            h.send2_spec,
            h.recv2_spec,
            out if h.final is None else None,
        )
        if h.final is None:
            return last
        if out is None:
            return _take(last, h.final)
        out[...] = _take(last, h.final)
        return out

    def _alltoallv(
        self, comm: MPI.Comm, rows: Any, send: RowCounts, recv: RowCounts, out: Any = None
    ) -> Any:
        return self._collective(comm, rows, send, recv, out).run()

    def _collective(
        self, comm: MPI.Comm, rows: Any, send: RowCounts, recv: RowCounts, out: Any = None
    ) -> _Call | _Done:
        """One Alltoallv of rows, its buffers ready (staged through pinned host memory for a
        device array when MPI is not CUDA-aware; a slot per exchange in flight)."""
        if (self.size if comm is self.comm else comm.size) == 1:  # nothing moves
            if out is None:
                return _Done(rows)
            out[...] = rows
            return _Done(out)
        shape = (recv.total, *rows.shape[1:])
        host = type(rows) is np.ndarray
        if out is None:
            out = (np if host else array_module(rows)).empty(shape, dtype=rows.dtype)
        elif out.shape != shape or out.dtype != rows.dtype:
            raise ValueError(
                f"receive buffer is {out.dtype}{out.shape}, expected {rows.dtype}{shape}"
            )
        rtype = self._types.get((rows.dtype, shape[1:])) or self._row_type(rows.dtype, shape[1:])
        if host:  # the common path stays a few attribute lookups away from raw Alltoallv
            sbuf = rows if rows.flags.c_contiguous else np.ascontiguousarray(rows)
            args = (
                [sbuf, (send.counts, send.displs), rtype],
                [out, (recv.counts, recv.displs), rtype],
            )
            return _Call(comm.Alltoallv, comm.Ialltoallv, args, out)
        # two exchanges in flight at once (an overlapped pair) need two sets of staging buffers
        slot = min(set(range(len(self._slots_busy) + 1)) - self._slots_busy)
        self._slots_busy.add(slot)
        sbuf, rbuf = self._device_buffers(rows, out, f".{slot}" if slot else "")
        args = (
            [sbuf, (send.counts, send.displs), rtype],
            [rbuf, (recv.counts, recv.displs), rtype],
        )
        return _Call(comm.Alltoallv, comm.Ialltoallv, args, out, rbuf, (self._slots_busy, slot))

    def _row_type(self, dtype: Any, row_shape: tuple[int, ...]) -> MPI.Datatype:
        """A committed contiguous datatype of one row, so counts are rows (no int overflow of
        element counts, nothing to rescale per call); cached per (dtype, row shape)."""
        width = math.prod(row_shape)
        t = from_numpy_dtype(np.dtype(dtype)).Create_contiguous(width).Commit()
        self._types[(dtype, row_shape)] = t
        return t

    def _device_buffers(self, rows: Any, out: Any, slot: str = "") -> tuple[Any, Any]:
        """Device arrays go to MPI directly when it is CUDA-aware (made contiguous, then the
        stream synchronised: CuPy does not do it for MPI), otherwise through the backend's
        pinned staging buffers, reused from call to call (plain host copies without one)."""
        xp = array_module(rows)
        backend = active_backend()
        if self.cuda_aware or backend is None or not backend.on_gpu:
            rows = xp.ascontiguousarray(rows)  # a copy kernel, so before the synchronisation
            xp.cuda.get_current_stream().synchronize()
            if self.cuda_aware:
                return rows, out
            return xp.asnumpy(rows), np.empty(out.shape, dtype=out.dtype)
        if slot:  # a second exchange in flight: its buffers start as large as the first's
            for name, nbytes in (("a2a.send", rows.nbytes), ("a2a.recv", out.nbytes)):
                backend.staging(max(nbytes, backend.slot_capacity(name)), name + slot)
        send = backend.stage_out(rows, "a2a.send" + slot).wait()
        recv = backend.staging(out.nbytes, "a2a.recv" + slot).view(out.dtype).reshape(out.shape)
        return send, recv


def _take(rows: Any, index: np.ndarray | None) -> Any:
    """rows[index] (None = all rows, in order: no copy)."""
    if index is None:
        return rows
    xp = array_module(rows)
    return rows[index if xp is np else xp.asarray(index)]


class _Done:
    """A collective with nothing to move: its result is already there."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def run(self) -> Any:
        return self.value

    def start(self) -> _Done:
        return self

    def wait(self) -> Any:
        return self.value


class _Call:
    """One MPI collective with its arguments: `run` calls the blocking form, `start` the
    nonblocking one (`wait` completes it). A staged receive (`rbuf` is not `out`) is copied
    into the device array when it completes, and its staging slot given back."""

    __slots__ = ("args", "blocking", "nonblocking", "out", "rbuf", "request", "slot")

    def __init__(
        self,
        blocking: Any,
        nonblocking: Any,
        args: tuple[Any, ...],
        out: Any,
        rbuf: Any = None,
        slot: tuple[set[int], int] | None = None,
    ):
        self.blocking, self.nonblocking, self.args, self.out = blocking, nonblocking, args, out
        self.rbuf, self.slot = rbuf, slot
        self.request: MPI.Request | None = None

    def run(self) -> Any:
        self.blocking(*self.args)
        return self._finish()

    def start(self) -> _Call:
        self.request = self.nonblocking(*self.args)
        return self

    def wait(self) -> Any:
        assert self.request is not None, "wait() before start()"
        self.request.Wait()
        self.request = None
        return self._finish()

    def _finish(self) -> Any:
        out, rbuf = self.out, self.rbuf
        if rbuf is not None:
            busy, k = self.slot  # type: ignore[misc]
            backend = active_backend()
            if backend is not None and backend.on_gpu:  # async, ordered before later kernels
                backend.finish_recv(out, rbuf, "a2a.recv" + (f".{k}" if k else ""))
            else:
                out.set(rbuf)
            busy.discard(k)
        return out
