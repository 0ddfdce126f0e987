"""What `hpcpipe plan DECK --flush-free MODE` prints: the deck's schedule run as a stream
without a flush, its weight versions and staleness, and its steady state against the same
schedule flushed every step."""

from __future__ import annotations

import math

import numpy as np

from hpcpipe.config import ConfigError
from hpcpipe.schedules.config import PipelineConfig, cost_model
from hpcpipe.schedules.flushfree import FlushFreePlan, flush_free, steady_state
from hpcpipe.schedules.plot import ascii_timeline, plot_timeline
from hpcpipe.schedules.registry import SCHEDULE_NAMES, build_schedule
from hpcpipe.schedules.simulate import simulate

__all__ = ["FLUSH_FREE_MODES", "flush_free_report"]

FLUSH_FREE_MODES = {
    "stash": "weight stashing: an update per microbatch, one version per microbatch in flight",
    "2bw": "double-buffered weights: an update per global batch, at most two versions",
}


def _plan(cfg: PipelineConfig, pp: int, mode: str, source: str) -> FlushFreePlan:
    if cfg.schedule not in SCHEDULE_NAMES:
        raise ConfigError(
            source,
            "pipeline.schedule",
            f"= {cfg.schedule!r}: --flush-free streams a generated schedule's order; name one "
            f"of {', '.join(SCHEDULE_NAMES)}",
        )
    m = cfg.microbatches
    window = 1 if mode == "stash" else m
    # long enough that fill and drain stay outside the middle half the steady state reads
    updates = max(8, math.ceil(8 * pp / window))
    try:
        return flush_free(
            cfg.schedule,
            pp,
            window,
            updates,
            v=cfg.virtual_stages,
            max_versions=2 if mode == "2bw" else None,
        )
    except ValueError as exc:
        key = "pipeline.microbatches" if mode == "2bw" else "pipeline.schedule"
        raise ConfigError(source, key, f"= {getattr(cfg, key.split('.')[1])!r}: {exc}") from None


def flush_free_report(
    cfg: PipelineConfig, pp: int, mode: str, *, png: str | None = None, source: str = "[pipeline]"
) -> str:
    """The stream's versions, delays, activations and steady state next to the flushed step."""
    if mode not in FLUSH_FREE_MODES:
        raise ConfigError("--flush-free", "", f"= {mode!r}: one of {', '.join(FLUSH_FREE_MODES)}")
    plan = _plan(cfg, pp, mode, source)
    sched = plan.schedule
    costs = cost_model(cfg, pp, sched.num_stages)
    stream = simulate(sched, costs)
    state = steady_state(plan, costs)
    step = simulate(build_schedule(cfg.schedule, pp, cfg.microbatches, cfg.virtual_stages), costs)
    flushed = float(step.busy.max() / step.makespan)
    delays = plan.delay.max(axis=1)

    def ints(values: np.ndarray) -> str:
        return "[" + ", ".join(f"{int(x)}" for x in values) + "]"

    def peaks(values: np.ndarray) -> str:
        return "[" + ", ".join(f"{x:g}" for x in values) + "]"

    lines = [
        f"pipeline without a flush (--flush-free {mode}, {FLUSH_FREE_MODES[mode]}): "
        f"{sched.name} on p={pp} ranks, an update every {plan.window} microbatch(es), "
        f"simulated over a stream of {plan.updates} updates ({sched.num_microbatches} "
        "microbatches)",
        f"weight versions held per stage (the newest and those in-flight microbatches read): "
        f"{ints(plan.peak_versions)}",
        f"gradient delay per stage, most updates between the version a gradient was computed "
        f"on and the one it updates: {ints(delays)}",
        f"steady state: {state.efficiency:.3f} of the no-bubble bound (the busiest rank's busy "
        f"share over the stream's middle half); flushed every step of m={cfg.microbatches}: "
        f"{flushed:.3f}",
        f"peak live activations per rank (microbatches): stream {peaks(stream.peak_memory)}, "
        f"flushed step {peaks(step.peak_memory)}",
        ascii_timeline(stream),
    ]
    if png:
        title = f"{sched.name} without a flush ({mode}), p={pp}, update every {plan.window}"
        lines.append(f"timeline written to {plot_timeline(stream, png, title=title)}")
    return "\n".join(lines)
