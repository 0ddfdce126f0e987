"""`hpcpipe run` with `[async] mode = "stash"` or `"2bw"`: the pipeline never flushes.

The whole run is one stream of `run.steps * pipeline.microbatches` microbatches (one fill,
one drain) that `FlushFreeRank` interprets, each stage updating its weights where the plan
lands each update. With `train.verify` rank 0 retrains with the flush-free reference
(`hpcpipe.train.flushfree_reference`), the same staleness in one process, and compares.

What the stream does not do yet, refused up front naming the key: data parallelism, MoE,
re-planning, checkpoints and resume (a checkpoint would have to hold every weight version and
the microbatches in flight), traces, stop signals mid-stream (the run ends at the stream's end).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from hpcpipe.config import ConfigError
from hpcpipe.model.models import boundary_shape, build_model
from hpcpipe.model.stage import Stage
from hpcpipe.runtime import RunContext
from hpcpipe.schedules.config import cost_model
from hpcpipe.schedules.errors import ScheduleError
from hpcpipe.schedules.flushfree import FlushFreePlan, steady_state
from hpcpipe.schedules.validate import validate
from hpcpipe.train.checks import deck_partition
from hpcpipe.train.data import build_dataset
from hpcpipe.train.flushfree_checks import UNSUPPORTED, check_flush_free
from hpcpipe.train.flushfree_rank import FlushFreeRank
from hpcpipe.train.optim import init_state

__all__ = ["run_flush_free"]


def run_flush_free(ctx: RunContext) -> None:
    """Train `run.steps` global batches as one stream (see the module docstring)."""
    from hpcpipe.train.workload import _check_batch, _gather_params, _write_metrics

    cfg = ctx.config
    if ctx.resume is not None:
        raise ConfigError(
            "--resume",
            "",
            "a stream starts from the seed, not a checkpoint; "
            + UNSUPPORTED.format(mode=cfg.sections["async"].mode),
        )
    plan = check_flush_free(cfg, ctx.rankmap)
    try:
        lowered = validate(plan.schedule)
    except ScheduleError as exc:
        raise ConfigError(cfg.source, "pipeline.schedule", f"cannot stream: {exc}") from None
    m = cfg.pipeline.microbatches
    rows_mb = _check_batch(ctx, m)
    pp_rank = ctx.rankmap.coords(ctx.rank)["pp"]
    units = build_model(cfg.model, cfg.moe)
    ranges = deck_partition(cfg, units, plan.schedule.stages_of_rank)
    mine = plan.schedule.stages_of_rank[pp_rank]
    stages = {s: Stage(units, ranges[s]) for s in mine}
    params = {s: stages[s].init(cfg.run.seed, ctx.xp, ctx.backend.dtype) for s in mine}
    opt_state = {s: init_state(cfg.optim, params[s]) for s in mine}
    runner = FlushFreeRank(
        plan,
        lowered,
        pp_rank,
        stages,
        params,
        cfg.optim,
        opt_state,
        pp_comm=ctx.comms.group("pp"),
        dp_comm=ctx.comms.group("dp"),
        backend=ctx.backend,
        act_shape=boundary_shape(cfg.model, rows_mb),
        recv_lookahead=cfg.train.recv_lookahead,
        blocking_sends=cfg.train.sends == "blocking",
        world_rank=ctx.rank,
    )
    mode, total = cfg.sections["async"].mode, plan.schedule.num_microbatches
    state = steady_state(plan, cost_model(cfg.pipeline, ctx.rankmap.pp, plan.num_stages))
    ctx.log(
        f"train: model={cfg.model.kind} units={len(units)} schedule={plan.schedule.name} "
        f"without a flush (async.mode={mode}): {plan.updates} updates of {plan.window} "
        f"microbatch(es) in one stream of {total}, rows/mb={rows_mb} "
        f"stage_units={[len(r) for r in ranges]}; weight versions per stage "
        f"{plan.peak_versions.tolist()}, predicted steady state {state.efficiency:.3f} of the "
        "no-bubble bound"
    )
    inputs = targets = None
    if any(stages[s].is_first or stages[s].is_last for s in mine):
        ds = build_dataset(cfg.data, cfg.model, cfg.run.seed, source=cfg.source)
        batches = [ds.global_batch(k) for k in range(cfg.run.steps)]
        rows = [slice((j % m) * rows_mb, (j % m + 1) * rows_mb) for j in range(total)]
        inputs = [ctx.xp.asarray(batches[j // m][0][rows[j]]) for j in range(total)]
        targets = [ctx.xp.asarray(batches[j // m][1][rows[j]]) for j in range(total)]
    t0 = time.perf_counter()
    with ctx.watchdog.phase("the stream", runner.where):
        result = runner.step(0, inputs, targets, 1.0 / plan.window)
    seconds = time.perf_counter() - t0
    losses = _losses_on_rank0(ctx, runner.finish_stream())
    tokens = total * rows_mb * cfg.model.seq_len
    if ctx.rank == 0:
        every = cfg.run.log_every
        for k, loss in enumerate(losses):
            if (k + 1) % every == 0 or k + 1 == len(losses):
                ctx.log(f"update {k + 1}/{len(losses)} loss={loss:.4f}")
        ctx.log(
            f"stream: {total} microbatches in {seconds:.2f} s, tok/s={tokens / seconds:.0f}, "
            f"rank 0 busy {result.compute_time / seconds:.1%} of it"
        )
        _write_metrics(
            ctx.output / "metrics.h5", {"loss": losses}, cfg, timing={"stream_s": seconds}
        )
    final = _gather_params(ctx, runner.params, ctx.rankmap.coords(ctx.rank))
    if cfg.train.verify and ctx.rank == 0:
        _verify(ctx, plan, ranges, losses, final)
    from hpcpipe.mpi.idle import idle_barrier

    idle_barrier(ctx.comms.world)  # rank 0 writes metrics and retrains the reference
    runner.free()


def _losses_on_rank0(ctx: RunContext, mine: list[Any]) -> list[float]:
    """Each update's loss, from the rank holding the last stage, on rank 0."""
    values = ctx.backend.scalars(mine) if mine else []
    found = [v for v in ctx.comms.world.gather([float(x) for x in values], root=0) or [] if v]
    return found[0] if found else []


def _verify(
    ctx: RunContext,
    plan: FlushFreePlan,
    ranges: list[range],
    losses: list[float],
    params: dict[int, dict[str, np.ndarray]] | None,
) -> None:
    """Retrain with the same staleness in one process and compare (rank 0)."""
    from hpcpipe.train.flushfree_reference import train_flush_free_reference
    from hpcpipe.train.verify import compare_with_reference, tolerance

    cfg = ctx.config
    assert params is not None
    rtol = tolerance(cfg)
    ref = train_flush_free_reference(
        cfg.model,
        cfg.data,
        cfg.optim,
        stage_units=ranges,
        version=plan.version,
        window=plan.window,
        microbatches=cfg.pipeline.microbatches,
        seed=cfg.run.seed,
        dtype=cfg.device.dtype,
    )
    compare_with_reference(
        ctx.log,
        "single-process flush-free reference (same weight versions)",
        losses,
        params,
        ref,
        rtol,
    )
