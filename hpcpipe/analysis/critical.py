"""The critical path of one step: the chain of events that set when the step ended.

Walk back from the event that ended last. A receive that started waiting before its sender
started sending (a late sender) was held up by the sender: the path jumps to the send, and the
time from the send's end to the receive's end counts as `transfer`. Any other event was held
up by the rank's previous event (the latest one, recorded earlier, that ended before it
started); a gap between them counts as `idle`. The path's time splits exactly into the kinds of
the events on it, `transfer` and `idle` (including the lag of the path's first event behind the
step's start). Collectives are treated as local events: the path does not follow the last rank
to enter an allreduce.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from hpcpipe.analysis.messages import Messages, match_messages
from hpcpipe.io.trace import RECV_KINDS, EventKind, Trace

__all__ = ["CriticalPath", "critical_path"]

_TOLERANCE_NS = 100  # clock interpolation rounding: consecutive events may touch by a few ns


@dataclass(frozen=True)
class CriticalPath:
    """`events` are (rank, row) pairs in time order; `breakdown` is ns per label, summing to
    `end_ns - start_ns` (labels: event kind names, `transfer`, `idle`)."""

    step: int
    start_ns: int
    end_ns: int
    events: tuple[tuple[int, int], ...]
    breakdown: dict[str, int]

    @property
    def length_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def ranks(self) -> list[int]:
        """Ranks the path visits, in time order, consecutive repeats merged."""
        out: list[int] = []
        for r, _ in self.events:
            if not out or out[-1] != r:
                out.append(r)
        return out


def _step_rows(trace: Trace, step: int) -> list[np.ndarray]:
    """Row indices of each rank's events in `step`, STEP brackets left out."""
    out = []
    for r, ev in enumerate(trace.events):
        rows = trace.step_rows(r, step)
        out.append(rows[ev["kind"][rows] != EventKind.STEP])
    return out


def critical_path(trace: Trace, step: int, messages: Messages | None = None) -> CriticalPath:
    """The critical path of `step` (see the module docstring); `messages` saves re-matching."""
    messages = messages if messages is not None else match_messages(trace)
    rows = _step_rows(trace, step)
    if not any(r.size for r in rows):
        raise ValueError(f"{trace.path}: step {step} has no events (steps: {list(trace.steps)})")
    step_start = min(int(trace.events[r]["t_start"][i].min()) for r, i in enumerate(rows) if i.size)
    for r in range(trace.num_ranks):
        ev = trace.step_events(r, step)
        bracket = ev[ev["kind"] == EventKind.STEP]
        if bracket.size:
            step_start = min(step_start, int(bracket["t_start"].min()))
    ends = [(int(trace.events[r]["t_end"][i].max()), r) for r, i in enumerate(rows) if i.size]
    end, r = max(ends)
    ev = trace.events[r]
    i = int(rows[r][np.argmax(ev["t_end"][rows[r]])])
    recv_kinds = [int(k) for k in RECV_KINDS]
    by_recv = messages.by_recv
    names = [k.name for k in EventKind]
    breakdown: dict[str, int] = defaultdict(int)
    path: list[tuple[int, int]] = []
    limit = end  # the path is accounted up to here; everything later is already counted
    seen: set[tuple[int, int]] = set()
    while (r, i) not in seen:
        seen.add((r, i))
        path.append((r, i))
        ev = trace.events[r]
        t0, t1, kind = int(ev["t_start"][i]), int(ev["t_end"][i]), int(ev["kind"][i])
        sender = by_recv.get((r, i)) if kind in recv_kinds else None
        if sender is not None:
            s_t0 = int(trace.events[sender[0]]["t_start"][sender[1]])
            s_t1 = int(trace.events[sender[0]]["t_end"][sender[1]])
            if s_t0 > t0 and trace.events[sender[0]]["step"][sender[1]] == step:
                breakdown["transfer"] += max(0, min(t1, limit) - s_t1)
                limit = min(limit, max(s_t1, s_t0), t1)
                r, i = sender
                continue
        breakdown[names[kind]] += max(0, min(t1, limit) - t0)
        limit = t0
        mine = rows[r]
        cand = mine[(mine < i) & (ev["t_end"][mine] <= t0 + _TOLERANCE_NS)]
        if cand.size == 0:
            break
        j = int(cand[np.lexsort((cand, ev["t_end"][cand]))[-1]])
        breakdown["idle"] += max(0, t0 - int(ev["t_end"][j]))
        limit = min(limit, int(ev["t_end"][j]))
        i = j
    breakdown["idle"] += max(0, limit - step_start)
    path.reverse()
    total = sum(breakdown.values())
    if total != end - step_start:  # overlapping or misaligned events: keep the sum exact
        breakdown["idle"] = max(0, breakdown["idle"] + (end - step_start) - total)
    return CriticalPath(step, step_start, end, tuple(path), dict(breakdown))
