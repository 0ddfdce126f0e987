"""Small helpers shared by the schedule generators: argument checks and array assembly.

Generators describe a rank's order as phases; each phase repeats a short pattern of actions a
number of times, and some slots of the pattern are empty in some repetitions (no forward left,
no weight update deferred yet). `phase` turns such a pattern into flat arrays with numpy, so
building a schedule for p=1024, m=4096 costs milliseconds per rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hpcpipe.schedules.ir import Kind, Schedule
from hpcpipe.schedules.listsched import unit_costs
from hpcpipe.schedules.simulate import simulate

__all__ = ["COMPACT_MAX_P", "Slot", "check_pm", "concat", "fastest", "phase"]

COMPACT_MAX_P = 64
"""Above this many ranks the constructions that cost more than linear time in the number of
actions (grid compaction, greedy builds for small m) are skipped."""

Slot = tuple[Kind, int, np.ndarray, np.ndarray | bool]
"""(kind, stage, microbatch per repetition, present per repetition)."""


def check_pm(name: str, p: int, m: int) -> None:
    """Reject non-integer or non-positive rank and microbatch counts with a clear message."""
    for key, value in (("p", p), ("m", m)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise ValueError(f"{name}: {key} must be an integer, got {value!r}")
        if value < 1:
            raise ValueError(f"{name}: {key} must be >= 1 (got {key}={value})")


def phase(count: int, slots: Sequence[Slot]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Repeat a pattern of slots `count` times: (kinds, stages, microbatches), empties removed."""
    count = max(int(count), 0)
    n = len(slots)
    kinds = np.empty((count, n), dtype=np.int8)
    stages = np.empty((count, n), dtype=np.int32)
    mbs = np.empty((count, n), dtype=np.int64)
    keep = np.empty((count, n), dtype=bool)
    for j, (kind, stage, mb, present) in enumerate(slots):
        kinds[:, j] = int(kind)
        stages[:, j] = stage
        mbs[:, j] = mb
        keep[:, j] = present
    keep = keep.ravel()
    return kinds.ravel()[keep], stages.ravel()[keep], mbs.ravel()[keep]


def concat(parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, ...]:
    """Join phases into one rank's (kinds, stages, microbatches)."""
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))


def fastest(candidates: Sequence[Schedule], p: int) -> Schedule:
    """The candidate with the shortest makespan under unit costs (ties: the earliest) among
    those holding no more activations than the first, the schedule's defining order: a
    generator's choice never changes the memory its name promises."""
    costs = unit_costs(p)(candidates[0].num_stages)
    runs = [simulate(c, costs) for c in candidates]
    limit = float(runs[0].peak_memory.max()) * (1 + 1e-9)
    best = 0
    for i, run in enumerate(runs):
        span = runs[best].makespan
        fits = float(run.peak_memory.max()) <= limit
        if fits and run.makespan < span - 1e-9 * max(1.0, span):
            best = i
    return candidates[best]
