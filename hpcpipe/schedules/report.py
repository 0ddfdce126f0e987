"""The text `hpcpipe plan` prints for the [pipeline] section: the chosen schedule drawn,
validated and simulated, and optionally every schedule compared under the same costs, or the
makespan vs peak-memory front of the schedule search next to every fixed schedule."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from hpcpipe.config import ConfigError
from hpcpipe.schedules.bound import LowerBound, lower_bound
from hpcpipe.schedules.config import PipelineConfig, cost_model, costs_for
from hpcpipe.schedules.errors import ScheduleError
from hpcpipe.schedules.ir import Schedule, read_csv, to_csv
from hpcpipe.schedules.plot import ascii_timeline, plot_pareto, plot_timeline
from hpcpipe.schedules.registry import PUBLISHED, SCHEDULE_NAMES, build_schedule
from hpcpipe.schedules.search import BudgetError, Found, fixed_points, pareto_front, search
from hpcpipe.schedules.simulate import SimResult, simulate
from hpcpipe.schedules.validate import validate

__all__ = ["load_schedule", "plan_report", "runnable_schedule"]

_SOURCE = "[pipeline]"  # when the caller does not name the deck


def load_schedule(cfg: PipelineConfig, pp: int, source: str = _SOURCE) -> Schedule:
    """The deck's schedule for `pp` ranks: generated, or read from `schedule_csv`.

    Raises ConfigError naming the key when the deck asks for something that cannot be built.
    """
    if cfg.schedule == "auto":
        return _searched(cfg, pp, source).schedule
    if cfg.schedule != "csv":
        try:
            return build_schedule(
                cfg.schedule, pp, cfg.microbatches, cfg.virtual_stages, pairs=cfg.overlap_pairs
            )
        except ValueError as exc:
            raise ConfigError(source, "pipeline.schedule", f"= {cfg.schedule!r}: {exc}") from None
    try:
        sched = read_csv(cfg.schedule_csv)
    except OSError as exc:
        raise ConfigError(source, "pipeline.schedule_csv", f"cannot be read: {exc}") from None
    except ValueError as exc:
        raise ConfigError(source, "pipeline.schedule_csv", f"is not a schedule: {exc}") from None
    if sched.num_ranks != pp:
        raise ConfigError(
            source,
            "pipeline.schedule_csv",
            f"has {sched.num_ranks} rank rows but topology.pp = {pp}",
        )
    if sched.num_microbatches != cfg.microbatches:
        raise ConfigError(
            source,
            "pipeline.microbatches",
            f"= {cfg.microbatches} but {cfg.schedule_csv} schedules {sched.num_microbatches}",
        )
    return sched


def runnable_schedule(cfg: PipelineConfig, pp: int, source: str = _SOURCE) -> tuple[Schedule, Any]:
    """The deck's schedule and its validated, lowered form (what the interpreter runs), or a
    ConfigError naming `pipeline.schedule`. Generated schedules are cached: the preflight and
    the trainer ask for the same one, and validating p=1024 schedules takes seconds."""
    if cfg.schedule == "csv":  # a file can change between two calls: never cached
        return _runnable(cfg, pp, source)
    return _runnable_cached(cfg, pp, source)


def _runnable(cfg: PipelineConfig, pp: int, source: str) -> tuple[Schedule, Any]:
    schedule = load_schedule(cfg, pp, source)
    try:
        return schedule, validate(schedule)
    except ScheduleError as exc:
        raise ConfigError(
            source, "pipeline.schedule", f"= {cfg.schedule!r} cannot run: {exc}"
        ) from None


_runnable_cached = functools.lru_cache(maxsize=4)(_runnable)


def _searched(cfg: PipelineConfig, pp: int, source: str) -> Found:
    """`schedule = "auto"`: the search's pick for the deck's budget and costs."""
    try:
        return search(pp, cfg.microbatches, costs_for(cfg, pp), cfg.memory_budget)
    except BudgetError as exc:
        raise ConfigError(
            source,
            "pipeline.memory_budget",
            f"= {exc.budget:g} is too small: no schedule fits it on pp = {pp}; the least "
            f"budget that fits is {exc.minimum:g} (one microbatch's activations on the "
            "fullest rank, in activation_memory units)",
        ) from None


def _run(cfg: PipelineConfig, sched: Schedule, pp: int, source: str = _SOURCE) -> SimResult:
    try:
        validate(sched)
    except ScheduleError as exc:
        raise ConfigError(source, "pipeline.schedule", f"cannot run: {exc}") from None
    return simulate(sched, cost_model(cfg, pp, sched.num_stages))


def _placement(sched: Schedule) -> str:
    per = len(sched.stages_of_rank[0])
    if per == 1:
        return "1 stage per rank"
    if sched.stages_of_rank[0] == (0, sched.num_stages - 1):
        return f"{per} stages per rank, V placement (rank r holds r and {sched.num_stages - 1}-r)"
    return f"{per} stages per rank, interleaved (rank r holds r, r+p, ...)"


def _summary(result: SimResult) -> str:
    return (
        f"predicted makespan {result.makespan:.6g}; bubble {100 * result.bubble_fraction:.1f}% "
        f"of all rank time (idle within the makespan); stage bubble "
        f"{100 * result.stage_bubble_fraction:.1f}% (worst rank's idle inside its own first-"
        "to-last action, the papers' measure)"
    )


def _rank_table(result: SimResult, max_rows: int = 16) -> str:
    sched = result.schedule
    p = sched.num_ranks
    rows = (
        list(range(p)) if p <= max_rows else [*range(max_rows // 2), *range(p - max_rows // 2, p)]
    )
    lines = [f"{'rank':>6} {'stages':>12} {'busy':>10} {'idle':>10} {'peak memory':>12}"]
    for i, r in enumerate(rows):
        if i and r != rows[i - 1] + 1:
            lines.append(f"{'...':>6}")
        stages = ",".join(str(s) for s in sched.stages_of_rank[r])
        lines.append(
            f"{r:>6} {stages:>12} {result.busy[r]:>10.6g} {result.bubble[r]:>10.6g} "
            f"{result.peak_memory[r]:>12.6g}"
        )
    return "\n".join(lines)


def _compare(cfg: PipelineConfig, pp: int, chosen: Schedule) -> str:
    names = list(SCHEDULE_NAMES)
    header = (
        f"{'schedule':<17} {'v':>2} {'makespan':>10} {'bubble':>7} {'stage bub':>9} "
        f"{'peak mem':>9} {'bound':>8} {'gap':>6}  {'published bubble':<19} memory"
    )
    lines = [
        f"all schedules for p={pp}, m={cfg.microbatches} and the deck's costs "
        "(* = the deck's choice; memory in activation_memory units, max over ranks):",
        header,
        "-" * len(header),
    ]
    entries: list[tuple[str, Schedule | str]] = []
    for name in names:
        v = cfg.virtual_stages if name == "interleaved-1f1b" else None
        try:
            entries.append(
                (name, build_schedule(name, pp, cfg.microbatches, v, pairs=cfg.overlap_pairs))
            )
        except ValueError as exc:
            entries.append((name, str(exc)))
    if cfg.schedule in ("csv", "auto"):
        entries.append((cfg.schedule, chosen))
    for name, item in entries:
        mark = "*" if name == cfg.schedule else " "
        if isinstance(item, str):
            lines.append(f"{mark}{name:<16}  skipped: {item}")
            continue
        result = _run(cfg, item, pp)
        v = len(item.stages_of_rank[0])
        bubble, memory = PUBLISHED.get(name, ("", ""))
        peak = float(result.peak_memory.max())
        if item.pairs.size:  # overlapped halves hide communication the bound charges
            bound_text, gap = "-", "-"
        else:
            bound = _bound(cfg, pp, item.stages_of_rank, peak, result.makespan)
            bound_text, gap = f"{bound.makespan:.6g}", _gap(bound, result.makespan)
        lines.append(
            f"{mark}{name:<16} {v:>2} {result.makespan:>10.6g} "
            f"{100 * result.bubble_fraction:>6.1f}% {100 * result.stage_bubble_fraction:>8.1f}% "
            f"{peak:>9.4g} {bound_text:>8} {gap:>6}  "
            f"{bubble:<19} {memory}".rstrip()
        )
    lines.append(
        "bubble: idle share of all ranks within the makespan; stage bubble: worst rank's idle "
        "share inside its own span (the papers' measure); bound: no schedule on the same "
        "placement within the same peak memory is faster (work per rank plus the fill and "
        "drain the memory forces, or a rank's fastest order alone within it; - for "
        "overlapped pairs, whose hidden communication it does not model); gap: makespan "
        "above the bound; published: F, B, W = one full stage"
    )
    return "\n".join(lines)


def _bound(
    cfg: PipelineConfig,
    pp: int,
    placement: tuple[tuple[int, ...], ...],
    peak: float,
    reached: float,
) -> LowerBound:
    """The bound within `peak`; `reached`: a makespan a schedule reaches there (the bound's
    search for one rank alone stops proving at it)."""
    stages = sum(len(row) for row in placement)
    costs = cost_model(cfg, pp, stages)
    return lower_bound(placement, cfg.microbatches, costs, peak, target=reached)


def _gap(bound: LowerBound, makespan: float) -> str:
    gap = bound.gap(makespan)
    return "0" if gap <= 1e-9 else f"{100 * gap:.1f}%"


def _placements(cfg: PipelineConfig, pp: int) -> list[tuple[tuple[int, ...], ...]]:
    """Every placement a schedule of the deck can have: one stage per rank, the V, and the
    interleaved one with the deck's virtual stages."""
    v = cfg.virtual_stages or 2
    return [
        tuple((r,) for r in range(pp)),
        tuple((r, 2 * pp - 1 - r) for r in range(pp)),
        tuple(tuple(r + k * pp for k in range(v)) for r in range(pp)),
    ]


def _front_bound(cfg: PipelineConfig, pp: int, peak: float, reached: float) -> LowerBound:
    """The least bound over every placement: nothing within `peak` memory is faster."""
    bounds = [_bound(cfg, pp, placement, peak, reached) for placement in _placements(cfg, pp)]
    return min(bounds, key=lambda b: b.makespan)


def _search_line(cfg: PipelineConfig, sched: Schedule) -> str:
    budget = "no limit" if cfg.memory_budget is None else f"{cfg.memory_budget:g}"
    return (
        f"schedule search: memory_budget {budget} (activation_memory units per rank); "
        f"fastest found: {sched.param('how', '?')}"
    )


def _pareto(
    cfg: PipelineConfig, pp: int, png: str | None, source: str, chosen: SimResult | None
) -> str:
    """The search's makespan vs peak-memory front next to every fixed schedule; `chosen` is
    the deck's own pick when schedule = "auto" (marked, or listed when not on the front)."""
    m = cfg.microbatches
    fixed = fixed_points(pp, m, costs_for(cfg, pp))
    front = pareto_front(pp, m, costs_for(cfg, pp), fixed)
    header = f"{'peak mem':>9} {'makespan':>10} {'bound':>8} {'gap':>6}  found by"
    pick = "" if chosen is None else "; > marks the pick for the deck's memory_budget"
    lines = [
        f"schedule search front for p={pp}, m={m} and the deck's costs: the fastest schedule "
        "found per budget",
        f"(peak memory in activation_memory units, max over ranks{pick}; bound: no schedule on "
        "any placement within that peak is faster; gap 0: the search is at the bound, optimal):",
        header,
        "-" * len(header),
    ]
    marked = False
    for f in front:
        same = chosen is not None and (f.makespan, f.peak) == (
            chosen.makespan,
            float(chosen.peak_memory.max()),
        )
        marked |= same
        bound = _front_bound(cfg, pp, f.peak, f.makespan)
        gap = _gap(bound, f.makespan)
        lines.append(
            f"{'>' if same else ' '}{f.peak:>8.4g} {f.makespan:>10.6g} {bound.makespan:>8.6g} "
            f"{gap:>6}  {f.how}{' (at the bound)' if gap == '0' else ''}"
        )
    if chosen is not None and not marked:
        lines.append(
            f">{chosen.peak_memory.max():>8.4g} {chosen.makespan:>10.6g}  the deck's "
            f"memory_budget (off the front): {chosen.schedule.param('how', '?')}"
        )
    header = (
        f"{'schedule':<17} {'v':>2} {'peak mem':>9} {'makespan':>10} {'search':>10} {'gain':>7}"
    )
    lines += [
        "",
        "fixed schedules and the search at the same budget",
        "(search: the front's best makespan with a peak at most the schedule's; gain: how much "
        "faster):",
        header,
        "-" * len(header),
    ]
    points = []
    for item in fixed:
        if not isinstance(item, Found):
            name, why = item
            lines.append(f" {name:<16}  skipped: {why}")
            continue
        name = item.how.removeprefix("fixed: ")
        points.append((name, item.peak, item.makespan))
        best = min(f.makespan for f in front if f.peak <= item.peak * (1 + 1e-9))
        gain = 100.0 * (item.makespan - best) / item.makespan if item.makespan else 0.0
        v = len(item.schedule.stages_of_rank[0])
        lines.append(
            f" {name:<16} {v:>2} {item.peak:>9.4g} {item.makespan:>10.6g} {best:>10.6g} "
            f"{gain:>6.1f}%"
        )
    if png:
        title = f"p={pp}, m={m}: makespan vs peak activation memory ({source})"
        path = plot_pareto(
            [(f.peak, f.makespan) for f in front],
            points,
            png,
            title=title,
            budget=cfg.memory_budget,
        )
        lines += ["", f"front written to {path}"]
    return "\n".join(lines)


def plan_report(
    cfg: PipelineConfig,
    pp: int,
    *,
    png: str | None = None,
    compare: bool = False,
    pareto: bool = False,
    pareto_png: str | None = None,
    csv: str | None = None,
    source: str = _SOURCE,
) -> str:
    """What `hpcpipe plan DECK` prints: the schedule as a rank x time grid, its predicted
    makespan, bubble and peak memory per rank; `png` also writes a timeline picture,
    `compare` appends a table of every schedule for the same p, m and costs, and `pareto`
    (or `pareto_png`, which also draws it) the schedule search's makespan vs memory front;
    `csv` writes the schedule the deck resolves to (the search's choice for 'auto'), which
    `schedule = 'csv'` reads back."""
    sched = load_schedule(cfg, pp, source)
    result = _run(cfg, sched, pp, source)
    parts = [
        f"pipeline schedule {sched.name}: p={pp} ranks, {sched.num_stages} stages "
        f"({_placement(sched)}), m={sched.num_microbatches} microbatches",
        ascii_timeline(result),
        _summary(result),
        _rank_table(result),
    ]
    if cfg.schedule == "auto":
        parts.insert(1, _search_line(cfg, sched))
    if png:
        parts.append(f"timeline written to {plot_timeline(result, png)}")
    if csv:
        budget = cfg.memory_budget is not None  # read only by 'auto'
        parts.append(
            f"schedule written to {_write_csv(sched, csv)}; run it as written (or edited) with "
            f"pipeline.schedule = 'csv' and pipeline.schedule_csv = '{csv}'"
            + (" (and without pipeline.memory_budget, which only 'auto' reads)" if budget else "")
        )
    if compare:
        parts.append(_compare(cfg, pp, sched))
    if pareto or pareto_png:
        chosen = result if cfg.schedule == "auto" else None
        parts.append(_pareto(cfg, pp, pareto_png, source, chosen))
    return "\n\n".join(parts)


def _write_csv(sched: Schedule, path: str) -> Path:
    """The schedule's CSV form, written whole or not at all (a temporary file renamed)."""
    out = Path(path)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        tmp.write_text(to_csv(sched), encoding="utf-8")
        tmp.replace(out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ConfigError("--csv", "", f"cannot write {path}: {exc.strerror or exc}") from None
    return out
