"""The deck checks of a pipeline without a flush (`[async] mode`) and the plans of its
segments: pure, no MPI, also run by `--dry-run` and `plan`.

A run is a sequence of streams (segments) of `async.flush_every` global batches each (the
whole run when 0); the pipeline drains between two, which is where checkpoints and stop signals
are taken. A segment is planned as its own stream; the weight versions of the whole run are the
segments' tables one after another, each offset by the updates before it
(`run_versions`), which is all the single-process reference needs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from hpcpipe.config import Config, ConfigError
from hpcpipe.schedules.flushfree import FlushFreePlan, flush_free
from hpcpipe.schedules.registry import SCHEDULE_NAMES
from hpcpipe.topology import RankMap
from hpcpipe.train.localsgd_reference import round_ends

__all__ = ["UNSUPPORTED", "check_flush_free", "run_versions", "segment_plan", "segments"]


def check_flush_free(config: Config, rankmap: RankMap) -> FlushFreePlan:
    """Refuse, naming the key, what a stream does not run yet, and plan every segment length
    the deck makes (also for `--dry-run` and `plan`: no MPI). Returns the first segment's."""
    mode, pipeline = config.sections["async"].mode, config.pipeline
    problems = [
        ("topology.dp", rankmap.dp > 1, f"= {rankmap.dp}: runs pp only (dp = 1)"),
        ("topology.ep", rankmap.ep > 1, f"= {rankmap.ep}: runs pp only (ep = 1)"),
        ("moe.enabled", config.moe.enabled, "= true: MoE layers are not streamed"),
        ("replan.enabled", config.replan.enabled, "= true: a stream is not re-planned"),
        ("trace.enabled", config.trace.enabled, "= true: a stream is not traced"),
        (
            "pipeline.schedule",
            pipeline.schedule not in SCHEDULE_NAMES,
            f"= {pipeline.schedule!r}: name a generated schedule to stream",
        ),
    ]
    for key, bad, why in problems:
        if bad:
            raise ConfigError(config.source, key, f"{why}; {UNSUPPORTED.format(mode=mode)}")
    every, flush = config.checkpoint.every, config.sections["async"].flush_every
    # a checkpoint only at the run's end is at a flush: the stream drains there
    if every and every < config.run.steps and (not flush or every % flush):
        raise ConfigError(
            config.source,
            "checkpoint.every",
            f"= {every}: a stream is checkpointed where it flushes, every async.flush_every = "
            f"{flush} global batches{' (0: never)' if not flush else ''}; set "
            f"async.flush_every to a divisor of {every}",
        )
    lengths = [b - a for a, b in segments(config, ())]
    plans = {n: segment_plan(config, rankmap, n) for n in sorted(set(lengths))}
    return plans[lengths[0]]


def segments(config: Config, earlier: Iterable[int], start: int = 0) -> list[tuple[int, int]]:
    """The run's streams as (first, end) global batches: every `async.flush_every`, the end,
    and the ends of earlier runs this one continues; those after `start`."""
    steps, flush = config.run.steps, config.sections["async"].flush_every
    ends = round_ends(steps, flush or steps, earlier)
    return [(a, b) for a, b in zip([0, *ends], ends, strict=False) if b > start]


def segment_plan(config: Config, rankmap: RankMap, batches: int) -> FlushFreePlan:
    """The plan of one stream of `batches` global batches; ConfigError naming the key when the
    deck's mode cannot hold it."""
    a, pipeline = config.sections["async"], config.pipeline
    m = pipeline.microbatches
    window = 1 if a.mode == "stash" else m
    try:
        plan = flush_free(
            pipeline.schedule,
            rankmap.pp,
            window,
            batches * m // window,
            v=pipeline.virtual_stages,
            max_versions=2 if a.mode == "2bw" else None,
        )
    except ValueError as exc:  # 2bw: the window (one global batch) is shorter than the pipe
        raise ConfigError(
            config.source,
            "pipeline.microbatches",
            f"= {m} cannot hold the stream: {exc}; or use async.mode = 'stash'",
        ) from None
    worst = int(plan.peak_versions.max())
    if a.mode == "stash" and a.versions and worst > a.versions:
        raise ConfigError(
            config.source,
            "async.versions",
            f"= {a.versions}: {pipeline.schedule} without a flush keeps {worst} weight versions "
            f"on stage {int(plan.peak_versions.argmax())} (one per microbatch in flight); "
            f"raise it to {worst}, or use async.mode = '2bw' (two versions)",
        )
    return plan


def run_versions(plans: Sequence[FlushFreePlan]) -> np.ndarray:
    """The weight version of every (stage, microbatch) of the whole run: the segments' tables
    side by side, each counting the updates of the segments before it."""
    tables, before = [], 0
    for plan in plans:
        tables.append(plan.version + before)
        before += plan.updates
    return np.concatenate(tables, axis=1)


UNSUPPORTED = (
    "async.mode = {mode!r} (a pipeline without a flush) does not support it yet: set "
    "async.mode = 'sync'"
)
