"""The deck checks of a pipeline without a flush (`[async] mode`): pure, no MPI, also run by
`--dry-run` and `plan`."""

from __future__ import annotations

from hpcpipe.config import Config, ConfigError
from hpcpipe.schedules.flushfree import FlushFreePlan, flush_free
from hpcpipe.schedules.registry import SCHEDULE_NAMES
from hpcpipe.topology import RankMap

__all__ = ["UNSUPPORTED", "check_flush_free"]


def check_flush_free(config: Config, rankmap: RankMap) -> FlushFreePlan:
    """The stream's plan; refuses, naming the key, what a stream does not run yet (also for
    `--dry-run` and `plan`: no MPI)."""
    mode, pipeline = config.sections["async"].mode, config.pipeline
    problems = [
        ("topology.dp", rankmap.dp > 1, f"= {rankmap.dp}: runs pp only (dp = 1)"),
        ("topology.ep", rankmap.ep > 1, f"= {rankmap.ep}: runs pp only (ep = 1)"),
        ("moe.enabled", config.moe.enabled, "= true: MoE layers are not streamed"),
        ("replan.enabled", config.replan.enabled, "= true: a stream is not re-planned"),
        ("checkpoint.every", config.checkpoint.every > 0, "> 0: a stream is not checkpointed"),
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
    a, m, steps = config.sections["async"], pipeline.microbatches, config.run.steps
    window = 1 if a.mode == "stash" else m
    try:
        plan = flush_free(
            pipeline.schedule,
            rankmap.pp,
            window,
            steps * m // window,
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


UNSUPPORTED = (
    "async.mode = {mode!r} (a pipeline without a flush) does not support it yet: set "
    "async.mode = 'sync'"
)
