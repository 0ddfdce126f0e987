"""`hpcpipe run` with `[async] mode = "local"`: data parallelism without a barrier every step.

Each data-parallel replica (a whole pipeline) trains on its own shard of every global batch
with its own optimizer: no gradient allreduce, so a replica never waits for another inside a
round. Every `async.average_every` steps (and at the last step) the replicas average their
parameters (`hpcpipe.mpi.averaging`): at once with `async.delay = 0`, or started there and
applied one round later with `delay = 1`, so the reduction overlaps a round of local steps and
a replica only waits for one that is a whole round behind. The semantics, and the oracle
`train.verify` compares with, are `hpcpipe.train.localsgd_reference`.

The step's figures (loss, norm, compute time, memory) are reduced inside the replica every
step and over the replicas with the averaging, so a step is logged when its round completes.

Checkpoints fall on round ends (`checkpoint.every` a multiple of `average_every`; a stop
signal is taken at the end of the round that carries it). Each replica writes its own
parameters and optimizer state; with delay 1 the round in flight is waited for and its totals
are written beside them, to be applied one round later as in an uninterrupted run, so a resume
continues bit for bit. Not supported yet, refused up front naming the key: expert parallelism
and MoE, re-planning.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from hpcpipe.config import ConfigError
from hpcpipe.io.checkpoint import ShardSpec
from hpcpipe.io.trace import EventKind
from hpcpipe.jobcontrol import StopSignal, write_status
from hpcpipe.mpi.averaging import ReplicaAverager
from hpcpipe.mpi.collectives import allreduce
from hpcpipe.runtime import RunContext
from hpcpipe.train.checkpointing import replica_prefix, restore, save
from hpcpipe.train.localsgd_checks import check_local
from hpcpipe.train.localsgd_reference import round_ends
from hpcpipe.train.pipeline import StepResult
from hpcpipe.train.workload import Trainer

__all__ = ["LocalTrainer", "run_local"]

PENDING = "pending"
"""Where a replica keeps the totals of the averaging round a checkpoint caught in flight."""


def run_local(ctx: RunContext) -> None:
    """Train `run.steps` steps, replicas averaging every `async.average_every`; checkpoints
    and stop signals at round ends (from a checkpoint with --resume)."""
    cfg = ctx.config
    check_local(cfg, ctx.rankmap)
    trainer = LocalTrainer(ctx)
    start = trainer.restore() if ctx.resume else 0
    stop = StopSignal()
    every, steps = cfg.checkpoint.every, cfg.run.steps
    state, last, done = "finished", None, start
    try:
        for step in range(start, steps):
            with ctx.watchdog.phase(f"step {step + 1}", trainer.where):
                stopping = trainer.step(step, stop)
            done = step + 1
            if stopping or (every and (done % every == 0 or done == steps)):
                last = trainer.checkpoint(done)  # waits for the round in flight
                stopping = stopping or trainer.stop_seen
            if stopping and done < steps:
                state = "preempted"
                ctx.log(
                    f"stopping on signal after step {done}/{steps} (the end of a round): "
                    f"checkpoint {last}; resume with --resume"
                )
                break
    finally:
        stop.restore()
    if ctx.rank == 0:
        write_status(ctx.output, state, done, last)
    trainer.finish(complete=state == "finished")
    trainer.averager.free()


class LocalTrainer(Trainer):
    """A `Trainer` whose step spans one replica; replicas meet only to average."""

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        cfg, a = self.cfg, self.cfg.sections["async"]
        self.objective_rows = cfg.data.global_batch // ctx.rankmap.dp  # a replica's shard
        self.step_comm = ctx.comms.group("pp")
        # the ends where the replicas take the mean at once: the run's last step, and those of
        # earlier runs this one continues (`restore`)
        self.at_once = {cfg.run.steps}
        self.ends = set(round_ends(cfg.run.steps, a.average_every))
        self.averager = ReplicaAverager(
            ctx.comms.group("dp"),
            ctx.backend,
            self.params,
            delay=a.delay,
            bucket_bytes=int(cfg.train.bucket_mb * 2**20),
        )
        self._replica: tuple[float, np.ndarray] = (0.0, np.zeros(2))
        self._stop = 0.0  # any stop signal seen on this rank since the last round started
        self._in_flight: list[tuple] = []  # the figures of the round being averaged
        self._waiting = False
        self.stop_seen = False  # a stop signal found by waiting for a round at a checkpoint
        ctx.log(
            f"local steps: {ctx.rankmap.dp} replica(s) of {self.objective_rows} rows, averaging "
            f"every {a.average_every} step(s) with delay {a.delay} "
            f"({len(self.ends)} round(s)); optimizer state stays each replica's own"
        )

    def _gradient_comms(self) -> tuple[Any, Any]:
        return self.ctx.comms.alone, self.ctx.comms.alone  # a replica's gradients are its own

    def where(self) -> str:
        if self._waiting:
            return (
                f"pipeline rank {self.coords['pp']} of replica {self.coords['dp']} waits for "
                "the other replicas' parameters (averaging)"
            )
        return self.runner.where()

    def step(self, step: int, stop: StopSignal | None = None) -> bool:
        t0 = time.perf_counter()
        self.averager.progress()
        stopping = super().step(step, stop)
        if self.ctx.rank == 0:  # what a straggling replica costs the others: their waits
            self.history.setdefault("wall_time", []).append(time.perf_counter() - t0)
        return stopping

    def _scalars(self, result: StepResult, stop_flag: float) -> tuple[float, float, bool]:
        """Inside the replica: its mean loss, its squared norm (clipped alone), its compute
        time and memory peaks for the figures. A stop waits for the round's end."""
        dense, expert = self.runner.local_sq_norms()
        total = allreduce(
            self.step_comm, np.array([result.loss_sum, dense + expert, result.compute_time])
        )
        peaks = allreduce(  # a stop seen by any of the replica's ranks is the replica's
            self.step_comm,
            np.array([float(result.peak_live_bytes), float(result.peak_live_units), stop_flag]),
            "max",
        )
        self._replica = (float(total[2]), peaks[:2])
        self._stop = max(self._stop, float(peaks[2]))
        return float(total[0]), float(total[1]), False

    def _queue_figures(self, step, result, moe_stats, loss, sq_norm, lr, dt) -> None:
        compute, peaks = self._replica
        self._pending.append((step, loss, sq_norm, compute, peaks, lr, dt))

    def flush_figures(self) -> None:
        """Figures travel with the averaging (see `_end_of_step`): nothing to reduce here."""

    def _end_of_step(self, step: int) -> bool:
        """At a round's end: average (delay 0), or apply the last round and start this one
        (delay 1). True when a completed round carried a stop signal."""
        if step + 1 not in self.ends:
            return False
        stop = False
        if self.averager.in_flight:  # delay 1: last round's mean
            stop = self._complete()
        rows, self._pending = self._pending, []
        sums = np.array([[r[1], r[2], r[3], 0.0] for r in rows], dtype=np.float64)
        sums[:, 3] = self._stop
        maxima = np.array([[r[4][0], r[4][1], r[6]] for r in rows], dtype=np.float64)
        self._stop = 0.0
        self.averager.start(self.params, sums.ravel(), maxima.ravel())
        self._in_flight = rows
        if self.averager.delay == 0 or step + 1 in self.at_once:
            stop = self._complete(at_once=True) or stop
        return stop

    def _settle(self) -> bool:
        """Wait for the reductions of the round in flight and log its steps (once per round).
        True when one of its steps carried a stop signal."""
        if not self.averager.in_flight or self.averager.ready:
            return False
        self._waiting, t0 = True, self.rec.now()
        try:
            sums, maxima = self.averager.wait()
        finally:
            self._waiting = False
        if self.rec.enabled:  # the wait for the replicas' mean (value 1: parameter averaging)
            nbytes = int(self.averager.sum.flat.nbytes)
            self.rec.record(EventKind.WAIT, -1, -1, t0, self.rec.now(), nbytes, value=1.0)
        rows, self._in_flight = self._in_flight, []
        n = self.ctx.rankmap.dp
        sums, maxima = sums.reshape(len(rows), 4), maxima.reshape(len(rows), 3)
        for (step, *_, lr, _), total, peak in zip(rows, sums, maxima, strict=True):
            # world compute time (each replica's is its pp ranks' sum), the slowest replica's
            # step time, the replicas' mean loss and mean squared norm
            self._log_step(
                step,
                np.array([total[2], 0.0]),
                peak[:2],
                total[0] / n,
                total[1] / n,
                lr,
                float(peak[2]),
            )
        return bool(len(rows) and sums[:, 3].max() > 0)

    def _complete(self, at_once: bool = False) -> bool:
        """Wait for the round in flight (unless a checkpoint did), take its parameters."""
        stop = self._settle()
        self.params = self.averager.finish(self.params, at_once=at_once)
        self.runner.params = self.params
        return stop

    def checkpoint(self, done: int) -> Path:
        """At a round's end: the round in flight is waited for (so the history reaches this
        step and its totals can be written), not applied."""
        self.stop_seen = self._settle()
        return super().checkpoint(done)

    def _save(self, done: int) -> Path:
        extra = {}
        if self.averager.in_flight:  # delay 1: the totals the next round end applies
            prefix = replica_prefix(self.coords["dp"]) + PENDING
            extra = {
                f"{prefix}/unit{i:04d}/{k}": total
                for (_, i, k), total in self.averager.pending().items()
            }
        ends = sorted(e for e in self.at_once if e <= done)
        return save(
            self.ctx,
            done,
            self.params,
            self.opt_state,
            self.history,
            replica=self.coords["dp"],
            extra=extra,
            attrs={"async_earlier_ends": json.dumps(ends), "local_pending": int(bool(extra))},
        )

    def restore(self) -> int:
        """Each replica's own parameters and optimizer state, and with delay 1 the round the
        checkpoint's step started (applied at the next round end, as in an uninterrupted
        run). Earlier runs' last steps stay round ends taken at once."""
        shapes = {
            (s, i, k): (tuple(v.shape), np.dtype(v.dtype))
            for s, tree in self.params.items()
            for i, p in tree.items()
            for k, v in p.items()
        }
        prefix = replica_prefix(self.coords["dp"]) + PENDING

        def pending(attrs: dict[str, Any]) -> dict[str, ShardSpec]:
            if not attrs.get("local_pending"):
                return {}
            return {
                f"{prefix}/unit{i:04d}/{k}": ShardSpec(f"{prefix}/unit{i:04d}/{k}", *shape)
                for (_, i, k), shape in shapes.items()
            }

        resumed = restore(
            self.ctx, self.params, self.opt_state, replica=self.coords["dp"], extra=pending
        )
        self.history = resumed.history
        self.runner.params = self.params
        try:
            earlier = json.loads(resumed.attrs.get("async_earlier_ends", "[]"))
        except ValueError:
            earlier = None
        if not isinstance(earlier, list) or not all(isinstance(e, int) for e in earlier):
            raise ConfigError(
                "--resume", "", "checkpoint attribute 'local_at_once' is damaged (not a step list)"
            )
        a = self.cfg.sections["async"]
        self.at_once |= set(earlier)
        self.ends = set(round_ends(self.cfg.run.steps, a.average_every, self.at_once))
        if resumed.extra:
            xp = self.ctx.xp
            totals = {
                key: xp.asarray(resumed.extra[f"{prefix}/unit{key[1]:04d}/{key[2]}"])
                for key in shapes
            }
            self.averager.resume(self.params, totals)
        return resumed.step

    def _verify(self, final: dict[int, dict[str, np.ndarray]] | None) -> None:
        from hpcpipe.train.localsgd_reference import train_local_reference
        from hpcpipe.train.verify import compare_with_reference, tolerance

        assert final is not None
        ctx, cfg, a = self.ctx, self.cfg, self.cfg.sections["async"]
        rtol = tolerance(cfg)
        ref = train_local_reference(
            cfg.model,
            cfg.data,
            cfg.optim,
            replicas=ctx.rankmap.dp,
            average_every=a.average_every,
            delay=a.delay,
            steps=cfg.run.steps,
            seed=cfg.run.seed,
            microbatches=self.m,
            dtype=cfg.device.dtype,
            at_once=self.at_once,
        )
        compare_with_reference(
            ctx.log,
            "single-process local-steps reference (same averaging)",
            self.history["loss"],
            final,
            ref,
            rtol,
        )
