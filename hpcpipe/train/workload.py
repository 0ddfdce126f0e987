"""The `train` workload: pipeline x data parallel training, reading top to bottom.

build schedule -> partition the model into its stages -> for each step: shard the batch, run the
rank's actions, reduce gradients over dp (already started during backward), clip over pp, update.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hpcpipe.config import ConfigError, dump_toml
from hpcpipe.faults import maybe_fail, slowdown
from hpcpipe.io.space import ensure_space
from hpcpipe.io.trace import EventKind, write_trace
from hpcpipe.jobcontrol import StopSignal, write_status
from hpcpipe.model.models import boundary_shape, build_model
from hpcpipe.model.stage import Stage, modelled_unit_ns
from hpcpipe.moe import summarize_stats
from hpcpipe.mpi.collectives import allreduce, exchange_objects
from hpcpipe.mpi.idle import idle_barrier
from hpcpipe.mpi.p2p import TagLimitError
from hpcpipe.runtime import RunContext
from hpcpipe.schedules.ir import Schedule
from hpcpipe.sleeps import fine_timer_slack
from hpcpipe.topology import format_ranks
from hpcpipe.train.checkpointing import restore, save
from hpcpipe.train.checks import deck_partition
from hpcpipe.train.data import build_dataset
from hpcpipe.train.optim import OptimState, apply_update, clip_scale, init_state, learning_rate
from hpcpipe.train.pipeline import PipelineRank, StepResult
from hpcpipe.train.replan import (
    Measured,
    Replanner,
    action_costs,
    cost_model,
    schedule_label,
    unit_groups,
)
from hpcpipe.train.trees import leaves, tree_map

__all__ = ["run"]

METRICS_FORMAT = ("hpcpipe-metrics", 1)
TIMED_STEPS = 1000
"""Steps whose action timings feed the end-of-run timing report (the most recent ones)."""


def _schedule(ctx: RunContext):
    """The deck's schedule and its validated, lowered form (the one the interpreter runs)."""
    from hpcpipe.schedules.report import runnable_schedule

    return runnable_schedule(ctx.config.pipeline, ctx.rankmap.pp, ctx.config.source)


def _check_batch(ctx: RunContext, m: int) -> int:
    """Rows per microbatch; the global batch must split evenly over dp and microbatches."""
    rows = ctx.config.data.global_batch
    dp = ctx.rankmap.dp
    if rows % (dp * m):
        raise ConfigError(
            ctx.config.source,
            "data.global_batch",
            f"= {rows} must be divisible by dp * pipeline.microbatches = {dp} * {m} = {dp * m}",
        )
    return rows // (dp * m)


def run(ctx: RunContext) -> None:
    """Train `run.steps` steps (from a checkpoint with --resume); stop early and checkpoint on
    SIGUSR1/SIGTERM (a scheduler's time-limit warning)."""
    cfg = ctx.config
    trainer = Trainer(ctx)
    start = trainer.restore() if ctx.resume else 0
    stop = StopSignal()
    every, steps = cfg.checkpoint.every, cfg.run.steps
    state, last, done = "finished", None, start
    try:
        for step in range(start, steps):
            with ctx.watchdog.phase(f"step {step + 1}", trainer.runner.where):
                stopping = trainer.step(step, stop)
            done = step + 1
            if stopping:
                last, state = trainer.checkpoint(done), "preempted"
                ctx.log(
                    f"stopping on signal after step {done}/{steps}: checkpoint {last}; "
                    "resume with --resume"
                )
                break
            if every and (done % every == 0 or done == steps):
                last = trainer.checkpoint(done)
    finally:
        stop.restore()
    if ctx.rank == 0:
        write_status(ctx.output, state, done, last)
    trainer.finish(complete=state == "finished")


class Trainer:
    """One rank's share of a training run: its stages, parameters, optimizer state, runtime."""

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        cfg = self.cfg = ctx.config
        xp, dtype = ctx.xp, ctx.backend.dtype
        self.coords = ctx.rankmap.coords(ctx.rank)
        self.schedule, self.lowered = _schedule(ctx)
        _check_same_schedule(ctx, self.lowered)
        self.m = m = self.schedule.num_microbatches
        self.rows_mb = _check_batch(ctx, m)
        self.objective_rows = cfg.data.global_batch  # the rows one optimizer step's mean covers
        self.step_comm = ctx.comms.world  # the ranks one optimizer step spans
        self.group = _expert_group(ctx)
        units = build_model(cfg.model, cfg.moe, self.group)
        ranges = deck_partition(cfg, units, self.schedule.stages_of_rank)
        self.mine = self.schedule.stages_of_rank[self.coords["pp"]]
        self.units, self.ranges = units, list(ranges)
        stages = {s: Stage(units, ranges[s]) for s in self.mine}
        self.params = {s: stages[s].init(cfg.run.seed, xp, dtype) for s in self.mine}
        self.opt_state = {s: init_state(cfg.optim, self.params[s]) for s in self.mine}
        self.dataset = build_dataset(cfg.data, cfg.model, cfg.run.seed, source=cfg.source)
        self.rec = cfg.trace.recorder(ctx.rank)
        if self.rec.enabled:
            self.rec.align_clock(ctx.comms.world)
        if self.group is not None:
            self.group.recorder = self.rec
        self.runner = self._build_runner(stages)
        self.needs_data = any(stages[s].is_first or stages[s].is_last for s in self.mine)
        self.history: dict[str, list[float]] = {}
        self._pending: list[tuple] = []  # steps whose figures are not reduced yet
        # the timing report's medians use the last TIMED_STEPS steps: a long run stays flat
        self.action_log: deque[dict[tuple[str, int], float]] = deque(maxlen=TIMED_STEPS)
        self.pipe_times: deque[float] = deque(maxlen=TIMED_STEPS)
        self.replanner = (
            Replanner(
                cfg.replan,
                self.schedule,
                unit_groups(units),
                rows=0 if cfg.moe.enabled else cfg.data.global_batch // ctx.rankmap.dp,
                blocking_lookahead=cfg.train.recv_lookahead if cfg.train.sends == "blocking" else 0,
            )
            if cfg.replan.enabled
            else None
        )
        self.replans: list[dict[str, Any]] = []  # every switch, for the log and metrics.h5
        # since the last check: per step, the actions' and the units' seconds
        self._window: list[tuple[dict[tuple[str, int], float], dict[tuple[str, int], float]]] = []
        self._time_units()
        self._warm = False  # the first step of a partition pays first-touch costs: not timed
        self._modelled: tuple[int, dict[int, int]] | None = None
        if cfg.device.synthetic_us_per_row > 0:
            fine_timer_slack()
        ctx.log(
            f"train: model={cfg.model.kind} units={len(units)} schedule={self.schedule.name} "
            f"stages={self.schedule.num_stages} microbatches={m} rows/mb={self.rows_mb} "
            f"stage_units={[len(r) for r in ranges]}"
            + (
                f" synthetic_us_per_row={cfg.device.synthetic_us_per_row:g}"
                if cfg.device.synthetic_us_per_row > 0
                else ""
            )
            + (
                f" optimal_loss={self.dataset.optimal_loss:.4f}"
                if self.dataset.optimal_loss
                else ""
            )
        )
        if self.schedule.num_ranks > 1:
            ctx.log(
                f"pipeline rank {self.coords['pp']}: "
                + self.runner.messages.describe(self.runner.mailbox.nbytes, ctx.backend.staged)
            )

    def _build_runner(self, stages: dict[int, Stage]) -> PipelineRank:
        """The interpreter of this rank's actions over `stages` (again after a re-partition)."""
        ctx, cfg = self.ctx, self.cfg
        try:
            return PipelineRank(
                self.lowered,
                self.coords["pp"],
                stages,
                self.params,
                pp_comm=ctx.comms.group("pp"),
                dp_comm=self._gradient_comms()[0],
                backend=ctx.backend,
                act_shape=boundary_shape(cfg.model, self.rows_mb),
                recv_lookahead=cfg.train.recv_lookahead,
                blocking_sends=cfg.train.sends == "blocking",
                bucket_bytes=int(cfg.train.bucket_mb * 2**20),
                world_rank=ctx.rank,
                recorder=self.rec,
                expert_dp_comm=self._gradient_comms()[1],
            )
        except TagLimitError as exc:  # ranks holding the last stages: abort_on_error ends all
            raise ConfigError(
                cfg.source,
                "topology.pp",
                f"{self.schedule.num_stages} pipeline stages: {exc}; use fewer stages "
                "(topology.pp, pipeline.virtual_stages)",
            ) from None

    def _gradient_comms(self) -> tuple[Any, Any]:
        """Where gradients are summed: dense over dp, experts over their replicas."""
        return self.ctx.comms.group("dp"), self.ctx.comms.expert_dp

    def restore(self) -> int:
        """Load the checkpoint named by --resume; returns the step to continue from."""
        resumed = restore(self.ctx, self.params, self.opt_state)
        self.history = resumed.history
        self.runner.params = self.params
        return resumed.step

    def checkpoint(self, done: int) -> Path:
        self.flush_figures()  # the checkpoint keeps the history up to this step
        t0 = self.rec.now()
        with self.ctx.watchdog.phase(
            f"the checkpoint after step {done}",
            lambda: f"writing the checkpoint of step {done} into {self.ctx.output}",
        ):
            path = self._save(done)
        if self.rec.enabled:
            self.rec.record(EventKind.CHECKPOINT, -1, -1, t0, self.rec.now())
            self.write_trace()  # so a run that dies later keeps its trace up to here
        self.ctx.log(f"checkpoint: {path}")
        return path

    def _save(self, done: int) -> Path:
        """Collective: this run's state after `done` steps into a new checkpoint."""
        return save(self.ctx, done, self.params, self.opt_state, self.history)

    def write_trace(self, memory: dict[str, Any] | None = None) -> Path:
        """Collective: the whole trace so far to trace.h5 (rewritten at each call); `memory`:
        the end-of-run memory report (rank 0's), for `hpcpipe trace summary`."""
        path = self.cfg.trace.resolve_path(self.ctx.output)
        meta = {
            "config": self.cfg,
            "topology": self.ctx.rankmap,
            "schedule": self.lowered,
            "workload": "train",
        }
        if memory is not None:
            meta["memory"] = memory
        write_trace(self.ctx.comms.world, path, self.rec, meta)
        return path

    def step(self, step: int, stop: StopSignal | None = None) -> bool:
        """One optimizer step; returns True when any rank was asked to stop."""
        ctx, cfg, rec, m, rows = self.ctx, self.cfg, self.rec, self.m, self.rows_mb
        steps = cfg.run.steps
        t0 = time.perf_counter()
        maybe_fail(f"step:{step + 1}", ctx.rank)
        rec.begin_step(step + 1)  # steps are numbered from 1 in logs, traces and metrics
        t_step = rec.now()
        inputs = targets = None
        if self.needs_data:
            x, t = self.dataset.shard(step, self.coords["dp"], ctx.rankmap.dp)
            inputs = [ctx.xp.asarray(x[k * rows : (k + 1) * rows]) for k in range(m)]
            targets = [ctx.xp.asarray(t[k * rows : (k + 1) * rows]) for k in range(m)]
        # each microbatch's share of the objective's rows (the global batch's, synchronously):
        # the summed gradients are the gradient of its mean loss
        weight = rows / self.objective_rows
        factor, modelled = slowdown(step + 1, ctx.rank), self._modelled_ns()
        for stage in self.runner.stages.values():
            stage.slowdown, stage.modelled_ns = factor, modelled
        result = self.runner.step(step, inputs, targets, weight)
        units = self._unit_seconds()
        if self._warm or steps == 1:  # a partition's first step pays first-touch allocations
            self.action_log.append(result.action_times)
            self.pipe_times.append(result.step_time)
            if self.replanner is not None:
                self._window.append((result.action_times, units))
        self._warm = True
        loss, sq_norm, stopping = self._scalars(result, stop.flag if stop is not None else 0.0)
        if not (math.isfinite(loss) and math.isfinite(sq_norm)):
            _report_non_finite(ctx, self.runner, step, loss, sq_norm, self.step_comm)
        lr = learning_rate(cfg.optim, step, steps)
        scale = clip_scale(sq_norm, cfg.optim.grad_clip)
        t_opt = rec.now()
        for s in self.mine:
            self.params[s], self.opt_state[s] = apply_update(
                cfg.optim,
                self.params[s],
                self.runner.grads_tree(s),
                self.opt_state[s],
                lr,
                grad_scale=scale,
            )
        self.runner.params = self.params
        ctx.backend.synchronize()
        if rec.enabled:
            rec.record(EventKind.OPTIMIZER, -1, -1, t_opt, rec.now())
        if rec.enabled:
            rec.record(
                EventKind.STEP, -1, -1, t_step, rec.now(), result.peak_live_bytes, value=loss
            )
        moe_stats = self.runner.moe_stats  # this step's, before a re-plan replaces the runner
        # a check after the last step would re-plan for nothing (and leave the end-of-run
        # reports a partition that never ran)
        due = self.replanner is not None and (step + 1) % cfg.replan.check_every == 0
        if due and step + 1 < steps:
            self._check_replan(step + 1)
        dt = time.perf_counter() - t0
        self._queue_figures(step, result, moe_stats, loss, sq_norm, lr, dt)
        stopping = self._end_of_step(step) or stopping
        if step % cfg.run.log_every == 0 or step == steps - 1:
            self.flush_figures()
        return stopping

    def _modelled_ns(self) -> dict[int, int] | None:
        """Per unit, how long a synthetic device's F, B and W last at this microbatch size
        (None: a real one); re-planning may change the size."""
        us = self.cfg.device.synthetic_us_per_row
        if us <= 0:
            return None
        if self._modelled is None or self._modelled[0] != self.rows_mb:
            self._modelled = (self.rows_mb, modelled_unit_ns(self.units, us, self.rows_mb))
        return self._modelled[1]

    def _scalars(self, result: StepResult, stop_flag: float) -> tuple[float, float, bool]:
        """The step's loss and squared gradient norm over what one optimizer step covers (the
        whole job here), and whether any rank was asked to stop."""
        return _reduce_scalars(self.ctx, self.runner, result, stop_flag)

    def _end_of_step(self, step: int) -> bool:
        """After the step's figures are queued (a subclass averages replicas here); True
        stops the run."""
        return False

    def _time_units(self) -> None:
        """With [replan] on, the stages time each unit (what re-planning weighs layers by)."""
        if self.replanner is not None:
            for stage in self.runner.stages.values():
                stage.unit_ns = {}

    def _unit_seconds(self) -> dict[tuple[str, int], float]:
        """The step's seconds inside each unit (kind, index), the stages' timers reset."""
        out: dict[tuple[str, int], float] = {}
        for stage in self.runner.stages.values():
            if stage.unit_ns:
                out.update({key: ns * 1e-9 for key, ns in stage.unit_ns.items()})
                stage.unit_ns.clear()
        return out

    def _check_replan(self, done: int) -> None:
        """Collective, every `replan.check_every` steps: gather the window's action costs on
        rank 0, which decides; every rank switches to the partition it broadcasts, if any."""
        ctx = self.ctx
        window, self._window = self._window, []
        world = ctx.comms.world
        mine: tuple[dict, dict] = ({}, {})
        if window:
            keys = {k for _, units in window for k in units}
            mine = (
                action_costs(self.schedule, self.coords["pp"], [a for a, _ in window]),
                {k: statistics.median([u.get(k, 0.0) for _, u in window]) for k in keys},
            )
        parts = world.gather(mine, root=0)
        decision = None
        if ctx.rank == 0:
            merged: tuple[dict, dict] = ({}, {})
            for part in parts:  # dp replicas of a stage: the slowest sets the pace
                for into, values in zip(merged, part, strict=True):
                    for key, value in values.items():
                        into[key] = max(into.get(key, 0.0), value)
            if len({s for _, s in merged[0]}) == self.schedule.num_stages:
                assert self.replanner is not None
                proposal = self.replanner.propose(self.ranges, Measured(*merged))
                chosen = self.replanner.decide(proposal)
                if chosen is not None:
                    decision = (
                        [(r.start, r.stop) for r in chosen.ranges],
                        chosen.describe(),
                        chosen.gain,
                        chosen.predicted_now,
                        chosen.predicted_new,
                        chosen.schedule,  # a searched schedule to switch to, or None
                    )
                elif ctx.verbose:  # why it stays, for whoever tunes [replan]
                    waits = "; waits for the next check" if self.replanner.waiting() else ""
                    ctx.log(f"replan check after step {done}: kept; {proposal.describe()}{waits}")
        decision = world.bcast(decision, root=0)
        if decision is not None:
            bounds, text, gain, before, after, schedule = decision
            self._repartition([range(a, b) for a, b in bounds], gain, schedule)
            self.replans.append(
                {
                    "step": done,
                    "gain": gain,
                    "predicted_before_s": before,
                    "predicted_after_s": after,
                    "stage_units": [b - a for a, b in bounds],
                    "schedule": schedule_label(self.schedule).encode(),
                }
            )
            ctx.log(f"replan after step {done}: {text}")

    def _switch_schedule(self, schedule: Schedule) -> None:
        """Run `schedule` from the next step (the same stages on the same ranks: the order of
        the actions changes, and maybe the microbatch count), validated and lowered like the
        deck's own."""
        from hpcpipe.schedules.validate import validate

        self.schedule, self.lowered = schedule, validate(schedule)
        assert self.replanner is not None
        self.replanner.schedule = schedule
        if schedule.num_microbatches != self.m:  # the same rows, split another way
            self.m = schedule.num_microbatches
            self.rows_mb = _check_batch(self.ctx, self.m)

    def _repartition(
        self, ranges: list[range], gain: float, schedule: Schedule | None = None
    ) -> None:
        """Collective over each pipeline: move the units whose stage changes rank, with their
        parameters and optimizer slots, over MPI (no restart, no file system), then rebuild
        this rank's stages and interpreter. dp replicas move the same units alike. The
        trace records the move as a REPLAN event (bytes sent, value = the predicted gain)."""
        ctx, backend = self.ctx, self.ctx.backend
        t0 = self.rec.now()
        if schedule is not None:
            self._switch_schedule(schedule)
        fingerprint = f"{self.lowered.fingerprint()}:{[(r.start, r.stop) for r in ranges]}"
        if len(set(ctx.comms.world.allgather(fingerprint))) != 1:
            raise RuntimeError(
                f"re-plan: ranks disagree on the new plan (this rank: {fingerprint})"
            )
        pp_comm, me = ctx.comms.group("pp"), self.coords["pp"]
        rank_of_stage = {s: r for r, row in enumerate(self.schedule.stages_of_rank) for s in row}
        before = {i: rank_of_stage[s] for s, r in enumerate(self.ranges) for i in r}
        after = {i: rank_of_stage[s] for s, r in enumerate(ranges) for i in r}
        optim_step = self.opt_state[self.mine[0]].step
        slots = list(self.opt_state[self.mine[0]].slots)
        held = {
            i: (self.params[s][i], {k: self.opt_state[s].slots[k][i] for k in slots})
            for s in self.mine
            for i in self.ranges[s]
        }
        outgoing: dict[int, dict[int, Any]] = {}
        for i, dest in after.items():
            if before[i] == me and dest != me:
                outgoing.setdefault(dest, {})[i] = tree_map(backend.to_host, held.pop(i))
        sources = {before[i] for i, dest in after.items() if dest == me and before[i] != me}
        sent = sum(int(a.nbytes) for part in outgoing.values() for a in leaves(part))
        self.runner.free()
        maybe_fail("replan", ctx.rank)  # a test point: a rank lost in the middle of the move
        for part in exchange_objects(pp_comm, outgoing, sources).values():
            for i, tree in part.items():
                held[i] = tree_map(lambda a: ctx.xp.asarray(a, dtype=a.dtype), tree)
        self.params = {s: {i: held[i][0] for i in ranges[s]} for s in self.mine}
        self.opt_state = {
            s: OptimState(optim_step, {k: {i: held[i][1][k] for i in ranges[s]} for k in slots})
            for s in self.mine
        }
        self.ranges = list(ranges)
        self.runner = self._build_runner({s: Stage(self.units, ranges[s]) for s in self.mine})
        self._time_units()
        if self.rec.enabled:
            self.rec.record(EventKind.REPLAN, -1, -1, t0, self.rec.now(), sent, value=gain)
        # the timing report and the next check see the new partition only
        self.action_log.clear()
        self.pipe_times.clear()
        self._window.clear()
        self._warm = False

    def _queue_figures(
        self,
        step: int,
        result: StepResult,
        moe_stats: list[Any],
        loss: float,
        sq_norm: float,
        lr: float,
        dt: float,
    ) -> None:
        """Keep this step's local figures; `flush_figures` reduces many steps at once, so a
        step makes one world-wide reduction (loss, norms, stop flag), not four to seven."""
        moe_local: dict[str, float] = {}
        if self.cfg.moe.enabled:
            if self.rec.enabled and moe_stats:
                # tokens this rank routed to each expert this step (zero-length events)
                t = self.rec.now()
                kept = np.sum([st.kept for st in moe_stats], axis=0)
                for expert, tokens in enumerate(kept.tolist()):
                    self.rec.record(EventKind.EXPERT, expert, -1, t, t, value=float(tokens))
            moe_local = summarize_stats(moe_stats)
        n = 1.0 if moe_local else 0.0
        sums = [result.compute_time, n] + [
            n * moe_local.get(k, 0.0)
            for k in ("tokens_per_expert_mean", "dropped_fraction", "aux_loss")
        ]
        maxes = [
            float(result.peak_live_bytes),
            float(result.peak_live_units),
            moe_local.get("tokens_per_expert_max", -np.inf),
            -moe_local.get("tokens_per_expert_min", np.inf),
        ]
        self._pending.append((step, sums, maxes, loss, sq_norm, lr, dt))

    def flush_figures(self) -> None:
        """Collective: reduce the queued steps' figures (two reductions for all of them), add
        them to rank 0's history and log the steps due. Called every `run.log_every` steps,
        before a checkpoint and at the end, on every rank alike."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        world = self.ctx.comms.world
        sums = allreduce(world, np.array([p[1] for p in pending], dtype=np.float64))
        maxes = allreduce(world, np.array([p[2] for p in pending], dtype=np.float64), "max")
        for (step, _, _, loss, sq_norm, lr, dt), total, peak in zip(
            pending, sums, maxes, strict=True
        ):
            self._log_step(step, total, peak, loss, sq_norm, lr, dt)

    def _log_step(
        self,
        step: int,
        total: np.ndarray,
        peak: np.ndarray,
        loss: float,
        sq_norm: float,
        lr: float,
        dt: float,
        share: float = 1.0,
    ) -> None:
        """`share`: of the global batch, what the step trained (replicas may skip a step)."""
        ctx, cfg = self.ctx, self.cfg
        tokens = cfg.data.global_batch * cfg.model.seq_len * share
        # measured bubble: 1 - mean compute / step time over the ranks that computed the step;
        # peak memory over ranks
        bubble = max(0.0, 1.0 - total[0] / (ctx.size * share) / dt)
        peak_bytes, peak_units = int(peak[0]), float(peak[1])
        figures = {
            "loss": loss,
            "grad_norm": math.sqrt(sq_norm),
            "lr": lr,
            "step_time": dt,
            "tokens_per_s": tokens / dt,
            "bubble": bubble,
            "peak_bytes": peak_bytes,
            "peak_microbatches": peak_units,
        }
        moe_text = ""
        if cfg.moe.enabled:
            count = max(total[1], 1.0)
            moe = {
                "min": float(-peak[3]),
                "max": float(peak[2]),
                "mean": float(total[2] / count),
                "dropped": float(total[3] / count),
                "aux": float(total[4] / count),
            }
            figures.update({f"moe_{k}": v for k, v in moe.items()})
            moe_text = (
                f" tok/expert={moe['min']:.0f}/{moe['mean']:.1f}/{moe['max']:.0f}"
                f" dropped={moe['dropped'] * 100:.1f}% aux={moe['aux']:.3f}"
            )
        if ctx.rank == 0:  # the metrics file, checkpoints' history and verify are rank 0's
            for key, value in figures.items():
                self.history.setdefault(key, []).append(float(value))
        if step % cfg.run.log_every == 0 or step == cfg.run.steps - 1:
            ctx.log(
                f"step {step + 1}/{cfg.run.steps} loss={loss:.4f} tok/s={tokens / dt:.0f} "
                f"bubble={bubble * 100:.1f}% mem={peak_bytes / 2**20:.2f}MiB "
                f"live_mb={peak_units:g} gnorm={math.sqrt(sq_norm):.3f}{moe_text}"
            )

    def finish(self, complete: bool) -> None:
        """Trace, memory and timing reports, metrics file, parameters, verification."""
        ctx, cfg = self.ctx, self.cfg
        self.flush_figures()
        memory = _report_activation_memory(ctx, self.schedule, self.runner)
        if self.rec.enabled:
            path = self.write_trace(memory)
            ctx.log(
                f"trace: {path} ({len(self.rec.events)} events on rank 0); "
                f"hpcpipe trace summary {path}"
            )
        step_times = self.history.get("step_time", [])
        timing = _report_timing(
            ctx, self.schedule, self.action_log, self.pipe_times, step_times[1:] or step_times
        )
        verify = cfg.train.verify and complete and not ctx.changed
        # the whole model on rank 0 only when something reads it (every rank decides alike)
        final = (
            _gather_params(ctx, self.params, self.coords)
            if cfg.train.save_params or verify
            else None
        )
        if ctx.rank == 0:
            _write_metrics(
                ctx.output / "metrics.h5",
                self.history,
                cfg,
                timing,
                memory,
                self.replans,
                self.metrics_arrays(),
            )
            if cfg.train.save_params:
                _write_params(ctx.output / "params.h5", final)
        if cfg.train.verify and complete and ctx.changed:
            ctx.log(
                "verify skipped: this run continued a checkpoint written with other "
                f"{', '.join(ctx.changed)} (--allow-change), which no single-process "
                "reference retraces"
            )
        elif verify and ctx.rank == 0:
            self._verify(final)
        idle_barrier(ctx.comms.world)  # rank 0 writes metrics and retrains the reference
        self.runner.free()
        if self.group is not None:
            self.group.free()

    def metrics_arrays(self) -> dict[str, np.ndarray]:
        """More datasets for metrics.h5 beside the per-step history (rank 0's)."""
        return {}

    def _verify(self, final: dict[int, dict[str, np.ndarray]] | None) -> None:
        """Rank 0: retrain with the single-process reference and compare."""
        assert final is not None
        _verify(self.ctx, self.history["loss"], final, self.m)


def _check_same_schedule(ctx: RunContext, lowered: Schedule) -> None:
    """Collective, once at start: every rank runs the same lowered schedule (exit 2 naming
    which ranks differ, instead of a hang on a message nobody sends)."""
    prints = ctx.comms.world.allgather(lowered.fingerprint())
    if len(set(prints)) == 1:
        return
    groups: dict[str, list[int]] = {}
    for rank, fp in enumerate(prints):
        groups.setdefault(fp, []).append(rank)
    described = "; ".join(
        f"ranks {format_ranks(ranks)} run schedule {fp}" for fp, ranks in groups.items()
    )
    raise ConfigError(
        ctx.config.source,
        "pipeline.schedule",
        f"differs between ranks ({described}): every rank must read the same deck, overrides "
        "and schedule file",
    )


def _reduce_scalars(
    ctx: RunContext, runner: PipelineRank, result: StepResult, stop_flag: float = 0.0
) -> tuple[float, float, bool]:
    """Global mean loss (last-stage ranks hold it) and the global squared gradient norm.

    After the reductions every dp replica holds the same dense gradients, and every expert
    group the same expert gradients: the norm takes dense parts from replica dp = 0 and expert
    parts from the first expert group (dp < ep), so nothing is counted twice.
    """
    dp = ctx.rankmap.coords(ctx.rank)["dp"]
    dense, expert = runner.local_sq_norms()
    local = np.array(
        [
            result.loss_sum,
            dense if dp == 0 else 0.0,
            expert if dp < ctx.rankmap.ep else 0.0,
            stop_flag,
        ]
    )
    total = allreduce(ctx.comms.world, local)  # one collective for all of them
    return float(total[0]), float(total[1] + total[2]), bool(total[3] > 0)


def _expert_group(ctx: RunContext):
    """The expert-parallel exchange for MoE decks (None for dense models)."""
    moe = ctx.config.moe
    if not moe.enabled:
        return None
    from hpcpipe.moe import ExpertGroup, check_moe

    check_moe(
        moe,
        ep=ctx.rankmap.ep,
        layers=ctx.config.model.layers,
        kind=ctx.config.model.kind,
        source=ctx.config.source,
    )
    return ExpertGroup.from_comms(
        ctx.comms, moe.experts, hierarchical=moe.hierarchical, cuda_aware=ctx.backend.cuda_aware
    )


def _report_non_finite(
    ctx: RunContext, runner: PipelineRank, step: int, loss: float, sq_norm: float, comm: Any
) -> None:
    """Collective over `comm` (the ranks that share the step's loss): name the stages."""
    coords = ctx.rankmap.coords(ctx.rank)
    bad = [
        s
        for s in runner.stages
        if not math.isfinite(
            sum(
                float(ctx.xp.sum(b[s].flat.astype(ctx.xp.float64)))
                for b in (runner.grads, runner.expert_grads)
            )
        )
    ]
    everyone = comm.allgather((coords["pp"], bad))
    stages = sorted({s for _, ss in everyone for s in ss})
    raise FloatingPointError(
        f"step {step + 1}: loss = {loss}, gradient norm^2 = {sq_norm} (not finite); non-finite "
        f"gradients on stage(s) {stages or 'none (loss only)'}; lower optim.lr or set "
        "optim.grad_clip"
    )


def _report_activation_memory(ctx: RunContext, schedule, runner: PipelineRank) -> dict | None:
    """Peak bytes each pipeline rank held between actions, measured on its arrays, next to
    the memory model's prediction: the schedule's order (`activation_peaks`) with each stage's
    bytes per microbatch as this run's first microbatch of it kept them, plus the message
    plan's receive buffers and the step's batch. Also the live-microbatch count against the
    plan's: a difference there means the runtime ran another order than the plan, a bug."""
    from hpcpipe.schedules import CostModel, simulate
    from hpcpipe.schedules.memory import activation_peaks

    coords = ctx.rankmap.coords(ctx.rank)
    chunks = len(schedule.stages_of_rank[coords["pp"]])
    mine = (
        runner.peak_units_overall / chunks,
        runner.peak_bytes_overall,
        runner.input_bytes,
        {s: tuple(b) for s, b in runner.stage_bytes.items()},
    )
    parts = ctx.comms.group("pp").allgather(mine)
    if ctx.rank != 0:
        return None
    counted = [p[0] for p in parts]
    planned = simulate(schedule, CostModel(activation=1.0 / chunks)).peak_memory
    ok = np.allclose(counted, planned, rtol=0, atol=1e-9)
    fmt = ", ".join
    ctx.log(
        f"activations: peak live microbatches per pipeline rank counted "
        f"[{fmt(f'{x:g}' for x in counted)}], planned [{fmt(f'{x:g}' for x in planned)}]"
        f"{'' if ok else ': DIFFERENT (the runtime did not run the plan order)'}"
    )
    sizes: dict[int, tuple[int, int]] = {}
    for p in parts:
        sizes.update(p[3])
    n = schedule.num_stages
    model = activation_peaks(
        schedule, [sizes[s][0] for s in range(n)], [sizes[s][1] for s in range(n)]
    )
    measured = np.array([p[1] for p in parts], dtype=np.float64)
    predicted = model + np.array([p[2] for p in parts], dtype=np.float64)
    ratio = measured / np.maximum(predicted, 1.0)
    mib = 2.0**20
    ctx.log(
        f"memory: peak bytes held between actions per pipeline rank (contexts, messages, "
        f"receive buffers, batch) measured [{fmt(f'{x / mib:.3f}' for x in measured)}] MiB, "
        f"predicted [{fmt(f'{x / mib:.3f}' for x in predicted)}] MiB, measured/predicted "
        f"max {ratio.max():.3f}; per stage and microbatch F keeps "
        f"[{fmt(f'{sizes[s][0] / mib:.3f}' for s in range(n))}] MiB, B "
        f"[{fmt(f'{sizes[s][1] / mib:.3f}' for s in range(n))}]"
    )
    return {
        "measured_peak_bytes": measured.tolist(),
        "predicted_peak_bytes": predicted.tolist(),
        "stage_bytes": [list(sizes[s]) for s in range(n)],
    }


def _report_timing(
    ctx: RunContext,
    schedule,
    action_log: Sequence[dict[tuple[str, int], float]],
    pipe_times: Sequence[float],
    step_times: list[float],
) -> dict[str, Any] | None:
    """Measured step time vs the simulator fed with the measured per-stage action costs.

    The ratio is what the runtime (messages, waits, Python) adds beyond the plan's critical
    path of compute; it is the figure `benchmarks/pipeline_step.py` reports.
    """
    from hpcpipe.schedules import simulate

    if not action_log:  # every rank ran the same steps: all return here together
        ctx.log(
            "timing: no step after the warm-up step was timed (the run stopped after one, or "
            "re-planned its layers one step before its end)"
        )
        return None
    mine = action_costs(schedule, ctx.rankmap.coords(ctx.rank)["pp"], action_log)
    parts = ctx.comms.group("pp").gather(mine, root=0)
    pipe = float(np.median(pipe_times)) if pipe_times else 0.0
    if ctx.rank != 0:
        return None
    costs: dict[tuple[str, int], float] = {}
    for part in parts:
        costs.update(part)
    model = cost_model(costs, schedule.num_stages)
    predicted = simulate(schedule, model).makespan
    full = float(np.median(step_times))
    ratio = pipe / predicted if predicted > 0 else float("nan")
    ctx.log(
        f"timing: pipeline step measured {pipe * 1e3:.2f} ms, simulated from measured "
        f"action costs {predicted * 1e3:.2f} ms, ratio {ratio:.3f}; full step with "
        f"optimizer {full * 1e3:.2f} ms (medians over {len(pipe_times)} step(s))"
        + _oversubscribed(ctx)
    )
    return {
        "pipeline_measured_s": pipe,
        "pipeline_predicted_s": predicted,
        "ratio": ratio,
        "step_s": full,
        "t_f": model.t_f,
        "t_b": model.t_b,
        "t_w": model.t_w,
        "t_bw": model.t_bw,
    }


def _oversubscribed(ctx: RunContext) -> str:
    """A warning suffix when a node runs more ranks than it has cores: timings mean little
    (unless the device is synthetic: its units sleep for their time, sharing no core)."""
    import os

    if ctx.config.device.synthetic_us_per_row > 0:
        return ""

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local = ctx.comms.node.size if not ctx.comms.node_info.virtual else ctx.size
    if cores and local > cores:
        return f" [oversubscribed: {local} ranks on {cores} cores, times are not meaningful]"
    return ""


def _gather_params(
    ctx: RunContext, params: dict[int, Any], coords: dict[str, int]
) -> dict[int, dict[str, np.ndarray]] | None:
    """Every parameter on rank 0: dense ones from replica dp = 0, experts from dp < ep."""
    from hpcpipe.moe.layer import is_expert_param

    dense_owner, expert_owner = coords["dp"] == 0, coords["dp"] < ctx.rankmap.ep
    mine: dict[int, dict[str, np.ndarray]] = {}
    for s in params:
        for i, p in params[s].items():
            for k, v in p.items():
                if expert_owner if is_expert_param(k) else dense_owner:
                    mine.setdefault(i, {})[k] = ctx.backend.to_host(v)
    parts = ctx.comms.world.gather(mine, root=0)
    if ctx.rank != 0:
        return None
    merged: dict[int, dict[str, np.ndarray]] = {}
    for part in parts:
        for i, p in part.items():
            merged.setdefault(i, {}).update(p)
    return dict(sorted(merged.items()))


def _write_metrics(
    path: Path,
    history: dict[str, list[float]],
    cfg,
    timing: dict[str, Any] | None = None,
    memory: dict[str, Any] | None = None,
    replans: Sequence[dict[str, Any]] = (),
    arrays: dict[str, np.ndarray] | None = None,
) -> None:
    import h5py

    tmp = path.with_suffix(".h5.tmp")
    ensure_space(path.parent, 8 * sum(len(v) for v in history.values()), f"metrics {path}")
    with h5py.File(tmp, "w") as f:
        f.attrs["format"], f.attrs["version"] = METRICS_FORMAT
        f.attrs["config"] = dump_toml(cfg)
        f.create_dataset("step", data=np.arange(1, len(history["loss"]) + 1))
        for key, value in (timing or {}).items():
            f.attrs[f"timing_{key}"] = value
        for key, value in (memory or {}).items():
            f.attrs[f"memory_{key}"] = np.asarray(value)
        for key, values in history.items():
            f.create_dataset(key, data=np.asarray(values))
        for key, value in (arrays or {}).items():
            f.create_dataset(key, data=value)
        if replans:  # one row per switch of the layer partition ([replan])
            group = f.create_group("replan")
            for key in replans[0]:
                group.create_dataset(key, data=np.asarray([r[key] for r in replans]))
    tmp.replace(path)


def _write_params(path: Path, params: dict[int, dict[str, np.ndarray]]) -> None:
    import h5py

    tmp = path.with_suffix(".h5.tmp")
    nbytes = sum(int(v.nbytes) for p in params.values() for v in p.values())
    ensure_space(path.parent, nbytes, f"parameters {path}")
    with h5py.File(tmp, "w") as f:
        for i, p in params.items():
            for k, v in p.items():
                f.create_dataset(f"unit{i:04d}/{k}", data=v)
    tmp.replace(path)


def _verify(
    ctx: RunContext, losses: list[float], params: dict[int, dict[str, np.ndarray]], m: int
) -> None:
    """Rerun with the single-process reference and compare: the oracle of every layout."""
    from hpcpipe.train.reference import train_reference
    from hpcpipe.train.verify import compare_with_reference, tolerance

    cfg = ctx.config
    rtol = tolerance(cfg)
    ref = train_reference(
        cfg.model,
        cfg.data,
        cfg.optim,
        steps=cfg.run.steps,
        seed=cfg.run.seed,
        microbatches=m * ctx.rankmap.dp,
        dtype=cfg.device.dtype,
        moe=cfg.moe,
    )
    compare_with_reference(ctx.log, "single-process reference", losses, params, ref, rtol)
