"""The KBA sweep order as data: decomposition, per-rank task lists, validation and a simulator.

Ranks form a Px x Py grid over x-y (rank = ix + Px * iy); each owns all of z. A task is one
(octant, angle block, z-block) on one rank; it needs the x face from its upwind x neighbour and
the y face from its upwind y neighbour for the same task, and sends its outgoing faces downwind.
Every rank runs the same task sequence, so the blocks flow through the grid like microbatches
through pipeline stages. Pure Python: a plan for thousands of ranks builds and simulates here.

Stage counts (unit tasks, free messages), with M = angle blocks x z-blocks per octant:
one octant takes M + (Px - 1) + (Py - 1) stages; all eight, swept as four corner pairs
(both z directions of a corner back to back), take 8M + 2(Px - 1) + 3(Py - 1) stages with the
`yx` corner order (+x+y, +x-y, -x-y, -x+y: y flips first) and 8M + 3(Px - 1) + 2(Py - 1) with `xy`,
when every rank runs the same sequence.

The `nearest` order (the default) lets each rank start with the corners it is closest to: its
tasks are sorted by the rank's grid distance from the corner an octant enters at, then by the
`yx`/`xy` sequence. The four corners' sweeps then start at once, each from its own corner, and
meet in the middle: a whole sweep takes 8M + 2(ceil(Px/2) - 1) + 2(ceil(Py/2) - 1) stages (no
fill at all on 2 x 1 or 2 x 2 ranks; 8M + 12 instead of 8M + 35 on 8 x 8). It cannot deadlock:
a rank's sequence and every face it waits for both go up in (distance, octant rank in the
sequence, angle block, z-block), and a face comes from a rank one step closer to the corner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcpipe.sweep.blocking import KERNEL_COSTS, Blocking, choose_blocking, hops
from hpcpipe.sweep.quadrature import OCTANTS

__all__ = [
    "CORNER_ORDERS",
    "OCTANT_ORDERS",
    "PlanError",
    "Simulation",
    "SweepPlan",
    "SweepTask",
    "blocking_for",
    "build_plan",
    "closed_form_stages",
    "corner_distance",
    "plan_for",
    "resolve_order",
    "simulate",
    "validate",
]

OCTANT_ORDERS = ("nearest", "yx", "xy")
"""What `octant_order` may name (plus `auto` = nearest); `custom` marks a plan built from an
explicit octant list."""

CORNER_ORDERS: dict[str, tuple[int, ...]] = {
    # octant o has signs OCTANTS[o]; bit 0 = -x, bit 1 = -y, bit 2 = -z
    "yx": (0, 4, 2, 6, 3, 7, 1, 5),
    "xy": (0, 4, 1, 5, 3, 7, 2, 6),
}


class PlanError(ValueError):
    """The blocking does not fit the mesh, or a plan is inconsistent (missing peer, deadlock)."""


@dataclass(frozen=True)
class SweepTask:
    """One pipelined unit on one rank: which block to sweep, who feeds it, who it feeds.

    Neighbours are ranks or -1 at the domain boundary. The x face travels with tag `tag`, the
    y face with `tag + 1`; tags are unique per task within a sweep.
    """

    octant: int
    angle_block: int
    z_block: int
    recv_x: int
    recv_y: int
    send_x: int
    send_y: int
    tag: int

    def __str__(self) -> str:
        return f"o{self.octant}a{self.angle_block}z{self.z_block}"


@dataclass(frozen=True)
class SweepPlan:
    """Per-rank ordered task lists for one full sweep (all octants) and the blocking behind them."""

    px: int
    py: int
    shape: tuple[int, int, int]
    z_block: int
    directions: int
    angle_block: int
    octants: tuple[int, ...]
    """The corner sequence every rank follows (`nearest`: among corners at equal distance)."""
    tasks: tuple[tuple[SweepTask, ...], ...]
    order: str = "yx"
    """How the task lists were ordered: one of OCTANT_ORDERS, or custom."""

    @property
    def ranks(self) -> int:
        return self.px * self.py

    @property
    def local_shape(self) -> tuple[int, int, int]:
        nx, ny, nz = self.shape
        return (nx // self.px, ny // self.py, nz)

    @property
    def z_blocks(self) -> int:
        return self.shape[2] // self.z_block

    @property
    def angle_blocks(self) -> int:
        return self.directions // self.angle_block

    @property
    def tasks_per_octant(self) -> int:
        """M in the closed forms."""
        return self.z_blocks * self.angle_blocks

    @property
    def max_tag(self) -> int:
        return 2 * len(self.tasks[0]) - 1

    def coords(self, rank: int) -> tuple[int, int]:
        return (rank % self.px, rank // self.px)

    def rank_of(self, ix: int, iy: int) -> int:
        return ix + self.px * iy

    def z_range(self, z_block: int, octant: int) -> tuple[int, int]:
        """Local z cells [z0, z1) of a z-block (blocks are numbered in sweep order)."""
        b = z_block if OCTANTS[octant][2] > 0 else self.z_blocks - 1 - z_block
        return (b * self.z_block, (b + 1) * self.z_block)

    def angle_range(self, angle_block: int) -> tuple[int, int]:
        return (angle_block * self.angle_block, (angle_block + 1) * self.angle_block)

    def describe(self) -> str:
        bx, by, bz = self.local_shape
        order = " ".join(str(o) for o in self.octants)
        lines = [
            f"KBA plan: {self.px} x {self.py} ranks, mesh {'x'.join(map(str, self.shape))}, "
            f"local block {bx}x{by}x{bz}",
            f"  z-blocks {self.z_blocks} of {self.z_block} cells, angle blocks "
            f"{self.angle_blocks} of {self.angle_block} directions, M = {self.tasks_per_octant}"
            f" tasks per octant, {len(self.tasks[0])} per sweep",
            f"  octant order {self.order}: {order}"
            + (", each rank starting from its nearest corners" if self.order == "nearest" else ""),
        ]
        return "\n".join(lines)


def resolve_order(octant_order: str) -> str:
    """The order `octant_order` names (auto = nearest); raises PlanError for an unknown one."""
    name = "nearest" if octant_order == "auto" else octant_order
    if name not in OCTANT_ORDERS:
        raise PlanError(
            f"octant_order: unknown {octant_order!r}; known: auto, " + ", ".join(OCTANT_ORDERS)
        )
    return name


def _corner_sequence(order: str, px: int, py: int) -> tuple[int, ...]:
    """The corner sequence of an order; `nearest` breaks its ties with the shorter of yx / xy."""
    if order == "nearest":
        order = "yx" if py <= px else "xy"
    return CORNER_ORDERS[order]


def corner_distance(ix: int, iy: int, px: int, py: int, octant: int) -> int:
    """Grid steps from rank (ix, iy) to the rank where `octant`'s sweep enters the domain."""
    sx, sy, _ = OCTANTS[octant]
    return (ix if sx > 0 else px - 1 - ix) + (iy if sy > 0 else py - 1 - iy)


def build_plan(
    px: int,
    py: int,
    shape: tuple[int, int, int],
    directions: int,
    z_block: int = 0,
    angle_block: int = 0,
    octant_order: str = "auto",
    octants: tuple[int, ...] | None = None,
) -> SweepPlan:
    """KBA decomposition of `shape` cells over px x py ranks with the given blocking.

    `z_block` / `angle_block` of 0 mean one block; `octants` overrides the corner order (used to
    study single-octant pipelines). Raises PlanError when the blocking does not divide evenly.
    """
    nx, ny, nz = shape
    z_block = z_block or nz
    angle_block = angle_block or directions
    for what, n, d in (("nx", nx, px), ("ny", ny, py)):
        if d < 1 or n % d:
            raise PlanError(f"{what} = {n} cells cannot be split evenly over {d} ranks")
    if nz % z_block:
        raise PlanError(f"z_block = {z_block} does not divide nz = {nz}")
    if directions % angle_block:
        raise PlanError(
            f"angle_block = {angle_block} does not divide the {directions} directions per octant"
        )
    name = "custom" if octants is not None else resolve_order(octant_order)
    order = octants if octants is not None else _corner_sequence(name, px, py)
    rank_in_sequence = {o: i for i, o in enumerate(order)}
    keys = [
        (o, a, z)
        for o in order
        for a in range(directions // angle_block)
        for z in range(nz // z_block)
    ]
    per_rank = []
    for rank in range(px * py):
        ix, iy = rank % px, rank // px
        tasks = []
        for t, (o, a, z) in enumerate(keys):
            sx, sy, _ = OCTANTS[o]
            up_x, down_x = ix - sx, ix + sx
            up_y, down_y = iy - sy, iy + sy
            tasks.append(
                SweepTask(
                    octant=o,
                    angle_block=a,
                    z_block=z,
                    recv_x=up_x + px * iy if 0 <= up_x < px else -1,
                    recv_y=ix + px * up_y if 0 <= up_y < py else -1,
                    send_x=down_x + px * iy if 0 <= down_x < px else -1,
                    send_y=ix + px * down_y if 0 <= down_y < py else -1,
                    tag=2 * t,  # by the shared sequence: the same task has one tag everywhere
                )
            )
        if name == "nearest":  # stable: each (octant, angle block) keeps its z-blocks in order
            tasks.sort(
                key=lambda t, ix=ix, iy=iy: (
                    corner_distance(ix, iy, px, py, t.octant),
                    rank_in_sequence[t.octant],
                )
            )
        per_rank.append(tuple(tasks))
    return SweepPlan(
        px, py, shape, z_block, directions, angle_block, tuple(order), tuple(per_rank), name
    )


def closed_form_stages(px: int, py: int, tasks_per_octant: int, octants: str = "yx") -> int:
    """Stage count the KBA model predicts: 'one' octant, or all eight in an OCTANT_ORDERS
    order (module docstring)."""
    m = tasks_per_octant
    if octants == "one":
        return m + (px - 1) + (py - 1)
    if octants in OCTANT_ORDERS:
        return 8 * m + hops(px, py, octants)
    raise ValueError(f"octants: {octants!r} is not one of 'one', " + ", ".join(OCTANT_ORDERS))


@dataclass(frozen=True, eq=False)
class Simulation:
    """Predicted timeline of a plan: per rank and task, start and end times."""

    plan: SweepPlan
    start: np.ndarray
    end: np.ndarray
    task_time: float

    @property
    def makespan(self) -> float:
        return float(self.end.max())

    @property
    def stages(self) -> int:
        """Makespan in units of one task (the stage count when messages are free)."""
        return round(self.makespan / self.task_time)

    @property
    def efficiency(self) -> float:
        """Busy time over ranks x makespan: the parallel efficiency the model predicts."""
        busy = self.task_time * self.end.size
        return busy / (self.plan.ranks * self.makespan)


def simulate(
    plan: SweepPlan,
    task_time: float = 1.0,
    message_time: float = 0.0,
    copy_time: tuple[float, float] = (0.0, 0.0),
) -> Simulation:
    """Run the plan on a model machine: a task starts when the rank's previous task and the
    upwind tasks it needs have ended (plus `message_time` per received face), and takes
    `task_time` plus `copy_time[axis]` per face it receives (the receiver's share of moving it).

    Works from the task lists alone (not the closed forms), so it also proves the plan cannot
    deadlock: a rank waiting on a face nobody will send raises PlanError with the stuck tasks.
    """
    n_ranks = plan.ranks
    n_tasks = len(plan.tasks[0])
    index = [
        {(t.octant, t.angle_block, t.z_block): i for i, t in enumerate(ts)} for ts in plan.tasks
    ]
    start = np.full((n_ranks, n_tasks), np.nan)
    end = np.full((n_ranks, n_tasks), np.nan)
    done = [0] * n_ranks
    progress = True
    while progress:
        progress = False
        for r in range(n_ranks):
            tasks = plan.tasks[r]
            while done[r] < len(tasks):
                task = tasks[done[r]]
                key = (task.octant, task.angle_block, task.z_block)
                ready = end[r, done[r] - 1] if done[r] else 0.0
                blocked = False
                took = task_time
                for axis, peer in enumerate((task.recv_x, task.recv_y)):
                    if peer < 0:
                        continue
                    j = index[peer].get(key)
                    if j is None or np.isnan(end[peer, j]):
                        blocked = True
                        break
                    ready = max(ready, end[peer, j] + message_time)
                    took += copy_time[axis]
                if blocked:
                    break
                start[r, done[r]] = ready
                end[r, done[r]] = ready + took
                done[r] += 1
                progress = True
    if any(d < len(ts) for d, ts in zip(done, plan.tasks, strict=True)):
        stuck = [
            f"rank {r} at task {d} ({plan.tasks[r][d]})"
            for r, d in enumerate(done)
            if d < len(plan.tasks[r])
        ]
        raise PlanError(
            "plan deadlocks: "
            + "; ".join(stuck[:8])
            + (f"; ... {len(stuck) - 8} more" if len(stuck) > 8 else "")
        )
    return Simulation(plan, start, end, task_time)


def validate(plan: SweepPlan) -> Simulation:
    """Check every face sent is received by the named peer with the same tag and task, every
    receive has a sender, and the order cannot deadlock; returns the unit-time simulation."""
    n = plan.ranks
    lengths = {len(ts) for ts in plan.tasks}
    if len(plan.tasks) != n or len(lengths) != 1:
        raise PlanError(
            f"plan has {len(plan.tasks)} task lists of lengths {sorted(lengths)} for {n} ranks"
        )
    by_tag = [{t.tag: t for t in ts} for ts in plan.tasks]
    for r, tasks in enumerate(plan.tasks):
        if len(by_tag[r]) != len(tasks):
            raise PlanError(f"rank {r}: tags repeat within one sweep")
        for task in tasks:
            for axis, peer in ((0, task.send_x), (1, task.send_y)):
                if peer < 0:
                    continue
                if not 0 <= peer < n:
                    raise PlanError(f"rank {r} task {task}: sends to rank {peer} of {n}")
                match = by_tag[peer].get(task.tag)
                got = (match.recv_x, match.recv_y)[axis] if match else None
                if got != r or str(match) != str(task):
                    raise PlanError(
                        f"rank {r} task {task}: sends its {'xy'[axis]} face to rank "
                        f"{peer}, which does not expect it with tag {task.tag}"
                    )
            for axis, peer in ((0, task.recv_x), (1, task.recv_y)):
                if peer < 0:
                    continue
                match = by_tag[peer].get(task.tag)
                if match is None or (match.send_x, match.send_y)[axis] != r:
                    raise PlanError(
                        f"rank {r} task {task}: waits for an {'xy'[axis]} face from "
                        f"rank {peer}, which never sends it"
                    )
    return simulate(plan)


def blocking_for(
    cfg: Any, problem: Any, kernel: str | None = None, device: str = "cpu"
) -> Blocking:
    """The blocking of a `[sweep]` deck: z_block / angle_block as given, a 0 chosen by the KBA
    cost model of the kernel that runs (`kernel`, a resolved name; None: the deck's `kernel`
    resolved for `device`, the NumPy one where it cannot run: the deck checks say why)."""
    if kernel is None:
        import numpy

        from hpcpipe.sweep.kernel import resolve_kernel

        try:
            kernel = resolve_kernel(cfg.kernel, numpy if device == "cpu" else None)
        except ValueError:
            kernel = "numpy"
    order = resolve_order(cfg.octant_order)
    return choose_blocking(
        cfg.px,
        cfg.py,
        problem.mesh.shape,
        problem.quadrature.per_octant,
        problem.groups,
        KERNEL_COSTS[kernel],
        cfg.z_block,
        cfg.angle_block,
        order,
        kernel,
    )


def plan_for(cfg: Any, problem: Any, blocking: Blocking | None = None) -> SweepPlan:
    """The KBA plan of a `[sweep]` deck (`SweepConfig`) for its built `Problem`, cut as
    `blocking` says (default: `blocking_for` with the deck's kernel)."""
    blocking = blocking if blocking is not None else blocking_for(cfg, problem)
    return build_plan(
        cfg.px,
        cfg.py,
        problem.mesh.shape,
        problem.quadrature.per_octant,
        blocking.z_block,
        blocking.angle_block,
        cfg.octant_order,
    )
