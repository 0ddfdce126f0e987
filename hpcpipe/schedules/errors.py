"""`ScheduleError`: what is wrong with a schedule, shown on the rank x step grid.

A message alone ("3W2 missing") is hard to act on in a schedule of thousands of actions; the grid
shows the neighbourhood of the problem the way the papers draw schedules, with the offending
cells in brackets.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from hpcpipe.schedules.ir import Action, Kind, Schedule

__all__ = ["ScheduleError", "format_step_grid"]

_KINDS = [Kind(k) for k in range(len(Kind))]


def _cell(schedule: Schedule, index: int) -> str:
    return str(
        Action(
            int(schedule.stages[index]),
            _KINDS[int(schedule.kinds[index])],
            int(schedule.microbatches[index]),
        )
    )


def format_step_grid(
    schedule: Schedule,
    marks: Iterable[tuple[int, int]] = (),
    *,
    max_steps: int = 24,
    max_ranks: int = 16,
) -> str:
    """Rank x step table of action strings; `marks` are (rank, step) cells shown as `[2F0]`.

    Large schedules are cut to a window around the first mark (steps) and to the marked ranks
    and their neighbours (ranks), with the cut stated, so the message stays readable.
    """
    p = schedule.num_ranks
    lengths = np.diff(schedule.offsets)
    marks = sorted({(int(r), int(s)) for r, s in marks})
    longest = int(lengths.max()) if p else 0
    width_total = max(longest, 1)
    focus = marks[0][1] if marks else 0
    lo = max(0, min(focus - max_steps // 2, width_total - max_steps))
    hi = min(width_total, lo + max_steps)
    if p <= max_ranks:
        ranks = list(range(p))
    else:
        wanted = {0, p - 1}
        for r, _ in marks:
            wanted.update({r - 1, r, r + 1})
        ranks = sorted(r for r in wanted if 0 <= r < p)[:max_ranks]
    marked = set(marks)
    columns = list(range(lo, hi))
    table: list[list[str]] = []
    for r in ranks:
        row = []
        for step in columns:
            text = _cell(schedule, int(schedule.offsets[r]) + step) if step < lengths[r] else ""
            row.append(f"[{text or '?'}]" if (r, step) in marked else f" {text} ")
        table.append(row)
    widths = [
        max([len(str(step)) + 2] + [len(table[i][j]) for i in range(len(ranks))])
        for j, step in enumerate(columns)
    ]
    rank_w = max(4, len(str(p - 1)))
    lines = [
        f"{'rank':>{rank_w}} |"
        + "".join(f"{step:^{w}}" for step, w in zip(columns, widths, strict=True))
    ]
    previous = None
    for r, row in zip(ranks, table, strict=True):
        if previous is not None and r != previous + 1:
            lines.append(f"{'...':>{rank_w}} |")
        lines.append(
            f"{r:>{rank_w}} |" + "".join(f"{c:<{w}}" for c, w in zip(row, widths, strict=True))
        )
        previous = r
    notes = []
    if lo > 0 or hi < width_total:
        notes.append(f"steps {lo}..{hi - 1} of 0..{width_total - 1}")
    if len(ranks) < p:
        notes.append(f"ranks {', '.join(map(str, ranks))} of {p}")
    if notes:
        lines.append("(showing " + "; ".join(notes) + ")")
    return "\n".join(lines)


class ScheduleError(ValueError):
    """A schedule that cannot run as written: the message names the problem and shows the grid.

    `marks` holds the offending (rank, step) cells; `problem` is the one-line reason. The grid
    is drawn when the message is first read: the search's shift pass rejects thousands of
    orders this way and reads none of them (drawing each took 40% of its time).
    """

    def __init__(
        self,
        problem: str,
        schedule: Schedule | None = None,
        marks: Iterable[tuple[int, int]] = (),
    ):
        self.problem = problem
        self.marks = tuple(marks)
        self.schedule = schedule
        self._text: str | None = None
        named = f"schedule {schedule.name!r}: {problem}" if schedule is not None else problem
        super().__init__(named)

    def __reduce__(self) -> tuple[type, tuple[str]]:
        """Pickled (a process pool, MPI) with the whole message, grid drawn: the schedule
        does not travel."""
        return (type(self), (str(self),))

    def __str__(self) -> str:
        if self._text is None:
            text = str(self.args[0]) if self.args else ""
            if self.schedule is not None and self.schedule.num_actions:
                text += "\n" + format_step_grid(self.schedule, self.marks)
            self._text = text
        return self._text
