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

import bisect
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
from hpcpipe.mpi.notices import RoundNotices
from hpcpipe.runtime import RunContext
from hpcpipe.train.checkpointing import replica_prefix, restore, save
from hpcpipe.train.localsgd_checks import check_local
from hpcpipe.train.localsgd_reference import round_ends
from hpcpipe.train.optim import learning_rate
from hpcpipe.train.pipeline import StepResult
from hpcpipe.train.workload import Trainer

__all__ = ["LocalTrainer", "run_local"]

PENDING = "pending"
"""Where a replica keeps the totals of the averaging round a checkpoint caught in flight."""
TAKEN = "local/taken"
"""The steps each replica took in each round so far ([rounds, replicas], rank 0's)."""


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
        step = start
        while step < steps:
            with ctx.watchdog.phase(f"step {step + 1}", trainer.where):
                stopping = trainer.step(step, stop)
            # a round ended early (the first replica was done): skip to its end
            done = step = trainer.next_step
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
    if trainer.notices is not None:
        trainer.notices.free()


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
        self.ends = round_ends(cfg.run.steps, a.average_every)
        # rounds that end when the first replica is done: the others hear of it here
        first = a.round_end == "first" and ctx.rankmap.dp > 1
        self.notices = RoundNotices(ctx.comms.group("dp")) if first else None
        self.next_step = 0  # where the run goes on after the step just taken
        self._step = 0  # the step being taken
        self._cut = False  # this replica ends the round after this step (another was done)
        self.taken: list[list[int]] = []  # rank 0: steps each replica took, per round
        self.averager = ReplicaAverager(
            ctx.comms.group("dp"),
            ctx.backend,
            self.params,
            delay=a.delay,
            bucket_bytes=int(cfg.train.bucket_mb * 2**20),
        )
        self.runner.background = self.averager.progress  # the round in flight, between actions
        self._replica: tuple[float, np.ndarray] = (0.0, np.zeros(2))
        self._stop = 0.0  # any stop signal seen on this rank since the last round started
        self._in_flight: list[tuple] = []  # the figures of the round being averaged
        self._round = -1  # the round being averaged
        self._waiting = False
        self.stop_seen = False  # a stop signal found by waiting for a round at a checkpoint
        ctx.log(
            f"local steps: {ctx.rankmap.dp} replica(s) of {self.objective_rows} rows, averaging "
            f"every {a.average_every} step(s) with delay {a.delay} "
            f"({len(self.ends)} round(s)"
            + ("; a round ends when the first replica is done" if first else "")
            + "); optimizer state stays each replica's own"
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
        self._step, self.next_step = step, step + 1
        stopping = super().step(step, stop)
        if self.ctx.rank == 0:  # what a straggling replica costs the others: their waits
            walls = self.history.setdefault("wall_time", [])
            walls.append(time.perf_counter() - t0)
            walls += [0.0] * (self.next_step - step - 1)  # the steps it skipped
        return stopping

    def _round_of(self, step: int) -> tuple[int, int, int]:
        """The round holding `step`: its index, first step and end (one past its last)."""
        c = bisect.bisect_right(self.ends, step)
        return c, self.ends[c - 1] if c else 0, self.ends[c]

    def _scalars(self, result: StepResult, stop_flag: float) -> tuple[float, float, bool]:
        """Inside the replica: its mean loss, its squared norm (clipped alone), its compute
        time and memory peaks for the figures. A stop waits for the round's end."""
        dense, expert = self.runner.local_sq_norms()
        total = allreduce(
            self.step_comm, np.array([result.loss_sum, dense + expert, result.compute_time])
        )
        # another replica done with the round, as any of this replica's ranks has heard
        heard = self.notices is not None and self.notices.arrived(self._round_of(self._step)[0])
        peaks = allreduce(  # a stop seen by any of the replica's ranks is the replica's
            self.step_comm,
            np.array(
                [
                    float(result.peak_live_bytes),
                    float(result.peak_live_units),
                    stop_flag,
                    float(heard),
                ]
            ),
            "max",
        )
        self._replica = (float(total[2]), peaks[:2])
        self._stop = max(self._stop, float(peaks[2]))
        self._cut = bool(peaks[3] > 0)
        return float(total[0]), float(total[1]), False

    def _queue_figures(self, step, result, moe_stats, loss, sq_norm, lr, dt) -> None:
        compute, peaks = self._replica
        self._pending.append((step, loss, sq_norm, compute, peaks, lr, dt))

    def flush_figures(self) -> None:
        """Figures travel with the averaging (see `_end_of_step`): nothing to reduce here."""

    def _end_of_step(self, step: int) -> bool:
        """At a round's end (its last step, or any step once another replica is done with
        it): average (delay 0), or apply the last round and start this one (delay 1). True
        when a completed round carried a stop signal."""
        c, begin, end = self._round_of(step)
        if step + 1 != end and not self._cut:
            return False
        self.next_step = end
        stop = False
        if self.averager.in_flight:  # delay 1: last round's mean
            stop = self._complete()
        rows, self._pending = self._pending, []
        taken = {r[0]: r for r in rows}
        # per step of the round: loss, squared norm, compute, stop, 1 if this replica took it
        sums = np.zeros((end - begin, 5))
        maxima = np.zeros((end - begin, 3))  # peak bytes, peak microbatches, step time
        for i, s in enumerate(range(begin, end)):
            if s in taken:
                _, loss, sq_norm, compute, peaks, _, dt = taken[s]
                sums[i] = (loss, sq_norm, compute, self._stop, 1.0)
                maxima[i] = (peaks[0], peaks[1], dt)
        counts = np.zeros(self.ctx.rankmap.dp)
        counts[self.coords["dp"]] = len(rows)  # which replica took how many
        self._stop = 0.0
        if self.notices is not None:
            self.notices.announce(c)
        self.averager.start(self.params, np.concatenate([sums.ravel(), counts]), maxima.ravel())
        self._in_flight, self._round = [begin, end], c
        if self.averager.delay == 0 or end in self.at_once:
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
        begin, end = self._in_flight
        self._in_flight = []
        n = end - begin
        counts, sums, maxima = sums[5 * n :], sums[: 5 * n].reshape(n, 5), maxima.reshape(n, 3)
        if self.ctx.rank == 0:
            self.taken.append([int(x) for x in counts])
        steps = self.cfg.run.steps
        for s, total, peak in zip(range(begin, end), sums, maxima, strict=True):
            # world compute time (each replica's is its pp ranks' sum), the slowest replica's
            # step time, the mean loss and mean squared norm of the replicas that took it
            took = total[4]
            self._log_step(
                s,
                np.array([total[2], 0.0]),
                peak[:2],
                total[0] / took,
                total[1] / took,
                learning_rate(self.cfg.optim, s, steps),
                float(peak[2]),
                share=took / self.ctx.rankmap.dp,
            )
        return bool(n and sums[:, 3].max() > 0)

    def _complete(self, at_once: bool = False) -> bool:
        """Wait for the round in flight (unless a checkpoint did), take its parameters."""
        stop = self._settle()
        self.params = self.averager.finish(self.params, at_once=at_once)
        self.runner.params = self.params
        if self.notices is not None:  # every replica has ended that round: its notices too
            self.notices.close(self._round)
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
        if self.ctx.rank == 0:  # the steps each replica took in each round so far
            extra[TAKEN] = np.array(self.taken, dtype=np.int64).reshape(-1, self.ctx.rankmap.dp)
        ends = sorted(e for e in self.at_once if e <= done)
        return save(
            self.ctx,
            done,
            self.params,
            self.opt_state,
            self.history,
            replica=self.coords["dp"],
            extra=extra,
            attrs={
                "async_earlier_ends": json.dumps(ends),
                "local_pending": int(self.averager.in_flight),
                "local_rounds": len(self.taken),
            },
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

        dp, rank0 = self.ctx.rankmap.dp, self.ctx.rank == 0

        def pending(attrs: dict[str, Any]) -> dict[str, ShardSpec]:
            wanted = {}
            rounds = attrs.get("local_rounds")
            if rank0 and isinstance(rounds, int) and rounds > 0:
                wanted[TAKEN] = ShardSpec(TAKEN, (rounds, dp), np.dtype(np.int64))
            if attrs.get("local_pending"):
                wanted |= {
                    f"{prefix}/unit{i:04d}/{k}": ShardSpec(f"{prefix}/unit{i:04d}/{k}", *shape)
                    for (_, i, k), shape in shapes.items()
                }
            return wanted

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
                "--resume",
                "",
                "checkpoint attribute 'async_earlier_ends' is damaged (not a step list)",
            )
        a = self.cfg.sections["async"]
        self.at_once |= set(earlier)
        # the checkpoint's step ended a round: so it does here, whatever the cadence now
        ends = {*round_ends(self.cfg.run.steps, a.average_every, self.at_once), resumed.step}
        self.ends = sorted(ends)
        taken = resumed.extra.pop(TAKEN, None)
        if taken is not None:
            self.taken = taken.tolist()
        if resumed.extra and a.delay == 0:
            raise ConfigError(
                "--resume",
                "",
                f"the checkpoint of step {resumed.step} holds an averaging round in flight "
                "(written with async.delay = 1), which async.delay = 0 has no place for: "
                "resume with async.delay = 1",
            )
        if resumed.extra:
            xp = self.ctx.xp
            totals = {
                key: xp.asarray(resumed.extra[f"{prefix}/unit{key[1]:04d}/{key[2]}"])
                for key in shapes
            }
            self.averager.resume(self.params, totals)
        return resumed.step

    def metrics_arrays(self) -> dict[str, np.ndarray]:
        """`replica_steps` [rounds, replicas]: the steps each replica took in each round
        (fewer than the round's for a straggler when a round ends with the first replica)."""
        return {
            "replica_steps": np.array(self.taken, dtype=np.int64).reshape(-1, self.ctx.rankmap.dp)
        }

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
            taken=self.taken,
        )
        compare_with_reference(
            ctx.log,
            "single-process local-steps reference (same averaging)",
            self.history["loss"],
            final,
            ref,
            rtol,
        )
