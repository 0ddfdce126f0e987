"""Dependency arrays for the compute actions of a schedule, and the checks that need no timing.

Shared by the validator, the lowering pass and the simulator. Everything is vectorised over
all actions (numpy, 32-bit where it fits); a large unlowered schedule (tens of millions of
actions) is checked by one compiled pass instead (`_table_numba`, ~0.6 s where the NumPy path
takes ~2 s at p = 1024, m = 4096), which on any problem hands over to the NumPy path for the
report. Indices here are "compute indices": positions among the F/B/W/BW actions, grouped by
rank in execution order (communication actions are skipped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

import hpcpipe.schedules._compiled as _compiled
from hpcpipe.schedules.errors import ScheduleError
from hpcpipe.schedules.ir import Kind, Schedule

__all__ = ["ComputeTable", "compute_table", "cycle_error", "index_dtype", "step_of"]


def index_dtype(limit: int) -> type:
    """The narrowest signed integer type that holds 0..limit (int32 or int64)."""
    return np.int32 if limit < 2**31 - 1 else np.int64


@dataclass(frozen=True)
class ComputeTable:
    """Compute actions of `schedule` with their dependency structure.

    dep[a] is the compute index of the action whose result `a` consumes: the previous stage's
    F for an F, the next stage's backward for a B/BW (the own F on the last stage), the own B
    for a W; `n` (one past the end) when there is none. `cross[a]` says that the result
    arrives from another rank.
    """

    schedule: Schedule
    pos: np.ndarray  # position of each compute action in the schedule arrays
    kind: np.ndarray
    stage: np.ndarray
    mb: np.ndarray
    rank: np.ndarray
    offsets: np.ndarray  # per-rank ranges in compute-index space (p + 1)
    f_at: np.ndarray  # (stage * m + mb) -> compute index of F
    b_at: np.ndarray  # ... of B or BW
    dep: np.ndarray
    cross: np.ndarray
    pair_dep: np.ndarray | None = None
    """With overlapped pairs: per action, a second dependency (`n`: none): an F half also
    waits for its B half's input, since the two start together."""
    pair_cross: np.ndarray | None = None  # that second input arrives from another rank
    timed_dep: np.ndarray | None = None
    """With pairs: `dep` for timing, where a consumer of a pair's F half waits for the whole
    pair (its SEND follows the B half); None means `dep`."""

    @property
    def n(self) -> int:
        return int(self.kind.size)


def step_of(schedule: Schedule, position: int) -> tuple[int, int]:
    """Global array position -> (rank, step within that rank)."""
    r = int(np.searchsorted(schedule.offsets, position, side="right") - 1)
    return r, int(position - schedule.offsets[r])


def _name(kind: int, stage: int, mb: int) -> str:
    return f"{stage}{Kind(int(kind)).name}{mb}"


_last: list[ComputeTable] = []
"""The most recent table: validating and then simulating one schedule (what `hpcpipe plan`
and a job's start do) builds it once; a Schedule is immutable, so identity is enough."""


def compute_table(schedule: Schedule) -> ComputeTable:
    """Check what needs no timing and return the dependency arrays.

    Checks: every action's stage lives on its rank; each (stage, microbatch) has exactly one F
    and either one B and one W or one BW; on a rank, F comes before its B, B before its W, and
    where consecutive stages share a rank (the V turnaround) their order respects the data flow.
    """
    if _last and _last[0].schedule is schedule:
        return _last[0]
    table = _build_table(schedule)
    _last[:] = [table]
    return table


def _build_table(schedule: Schedule) -> ComputeTable:
    if not schedule.is_lowered and _compiled.wanted(schedule.num_actions):
        kernel = _compiled.kernel("_table_numba", "dependencies")
        table = None if kernel is None else _compiled_table(schedule, kernel)
        if table is not None:
            return table
    p, S, m = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    rank_of = schedule.rank_of_stage.astype(np.int32)
    all_ranks = np.repeat(np.arange(p, dtype=np.int32), np.diff(schedule.offsets))
    wrong = rank_of[schedule.stages] != all_ranks
    if wrong.any():
        i = int(np.flatnonzero(wrong)[0])
        s = int(schedule.stages[i])
        raise ScheduleError(
            f"rank {all_ranks[i]} runs "
            f"{_name(schedule.kinds[i], s, schedule.microbatches[i])} but stage {s} is "
            f"placed on rank {rank_of[s]} ({int(wrong.sum())} such action(s))",
            schedule,
            [step_of(schedule, i)],
        )
    del wrong

    if schedule.is_lowered:
        pos = np.flatnonzero(schedule.kinds < Kind.SEND_F)
        kind, stage, mb = schedule.kinds[pos], schedule.stages[pos], schedule.microbatches[pos]
        rank = all_ranks[pos]
        offsets = np.searchsorted(pos, schedule.offsets).astype(np.int64)
    else:
        pos = None  # the identity; set below
        kind, stage, mb = schedule.kinds, schedule.stages, schedule.microbatches
        rank, offsets = all_ranks, schedule.offsets
    del all_ranks
    n = int(kind.size)
    it = index_dtype(4 * S * m)
    key = stage.astype(it) * m + mb
    code = key * 4 + kind
    # Scatter every action into a (stage, microbatch, kind) table; a slot written twice keeps
    # only one writer, so reading back finds the duplicates; empty slots are missing actions.
    at = np.full(4 * S * m, n, dtype=index_dtype(n))
    idx = np.arange(n, dtype=at.dtype)
    at[code] = idx
    if pos is None:
        pos = idx
    duplicate = at[code] != idx
    del code
    at = at.reshape(S * m, 4)
    has = at < n
    bad = ~has[:, 0] | (has[:, 1] == has[:, 3]) | (has[:, 2] != has[:, 1])
    if duplicate.any():
        bad[key[duplicate]] = True
    if bad.any():
        _count_error(schedule, pos, key, kind, int(np.flatnonzero(bad)[0]), int(bad.sum()))
    del duplicate, has, bad
    f_at = at[:, 0].copy()
    b_at = np.where(at[:, 3] < n, at[:, 3], at[:, 1])
    del at

    is_f = kind == Kind.F
    is_w = kind == Kind.W
    is_b = ~(is_f | is_w)
    on_last = stage == S - 1
    dkey = key.copy()
    dkey[is_f] -= m
    dkey[is_b & ~on_last] += m
    np.clip(dkey, 0, S * m - 1, out=dkey)
    from_f = is_f | (is_b & on_last)
    dep = np.where(from_f, f_at[dkey], b_at[dkey])
    dep[is_f & (stage == 0)] = n
    del dkey, from_f
    rank_ext = np.append(rank, np.int32(-1))
    has_dep = dep < n
    cross = has_dep & (rank_ext[dep] != rank)

    # Same-rank order: a dependency on this rank must come earlier (compute index order is
    # execution order within a rank). B on a non-last stage also needs its own stage's F.
    late = has_dep & ~cross & (dep > idx)
    own_f = f_at[key]
    late_f = is_b & (own_f > idx)
    if late.any() or late_f.any():
        _order_error(schedule, pos, kind, stage, mb, rank, dep, own_f, late, late_f)
    return _with_pairs(
        ComputeTable(schedule, pos, kind, stage, mb, rank, offsets, f_at, b_at, dep, cross)
    )


def _compiled_table(schedule: Schedule, kernel: Callable[..., bool]) -> ComputeTable | None:
    """The table of a large unlowered schedule in one compiled pass
    (`_table_numba.dependencies`), the same arrays as the NumPy path; None when the
    schedule has a problem, which the NumPy path then reports."""
    p, S, m = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    n = schedule.num_actions
    rank = np.repeat(np.arange(p, dtype=np.int32), np.diff(schedule.offsets))
    it = index_dtype(n)
    f_at, b_at, dep = np.empty(S * m, dtype=it), np.empty(S * m, dtype=it), np.empty(n, dtype=it)
    cross = np.empty(n, dtype=bool)
    kind, stage, mb = schedule.kinds, schedule.stages, schedule.microbatches
    rank_of = schedule.rank_of_stage.astype(np.int32)
    if not kernel(kind, stage, mb, rank, rank_of, m, f_at, b_at, dep, cross):
        return None
    pos = np.arange(n, dtype=it)
    offsets = schedule.offsets
    return _with_pairs(
        ComputeTable(schedule, pos, kind, stage, mb, rank, offsets, f_at, b_at, dep, cross)
    )


def _with_pairs(table: ComputeTable) -> ComputeTable:
    """`table` with the dependencies of its schedule's overlapped pairs, if it has any."""
    if not table.schedule.pairs.size:
        return table
    pair_dep, pair_cross, timed_dep = _pair_deps(
        table.schedule, table.pos, table.stage, table.mb, table.dep, table.cross
    )
    return replace(table, pair_dep=pair_dep, pair_cross=pair_cross, timed_dep=timed_dep)


def _pair_deps(
    schedule: Schedule,
    pos: np.ndarray,
    stage: np.ndarray,
    mb: np.ndarray,
    dep: np.ndarray,
    cross: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The F half of a pair starts with its B half, so it also waits for the B half's input,
    and its result leaves with the pair (after the B half); the halves must not feed each
    other. Returns (second dependency, its crossing, dependencies for timing)."""
    n = int(dep.size)
    pf = np.searchsorted(pos, schedule.pairs)  # both halves are compute actions (Schedule)
    pb = pf + 1
    own = (stage[pf] == stage[pb]) & (mb[pf] == mb[pb])
    feeds = (dep[pb] == pf) | own
    if feeds.any():
        j = int(np.flatnonzero(feeds)[0])
        a, b = int(pf[j]), int(pb[j])
        half = _name(schedule.kinds[pos[b]], stage[b], mb[b])
        raise ScheduleError(
            f"pair {_name(Kind.F, stage[a], mb[a])}&{half}: the backward half needs the "
            "forward half's result, but a pair's halves start together (pair a forward with "
            "the backward of another microbatch)",
            schedule,
            [step_of(schedule, int(pos[a]))],
        )
    pair_dep = np.full(n, n, dtype=dep.dtype)
    pair_dep[pf] = dep[pb]
    pair_cross = np.zeros(n, dtype=bool)
    pair_cross[pf] = cross[pb]
    remap = np.arange(n + 1, dtype=dep.dtype)
    remap[pf] = pb
    return pair_dep, pair_cross, remap[dep]


def _count_error(
    schedule: Schedule, pos: np.ndarray, key: np.ndarray, kind: np.ndarray, first: int, total: int
) -> None:
    m = schedule.num_microbatches
    s, i = divmod(first, m)
    where = np.flatnonzero(key == first)
    nf, nb, nw, nbw = (int(np.count_nonzero(kind[where] == k)) for k in range(4))
    if nf != 1:
        why = f"stage {s} microbatch {i} has {nf} F (needs exactly one {s}F{i})"
    elif nb + nbw != 1:
        why = (
            f"stage {s} microbatch {i} has {nb} B and {nbw} BW (needs exactly one backward: "
            f"{s}B{i} with {s}W{i}, or {s}BW{i})"
        )
    elif nbw:
        why = f"stage {s} microbatch {i} has BW and also {nw} W ({s}BW{i} includes W)"
    else:
        why = (
            f"stage {s} microbatch {i} has {nb} B but {nw} W "
            f"(a split backward needs exactly one {s}W{i})"
        )
    if total > 1:
        why += f"; {total - 1} more (stage, microbatch) pair(s) are wrong too"
    raise ScheduleError(why, schedule, [step_of(schedule, int(pos[j])) for j in where])


def _order_error(schedule, pos, kind, stage, mb, rank, dep, own_f, late, late_f) -> None:
    first_dep = int(np.flatnonzero(late)[0]) if late.any() else None
    first_f = int(np.flatnonzero(late_f)[0]) if late_f.any() else None
    use_f = first_dep is None or (first_f is not None and first_f <= first_dep)
    a = first_f if use_f else first_dep
    d = int(own_f[a]) if use_f else int(dep[a])
    why = {
        Kind.W: "W needs its B first",
        Kind.B: "a backward needs its own forward and the next stage's backward",
        Kind.BW: "a backward needs its own forward and the next stage's backward",
        Kind.F: "a forward needs the previous stage's forward",
    }[Kind(int(kind[a]))]
    total = int(late.sum() + late_f.sum())
    raise ScheduleError(
        f"rank {rank[a]} runs {_name(kind[a], stage[a], mb[a])} before "
        f"{_name(kind[d], stage[d], mb[d])}, which it needs ({why}); "
        f"{total} action(s) out of order",
        schedule,
        [step_of(schedule, int(pos[a])), step_of(schedule, int(pos[d]))],
    )


def cycle_error(table: ComputeTable, heads: np.ndarray) -> ScheduleError:
    """No rank can start its next action: name each stuck action and what it waits for."""
    sched = table.schedule
    lines = []
    marks = []
    for a in heads[:6].tolist():
        d = int(table.dep[a])
        r, step = step_of(sched, int(table.pos[a]))
        dr, dstep = step_of(sched, int(table.pos[d]))
        lines.append(
            f"rank {r} step {step} {_name(table.kind[a], table.stage[a], table.mb[a])} waits "
            f"for {_name(table.kind[d], table.stage[d], table.mb[d])} (rank {dr} step {dstep})"
        )
        marks += [(r, step), (dr, dstep)]
    more = f"; {heads.size - 6} more rank(s) stuck" if heads.size > 6 else ""
    return ScheduleError(
        "dependency cycle: no rank can start its next action (it would deadlock): "
        + "; ".join(lines)
        + more,
        sched,
        marks,
    )
