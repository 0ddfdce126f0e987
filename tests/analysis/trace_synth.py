"""Synthetic traces whose answers are known: the simulator's timeline written as trace events.

Each rank's compute actions get the simulator's start and end; a compute action whose input
comes from another rank is preceded by a receive wait (from the moment the rank was free to
the action's start) and its producer is followed by a zero-length send, which is exactly how
the runtime interleaves them. Steps follow each other with a gap; every rank gets a STEP event.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from hpcpipe.io.trace import EVENT_DTYPE, ClockSample, EventKind, save_trace
from hpcpipe.schedules.ir import Kind, Schedule, to_csv
from hpcpipe.schedules.simulate import CostModel, SimResult, simulate

K = EventKind

# A V-shape schedule with split backward, p = 2, m = 2: rank 0 holds stages 0 and 3.
V_SHAPE = Schedule.from_actions(
    [
        ["0F0", "0F1", "3F0", "3B0", "3W0", "3F1", "3B1", "0B0", "3W1", "0W0", "0B1", "0W1"],
        ["1F0", "2F0", "1F1", "2F1", "2B0", "1B0", "2W0", "2B1", "1B1", "1W0", "2W1", "1W1"],
    ],
    name="vshape-test",
)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B written out here, so these tests do not follow the generators' changes."""
    rows = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        acts = [f"{r}F{i}" for i in range(warm)]
        for i in range(m - warm):
            acts += [f"{r}F{warm + i}", f"{r}BW{i}"]
        acts += [f"{r}BW{i}" for i in range(m - warm, m)]
        rows.append(acts)
    return Schedule.from_actions(rows, name="1f1b", stages_of_rank=[(r,) for r in range(p)])


def timeline_events(
    sim: SimResult,
    *,
    steps: int = 1,
    gap: int = 1000,
    stretch: Callable[[int, int], float] | None = None,
    peak_bytes: Sequence[int] | None = None,
    world: Sequence[int] | None = None,
) -> list[np.ndarray]:
    """Per pipeline rank (or per world rank listed in `world`), events of `steps` steps.

    `stretch(step, rank)` scales the whole step of one rank's timeline (a straggling step).
    """
    sched = sim.schedule
    rank_of = sched.rank_of_stage
    last = sched.num_stages - 1
    period = int(np.ceil(sim.makespan)) + gap
    p = sched.num_ranks
    world = list(range(p)) if world is None else list(world)
    out: list[list[tuple]] = [[] for _ in range(max(world) + 1)]

    def row(step, kind, stage, mb, t0, t1, nbytes=0, peer=-1, value=0.0):
        return (int(t0), int(t1), nbytes, value, step, stage, mb, peer, int(kind))

    for step in range(steps):
        base = step * period
        for r in range(p):
            f = stretch(step, r) if stretch else 1.0
            me = world[r]
            evs = out[me]
            free = 0.0
            evs.append(
                row(
                    step,
                    K.STEP,
                    -1,
                    -1,
                    base,
                    base + sim.makespan * f,
                    nbytes=int(peak_bytes[r]) if peak_bytes else 0,
                )
            )
            for action, t0, t1 in sim.timeline(r):
                s, kind, mb = action
                peer = None
                if kind == Kind.F and s > 0 and rank_of[s - 1] != r:
                    peer, rk = rank_of[s - 1], K.RECV_F
                elif kind in (Kind.B, Kind.BW) and s < last and rank_of[s + 1] != r:
                    peer, rk = rank_of[s + 1], K.RECV_B
                if peer is not None:
                    evs.append(
                        row(step, rk, s, mb, base + free * f, base + t0 * f, 64, world[peer])
                    )
                evs.append(row(step, kind, s, mb, base + t0 * f, base + t1 * f))
                free = t1
                if kind == Kind.F and s < last and rank_of[s + 1] != r:
                    evs.append(
                        row(
                            step,
                            K.SEND_F,
                            s,
                            mb,
                            base + t1 * f,
                            base + t1 * f,
                            64,
                            world[rank_of[s + 1]],
                        )
                    )
                if kind in (Kind.B, Kind.BW) and s > 0 and rank_of[s - 1] != r:
                    evs.append(
                        row(
                            step,
                            K.SEND_B,
                            s,
                            mb,
                            base + t1 * f,
                            base + t1 * f,
                            64,
                            world[rank_of[s - 1]],
                        )
                    )
    return [np.array(e, dtype=EVENT_DTYPE) for e in out]


def write_synthetic(
    path: Path,
    schedule: Schedule,
    costs: CostModel,
    *,
    offsets: Sequence[int] | None = None,
    with_clock: bool = True,
    topology: dict | None = None,
    events: list[np.ndarray] | None = None,
    **kwargs,
) -> tuple[Path, SimResult]:
    """Write the synthetic trace of `schedule` under `costs`; `offsets` shift each rank's raw
    clock (and are recorded as its clock samples unless `with_clock` is False)."""
    sim = simulate(schedule, costs)
    evs = events if events is not None else timeline_events(sim, **kwargs)
    clocks = None
    if offsets is not None:
        evs = [e.copy() for e in evs]
        for e, off in zip(evs, offsets, strict=True):
            e["t_start"] += off
            e["t_end"] += off
        if with_clock:
            clocks = [
                [ClockSample(0, off, 2000), ClockSample(10**12, off, 2000)] for off in offsets
            ]
    meta = {"schedule": to_csv(schedule), "workload": "synthetic"}
    if topology is not None:
        meta["topology"] = topology
    save_trace(path, evs, meta, clocks=clocks)
    return path, sim
