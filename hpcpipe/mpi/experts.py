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
from collections.abc import Generator
from typing import Any

import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype

from hpcpipe.backend import active_backend
from hpcpipe.faults import maybe_fail
from hpcpipe.model.layers import array_module
from hpcpipe.model.steps import Operation
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
        self._slots_busy: set[int] = set()  # staging slots of exchanges started, not finished
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
        send, recv = self._count_buffers(send_expert)
        self.comm.Alltoall(send, recv)
        if not self.hierarchical:
            return build_dispatch_plan(send, recv.reshape(self.size, self.per_rank))
        assert self.node_comm is not None
        mine, mates = self._node_count_buffers(send, recv)
        self.node_comm.Allgather(mine, mates)
        return self._two_phase_plan(send, recv, mates)

    def plan_op(self, send_expert: np.ndarray) -> Operation:
        """`plan` as a step a layer yields (`hpcpipe.model.steps`)."""
        return Operation(self.plan, self._plan_steps, send_expert)

    def _plan_steps(self, send_expert: np.ndarray) -> Generator[_Call, Any, DispatchPlan]:
        send, recv = self._count_buffers(send_expert)
        yield _Call(self.comm.Ialltoall, (send, recv), recv)
        if not self.hierarchical:
            return build_dispatch_plan(send, recv.reshape(self.size, self.per_rank))
        assert self.node_comm is not None
        mine, mates = self._node_count_buffers(send, recv)
        yield _Call(self.node_comm.Iallgather, (mine, mates), mates)
        return self._two_phase_plan(send, recv, mates)

    def _count_buffers(self, send_expert: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        send = np.ascontiguousarray(send_expert, dtype=np.int64)
        if send.shape != (self.experts,):
            raise ValueError(
                f"per-expert counts have shape {send.shape}, expected ({self.experts},)"
            )
        return send, np.empty(self.experts, dtype=np.int64)

    def _node_count_buffers(
        self, send: np.ndarray, recv: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """This rank's rows to and from every ep rank, and room for every node mate's."""
        assert self.node_comm is not None
        mine = np.concatenate(
            (
                send.reshape(self.size, self.per_rank).sum(axis=1),
                recv.reshape(self.size, self.per_rank).sum(axis=1),
            )
        )
        return mine, np.empty((self.node_comm.size, mine.size), dtype=np.int64)

    def _two_phase_plan(
        self, send: np.ndarray, recv: np.ndarray, mates: np.ndarray
    ) -> DispatchPlan:
        return build_dispatch_plan(
            send,
            recv.reshape(self.size, self.per_rank),
            layout=self.layout,
            me=self.rank,
            node_counts=mates,
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
            result = self._exchange(rows, exchange, out)
            self._record(rows, t0)
            return result
        return self._exchange(rows, exchange, out)

    def _record(self, rows: Any, t0: int) -> None:
        """The ALLTOALL trace event of one exchange of `rows` that started at `t0`."""
        from hpcpipe.io.trace import EventKind

        rec = self.recorder
        rec.record(
            EventKind.ALLTOALL,
            -1,
            -1,
            t0,
            rec.now(),
            int(getattr(rows, "nbytes", 0)),
            value=float(len(rows)),
        )

    def alltoallv_op(self, rows: Any, exchange: Exchange) -> Operation:
        """`alltoallv` as a step a layer yields (`hpcpipe.model.steps`): in an overlapped pair
        each phase's exchange is in flight while the other half computes. Its trace event
        spans start to completion."""
        return Operation(self.alltoallv, self._exchange_steps, rows, exchange)

    def _exchange(self, rows: Any, exchange: Exchange, out: Any = None) -> Any:
        if exchange.hierarchical is None:  # the common path: nothing in the way
            return self._alltoallv(self.comm, rows, exchange.send_spec, exchange.recv_spec, out)
        phases = self._phases(rows, exchange, out)
        try:
            spec = next(phases)
            while True:
                spec = phases.send(self._alltoallv(*spec))
        except StopIteration as stop:
            return stop.value

    def _exchange_steps(self, rows: Any, exchange: Exchange) -> Generator[Any, Any, Any]:
        maybe_fail("alltoall")
        rec = self.recorder
        t0 = rec.now() if rec is not None and rec.enabled else None
        phases = self._phases(rows, exchange)
        try:
            spec = next(phases)
            while True:
                spec = phases.send((yield self._collective(*spec)))
        except StopIteration as stop:
            result = stop.value
        if t0 is not None:
            self._record(rows, t0)
        return result

    def _phases(self, rows: Any, exchange: Exchange, out: Any = None) -> Generator[Any, Any, Any]:
        """The exchange as the Alltoallv calls it is made of: yields each one's arguments
        (comm, rows, send counts, receive counts, out) and is sent the rows it received."""
        h = exchange.hierarchical
        if h is None:
            return (yield (self.comm, rows, exchange.send_spec, exchange.recv_spec, out))
        mid = yield (self.node_comm, _take(rows, h.index1), h.send1_spec, h.recv1_spec, None)
        last = yield (
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
        if (self.size if comm is self.comm else comm.size) == 1:  # nothing moves
            if out is None:
                return rows
            out[...] = rows
            return out
        shape = (recv.total, *rows.shape[1:])
        host = type(rows) is np.ndarray
        if out is None:
            out = (np if host else array_module(rows)).empty(shape, dtype=rows.dtype)
        elif out.shape != shape or out.dtype != rows.dtype:
            raise ValueError(
                f"receive buffer is {out.dtype}{out.shape}, expected {rows.dtype}{shape}"
            )
        if host:  # the common path stays a few attribute lookups away from raw Alltoallv
            sbuf = rows if rows.flags.c_contiguous else np.ascontiguousarray(rows)
            rbuf = out
        else:
            sbuf, rbuf = self._device_buffers(rows, out)
        rtype = self._types.get((rows.dtype, shape[1:])) or self._row_type(rows.dtype, shape[1:])
        comm.Alltoallv(
            [sbuf, (send.counts, send.displs), rtype], [rbuf, (recv.counts, recv.displs), rtype]
        )
        if rbuf is not out:
            backend = active_backend()
            if backend is not None and backend.on_gpu:
                backend.finish_recv(out, rbuf, "a2a.recv")  # async, ordered before later kernels
            else:
                out.set(rbuf)
        return out

    def _collective(
        self, comm: MPI.Comm, rows: Any, send: RowCounts, recv: RowCounts, out: Any = None
    ) -> _Call | _Done:
        """`_alltoallv` to be started and waited for later (an overlapped pair): the same
        buffers, except that a staged exchange takes a staging slot of its own, since two can
        be in flight at once; it is given back when the exchange completes."""
        if (self.size if comm is self.comm else comm.size) == 1:  # nothing moves
            if out is None:
                return _Done(rows)
            out[...] = rows
            return _Done(out)
        shape = (recv.total, *rows.shape[1:])
        host = type(rows) is np.ndarray
        if out is None:
            out = (np if host else array_module(rows)).empty(shape, dtype=rows.dtype)
        rtype = self._types.get((rows.dtype, shape[1:])) or self._row_type(rows.dtype, shape[1:])
        slot = None
        if host:
            sbuf = rows if rows.flags.c_contiguous else np.ascontiguousarray(rows)
            rbuf = out
        else:
            backend = active_backend()
            if not self.cuda_aware and backend is not None and backend.on_gpu:
                busy = self._slots_busy
                slot = min(set(range(len(busy) + 1)) - busy)
                busy.add(slot)
            try:
                sbuf, rbuf = self._device_buffers(rows, out, f".{slot}" if slot else "")
            except BaseException:
                self._slots_busy.discard(slot)  # type: ignore[arg-type]
                raise
        args = (
            [sbuf, (send.counts, send.displs), rtype],
            [rbuf, (recv.counts, recv.displs), rtype],
        )
        if rbuf is out:
            return _Call(comm.Ialltoallv, args, out)
        return _Call(comm.Ialltoallv, args, out, rbuf, slot, self._slots_busy)

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
        pinned staging buffers of `slot`, reused from call to call (plain host copies without
        one)."""
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
    """An exchange with nothing to move: its result is already there."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def start(self) -> _Done:
        return self

    def wait(self) -> Any:
        return self.value


class _Call:
    """A nonblocking MPI collective with its arguments: `start` posts it, `wait` completes it.
    A staged receive (`rbuf`) is copied into its device array then, and its staging slot given
    back whatever happens."""

    __slots__ = ("args", "busy", "nonblocking", "out", "rbuf", "request", "slot")

    def __init__(
        self,
        nonblocking: Any,
        args: tuple[Any, ...],
        out: Any,
        rbuf: Any = None,
        slot: int | None = None,
        busy: set[int] | None = None,
    ):
        self.nonblocking, self.args, self.out = nonblocking, args, out
        self.rbuf, self.slot, self.busy = rbuf, slot, busy
        self.request: MPI.Request | None = None

    def start(self) -> _Call:
        try:
            self.request = self.nonblocking(*self.args)
        except BaseException:
            self._release()
            raise
        return self

    def wait(self) -> Any:
        assert self.request is not None, "wait() before start()"
        try:
            self.request.Wait()
            self.request = None
            out, rbuf = self.out, self.rbuf
            if rbuf is not None:
                backend = active_backend()
                if backend is not None and backend.on_gpu:  # async, before later kernels
                    backend.finish_recv(
                        out, rbuf, "a2a.recv" + (f".{self.slot}" if self.slot else "")
                    )
                else:
                    out.set(rbuf)
            return out
        finally:
            self._release()

    def _release(self) -> None:
        if self.busy is not None:
            self.busy.discard(self.slot)  # type: ignore[arg-type]
            self.busy = None
