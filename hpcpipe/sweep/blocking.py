"""How a KBA sweep is cut into tasks: a cost model of one task and the blocking it picks.

A task is (bx, by, z_block) cells x angle_block directions x G groups on one rank. Small tasks
fill the pipeline sooner (fewer idle stages at the corners) but pay the per-task costs (Python
around the kernel, posting and waiting for two face messages) more often. With every task
costing t and every face message m, the plan's makespan is exactly

    8 M t + hops (t + m),    hops = 2 (ceil(Px/2) - 1) + 2 (ceil(Py/2) - 1)  (nearest order;
                             2 (Px - 1) + 3 (Py - 1) for yx, xy swaps them)

(the closed form `plan.closed_form_stages` extended by the message on each hop; the plan
simulator agrees to round-off, a test checks it; under `nearest` while a message takes no
longer than a task, m <= t, as in every blocking worth running: beyond that the corners'
sweeps wait longer where they meet). Where receiving a face costs the receiver
CPU time (shared memory), t also carries the busiest rank's mean copies per task
(`receiving_share`: exact on up to 2 x 2 ranks under `nearest`, an upper bound otherwise).
`choose_blocking` evaluates it for every z_block dividing nz and every angle_block dividing the
directions of an octant and keeps the fastest. The costs are per kernel (`KERNEL_COSTS`),
measured by `hpcpipe bench sweep`, which prints the model's efficiency next to the measured
one. Pure: no MPI.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "KERNEL_COSTS",
    "Blocking",
    "SweepCost",
    "choose_blocking",
    "describe_blocking",
    "predict_makespan",
    "receiving_share",
]

MAX_TASKS = 16_384
"""Tasks per rank and sweep the choice may take: two tags per task stay within 32767, the
MPI_TAG_UB every MPI library guarantees."""


@dataclass(frozen=True)
class SweepCost:
    """Seconds one rank spends per KBA task, as a model: kernel + fixed costs + messages."""

    per_unknown: float
    """Kernel time per cell x direction x group."""
    per_task: float
    """Fixed time around each task (executor bookkeeping, boundary faces, posting receives)."""
    per_plane: float = 0.0
    """Per hyperplane of the block (the NumPy kernel's Python loop); 0 for compiled loops."""
    message: float = 0.0
    """Latency of one face message."""
    per_byte: float = 0.0
    """Inverse bandwidth of face messages."""
    copy_per_byte: float = 0.0
    """Time the receiving rank itself spends bringing a face in, per byte (shared memory: a
    copy by the CPU; ~0 where the network moves data without it). Paid on every received face,
    not only on the critical path's hops."""

    def task_seconds(self, block: tuple[int, int, int], directions: int, groups: int) -> float:
        bx, by, bz = block
        planes = bx + by + bz - 2
        unknowns = bx * by * bz * directions * groups
        return self.per_task + self.per_plane * planes + self.per_unknown * unknowns

    def message_seconds(self, face_cells: int, directions: int, groups: int) -> float:
        return self.message + self.per_byte * 8 * face_cells * directions * groups

    def copy_seconds(self, face_cells: int, directions: int, groups: int) -> float:
        return self.copy_per_byte * 8 * face_cells * directions * groups


KERNEL_COSTS: dict[str, SweepCost] = {
    # Measured by `hpcpipe bench sweep` on Kripke's problem (2-core x86_64, MPICH 5 shared
    # memory): numba 1.4-1.5 ns per unknown without the fix-up and 1.9-2.0 with it (a quarter
    # of the cells fix up there); tens of microseconds around each task; NumPy about 13 ns per
    # unknown and 25 us per hyperplane.
    "numba": SweepCost(
        per_unknown=2.0e-9, per_task=80e-6, message=30e-6, per_byte=1 / 5e9, copy_per_byte=1 / 12e9
    ),
    "numpy": SweepCost(
        per_unknown=13e-9,
        per_task=80e-6,
        per_plane=25e-6,
        message=30e-6,
        per_byte=1 / 5e9,
        copy_per_byte=1 / 12e9,
    ),
    # The CUDA kernel: one launch per task, a barrier per hyperplane inside it (a plane's
    # cells wait for the one before), little per unknown while the GPU has threads to spare.
    # Faces are device arrays: staged through the host unless MPI is CUDA-aware.
    "cuda": SweepCost(
        per_unknown=0.05e-9, per_task=60e-6, per_plane=2e-6, message=30e-6, per_byte=1 / 5e9
    ),
}


def hops(px: int, py: int, octant_order: str) -> int:
    """Pipeline fill stages of a whole sweep beyond its 8 M tasks (plan.closed_form_stages)."""
    if octant_order == "nearest":  # the four corners' sweeps meet in the middle
        return 2 * ((px + 1) // 2 - 1) + 2 * ((py + 1) // 2 - 1)
    if octant_order == "xy":
        return 3 * (px - 1) + 2 * (py - 1)
    if octant_order == "yx":
        return 2 * (px - 1) + 3 * (py - 1)
    raise ValueError(f"octant_order: {octant_order!r} is not one of nearest, yx, xy")


def receiving_share(ranks: int, octant_order: str) -> float:
    """Of the busiest rank's tasks, the share that receive a face along an axis of `ranks`
    ranks: none on one rank; under `nearest` on two, each rank receives only in the half of
    its tasks it starts second (exact: the simulator agrees); an inner rank receives always
    (an upper bound: the edge ranks of a wider grid receive less)."""
    if ranks == 1:
        return 0.0
    return 0.5 if ranks == 2 and octant_order == "nearest" else 1.0


def predict_makespan(
    px: int,
    py: int,
    local: tuple[int, int, int],
    directions: int,
    groups: int,
    z_block: int,
    angle_block: int,
    cost: SweepCost,
    octant_order: str = "nearest",
) -> float:
    """Seconds of one sweep under `cost`: 8 M t + hops (t + m) (module docstring), t with the
    busiest rank's mean face copies per task (`receiving_share`)."""
    bx, by, nz = local
    m = (nz // z_block) * (directions // angle_block)
    t = cost.task_seconds((bx, by, z_block), angle_block, groups)
    t += receiving_share(px, octant_order) * cost.copy_seconds(by * z_block, angle_block, groups)
    t += receiving_share(py, octant_order) * cost.copy_seconds(bx * z_block, angle_block, groups)
    # the face a hop waits for: the larger of the x and y faces of a task
    face = max(by if px > 1 else 0, bx if py > 1 else 0) * z_block
    msg = cost.message_seconds(face, angle_block, groups) if px * py > 1 else 0.0
    return 8 * m * t + hops(px, py, octant_order) * (t + msg)


@dataclass(frozen=True)
class Blocking:
    """The blocking a plan uses and what the model predicts for it."""

    z_block: int
    angle_block: int
    seconds: float
    """Predicted sweep time."""
    busy: float
    """Predicted kernel share of the sweep time (the rest: fixed costs, messages, fill)."""
    chosen: bool
    """Picked by the model (the deck left z_block or angle_block at 0)."""
    kernel: str = ""
    """The kernel whose costs the model used."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def choose_blocking(
    px: int,
    py: int,
    shape: tuple[int, int, int],
    directions: int,
    groups: int,
    cost: SweepCost,
    z_block: int = 0,
    angle_block: int = 0,
    octant_order: str = "nearest",
    kernel: str = "",
) -> Blocking:
    """The fastest blocking under `cost`; a nonzero `z_block` / `angle_block` is kept as given.

    Ties go to the larger blocks (fewer messages). Deterministic: every rank picks the same.
    """
    nx, ny, nz = shape
    local = (nx // px, ny // py, nz)
    zs = [z_block] if z_block else _divisors(nz)
    angles = [angle_block] if angle_block else _divisors(directions)
    candidates = [
        (zb, ab) for zb in zs for ab in angles if 8 * (nz // zb) * (directions // ab) <= MAX_TASKS
    ] or [(zs[-1], angles[-1])]
    # fastest first; among equals the larger blocks
    seconds, _, zb, ab = min(
        (
            predict_makespan(px, py, local, directions, groups, zb, ab, cost, octant_order),
            -zb * ab,
            zb,
            ab,
        )
        for zb, ab in candidates
    )
    bx, by, _ = local
    busy = cost.per_unknown * bx * by * nz * directions * 8 * groups / seconds
    return Blocking(zb, ab, seconds, busy, not (z_block and angle_block), kernel)


def describe_blocking(blocking: Blocking) -> str:
    """One line for the run log and `hpcpipe plan`: the blocking, who chose it, the model."""
    how = (
        f"chosen by the KBA cost model of the {blocking.kernel} kernel "
        "(sweep.z_block / angle_block = 0)"
        if blocking.chosen
        else "as the deck gives it"
    )
    return (
        f"  blocking z_block={blocking.z_block} angle_block={blocking.angle_block} {how}: "
        f"predicted sweep {blocking.seconds * 1e3:.3g} ms, kernel {100 * blocking.busy:.2g}% "
        "of it"
    )
