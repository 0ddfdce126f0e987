"""The message plan of one pipeline rank: which tag each message travels on, when each receive
is posted, and which receive buffer it lands in. Pure data, like the schedule it comes from.

Tags are per channel, not per message: every activation stage s-1 sends to stage s travels on
tag 2s, every gradient stage s+1 sends back on tag 2s+1. MPI matches messages of one sender and
tag in the order they were sent, so this is correct exactly when, on every channel, the sender's
SEND order equals the receiver's RECV order: the validator proves it for every schedule the
runtime runs, and `channel_order_error` says where it fails in words.
The payoff is that tags no longer grow with microbatches and that a receive buffer with its
persistent request can serve a new microbatch each time, instead of one buffer per message.

A receive buffer is busy from the moment its receive is posted (`lookahead` actions before the
RECV, so the sender never waits for this rank to catch up) until the last compute action of its
(stage, microbatch) on this rank: the stage may keep its input or the incoming gradient in the
context it holds until W. Buffers of one channel are assigned greedily in posting order, which
needs exactly the peak number of simultaneously busy ones: the plan's live-buffer count, not
the number of microbatches (p for 1F1B, m for GPipe, as their memory is).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from hpcpipe.schedules.ir import Kind, Schedule

__all__ = [
    "BACKWARD",
    "FORWARD",
    "MessagePlan",
    "Receive",
    "Send",
    "assign_slots",
    "channel_order_error",
    "channel_tag",
    "ping_pong",
    "plan_messages",
]

FORWARD, BACKWARD = 0, 1


def channel_tag(stage: int, direction: int) -> int:
    """The tag of every message into `stage` in `direction` (FORWARD: activations from stage-1,
    BACKWARD: gradients from stage+1)."""
    return 2 * stage + direction


@dataclass(frozen=True)
class Receive:
    """One receive of one step: which message, from whom, into which buffer, and when."""

    stage: int  # the receiving stage (on this rank)
    microbatch: int
    direction: int
    peer: int  # the pipeline rank that sends it
    slot: int  # the buffer of its channel it lands in
    post_at: int  # posted before the action at this position runs
    release_after: int  # its buffer is free once the action at this position has run

    @property
    def tag(self) -> int:
        return channel_tag(self.stage, self.direction)

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.stage, self.microbatch, self.direction)


@dataclass(frozen=True)
class Send:
    """One send of one step, in the rank's order."""

    stage: int  # the receiving stage (on `peer`)
    microbatch: int
    direction: int
    peer: int

    @property
    def tag(self) -> int:
        return channel_tag(self.stage, self.direction)


@dataclass(frozen=True)
class MessagePlan:
    """The receives of one rank in posting (= RECV) order, its sends in SEND order, and the
    buffers each channel needs."""

    rank: int
    receives: tuple[Receive, ...]
    slots: dict[int, int]  # tag -> buffers that channel needs
    peers: dict[int, int]  # tag -> the rank its messages come from
    sends: tuple[Send, ...] = ()
    send_slots: dict[int, int] = field(default_factory=dict)
    """Outgoing tag -> buffers the receiving rank keeps for it: the most staged sends of that
    channel worth keeping in flight (more would only wait for the receiver)."""
    lookahead: int = 8

    @property
    def receive_buffers(self) -> int:
        """Receive buffers of this rank, all channels (the plan's live-buffer count)."""
        return sum(self.slots.values())

    def releases(self) -> dict[int, tuple[tuple[int, int], ...]]:
        """Action position -> the (tag, slot) buffers that become free once it has run."""
        out: dict[int, list[tuple[int, int]]] = {}
        for r in self.receives:
            out.setdefault(r.release_after, []).append((r.tag, r.slot))
        return {pos: tuple(v) for pos, v in out.items()}

    def describe(self, message_bytes: int, staged: bool = False) -> str:
        """One line for the log: the buffers this plan keeps, and their bytes (with `staged`,
        the pinned staging buffers of device sends too)."""
        n = self.receive_buffers + (sum(self.send_slots.values()) if staged else 0)
        kib = n * message_bytes / 1024
        size = f"{kib / 1024:.1f} MiB" if kib >= 1024 else f"{kib:.0f} KiB"
        sends = f" + {sum(self.send_slots.values())} staged send buffers" if staged else ""
        return (
            f"p2p plan: {len(self.receives)} receives/step on {len(self.slots)} channels in "
            f"{self.receive_buffers} persistent buffers (lookahead {self.lookahead}){sends}, "
            f"{size}"
        )


def assign_slots(intervals: list[tuple[int, int, int]]) -> tuple[list[int], dict[int, int]]:
    """Buffers for busy intervals (channel, start, end), given in order of start: the buffer of
    each interval and the count per channel. An interval starting after another's end (strictly)
    may take its buffer; greedy in start order needs no more than the peak overlap."""
    free: dict[int, list[int]] = {}
    busy: dict[int, list[tuple[int, int]]] = {}
    count: dict[int, int] = {}
    out = []
    last_start: dict[int, int] = {}
    for channel, start, end in intervals:
        if start < last_start.get(channel, start):
            raise ValueError("intervals must be given in order of start, per channel")
        last_start[channel] = start
        b, f = busy.setdefault(channel, []), free.setdefault(channel, [])
        while b and b[0][0] < start:
            heapq.heappush(f, heapq.heappop(b)[1])
        if f:
            slot = heapq.heappop(f)
        else:
            slot = count.get(channel, 0)
            count[channel] = slot + 1
        heapq.heappush(b, (end, slot))
        out.append(slot)
    return out, count


def _receives_of(schedule: Schedule, rank: int, lookahead: int) -> list[tuple]:
    """(stage, mb, direction, peer, post_at, release_after) per RECV of `rank`, in order."""
    lo, hi = int(schedule.offsets[rank]), int(schedule.offsets[rank + 1])
    kinds = schedule.kinds[lo:hi].tolist()
    stages = schedule.stages[lo:hi].tolist()
    mbs = schedule.microbatches[lo:hi].tolist()
    last_use: dict[tuple[int, int], int] = {}
    for pos, (k, s, mb) in enumerate(zip(kinds, stages, mbs, strict=True)):
        if k <= Kind.BW:
            last_use[(s, mb)] = pos
    rank_of = schedule.rank_of_stage
    out = []
    for pos, (k, s, mb) in enumerate(zip(kinds, stages, mbs, strict=True)):
        if k == Kind.RECV_F:
            direction, peer = FORWARD, int(rank_of[s - 1])
        elif k == Kind.RECV_B:
            direction, peer = BACKWARD, int(rank_of[s + 1])
        else:
            continue
        end = last_use.get((s, mb), pos)
        out.append((s, mb, direction, peer, max(0, pos - lookahead + 1), max(end, pos)))
    return out


def plan_messages(schedule: Schedule, rank: int, lookahead: int = 8) -> MessagePlan:
    """The message plan of `rank` in a lowered, validated `schedule` (see the module docstring).

    `lookahead`: how many actions ahead of its RECV a receive is posted (at least 1).
    """
    if lookahead < 1:
        raise ValueError(f"lookahead must be >= 1 action, got {lookahead}")
    if not schedule.is_lowered and schedule.num_ranks > 1:
        raise ValueError("plan_messages needs the lowered schedule (validate() returns it)")
    mine = _receives_of(schedule, rank, lookahead)
    slot_of, counts = assign_slots(
        [(channel_tag(s, d), post, end) for s, _, d, _, post, end in mine]
    )
    receives = tuple(
        Receive(s, mb, d, peer, slot, post, end)
        for (s, mb, d, peer, post, end), slot in zip(mine, slot_of, strict=True)
    )
    peers = {r.tag: r.peer for r in receives}
    # what each receiving neighbour keeps for this rank's outgoing channels
    send_slots: dict[int, int] = {}
    neighbours = {int(schedule.rank_of_stage[t]) for t in _sent_to(schedule, rank)}
    for other in sorted(neighbours):
        theirs = _receives_of(schedule, other, lookahead)
        intervals = [(channel_tag(s, d), post, end) for s, _, d, _, post, end in theirs]
        _, their_counts = assign_slots(intervals)
        for s, _, d, peer, _, _ in theirs:
            if peer == rank:
                send_slots[channel_tag(s, d)] = their_counts[channel_tag(s, d)]
    sends = _sends_of(schedule, rank)
    return MessagePlan(rank, receives, counts, peers, sends, send_slots, lookahead)


def _sends_of(schedule: Schedule, rank: int) -> tuple[Send, ...]:
    lo, hi = int(schedule.offsets[rank]), int(schedule.offsets[rank + 1])
    rank_of = schedule.rank_of_stage
    out = []
    for k, s, mb in zip(
        schedule.kinds[lo:hi].tolist(),
        schedule.stages[lo:hi].tolist(),
        schedule.microbatches[lo:hi].tolist(),
        strict=True,
    ):
        if k == Kind.SEND_F:
            out.append(Send(s + 1, mb, FORWARD, int(rank_of[s + 1])))
        elif k == Kind.SEND_B:
            out.append(Send(s - 1, mb, BACKWARD, int(rank_of[s - 1])))
    return tuple(out)


def _sent_to(schedule: Schedule, rank: int) -> set[int]:
    """Stages that receive messages from `rank`."""
    lo, hi = int(schedule.offsets[rank]), int(schedule.offsets[rank + 1])
    kinds, stages = schedule.kinds[lo:hi], schedule.stages[lo:hi]
    fwd = stages[kinds == Kind.SEND_F] + 1
    bwd = stages[kinds == Kind.SEND_B] - 1
    return {int(s) for s in np.concatenate([fwd, bwd])}


def channel_order_error(schedule: Schedule) -> str | None:
    """Why per-channel tags would mismatch messages in a lowered `schedule`, or None.

    On each channel (receiving stage, direction) the microbatches must be received in the order
    they are sent; the first channel where they are not is named with both orders.
    """
    sent: dict[tuple[int, int], list[int]] = {}
    received: dict[tuple[int, int], list[int]] = {}
    columns = (schedule.kinds, schedule.stages, schedule.microbatches)
    for k, s, mb in zip(*(c.tolist() for c in columns), strict=True):
        if k == Kind.SEND_F:
            sent.setdefault((s + 1, FORWARD), []).append(mb)
        elif k == Kind.SEND_B:
            sent.setdefault((s - 1, BACKWARD), []).append(mb)
        elif k == Kind.RECV_F:
            received.setdefault((s, FORWARD), []).append(mb)
        elif k == Kind.RECV_B:
            received.setdefault((s, BACKWARD), []).append(mb)
    for (stage, direction), order in sorted(received.items()):
        theirs = sent.get((stage, direction), [])
        if order != theirs:
            i = next(
                (j for j, (a, b) in enumerate(zip(order, theirs, strict=False)) if a != b),
                min(len(order), len(theirs)),
            )
            what = "activations into" if direction == FORWARD else "gradients into"
            return (
                f"{what} stage {stage}: microbatches are sent in the order "
                f"{_excerpt(theirs, i)} but received in the order {_excerpt(order, i)} "
                f"(first difference at message {i}); messages of one channel share a tag, so "
                "they must be received in the order they are sent"
            )
    return None


def _excerpt(order: list[int], i: int) -> str:
    lo = max(0, i - 2)
    body = ", ".join(str(x) for x in order[lo : i + 3])
    return f"[{'..., ' if lo else ''}{body}{', ...' if i + 3 < len(order) else ''}]"


def ping_pong(microbatches: int) -> Schedule:
    """Two stages on two ranks, one microbatch at a time: F on rank 0, its activation to rank 1,
    the gradient straight back. The smallest real pipeline, for transport tests and benchmarks."""
    r0 = [(Kind.F, 0), (Kind.SEND_F, 0), (Kind.RECV_B, 0), (Kind.B, 0), (Kind.W, 0)]
    r1 = [(Kind.RECV_F, 1), (Kind.F, 1), (Kind.B, 1), (Kind.SEND_B, 1), (Kind.W, 1)]
    kinds, stages, mbs = [], [], []
    for row in (r0, r1):
        for mb in range(microbatches):
            for kind, stage in row:
                kinds.append(int(kind))
                stages.append(stage)
                mbs.append(mb)
    n = len(r0) * microbatches
    return Schedule("ping-pong", ((0,), (1,)), microbatches, [0, n, 2 * n], kinds, stages, mbs)
