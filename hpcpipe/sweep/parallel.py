"""The KBA executor: walks one rank's task list from a SweepPlan, its face fluxes moved by the
MPI layer's `FaceChannel` (hpcpipe.mpi.faces).

Receives are pre-posted a few tasks ahead; outgoing faces leave with nonblocking sends on the
channel's private communicator, tagged by task (x face `tag`, y face `tag + 1`), so no two
messages of a sweep can match the wrong receive and no other traffic can interfere. Sweeps are
separated by the solver's reductions, so tags may repeat from one sweep to the next.

With a trace recorder each task records one SWEEP_BLOCK event (stage = octant, microbatch =
the task's index in its octant, `angle_block * z_blocks + z_block`), each face message a SEND
on the sender and a RECV (the wait) on the receiver with that same (stage, microbatch) tag,
bytes, the peer's world rank and the axis in `value` (0 = x face, 1 = y face); the drain of
the last sends is a WAIT and each reduction an ALLREDUCE. Disabled, each hook is one test.

On a GPU (`xp` = cupy) the faces stay on the device (the channel hands them to a CUDA-aware MPI
directly, else through host copies); the boundary flows are summed on the device and copied to
the host once per sweep.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcpipe.backend import active_backend
from hpcpipe.io.trace import EventKind, Recorder
from hpcpipe.mpi import Comm
from hpcpipe.mpi.faces import FaceChannel, PostedFace
from hpcpipe.sweep.kernel import (
    angle_block,
    block_order,
    face_current,
    resolve_kernel,
    sweep_block,
)
from hpcpipe.sweep.mesh import Problem
from hpcpipe.sweep.plan import SweepPlan, SweepTask

__all__ = ["KBASweeper", "SweepTiming"]


@dataclass
class SweepTiming:
    """Where the last sweep's time went on this rank (seconds)."""

    wall: float = 0.0
    busy: float = 0.0
    wait: float = 0.0


class KBASweeper:
    """One rank's share of a pipelined sweep: `sweep(q)` returns this rank's (phi, outflow, inflow).

    The global reductions the solver needs (`allsum`, `allmax`) go through the same private
    communicator, so the solver itself never touches MPI.
    """

    def __init__(
        self,
        problem: Problem,
        plan: SweepPlan,
        comm: Comm,
        xp: Any = np,
        recv_depth: int = 4,
        device_buffers: bool = False,
        recorder: Recorder | None = None,
    ):
        if comm.size != plan.ranks:
            raise ValueError(
                f"the plan is for {plan.px} x {plan.py} = {plan.ranks} ranks but "
                f"the communicator has {comm.size}"
            )
        self.channel = FaceChannel(comm, plan.max_tag, xp, device_buffers)
        self.problem, self.plan, self.xp = problem, plan, xp
        self.rank = self.channel.rank
        self.ranks = self.channel.size
        self.recv_depth = max(1, recv_depth)
        self.timing = SweepTiming()
        bx, by, nz = plan.local_shape
        ix, iy = plan.coords(self.rank)
        self.x_cells = slice(ix * bx, (ix + 1) * bx)
        self.y_cells = slice(iy * by, (iy + 1) * by)
        quad, mesh = problem.quadrature, problem.mesh
        self.kernel = resolve_kernel(problem.kernel, xp)
        self._orders = {
            o: block_order(xp, (bx, by, plan.z_block), nz, o, self.kernel) for o in plan.octants
        }
        self._angles = [
            angle_block(xp, quad, *plan.angle_range(a), mesh.spacing, problem.scheme)
            for a in range(plan.angle_blocks)
        ]
        dx, dy, dz = mesh.spacing
        self._areas = (dy * dz, dx * dz, dx * dy)
        self._face_cells = (by * plan.z_block, bx * plan.z_block, bx * by)
        self.rec = recorder if recorder is not None else Recorder(self.rank, enabled=False)
        # trace tags and world-rank peers, computed once so the hooks only index
        self._tags = [
            (t.octant, t.angle_block * plan.z_blocks + t.z_block) for t in plan.tasks[self.rank]
        ]
        self._world = self.channel.world_ranks() if recorder is not None else []
        self._incident: dict[tuple[int, int, int], Any] = {}  # boundary faces on the device

    # ---------------------------------------------------------------- reductions for the solver
    def where(self) -> str:
        """This rank's place in the sweep, in plan terms (read by the watchdog's thread)."""
        tasks, t = self.plan.tasks[self.rank], getattr(self, "_task", -1)
        if t < 0:
            return f"sweep rank {self.rank}: between sweeps (iteration reductions, checkpoint)"
        if t >= len(tasks):
            return f"sweep rank {self.rank}: all {len(tasks)} tasks done, completing its sends"
        task = tasks[t]
        return (
            f"sweep rank {self.rank}: task {t}/{len(tasks)} ({task}), receiving faces from "
            f"ranks x={task.recv_x} y={task.recv_y} (-1 = boundary)"
        )

    def allsum(self, values: np.ndarray) -> np.ndarray:
        return self._allreduce(values, "sum")

    def allmax(self, values: np.ndarray) -> np.ndarray:
        return self._allreduce(values, "max")

    def _allreduce(self, values: np.ndarray, op: str) -> np.ndarray:
        t0 = time.perf_counter_ns()
        out = self.channel.allreduce(values, op)
        if self.rec.enabled:
            self.rec.record(EventKind.ALLREDUCE, -1, -1, t0, time.perf_counter_ns(), out.nbytes)
        return out

    def free(self) -> None:
        """Release the channel's communicator (after the last sweep)."""
        self.channel.free()

    def gather(self, local: np.ndarray) -> np.ndarray | None:
        """Assemble a per-cell array (bx, by, nz, ...) into the global one on rank 0."""
        out = self.channel.gather(local)
        if out is None:
            return None
        bx, by, _ = self.plan.local_shape
        full = np.empty((*self.problem.mesh.shape, *local.shape[3:]))
        for r in range(self.plan.ranks):
            ix, iy = self.plan.coords(r)
            full[ix * bx : (ix + 1) * bx, iy * by : (iy + 1) * by] = out[r]
        return full

    # ---------------------------------------------------------------- the sweep
    def _face_shape(self, axis: int, task: SweepTask) -> tuple[int, int, int]:
        return (self._face_cells[axis], self._angles[task.angle_block].size, self.problem.groups)

    def _boundary(self, axis: int, task: SweepTask) -> tuple[Any, bool]:
        """The incoming face at the domain boundary, and whether it carries any flux (a
        vacuum face adds nothing to the inflow: its current is not computed)."""
        side = 0 if (task.octant >> axis) & 1 == 0 else 1  # +direction enters at the low face
        value = self.problem.incident[2 * axis + side]
        shape = self._face_shape(axis, task)
        host = self.xp is np
        if not value.any():
            return (self.channel.take(shape, zero=True) if host else self.xp.zeros(shape)), False
        key = (axis, side, task.angle_block)
        face = self._incident.get(key)
        if face is None:  # copied to the device once; each task gets its own copy (it is updated)
            face = self._incident[key] = self.xp.asarray(np.broadcast_to(value, shape).copy())
        if not host:
            return face.copy(), True
        out = self.channel.take(shape)
        np.copyto(out, face)
        return out, True

    def _post(self, task: SweepTask) -> list[PostedFace | None]:
        posted: list[PostedFace | None] = []
        first = True
        for axis, peer in ((0, task.recv_x), (1, task.recv_y)):
            if peer < 0:
                posted.append(None)
                continue
            posted.append(
                self.channel.post(peer, task.tag + axis, self._face_shape(axis, task), sync=first)
            )
            first = False
        return posted

    def sweep(self, q: Any, sigma_t: Any) -> tuple[Any, np.ndarray, np.ndarray]:
        """All octants over this rank's block; `q`, `sigma_t` are (cells, G) on this rank."""
        xp, plan, problem = self.xp, self.plan, self.problem
        groups = problem.groups
        tasks = plan.tasks[self.rank]
        rec, tags, world = self.rec, self._tags, self._world
        now = time.perf_counter_ns  # the recorder's clock too
        phi = xp.zeros((int(np.prod(plan.local_shape)), groups))
        outflow = xp.zeros(groups)  # on the device: copied to the host once, at the end
        inflow = xp.zeros(groups)
        posted: dict[int, list] = {}
        busy = wait = 0
        start = now()
        for t in range(min(self.recv_depth, len(tasks))):
            posted[t] = self._post(tasks[t])
        fz = None
        for t, task in enumerate(tasks):
            self._task = t
            if t + self.recv_depth < len(tasks):
                posted[t + self.recv_depth] = self._post(tasks[t + self.recv_depth])
            angles = self._angles[task.angle_block]
            currents = (angles.wmu, angles.weta, angles.wxi)
            octant, sub = tags[t]
            faces = []
            t0 = now()
            for axis, got in enumerate(posted.pop(t)):
                if got is None:
                    face, lit = self._boundary(axis, task)
                    if lit:
                        inflow += self._areas[axis] * face_current(face, currents[axis])
                else:
                    w0 = now()
                    face, nbytes = self.channel.wait(got)
                    if rec.enabled:
                        peer = world[(task.recv_x, task.recv_y)[axis]]
                        rec.record(EventKind.RECV, octant, sub, w0, now(), nbytes, peer, axis)
                faces.append(face)
            if task.z_block == 0:
                fz, lit = self._boundary(2, task)
                if lit:
                    inflow += self._areas[2] * face_current(fz, angles.wxi)
            t1 = now()
            z0, _ = plan.z_range(task.z_block, task.octant)
            sweep_block(
                xp,
                self._orders[task.octant],
                z0,
                angles,
                q,
                sigma_t,
                phi,
                faces[0],
                faces[1],
                fz,
                problem.scheme,
                problem.fixup,
                self.kernel,
                self.channel.progress,
            )
            t2 = now()
            if rec.enabled:
                rec.record(EventKind.SWEEP_BLOCK, octant, sub, t1, t2)
            wait += t1 - t0
            busy += t2 - t1
            for axis, peer in ((0, task.send_x), (1, task.send_y)):
                if peer < 0:
                    outflow += self._areas[axis] * face_current(faces[axis], currents[axis])
                    self.channel.give_back(faces[axis])
                else:
                    s0 = now()
                    nbytes = self.channel.send(faces[axis], peer, task.tag + axis)
                    if rec.enabled:
                        rec.record(
                            EventKind.SEND, octant, sub, s0, now(), nbytes, world[peer], axis
                        )
            if task.z_block == plan.z_blocks - 1:
                outflow += self._areas[2] * face_current(fz, angles.wxi)
                self.channel.give_back(fz)
        t0 = now()
        self._task = len(tasks)
        self.channel.drain()
        self._task = -1
        end = now()
        if rec.enabled:
            rec.record(EventKind.WAIT, -1, -1, t0, end)
        self.timing = SweepTiming(
            wall=(end - start) * 1e-9, busy=busy * 1e-9, wait=(wait + end - t0) * 1e-9
        )
        if xp is not np:
            outflow, inflow = _host(xp, xp.stack((outflow, inflow)))  # one copy per sweep
        return phi, outflow, inflow


def _host(xp: Any, value: Any) -> np.ndarray:
    """A counted host copy of a device array (through the backend where there is one)."""
    if xp is np:
        return value
    backend = active_backend()
    return backend.to_host(value) if backend is not None else xp.asnumpy(value)
