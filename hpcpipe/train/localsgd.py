"""`hpcpipe run` with `[async] mode = "local"`: data parallelism without a barrier every step.

Each data-parallel replica (a whole pipeline) trains on its own shard of every global batch
with its own optimizer: no gradient allreduce, so a replica never waits for another inside a
round. Every `async.average_every` steps (and at the last step) the replicas average their
parameters (`hpcpipe.train.averaging`): at once with `async.delay = 0`, or started there and
applied one round later with `delay = 1`, so the reduction overlaps a round of local steps and
a replica only waits for one that is a whole round behind. The semantics, and the oracle
`train.verify` compares with, are `hpcpipe.train.localsgd_reference`.

The step's figures (loss, norm, compute time, memory) are reduced inside the replica every
step and over the replicas with the averaging, so a step is logged when its round completes.
Not supported yet, refused up front naming the key: expert parallelism and MoE, re-planning,
checkpoints and --resume (a checkpoint would hold every replica's weights and optimizer state
and the round in flight). A stop signal ends the run at the end of the round that carries it.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from hpcpipe.config import ConfigError
from hpcpipe.io.trace import EventKind
from hpcpipe.jobcontrol import StopSignal, write_status
from hpcpipe.mpi.averaging import ReplicaAverager
from hpcpipe.mpi.collectives import allreduce
from hpcpipe.runtime import RunContext
from hpcpipe.train.localsgd_checks import UNSUPPORTED, check_local
from hpcpipe.train.localsgd_reference import round_ends
from hpcpipe.train.pipeline import StepResult
from hpcpipe.train.workload import Trainer

__all__ = ["LocalTrainer", "run_local"]


def run_local(ctx: RunContext) -> None:
    """Train `run.steps` steps, replicas averaging every `async.average_every`."""
    cfg = ctx.config
    if ctx.resume is not None:
        raise ConfigError("--resume", "", f"replicas start from the seed; {UNSUPPORTED}")
    check_local(cfg, ctx.rankmap)
    trainer = LocalTrainer(ctx)
    stop = StopSignal()
    state, done, steps = "finished", 0, cfg.run.steps
    try:
        for step in range(steps):
            with ctx.watchdog.phase(f"step {step + 1}", trainer.where):
                stopping = trainer.step(step, stop)
            done = step + 1
            if stopping and done < steps:
                state = "preempted"
                ctx.log(
                    f"stopping on signal after step {done}/{steps} (the end of a round); "
                    "async.mode = 'local' writes no checkpoint yet"
                )
                break
    finally:
        stop.restore()
    if ctx.rank == 0:
        write_status(ctx.output, state, done, None)
    trainer.finish(complete=state == "finished")
    trainer.averager.free()


class LocalTrainer(Trainer):
    """A `Trainer` whose step spans one replica; replicas meet only to average."""

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        cfg, a = self.cfg, self.cfg.sections["async"]
        self.objective_rows = cfg.data.global_batch // ctx.rankmap.dp  # a replica's shard
        self.step_comm = ctx.comms.group("pp")
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
        self._walls: list[float] = []  # this rank's steps' wall times, averaging waits included
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
        self._walls.append(time.perf_counter() - t0)
        return stopping

    def finish(self, complete: bool) -> None:
        if self.ctx.rank == 0:  # what a straggling replica costs the others: their waits
            self.history["wall_time"] = self._walls
        super().finish(complete)

    def _scalars(self, result: StepResult, stop_flag: float) -> tuple[float, float, bool]:
        """Inside the replica: its mean loss, its squared norm (clipped alone), its compute
        time and memory peaks for the figures. A stop waits for the round's end."""
        dense, expert = self.runner.local_sq_norms()
        total = allreduce(
            self.step_comm, np.array([result.loss_sum, dense + expert, result.compute_time])
        )
        peaks = allreduce(
            self.step_comm,
            np.array([float(result.peak_live_bytes), float(result.peak_live_units)]),
            "max",
        )
        self._replica = (float(total[2]), peaks)
        self._stop = max(self._stop, stop_flag)
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
        if self.averager.delay == 0 or step + 1 == self.cfg.run.steps:
            stop = self._complete(at_once=True) or stop
        return stop

    def _complete(self, at_once: bool = False) -> bool:
        """Wait for the round in flight, take its parameters, log its steps."""
        self._waiting, t0 = True, self.rec.now()
        try:
            self.params, sums, maxima = self.averager.finish(self.params, at_once=at_once)
        finally:
            self._waiting = False
        if self.rec.enabled:  # the wait for the replicas' mean (value 1: parameter averaging)
            nbytes = int(self.averager.sum.flat.nbytes)
            self.rec.record(EventKind.WAIT, -1, -1, t0, self.rec.now(), nbytes, value=1.0)
        self.runner.params = self.params
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
        )
        compare_with_reference(
            ctx.log,
            "single-process local-steps reference (same averaging)",
            self.history["loss"],
            final,
            ref,
            rtol,
        )
