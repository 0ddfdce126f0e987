"""Point-to-point transport for pipeline activations and gradients, run from a `MessagePlan`.

Receives are persistent: every receive buffer of the plan gets one `Recv_init` when the mailbox
is built, and a step only `Start`s and `Wait`s them, so the per-message cost is two calls into
MPI (no request construction, no buffer parsing, no allocation). Messages into one stage and
direction share a tag (`hpcpipe.schedules.messages`), which is what lets a buffer and its request
serve a different microbatch each time; the validator proves each channel is received in the
order it is sent. Receives are posted `lookahead` actions ahead, so a sender never waits for its
receiver to reach the matching action.

Sends of host memory go out as `Isend` of the producer's array itself (zero copy; it must not
change until `drain`). Device memory goes either straight to a CUDA-aware MPI, once an event
recorded after the producing kernels has completed (an event, not a stream or device
synchronisation), or through pinned staging buffers with persistent `Send_init`s, reused once
their send completes (normally no more per channel than the receiver keeps buffers for it).
With `overlap`, a device send whose data is not ready yet is posted later (by `progress`
between actions, or before this rank blocks), so the host goes on queueing compute. A receive
into a staged buffer is copied to the device on the copy stream without blocking the host; a
direct receive into a device buffer waits first for the event recorded when the plan freed that
buffer (`release`), so MPI never overwrites data a queued kernel still reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from hpcpipe.backend import Backend
from hpcpipe.schedules.messages import BACKWARD, FORWARD, MessagePlan

__all__ = ["BACKWARD", "FORWARD", "Mailbox", "TagLimitError"]

_BYTE = MPI.BYTE


@dataclass(eq=False)
class _Slot:
    """One receive buffer of a channel, its persistent request, and what MPI writes into."""

    request: Any
    array: Any  # the buffer handed to the consumer (host memory, or device memory when direct)
    buffer: Any  # what MPI writes into (the array, or a pinned host buffer when staged)
    name: str  # the backend's staging slot name (staged), for the copy-back event
    freed: Any = None  # direct: event recorded when the plan released the buffer
    posted: bool = False
    arrived: bool = False  # completed by a `progress` poke: its status holds the message's
    status: Any = None


@dataclass(eq=False)
class _SendSlot:
    """A pinned staging buffer for a device send and its persistent request (staged path)."""

    request: Any
    buffer: np.ndarray
    name: str
    active: bool = False  # holds a message not yet known to be sent
    started: bool = False  # its send was started (not still waiting for the copy)

    def start(self) -> None:
        self.request.Start()
        self.started = True


class TagLimitError(ValueError):
    """The pipeline's channel tags (2 x stages) exceed the MPI library's MPI_TAG_UB."""


class Mailbox:
    """Sends and planned persistent receives of one rank on the pipeline communicator."""

    def __init__(
        self,
        comm: MPI.Comm,
        backend: Backend,
        plan: MessagePlan,
        shape: tuple[int, ...],
        dtype: Any,
        overlap: bool = False,
        blocking: bool = False,
    ):
        self.comm = comm
        self.backend = backend
        self.plan = plan
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.overlap = overlap
        """Defer a device send whose data is not ready instead of waiting for it. Safe only
        where this rank makes no blocking MPI call between actions other than through this
        mailbox (which posts deferred sends before it blocks): the interpreter turns it on for
        dense models, off when MoE all-to-alls run inside F and B."""
        self.blocking = blocking
        """Synchronous sends (`Ssend`): a send returns once its receive is posted. What a
        user asks for with [train] sends = "blocking"; the validator proves the order cannot
        deadlock that way for the plan's lookahead before the run starts."""
        self.sends_deferred = 0  # device sends posted after their action (overlap at work)
        self.host_waits = 0  # times the host waited for a device event or a staging slot
        self.send_pool_overflows = 0  # staged sends beyond the plan's buffers (see _send_slot)
        # TAG_UB is guaranteed on COMM_WORLD only (Open MPI does not copy it to derived comms)
        tag_ub = int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB))
        top = max([*plan.slots, *plan.send_slots], default=0)
        if top > tag_ub:
            raise TagLimitError(
                f"the pipeline's messages need tags up to {top} (two channels per stage) but "
                f"this MPI allows {tag_ub} (MPI_TAG_UB)"
            )
        self._host = not backend.on_gpu
        self._staged = backend.staged
        self._slots: dict[int, list[_Slot]] = {}
        self._slot_ids: set[int] = set()
        for tag, count in plan.slots.items():
            self._slots[tag] = [self._make_slot(tag, k, plan.peers[tag]) for k in range(count)]
        self._order = [self._slots[r.tag][r.slot] for r in plan.receives]
        self._send_to = [(d.peer, d.tag) for d in plan.sends]
        self._n_posts = self._n_waits = 0  # this step's, in plan order
        self._sends: list[Any] = []  # Isend requests (each keeps its array alive)
        self._send_slots: dict[int, list[_SendSlot]] = {}
        self._inflight: list[_SendSlot] = []
        self._deferred: list[tuple[Any, Callable[[], None]]] = []  # (event, post it)
        if self._host:  # the hot path of CPU runs, without the device branches
            self.post_recv = self._post_host  # type: ignore[method-assign]
            self.wait_recv = self._wait_host  # type: ignore[method-assign]

    # ------------------------------------------------------------------ receive buffers

    def _make_slot(self, tag: int, k: int, peer: int) -> _Slot:
        xp = self.backend.xp
        name = f"p2p.r{tag}.{k}"
        if self._host:
            array = np.empty(self.shape, self.dtype)
            buffer = array
            self._slot_ids.add(id(array))
        elif self._staged:
            array = None  # a fresh device array per message: the copy-back writes it
            buffer = self.backend.staging(self.nbytes, name).view(self.dtype).reshape(self.shape)
        else:
            array = xp.empty(self.shape, self.dtype)
            buffer = array
            self._slot_ids.add(id(array))
        request = self.comm.Recv_init(buffer, source=peer, tag=tag)
        slot = _Slot(request, array, buffer, name, status=MPI.Status())
        if not self._host and not self._staged:  # pool memory a queued kernel may still read
            slot.freed = self.backend.record_event()
        return slot

    def receive_buffers(self) -> list[Any]:
        """The arrays messages arrive in, allocated once for the run (host or direct device
        buffers; staged receives land in pinned staging memory, then in a new device array)."""
        return [
            slot.array for slots in self._slots.values() for slot in slots if slot.array is not None
        ]

    def post_recv(self, i: int) -> None:
        """Start the step's receive number `i` (`plan.receives[i]`) into its planned buffer."""
        slot = self._order[i]
        if slot.posted:
            self._busy(i)
        self._ready_to_receive(slot)
        slot.request.Start()
        slot.posted = True
        self._n_posts += 1

    def _post_host(self, i: int) -> None:
        slot = self._order[i]
        if slot.posted:
            self._busy(i)
        slot.request.Start()
        slot.posted = True
        self._n_posts += 1

    def _wait_host(self, i: int) -> Any:
        return self._complete(i).array

    def _complete(self, i: int) -> Any:
        """Wait for receive `i` (unless a test saw it arrive) and check its size."""
        slot = self._order[i]
        status = slot.status
        if slot.arrived:
            slot.arrived = False
        else:
            try:
                slot.request.Wait(status)
            except MPI.Exception as exc:
                self._failed(i, exc)
        if status.Get_count(_BYTE) != self.nbytes:
            self._wrong_size(i, status)
        slot.posted = False
        self._n_waits += 1
        return slot

    def _busy(self, i: int) -> None:
        raise RuntimeError(
            f"the buffer planned for the {self._what(i)} still holds an earlier message "
            "that was not received: receives must be posted and waited for in plan order"
        )

    def _failed(self, i: int, exc: MPI.Exception) -> None:
        raise RuntimeError(
            f"receiving the {self._what(i)}: {exc.Get_error_string()} (expected "
            f"{self.nbytes} bytes: shape {self.shape} {self.dtype}; do both ranks build "
            "the same model?)"
        ) from None

    def _wrong_size(self, i: int, status: MPI.Status) -> None:
        raise RuntimeError(
            f"the {self._what(i)} has {status.Get_count(_BYTE)} bytes, expected "
            f"{self.nbytes} (shape {self.shape} {self.dtype}); do both ranks build the "
            "same model?"
        )

    def _ready_to_receive(self, slot: _Slot) -> None:
        """The buffer may be written by MPI now: its last copy back to the device has landed
        (staged), or the kernels that read it before the plan released it are done (direct)."""
        if self._staged:
            event = self.backend.pending_copy(slot.name)
        else:
            event, slot.freed = slot.freed, None
        if event is not None and not event.done:
            self.host_waits += 1
            event.synchronize()

    def release(self, buffers: tuple[tuple[int, int], ...]) -> None:
        """The plan frees these (tag, slot) buffers: mark the point in the compute stream after
        which MPI may overwrite them (direct device buffers only; host and staged need none)."""
        for tag, k in buffers:
            self._slots[tag][k].freed = self.backend.record_event()

    @property
    def needs_release(self) -> bool:
        """Whether the interpreter must call `release` (device buffers handed to MPI)."""
        return self.backend.on_gpu and not self._staged

    def wait_recv(self, i: int) -> Any:
        """Block until receive number `i` completes; return its array (valid until the plan
        frees its buffer: after the last compute action of its stage and microbatch)."""
        if self._deferred:  # the peer may be waiting for one of them: never block on those
            self._post_deferred(block=True)
        slot = self._complete(i)
        if self._staged:
            array = self.backend.xp.empty(self.shape, self.dtype)
            self.backend.stage_in(array, slot.buffer, slot.name)
            return array
        return slot.array

    def _what(self, i: int) -> str:
        r = self.plan.receives[i]
        what = "activation" if r.direction == FORWARD else "gradient"
        return (
            f"{what} into stage {r.stage}, microbatch {r.microbatch}, from pipeline rank {r.peer}"
        )

    # ------------------------------------------------------------------ sends

    def send(self, array: Any, i: int) -> None:
        """Start the step's send number `i` (`plan.sends[i]`) of `array`; it must not change
        until `drain`."""
        peer, tag = self._send_to[i]
        if self.blocking:
            self._send_blocking(array, i, peer, tag)
            return
        if self._host:
            ids = self._slot_ids
            if id(array) in ids or id(array.base) in ids:
                array = array.copy()  # a receive buffer passed through: it will be reused
            sends = self._sends
            sends.append(self.comm.Isend(array, peer, tag))  # the request holds the array
            if len(sends) >= 64:
                self._reap()
            return
        self._check_size(array, i)
        if self._staged:
            slot = self._send_slot(tag, peer)
            copy = self.backend.stage_out(array, slot.name)
            slot.active, slot.started = True, False
            self._inflight.append(slot)
            if self.overlap and not copy.ready():
                self._defer(copy.event, slot.start)
                return
            if not copy.ready():
                self.host_waits += 1
            copy.wait()
            slot.start()
            return
        if id(array) in self._slot_ids:  # a receive buffer passed through: it will be reused
            array = array.copy()
        elif not array.flags.c_contiguous:
            array = self.backend.xp.ascontiguousarray(array)
        event = self.backend.record_event()

        def isend(array: Any = array) -> None:
            self._sends.append(self.comm.Isend(array, peer, tag))

        if event.done:
            isend()
        elif self.overlap:
            self._defer(event, isend)
        else:
            self.host_waits += 1
            event.synchronize()
            isend()

    def _send_blocking(self, array: Any, i: int, peer: int, tag: int) -> None:
        """`Ssend` once the bytes are there: host memory as is, device memory after its
        producer's event (CUDA-aware) or through a staging buffer; nothing stays in flight."""
        if self._host:
            self.comm.Ssend(array, peer, tag)
            return
        self._check_size(array, i)
        if self._staged:
            slot = self._send_slot(tag, peer)
            copy = self.backend.stage_out(array, slot.name)
            if not copy.ready():
                self.host_waits += 1
            copy.wait()
            self.comm.Ssend(slot.buffer, peer, tag)
            return
        if not array.flags.c_contiguous:
            array = self.backend.xp.ascontiguousarray(array)
        event = self.backend.record_event()
        if not event.done:
            self.host_waits += 1
            event.synchronize()
        self.comm.Ssend(array, peer, tag)

    def _check_size(self, array: Any, i: int) -> None:
        if array.nbytes != self.nbytes:
            d = self.plan.sends[i]
            raise RuntimeError(
                f"the {'activation' if d.direction == FORWARD else 'gradient'} for stage "
                f"{d.stage}, microbatch {d.microbatch}, has {array.nbytes} bytes, the "
                f"pipeline's messages {self.nbytes} (shape {self.shape} {self.dtype})"
            )

    def _send_slot(self, tag: int, peer: int) -> _SendSlot:
        """A free staging buffer of this channel: one whose send has completed, else a new one.
        Never waits for a send (a receiver may need this rank's later messages first); the
        pool settles at the sends in flight, normally no more than the receiver's buffers for
        the channel (`plan.send_slots`), and `send_pool_overflows` counts the times it grew
        beyond that."""
        pool = self._send_slots.setdefault(tag, [])
        for slot in pool:
            if not slot.active:
                return slot
        self._reap_slots()
        for slot in pool:
            if not slot.active:
                return slot
        if len(pool) >= max(1, self.plan.send_slots.get(tag, 1)):
            self.send_pool_overflows += 1
        name = f"p2p.s{tag}.{len(pool)}"
        buf = self.backend.staging(self.nbytes, name).view(self.dtype).reshape(self.shape)
        slot = _SendSlot(self.comm.Send_init(buf, dest=peer, tag=tag), buf, name)
        pool.append(slot)
        return slot

    def _defer(self, event: Any, post: Callable[[], None]) -> None:
        self._deferred.append((event, post))
        self.sends_deferred += 1

    def _post_deferred(self, block: bool) -> None:
        """Post the deferred sends whose data is ready (all of them, waiting, when `block`).
        Sends of one channel keep their order: a later one never overtakes an earlier one."""
        left = []
        for event, post in self._deferred:
            if not left and event.done:
                post()
            elif block:
                self.host_waits += 1
                event.synchronize()
                post()
            else:
                left.append((event, post))
        self._deferred = left

    # ------------------------------------------------------------------ progress, end of step

    def progress(self) -> None:
        """Let MPI move outstanding messages while this rank is between actions.

        Large messages use a rendezvous protocol that advances only inside MPI calls on both
        sides; without this poke a receiver can wait a whole compute action for a sender that
        has already posted its send. Deferred device sends whose data is ready go out here.
        """
        if self._deferred:
            self._post_deferred(block=False)
        if self._sends:
            self._reap()
        elif self._inflight:
            self._reap_slots()
        elif self._n_posts > self._n_waits:
            slot = self._order[self._n_waits]  # receives are waited for in plan order
            if slot.posted and not slot.arrived and slot.request.Test(slot.status):
                slot.arrived = True

    def _reap(self) -> None:
        self._sends = [r for r in self._sends if not r.Test()]

    def _reap_slots(self) -> None:
        left = []
        for slot in self._inflight:
            if slot.started and slot.request.Test():
                slot.active = False
            else:
                left.append(slot)
        self._inflight = left

    def describe_pending(self) -> str:
        """Outstanding traffic in words (read from the watchdog's thread: counts only)."""
        deferred = f", {len(self._deferred)} device sends not ready" if self._deferred else ""
        sends = len(self._sends) + len(self._inflight)
        posted = self._n_posts - self._n_waits
        return f"{sends} sends in flight, {posted} receives posted{deferred}"

    def drain(self) -> None:
        """Complete every outstanding send (end of step); receives must all have been consumed."""
        if self._deferred:
            self._post_deferred(block=True)
        if self._sends:
            MPI.Request.Waitall(self._sends)
            self._sends.clear()
        if self._inflight:
            for slot in self._inflight:
                slot.request.Wait()
                slot.active = False
            self._inflight.clear()
        posted = self._n_posts - self._n_waits
        self._n_posts = self._n_waits = 0  # the next step numbers its messages from 0
        if posted:
            left = ", ".join(
                f"stage {r.stage} mb {r.microbatch} {'F' if r.direction == FORWARD else 'B'}"
                for r, slot in zip(self.plan.receives, self._order, strict=True)
                if slot.posted
            )
            raise RuntimeError(f"receives posted but never consumed: {left}")

    def free(self) -> None:
        """Release the persistent requests (after the last step, before the communicator)."""
        self.drain()
        for slots in self._slots.values():
            for slot in slots:
                slot.request.Free()
        for pool in self._send_slots.values():
            for send_slot in pool:
                send_slot.request.Free()
        self._slots.clear()
        self._send_slots.clear()
        self._order.clear()
