"""`hpcpipe run` with `[async] mode = "stash"` or `"2bw"`: the pipeline never flushes.

The run is one stream of `run.steps * pipeline.microbatches` microbatches (one fill, one
drain), or with `async.flush_every` a sequence of streams of that many global batches each
(`hpcpipe.train.flushfree_checks.segments`), which `FlushFreeRank` interprets, each stage
updating its weights where the plan lands each update. Between two streams the pipeline is
drained and every stage holds one version: that is where checkpoints are written (the
synchronous format, so any pipeline layout can resume them) and stop signals are taken. With
`train.verify` rank 0 retrains with the flush-free reference
(`hpcpipe.train.flushfree_reference`) over the whole run's weight-version table and compares.

What a stream does not do yet, refused up front naming the key: data parallelism, MoE,
re-planning, traces.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from hpcpipe.config import ConfigError
from hpcpipe.faults import maybe_fail
from hpcpipe.jobcontrol import StopSignal, write_status
from hpcpipe.model.models import boundary_shape, build_model
from hpcpipe.model.stage import Stage, modelled_unit_ns
from hpcpipe.mpi.collectives import allreduce
from hpcpipe.mpi.idle import idle_barrier
from hpcpipe.runtime import RunContext
from hpcpipe.schedules.config import cost_model
from hpcpipe.schedules.errors import ScheduleError
from hpcpipe.schedules.flushfree import FlushFreePlan, steady_state
from hpcpipe.schedules.validate import validate
from hpcpipe.sleeps import fine_timer_slack
from hpcpipe.train.checkpointing import restore, save
from hpcpipe.train.checks import deck_partition
from hpcpipe.train.data import build_dataset
from hpcpipe.train.flushfree_checks import check_flush_free, run_versions, segment_plan, segments
from hpcpipe.train.flushfree_rank import FlushFreeRank
from hpcpipe.train.optim import init_state

__all__ = ["run_flush_free"]


def run_flush_free(ctx: RunContext) -> None:
    """Train `run.steps` global batches as one or several streams (see the module docstring);
    checkpoint and stop between two (from a checkpoint with --resume)."""
    cfg = ctx.config
    check_flush_free(cfg, ctx.rankmap)
    run = StreamRun(ctx)
    start = run.restore() if ctx.resume else 0
    stop = StopSignal()
    every, steps = cfg.checkpoint.every, cfg.run.steps
    state, last, done = "finished", None, start
    try:
        for first, end in segments(cfg, run.earlier, start):
            with ctx.watchdog.phase(f"the stream of global batches {first + 1}-{end}", run.where):
                run.stream(first, end)
            done = end
            stopping = run.stop_requested(stop)
            if stopping or (every and (done % every == 0 or done == steps)):
                last = run.checkpoint(done)
            if stopping and done < steps:
                state = "preempted"
                ctx.log(
                    f"stopping on signal after global batch {done}/{steps} (a flush of the "
                    f"stream): checkpoint {last}; resume with --resume"
                )
                break
    finally:
        stop.restore()
    if ctx.rank == 0:
        write_status(ctx.output, state, done, last)
    run.finish(complete=state == "finished")


class StreamRun:
    """One rank's share of a flush-free run: its stages, parameters, optimizer state and the
    interpreters of its streams (one per stream length)."""

    def __init__(self, ctx: RunContext):
        from hpcpipe.train.workload import _check_batch

        self.ctx = ctx
        cfg = self.cfg = ctx.config
        self.mode = cfg.sections["async"].mode
        self.m = m = cfg.pipeline.microbatches
        self.window = 1 if self.mode == "stash" else m
        self.rows_mb = _check_batch(ctx, m)
        self.pp_rank = ctx.rankmap.coords(ctx.rank)["pp"]
        self._plans: dict[int, FlushFreePlan] = {}
        first = self.plan(segments(cfg, ())[0][1])
        units = build_model(cfg.model, cfg.moe)
        self.ranges = deck_partition(cfg, units, first.schedule.stages_of_rank)
        mine = first.schedule.stages_of_rank[self.pp_rank]
        self.stages = {s: Stage(units, self.ranges[s]) for s in mine}
        if cfg.device.synthetic_us_per_row > 0:
            fine_timer_slack()
            modelled = modelled_unit_ns(units, cfg.device.synthetic_us_per_row, self.rows_mb)
            for stage in self.stages.values():
                stage.modelled_ns = modelled
        dtype = ctx.backend.dtype
        self.params = {s: self.stages[s].init(cfg.run.seed, ctx.xp, dtype) for s in mine}
        self.opt_state = {s: init_state(cfg.optim, self.params[s]) for s in mine}
        ends = any(self.stages[s].is_first or self.stages[s].is_last for s in mine)
        self.dataset = (
            build_dataset(cfg.data, cfg.model, cfg.run.seed, source=cfg.source) if ends else None
        )
        self.earlier: set[int] = set()  # the last global batches of the runs this one continues
        self.untraced = ""  # why the reference cannot retrace this run (resumed on another layout)
        self.history: dict[str, list[float]] = {"loss": []} if ctx.rank == 0 else {}
        self._runners: dict[int, FlushFreeRank] = {}
        self._runner: FlushFreeRank | None = None
        self._seconds = self._compute = 0.0
        self._microbatches = 0
        total = cfg.run.steps * m
        state = steady_state(first, cost_model(cfg.pipeline, ctx.rankmap.pp, first.num_stages))
        flush = cfg.sections["async"].flush_every
        streams = (
            f"streams of {flush} global batch(es) ({flush * m} microbatches), flushed between"
            if flush and flush < cfg.run.steps
            else f"one stream of {total}"
        )
        ctx.log(
            f"train: model={cfg.model.kind} units={len(units)} schedule={first.schedule.name} "
            f"without a flush (async.mode={self.mode}): {total // self.window} updates of "
            f"{self.window} microbatch(es) in {streams}, rows/mb={self.rows_mb} "
            f"stage_units={[len(r) for r in self.ranges]}; weight versions per stage "
            f"{first.peak_versions.tolist()}, predicted steady state {state.efficiency:.3f} of "
            "the no-bubble bound"
        )

    def plan(self, batches: int) -> FlushFreePlan:
        """The plan of a stream of `batches` global batches (the same on every rank)."""
        if batches not in self._plans:
            self._plans[batches] = segment_plan(self.cfg, self.ctx.rankmap, batches)
        return self._plans[batches]

    def _runner_for(self, batches: int) -> FlushFreeRank:
        if batches in self._runners:
            return self._runners[batches]
        ctx, cfg, plan = self.ctx, self.cfg, self.plan(batches)
        try:
            lowered = validate(plan.schedule)
        except ScheduleError as exc:
            raise ConfigError(cfg.source, "pipeline.schedule", f"cannot stream: {exc}") from None
        runner = FlushFreeRank(
            plan,
            lowered,
            self.pp_rank,
            self.stages,
            self.params,
            cfg.optim,
            self.opt_state,
            pp_comm=ctx.comms.group("pp"),
            dp_comm=ctx.comms.group("dp"),
            backend=ctx.backend,
            act_shape=boundary_shape(cfg.model, self.rows_mb),
            recv_lookahead=cfg.train.recv_lookahead,
            blocking_sends=cfg.train.sends == "blocking",
            world_rank=ctx.rank,
        )
        self._runners[batches] = runner
        return runner

    def where(self) -> str:
        return self._runner.where() if self._runner else "between two streams"

    def stream(self, first: int, end: int) -> None:
        """Global batches `first` .. `end` - 1 as one stream from the current parameters."""
        ctx, m, rows = self.ctx, self.m, self.rows_mb
        runner = self._runner = self._runner_for(end - first)
        runner.params = self.params
        runner.start_stream(first * m // self.window, self.cfg.run.steps * m // self.window)
        inputs = targets = None
        n = (end - first) * m
        if self.dataset is not None:
            batches = [self.dataset.global_batch(k) for k in range(first, end)]
            sl = [slice((j % m) * rows, (j % m + 1) * rows) for j in range(n)]
            inputs = [ctx.xp.asarray(batches[j // m][0][sl[j]]) for j in range(n)]
            targets = [ctx.xp.asarray(batches[j // m][1][sl[j]]) for j in range(n)]
        maybe_fail(f"step:{first + 1}", ctx.rank)  # a stream starts at a global batch
        t0 = time.perf_counter()
        result = runner.step(first, inputs, targets, 1.0 / self.window)
        seconds = time.perf_counter() - t0
        losses = _losses_on_rank0(ctx, runner.finish_stream())
        self._runner = None
        self._seconds += seconds
        self._compute += result.compute_time
        self._microbatches += n
        if ctx.rank != 0:
            return
        before = len(self.history["loss"])
        self.history["loss"] += losses
        total, every = self.cfg.run.steps * m // self.window, self.cfg.run.log_every
        for k, loss in enumerate(losses, start=before + 1):
            if k % every == 0 or k == total:
                ctx.log(f"update {k}/{total} loss={loss:.4f}")
        if end - first < self.cfg.run.steps:  # one line per stream when there are several
            tokens = n * rows * self.cfg.model.seq_len
            ctx.log(
                f"stream of global batches {first + 1}-{end}: {seconds:.2f} s, "
                f"tok/s={tokens / seconds:.0f}, rank 0 busy {result.compute_time / seconds:.1%}"
            )

    def stop_requested(self, stop: StopSignal) -> bool:
        """Collective, between two streams: whether any rank was asked to stop."""
        return bool(allreduce(self.ctx.comms.world, np.array([stop.flag]), "max")[0] > 0)

    def checkpoint(self, done: int) -> Path:
        """Collective, between two streams: one version per stage, so the synchronous format
        (resumable on any pipeline layout) plus the earlier runs' ends."""
        ctx = self.ctx
        with ctx.watchdog.phase(
            f"the checkpoint after global batch {done}",
            lambda: f"writing the checkpoint of global batch {done} into {ctx.output}",
        ):
            path = save(
                ctx,
                done,
                self.params,
                self.opt_state,
                self.history,
                attrs={
                    "async_earlier_ends": json.dumps(sorted(self.earlier)),
                    "stream_layout": self._layout(),
                },
            )
        ctx.log(f"checkpoint: {path}")
        return path

    def restore(self) -> int:
        """The parameters and optimizer state of the checkpoint named by --resume (written
        between two streams); returns the global batch to go on from."""
        resumed = restore(self.ctx, self.params, self.opt_state, per_step=self.m // self.window)
        try:
            earlier = json.loads(resumed.attrs.get("async_earlier_ends", "[]"))
        except ValueError:
            earlier = None
        if not isinstance(earlier, list) or not all(isinstance(e, int) for e in earlier):
            raise ConfigError(
                "--resume", "", "checkpoint attribute 'async_earlier_ends' is damaged"
            )
        flush = self.cfg.sections["async"].flush_every
        self.earlier = set(earlier)
        if not flush or resumed.step % flush:  # a finished run's end: a flush there too
            self.earlier.add(resumed.step)
        if resumed.attrs.get("stream_layout") != self._layout():
            self.untraced = (
                f"the streams before global batch {resumed.step} ran another pipeline layout "
                f"({resumed.attrs.get('stream_layout')}), whose weight versions this run's "
                "reference cannot retrace"
            )
        if self.ctx.rank == 0:
            self.history = {"loss": list(resumed.history.get("loss", []))}
        return resumed.step

    def _layout(self) -> str:
        """What fixes the weight versions a stream's actions read, besides its length."""
        p = self.cfg.pipeline
        return json.dumps(
            {
                "pp": self.ctx.rankmap.pp,
                "schedule": p.schedule,
                "virtual_stages": p.virtual_stages,
                "microbatches": self.m,
                "stage_units": [[r.start, r.stop] for r in self.ranges],
            }
        )

    def finish(self, complete: bool) -> None:
        """Summary, metrics file, verification (rank 0), then free the interpreters."""
        from hpcpipe.train.workload import _gather_params, _write_metrics, _write_params

        ctx, cfg = self.ctx, self.cfg
        if ctx.rank == 0 and self._seconds > 0:
            tokens = self._microbatches * self.rows_mb * cfg.model.seq_len
            ctx.log(
                f"stream: {self._microbatches} microbatches in {self._seconds:.2f} s, "
                f"tok/s={tokens / self._seconds:.0f}, rank 0 busy "
                f"{self._compute / self._seconds:.1%} of it"
            )
        if ctx.rank == 0:
            _write_metrics(
                ctx.output / "metrics.h5",
                self.history,
                cfg,
                timing={"stream_s": self._seconds},
            )
        verify = cfg.train.verify and complete and not ctx.changed and not self.untraced
        if cfg.train.verify and complete and not verify:
            why = self.untraced or (
                f"this run continued a checkpoint written with other {', '.join(ctx.changed)} "
                "(--allow-change), which no single-process reference retraces"
            )
            ctx.log(f"verify skipped: {why}")
        final = (
            _gather_params(ctx, self.params, ctx.rankmap.coords(ctx.rank))
            if verify or cfg.train.save_params
            else None
        )
        if ctx.rank == 0 and cfg.train.save_params:
            assert final is not None
            _write_params(ctx.output / "params.h5", final)
        if verify and ctx.rank == 0:
            self._verify(final)
        idle_barrier(ctx.comms.world)  # rank 0 writes metrics and retrains the reference
        for runner in self._runners.values():
            runner.free()

    def _verify(self, params: dict[int, dict[str, np.ndarray]] | None) -> None:
        """Retrain the whole run with the same staleness in one process and compare."""
        from hpcpipe.train.flushfree_reference import train_flush_free_reference
        from hpcpipe.train.verify import compare_with_reference, tolerance

        cfg = self.cfg
        assert params is not None
        plans = [self.plan(b - a) for a, b in segments(cfg, self.earlier)]
        ref = train_flush_free_reference(
            cfg.model,
            cfg.data,
            cfg.optim,
            stage_units=self.ranges,
            version=run_versions(plans),
            window=self.window,
            microbatches=self.m,
            seed=cfg.run.seed,
            dtype=cfg.device.dtype,
        )
        compare_with_reference(
            self.ctx.log,
            "single-process flush-free reference (same weight versions)",
            self.history["loss"],
            params,
            ref,
            tolerance(cfg),
        )


def _losses_on_rank0(ctx: RunContext, mine: list[Any]) -> list[float]:
    """Each update's loss, from the rank holding the last stage, on rank 0."""
    values = ctx.backend.scalars(mine) if mine else []
    found = [v for v in ctx.comms.world.gather([float(x) for x in values], root=0) or [] if v]
    return found[0] if found else []
