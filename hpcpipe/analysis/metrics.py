"""Figures of a trace: where each rank's time went, the bubble against the simulator, stragglers.

Definitions (times on the aligned clock, one step at a time, then summed over recorded steps):
- step window: from the earliest start to the latest end over all ranks (a STEP event, when
  recorded, widens it to the whole step); its length is the step time.
- per rank: `busy` is the union of compute events (F, B, W, BW, OPTIMIZER, SWEEP_BLOCK, EXPERT),
  `comm` the union of communication events (sends, receive waits, WAIT, collectives), `io` of
  CHECKPOINT and REPLAN (moving layers); `idle` is the rest of the step window. `overlap` is
  the share of comm time during which the rank also computed (asynchronous collectives),
  `late_sender` the part of its receive waits before the matching send had even started.
- bubble: over the pipeline actions only, as the simulator defines it: 1 - sum of the ranks'
  F/B/W/BW time / (ranks x span of the pipeline actions); `stage_bubble` is the papers'
  per-rank measure (max over ranks of 1 - own F/B/W/BW time / own span).
- predicted: `simulate` of the recorded schedule with the measured costs: the median F, B, W
  and BW time per stage and, for transfers, the median time from a send's start to the end of
  a receive that was already waiting for it. The difference to the measured bubble is what the
  model leaves out (send/receive overheads, jitter, imbalance between replicas).
- reductions (ALLREDUCE events): `reduce` is the union of a rank's reductions in flight;
  `reduce_exposed` the part of it after the step's work ended (the last compute or message
  event of any rank), i.e. what the reductions added to the step; `hidden` = 1 - exposed /
  in flight over all ranks. `reduce_behind_compute` is the part during the rank's own compute.
  A pipeline sees a reduction complete between actions, so its end (and the hidden share) is
  late by at most the action during which it completed.
- memory: a rank's peak is the largest `bytes` of its STEP events (what the runtime held
  between actions, measured on its arrays); the prediction, when the run recorded its memory
  model (attribute `memory`), is that of the rank's pipeline rank.
- stragglers: a rank whose busy time exceeds the median rank's by more than the threshold (it
  holds the most work), or whose `slowdown` does: its F/B/W/BW time over the median time of the
  same actions in the same step on every rank that ran them (data-parallel replicas), which
  singles out a slow rank or node. Slow steps: step time above the median step's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcpipe.analysis.critical import CriticalPath, critical_path
from hpcpipe.analysis.messages import Messages, match_messages
from hpcpipe.io.trace import (
    COMM_KINDS,
    COMPUTE_KINDS,
    PIPELINE_KINDS,
    RECV_KINDS,
    SEND_KINDS,
    EventKind,
    Trace,
)

__all__ = ["Prediction", "StepFigures", "Summary", "format_summary", "summarize"]

K = EventKind
_COMPUTE = np.array([int(k) for k in COMPUTE_KINDS])
_COMM = np.array([int(k) for k in COMM_KINDS])
_PIPE_COMPUTE = np.array([int(K.F), int(K.B), int(K.W), int(K.BW)])
_WORK = np.array(  # what a step's reductions can hide behind: compute and messages, any rank
    [int(k) for k in COMPUTE_KINDS if k != K.OPTIMIZER]
    + [int(k) for k in (*SEND_KINDS, *RECV_KINDS)]
)
_NPIPE = len(PIPELINE_KINDS)


def union_length(starts: np.ndarray, ends: np.ndarray) -> int:
    """Total length covered by the intervals [starts, ends) (overlaps counted once)."""
    if starts.size == 0:
        return 0
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    before = np.concatenate(([s[0]], reach[:-1]))
    return int(np.maximum(0, e - np.maximum(s, before)).sum())


@dataclass(frozen=True)
class StepFigures:
    """One step: window, pipeline bubble, peak memory over ranks, critical path."""

    step: int
    start_ns: int
    time_ns: int
    bubble: float | None
    stage_bubble: float | None
    peak_bytes: int
    critical: CriticalPath


@dataclass(frozen=True)
class Prediction:
    """What the simulator predicts for the recorded schedule under the measured costs."""

    step_time_ns: float
    bubble: float
    stage_bubble: float
    transfer_ns: float
    costs_ns: dict[str, list[float]]  # kind -> median per stage (NaN where not recorded)


@dataclass(frozen=True)
class Summary:
    """Everything `hpcpipe trace summary` prints; arrays are per rank, summed over steps."""

    path: str
    num_ranks: int
    steps: tuple[int, ...]
    schedule: str | None
    busy_ns: np.ndarray
    comm_ns: np.ndarray
    io_ns: np.ndarray
    idle_ns: np.ndarray
    overlap_ns: np.ndarray
    late_sender_ns: np.ndarray
    reduce_ns: np.ndarray
    reduce_exposed_ns: np.ndarray
    reduce_behind_compute_ns: np.ndarray
    window_ns: int
    per_step: tuple[StepFigures, ...]
    prediction: Prediction | None
    prediction_note: str
    slowdown: np.ndarray  # per rank: own compute time / the same actions' median in that step
    stragglers: tuple[tuple[int, str], ...]
    slow_steps: tuple[tuple[int, float], ...]
    threshold: float
    messages: int
    unmatched_sends: int
    unmatched_recvs: int
    experts: dict[str, Any] | None
    clock_error_ns: int
    events: int
    rank_peak_bytes: np.ndarray  # per rank: the largest STEP `bytes` (memory held) over steps
    predicted_peak_bytes: np.ndarray | None  # per rank, the run's memory model (if recorded)

    @property
    def bubble(self) -> float | None:
        """Measured pipeline bubble over all recorded steps (time-weighted)."""
        vals = [(s.bubble, s.time_ns) for s in self.per_step if s.bubble is not None]
        if not vals:
            return None
        return float(sum(b * t for b, t in vals) / max(sum(t for _, t in vals), 1))

    @property
    def stage_bubble(self) -> float | None:
        vals = [s.stage_bubble for s in self.per_step if s.stage_bubble is not None]
        return float(np.median(vals)) if vals else None

    @property
    def step_time_ns(self) -> float:
        return float(np.median([s.time_ns for s in self.per_step])) if self.per_step else 0.0

    @property
    def peak_bytes(self) -> int:
        return max((s.peak_bytes for s in self.per_step), default=0)

    @property
    def reduce_hidden(self) -> float | None:
        """Share of the ranks' reduction time that did not lengthen the step (None: none ran)."""
        total = int(self.reduce_ns.sum())
        return None if total == 0 else 1.0 - float(self.reduce_exposed_ns.sum()) / total

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form (times in seconds)."""
        ns = 1e-9

        def arr(a: np.ndarray) -> list[float]:
            return [float(x) * ns for x in a]

        return {
            "path": self.path,
            "ranks": self.num_ranks,
            "steps": list(self.steps),
            "schedule": self.schedule,
            "events": self.events,
            "step_time": self.step_time_ns * ns,
            "bubble": self.bubble,
            "stage_bubble": self.stage_bubble,
            "peak_bytes": self.peak_bytes,
            "reduce_hidden": self.reduce_hidden,
            "per_rank": {
                "busy": arr(self.busy_ns),
                "comm": arr(self.comm_ns),
                "io": arr(self.io_ns),
                "idle": arr(self.idle_ns),
                "overlap": arr(self.overlap_ns),
                "late_sender": arr(self.late_sender_ns),
                "reduce": arr(self.reduce_ns),
                "reduce_exposed": arr(self.reduce_exposed_ns),
                "reduce_behind_compute": arr(self.reduce_behind_compute_ns),
                "slowdown": [float(x) for x in self.slowdown],
            },
            "per_step": [
                {
                    "step": s.step,
                    "time": s.time_ns * ns,
                    "bubble": s.bubble,
                    "stage_bubble": s.stage_bubble,
                    "peak_bytes": s.peak_bytes,
                    "critical_path": {k: v * ns for k, v in s.critical.breakdown.items()},
                    "critical_ranks": s.critical.ranks,
                }
                for s in self.per_step
            ],
            "prediction": None
            if self.prediction is None
            else {
                "step_time": self.prediction.step_time_ns * ns,
                "bubble": self.prediction.bubble,
                "stage_bubble": self.prediction.stage_bubble,
                "transfer": self.prediction.transfer_ns * ns,
                "costs": {
                    k: [None if np.isnan(v) else v * ns for v in vals]
                    for k, vals in self.prediction.costs_ns.items()
                },
            },
            "prediction_note": self.prediction_note,
            "stragglers": [{"rank": r, "why": why} for r, why in self.stragglers],
            "slow_steps": [{"step": s, "ratio": x} for s, x in self.slow_steps],
            "threshold": self.threshold,
            "messages": {
                "matched": self.messages,
                "unmatched_sends": self.unmatched_sends,
                "unmatched_receives": self.unmatched_recvs,
            },
            "experts": self.experts,
            "clock_error": self.clock_error_ns * ns,
            "memory": {
                "peak_bytes": [int(x) for x in self.rank_peak_bytes],
                "predicted_peak_bytes": None
                if self.predicted_peak_bytes is None
                else [float(x) for x in self.predicted_peak_bytes],
            },
        }

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)


# ---------------------------------------------------------------- building blocks


def _step_window(trace: Trace, step: int) -> tuple[int, int]:
    lo, hi = None, None
    for r in range(trace.num_ranks):
        sel = trace.step_events(r, step)
        if sel.size:
            a, b = int(sel["t_start"].min()), int(sel["t_end"].max())
            lo = a if lo is None else min(lo, a)
            hi = b if hi is None else max(hi, b)
    if lo is None or hi is None:
        raise ValueError(f"step {step} has no events")
    return lo, hi


def _work_end(trace: Trace, step: int) -> int:
    """When the step's work (compute and messages, not the optimizer) ended on the last rank."""
    end = None
    for r in range(trace.num_ranks):
        ev = trace.step_events(r, step)
        work = ev[np.isin(ev["kind"], _WORK)]
        if work.size:
            e = int(work["t_end"].max())
            end = e if end is None else max(end, e)
    return end if end is not None else 0


def _reduction_split(red: np.ndarray, comp: np.ndarray, work_end: int) -> tuple[int, int, int]:
    """A rank's reductions in one step: (in flight, after `work_end`, during own compute)."""
    total = union_length(red["t_start"], red["t_end"])
    tail_start = np.maximum(red["t_start"], work_end)
    after = union_length(tail_start, np.maximum(red["t_end"], tail_start))
    both = np.concatenate([red, comp])
    during = (
        total
        + union_length(comp["t_start"], comp["t_end"])
        - union_length(both["t_start"], both["t_end"])
    )
    return total, after, during


def _durations(ev: np.ndarray) -> np.ndarray:
    return (ev["t_end"] - ev["t_start"]).astype(np.int64)


def _last_replan(trace: Trace) -> int:
    """The last step that ended with a REPLAN event (0: none)."""
    tab = trace.table
    steps = tab["step"][tab["kind"] == K.REPLAN]
    return int(steps.max()) if steps.size else 0


def _medians(trace: Trace, num_stages: int, after: int = 0) -> dict[int, np.ndarray]:
    """Median duration (ns) per (compute kind, stage) over steps after `after`; NaN where the
    pair never ran."""
    tab = trace.table
    tab = tab[tab["step"] > after] if after else tab
    out = {}
    for kind in _PIPE_COMPUTE.tolist():
        rows = tab[(tab["kind"] == kind) & (tab["stage"] >= 0) & (tab["stage"] < num_stages)]
        med = np.full(num_stages, np.nan)
        if rows.size:
            d = (rows["t_end"] - rows["t_start"]).astype(np.float64)
            order = np.argsort(rows["stage"], kind="stable")
            st, d = rows["stage"][order], d[order]
            uniq, first = np.unique(st, return_index=True)
            for s, part in zip(uniq, np.split(d, first[1:]), strict=True):
                med[int(s)] = float(np.median(part))
        out[kind] = med
    return out


def _late_and_transfer(trace: Trace, messages: Messages) -> tuple[np.ndarray, float]:
    """Per-rank late-sender time and the median transfer time of waited-for messages."""
    late = np.zeros(trace.num_ranks, dtype=np.int64)
    if not len(messages):
        return late, 0.0
    tab = trace.table
    first = np.concatenate(([0], np.cumsum([len(e) for e in trace.events])))
    snd = tab[first[messages.send_rank] + messages.send_index]
    rcv = tab[first[messages.recv_rank] + messages.recv_index]
    wait = rcv["t_end"] - rcv["t_start"]
    ahead = snd["t_start"] - rcv["t_start"]
    np.add.at(late, messages.recv_rank, np.clip(ahead, 0, wait))
    waited = ahead >= 0
    transfers = rcv["t_end"][waited] - snd["t_start"][waited]
    return late, float(np.median(transfers)) if transfers.size else 0.0


def _predict(
    trace: Trace, medians: dict[int, np.ndarray], transfer_ns: float
) -> tuple[Prediction | None, str]:
    sched = trace.schedule
    if sched is None:
        return None, "no schedule in the trace (a non-pipeline run, or written without one)"
    from hpcpipe.schedules.simulate import CostModel, simulate

    f, b, w, bw = (medians[int(k)] for k in (K.F, K.B, K.W, K.BW))

    def fill(a: np.ndarray) -> np.ndarray:
        return np.nan_to_num(a, nan=0.0)

    has_bw = not np.all(np.isnan(bw))
    t_bw = np.where(np.isnan(bw), fill(b) + fill(w), bw) if has_bw else None
    if np.all(np.isnan(f)):
        return None, "no F events of the schedule's stages were recorded"
    costs = CostModel(
        t_f=fill(f), t_b=fill(b), t_w=fill(w), t_bw=t_bw, comm_latency=max(transfer_ns, 0.0)
    )
    try:
        sim = simulate(sched, costs)
    except Exception as exc:  # a schedule the simulator rejects still gets a summary
        return None, f"the simulator rejected the recorded schedule: {exc}"
    names = {"F": f, "B": b, "W": w, "BW": bw}
    return (
        Prediction(
            step_time_ns=sim.makespan,
            bubble=sim.bubble_fraction,
            stage_bubble=sim.stage_bubble_fraction,
            transfer_ns=transfer_ns,
            costs_ns={k: v.tolist() for k, v in names.items() if not np.all(np.isnan(v))},
        ),
        "simulated with the median measured F/B/W/BW time per stage and the median transfer",
    )


def _slowdown(trace: Trace) -> np.ndarray:
    """Per rank: time of its pipeline compute events / the median time of the same action
    (kind, stage) in the same step over all ranks that ran it (data-parallel replicas)."""
    tab = trace.table
    rows = tab[np.isin(tab["kind"], _PIPE_COMPUTE)]
    out = np.ones(trace.num_ranks)
    if not rows.size:
        return out
    dur = (rows["t_end"] - rows["t_start"]).astype(np.float64)
    keys = np.stack([rows["step"], rows["kind"], rows["stage"]], axis=1).astype(np.int64)
    _, group = np.unique(keys, axis=0, return_inverse=True)
    group = group.reshape(-1)
    order = np.argsort(group, kind="stable")
    bounds = np.flatnonzero(np.diff(group[order])) + 1
    typical = np.empty(rows.size)
    for part in np.split(order, bounds):
        typical[part] = np.median(dur[part])
    own = np.bincount(rows["rank"], weights=dur, minlength=trace.num_ranks)
    ref = np.bincount(rows["rank"], weights=typical, minlength=trace.num_ranks)
    ok = ref > 0
    out[ok] = own[ok] / ref[ok]
    return out


def _experts(trace: Trace) -> dict[str, Any] | None:
    tab = trace.table
    rows = tab[tab["kind"] == K.EXPERT]
    if not rows.size:
        return None
    n = int(rows["stage"].max()) + 1
    tokens = np.bincount(rows["stage"], weights=rows["value"], minlength=n)
    per_step = []
    for step in np.unique(rows["step"]).tolist():
        sel = rows[rows["step"] == step]
        t = np.bincount(sel["stage"], weights=sel["value"], minlength=n)
        per_step.append(float(t.max() / t.mean()) if t.mean() > 0 else 1.0)
    mean = float(tokens.mean())
    return {
        "experts": n,
        "tokens": tokens.tolist(),
        "max_over_mean": float(tokens.max() / mean) if mean > 0 else 1.0,
        "min": float(tokens.min()),
        "max": float(tokens.max()),
        "worst_step_max_over_mean": max(per_step),
        "alltoall_s": float(_durations(tab[tab["kind"] == K.ALLTOALL]).sum() * 1e-9),
    }


def _stragglers(
    busy: np.ndarray, slowdown: np.ndarray, threshold: float
) -> tuple[tuple[int, str], ...]:
    med = float(np.median(busy)) if busy.size else 0.0
    out = []
    for r in range(busy.size):
        why = []
        if med > 0 and busy[r] > med * (1 + threshold):
            why.append(f"busy {busy[r] / med:.2f}x the median rank (the most work)")
        if slowdown[r] > 1 + threshold:
            why.append(f"its actions take {slowdown[r]:.2f}x their median time (slow rank?)")
        if why:
            out.append((r, max(busy[r] / med if med else 1.0, slowdown[r]), "; ".join(why)))
    out.sort(key=lambda x: -x[1])
    return tuple((r, why) for r, _, why in out)


# ---------------------------------------------------------------- summary


def summarize(trace: Trace, threshold: float = 0.1, steps: Iterable[int] | None = None) -> Summary:
    """Compute every figure of the summary (see the module docstring for the definitions)."""
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    chosen = tuple(trace.steps) if steps is None else tuple(sorted(set(steps)))
    missing = [s for s in chosen if s not in trace.steps]
    if missing:
        raise ValueError(f"{trace.path}: steps {missing} are not in the trace {list(trace.steps)}")
    p = trace.num_ranks
    messages = match_messages(trace)
    busy = np.zeros(p, dtype=np.int64)
    comm = np.zeros(p, dtype=np.int64)
    io = np.zeros(p, dtype=np.int64)
    idle = np.zeros(p, dtype=np.int64)
    overlap = np.zeros(p, dtype=np.int64)
    reduce = np.zeros(p, dtype=np.int64)
    exposed = np.zeros(p, dtype=np.int64)
    behind = np.zeros(p, dtype=np.int64)
    window_total = 0
    per_step = []
    for step in chosen:
        lo, hi = _step_window(trace, step)
        window = hi - lo
        window_total += window
        pipe_busy = np.zeros(p, dtype=np.int64)
        pipe_span = np.ones(p, dtype=np.int64)
        pipe_lo, pipe_hi = [], []
        peak = 0
        work_end = _work_end(trace, step)
        for r in range(p):
            all_ev = trace.step_events(r, step)
            sel = all_ev[all_ev["kind"] != K.STEP]
            bracket = all_ev[all_ev["kind"] == K.STEP]
            if bracket.size:
                peak = max(peak, int(bracket["bytes"].max()))
            comp = sel[np.isin(sel["kind"], _COMPUTE)]
            com = sel[np.isin(sel["kind"], _COMM)]
            ckp = sel[np.isin(sel["kind"], (K.CHECKPOINT, K.REPLAN))]
            b = union_length(comp["t_start"], comp["t_end"])
            c = union_length(com["t_start"], com["t_end"])
            both = np.concatenate([comp, com])
            u = union_length(both["t_start"], both["t_end"])
            every = np.concatenate([both, ckp])
            busy[r] += b
            comm[r] += c
            overlap[r] += b + c - u
            io[r] += union_length(ckp["t_start"], ckp["t_end"])
            red = sel[sel["kind"] == K.ALLREDUCE]
            if red.size:
                total, after, during = _reduction_split(red, comp, work_end)
                reduce[r] += total
                exposed[r] += after
                behind[r] += during
            idle[r] += window - union_length(every["t_start"], every["t_end"])
            pipe = sel[np.isin(sel["kind"], _PIPE_COMPUTE)]
            if pipe.size:
                pipe_lo.append(int(pipe["t_start"].min()))
                pipe_hi.append(int(pipe["t_end"].max()))
                pipe_busy[r] = _durations(pipe).sum()
                pipe_span[r] = pipe_hi[-1] - pipe_lo[-1]
        bubble = stage_bubble = None
        if pipe_lo:
            span = max(pipe_hi) - min(pipe_lo)
            ranks = np.flatnonzero(pipe_busy > 0)
            if span > 0 and ranks.size:
                bubble = float(1.0 - pipe_busy[ranks].sum() / (ranks.size * span))
                stage_bubble = float(np.max(1.0 - pipe_busy[ranks] / pipe_span[ranks]))
        per_step.append(
            StepFigures(
                step, lo, window, bubble, stage_bubble, peak, critical_path(trace, step, messages)
            )
        )
    sched = trace.schedule
    # a run that re-planned its layers ran other stages before its last switch: the prediction
    # and the memory model (the final partition's) are held against the steps after it
    replanned = _last_replan(trace)
    medians = _medians(
        trace, sched.num_stages if sched is not None else _max_stage(trace), replanned
    )
    late, transfer = _late_and_transfer(trace, messages)
    prediction, note = _predict(trace, medians, transfer)
    if replanned and replanned < max(trace.steps, default=0):
        note += (
            f"; the run moved layers to a new partition after step {replanned} (REPLAN): "
            f"prediction and memory use steps {replanned + 1}.. only"
        )
    slowdown = _slowdown(trace)
    times = np.array([s.time_ns for s in per_step], dtype=np.float64)
    med_t = float(np.median(times)) if times.size else 0.0
    slow_steps = tuple(
        (s.step, float(s.time_ns / med_t))
        for s in per_step
        if med_t > 0 and s.time_ns > med_t * (1 + threshold)
    )
    clock_err = max((int(c["rtt_ns"].max()) // 2 for c in trace.clock if c.size), default=0)
    rank_peak = np.zeros(p, dtype=np.int64)
    for r in range(p):
        for step in chosen:
            if step <= replanned < max(trace.steps):
                continue
            ev = trace.step_events(r, step)
            marks = ev["bytes"][ev["kind"] == K.STEP]
            if marks.size:
                rank_peak[r] = max(rank_peak[r], int(marks.max()))
    predicted = None
    model = trace.memory
    if model and model.get("predicted_peak_bytes"):
        per_pp = model["predicted_peak_bytes"]
        predicted = np.array([float(per_pp[trace.pipeline_rank(r)]) for r in range(p)])
    return Summary(
        path=str(trace.path),
        num_ranks=p,
        steps=chosen,
        schedule=None if sched is None else _schedule_name(sched),
        busy_ns=busy,
        comm_ns=comm,
        io_ns=io,
        idle_ns=idle,
        overlap_ns=overlap,
        late_sender_ns=late,
        reduce_ns=reduce,
        reduce_exposed_ns=exposed,
        reduce_behind_compute_ns=behind,
        window_ns=window_total,
        per_step=tuple(per_step),
        prediction=prediction,
        prediction_note=note,
        slowdown=slowdown,
        stragglers=_stragglers(busy, slowdown, threshold),
        slow_steps=slow_steps,
        threshold=threshold,
        messages=len(messages),
        unmatched_sends=messages.unmatched_sends,
        unmatched_recvs=messages.unmatched_recvs,
        experts=_experts(trace),
        clock_error_ns=clock_err,
        events=int(sum(len(e) for e in trace.events)),
        rank_peak_bytes=rank_peak,
        predicted_peak_bytes=predicted,
    )


def _max_stage(trace: Trace) -> int:
    tab = trace.table
    pipe = tab[tab["kind"] < _NPIPE]
    return int(pipe["stage"].max()) + 1 if pipe.size else 0


def _schedule_name(sched: Any) -> str:
    shape = f"p={sched.num_ranks}, m={sched.num_microbatches}"
    if sched.num_stages != sched.num_ranks:
        shape += f", stages={sched.num_stages}"
    return f"{sched.name} ({shape})"


# ---------------------------------------------------------------- text


def fmt_time(ns: float) -> str:
    """A duration with a unit that keeps 3-4 significant digits."""
    a = abs(ns)
    if a >= 1e9:
        return f"{ns / 1e9:.3f} s"
    if a >= 1e6:
        return f"{ns / 1e6:.3f} ms"
    if a >= 1e3:
        return f"{ns / 1e3:.1f} us"
    return f"{ns:.0f} ns"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _critical_text(cp: CriticalPath) -> str:
    total = max(cp.length_ns, 1)
    parts = sorted(cp.breakdown.items(), key=lambda kv: -kv[1])
    body = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in parts if 200 * v >= total)
    ranks = cp.ranks
    route = ">".join(str(r) for r in ranks[:24]) + (">..." if len(ranks) > 24 else "")
    return f"{body}; ranks {route}"


def format_summary(s: Summary, max_rows: int = 32) -> str:
    """The summary as text tables (what `hpcpipe trace summary` prints)."""
    lines = []
    steps = f"{s.steps[0]}..{s.steps[-1]}" if len(s.steps) > 1 else str(s.steps[0])
    lines.append(
        f"trace {s.path}: {s.num_ranks} ranks, step(s) {steps} ({len(s.steps)} recorded), "
        f"{s.events} events, schedule {s.schedule or '-'}, clock error <= "
        f"{fmt_time(s.clock_error_ns)}"
    )
    lines.append("")
    unit, scale = ("ms", 1e-6) if s.window_ns >= 1e6 else ("us", 1e-3)
    lines.append(f"per rank, summed over the recorded steps ({unit}):")
    lines.append(
        f"{'rank':>5} {'busy':>10} {'comm':>10} {'idle':>10} {'io':>8} {'util':>6} "
        f"{'overlap':>8} {'late_send':>10} {'slowdown':>8}"
    )
    win = max(s.window_ns, 1)
    order = np.arange(s.num_ranks)
    if s.num_ranks > max_rows:  # the extremes are what matter at scale
        by_util = np.argsort(s.busy_ns)
        half = max_rows // 2
        order = np.unique(np.concatenate([by_util[:half], by_util[-half:]]))
    for r in order.tolist():
        ov = s.overlap_ns[r] / s.comm_ns[r] if s.comm_ns[r] else 0.0
        lines.append(
            f"{r:>5} {s.busy_ns[r] * scale:>10.3f} {s.comm_ns[r] * scale:>10.3f} "
            f"{s.idle_ns[r] * scale:>10.3f} {s.io_ns[r] * scale:>8.3f} "
            f"{100 * s.busy_ns[r] / win:>5.1f}% "
            f"{100 * ov:>7.1f}% {s.late_sender_ns[r] * scale:>10.3f} {s.slowdown[r]:>8.2f}"
        )
    if s.num_ranks > max_rows:
        lines.append(f"  ({s.num_ranks - order.size} ranks between these not shown)")
    lines.append("")
    pred = s.prediction
    if s.bubble is not None:
        lines.append(
            f"pipeline bubble: measured {_pct(s.bubble)}, predicted "
            f"{_pct(pred.bubble if pred else None)}; per-rank (papers') measure: measured "
            f"{_pct(s.stage_bubble)}, predicted {_pct(pred.stage_bubble if pred else None)}"
        )
    lines.append(
        f"step time: measured median {fmt_time(s.step_time_ns)}"
        + (f", predicted {fmt_time(pred.step_time_ns)}" if pred else "")
        + (f", peak memory {s.peak_bytes / 2**20:.2f} MiB" if s.peak_bytes else "")
    )
    hidden = s.reduce_hidden
    if hidden is not None:
        n_steps = max(len(s.steps), 1)
        worst = int(np.argmax(s.reduce_exposed_ns))
        lines.append(
            f"gradient reductions: in flight {fmt_time(s.reduce_ns.mean() / n_steps)} per step "
            f"(mean over ranks), {_pct(hidden)} hidden (over before the step's last compute or "
            f"message ended), {_pct(s.reduce_behind_compute_ns.sum() / s.reduce_ns.sum())} "
            f"behind the rank's own compute; exposed "
            f"{fmt_time(s.reduce_exposed_ns.mean() / n_steps)} per step (worst rank {worst}: "
            f"{fmt_time(s.reduce_exposed_ns[worst] / n_steps)})"
        )
    if s.predicted_peak_bytes is not None and s.rank_peak_bytes.any():
        ratio = s.rank_peak_bytes / np.maximum(s.predicted_peak_bytes, 1.0)
        top, worst = int(np.argmax(s.rank_peak_bytes)), int(np.argmax(np.abs(ratio - 1.0)))
        lines.append(
            f"memory held between actions: peak {s.rank_peak_bytes[top] / 2**20:.3f} MiB on "
            f"rank {top}, predicted {s.predicted_peak_bytes[top] / 2**20:.3f} MiB; measured / "
            f"predicted {ratio.min():.3f}-{ratio.max():.3f} over ranks (furthest: rank {worst})"
        )
    lines.append(f"prediction: {s.prediction_note}")
    if pred:
        lines.append(f"  median transfer of a waited-for message: {fmt_time(pred.transfer_ns)}")
        kinds = list(pred.costs_ns)
        lines.append(f"  median action time per stage ({unit}):")
        lines.append(f"  {'stage':>5} " + " ".join(f"{k:>8}" for k in kinds))
        n = len(next(iter(pred.costs_ns.values())))
        for st in range(min(n, max_rows)):
            cells = [pred.costs_ns[k][st] for k in kinds]
            vals = " ".join(f"{'-':>8}" if np.isnan(v) else f"{v * scale:>8.3f}" for v in cells)
            lines.append(f"  {st:>5} {vals}")
        if n > max_rows:
            lines.append(f"  ({n - max_rows} more stages not shown)")
    lines.append("")
    lines.append("per step:")
    lines.append(f"{'step':>5} {'time_' + unit:>10} {'bubble':>7} {'mem_MiB':>8}  critical path")
    for st in s.per_step:
        lines.append(
            f"{st.step:>5} {st.time_ns * scale:>10.3f} {_pct(st.bubble):>7} "
            f"{st.peak_bytes / 2**20:>8.2f}  {_critical_text(st.critical)}"
        )
    lines.append("")
    thr = f"{100 * s.threshold:.0f}%"
    if s.stragglers:
        lines.append(f"stragglers (more than {thr} above the median):")
        for r, why in s.stragglers[:5]:
            lines.append(f"  rank {r}: {why}")
        if len(s.stragglers) > 5:
            lines.append(f"  ... and {len(s.stragglers) - 5} more")
    else:
        lines.append(f"stragglers (more than {thr} above the median): none")
    slow = ", ".join(f"step {st} {x:.2f}x" for st, x in s.slow_steps[:8])
    lines.append(f"slow steps (more than {thr} above the median step time): {slow or 'none'}")
    lines.append(
        f"messages: {s.messages} matched, {s.unmatched_sends} unmatched sends, "
        f"{s.unmatched_recvs} unmatched receives; late-sender wait "
        f"{fmt_time(float(s.late_sender_ns.sum()))} in total"
    )
    if s.experts:
        e = s.experts
        lines.append(
            f"MoE: {e['experts']} experts, tokens per expert max/mean "
            f"{e['max_over_mean']:.2f} (min {e['min']:.0f}, max {e['max']:.0f}; worst step "
            f"{e['worst_step_max_over_mean']:.2f}), all-to-all {e['alltoall_s'] * 1e3:.3f} ms"
        )
    return "\n".join(lines)
