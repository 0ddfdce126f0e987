"""The pipeline interpreter: executes one rank's lowered schedule for one optimizer step.

Every action goes through one dispatch (`_run_action`); compute actions call the stage's F, B
or W, communication actions move activations and gradients through the `Mailbox`, which posts
each receive where the rank's message plan says (`hpcpipe.schedules.messages`).
Data-parallel gradient reduction of a stage starts as soon as its last W has run. An error
names the rank, the step and the action, and shows where it was in the rank's action list.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpcpipe.faults import link_faults, maybe_fail
from hpcpipe.io.trace import EventKind, Recorder, action_peers
from hpcpipe.model.models import Params
from hpcpipe.model.stage import Stage
from hpcpipe.model.steps import Steps, interleave, run
from hpcpipe.moe.layer import is_expert_param
from hpcpipe.mpi import Comm
from hpcpipe.mpi.clock import world_ranks
from hpcpipe.mpi.collectives import BucketedAllreduce, FlatBuffer
from hpcpipe.mpi.p2p import Mailbox
from hpcpipe.schedules.ir import Action, Kind, Schedule
from hpcpipe.schedules.messages import plan_messages
from hpcpipe.train.memory import LiveArrays

__all__ = ["PipelineRank", "StepResult"]


@dataclass
class StepResult:
    """What one rank measured in one step (times in seconds, memory in bytes and microbatches)."""

    loss_sum: float  # sum over this rank's last-stage microbatches of weight * loss
    compute_time: float
    step_time: float
    peak_live_bytes: int  # arrays held between actions (`LiveArrays`), receive buffers included
    peak_live_units: float  # microbatches of one full stage (a chunk of v counts 1/v)
    action_times: dict[tuple[str, int], float] = field(default_factory=dict)
    """Total seconds per (action kind name, stage) in this step."""


class ActionError(RuntimeError):
    """An action failed; the message shows the rank's action list around it."""


class PipelineRank:
    """One pipeline rank: its stages, their parameters and gradient buffers, and the transport."""

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        stages: dict[int, Stage],
        params: dict[int, Params],
        *,
        pp_comm: Comm,
        dp_comm: Comm,
        backend: Any,
        act_shape: Sequence[int],
        recv_lookahead: int = 8,
        blocking_sends: bool = False,
        bucket_bytes: int = 4 << 20,
        world_rank: int = 0,
        recorder: Recorder | None = None,
        expert_dp_comm: Comm | None = None,
    ):
        self.schedule = schedule
        self.rank = rank
        self.world_rank = world_rank
        self.stages = stages
        self.params = params
        self.backend = backend
        self.xp = backend.xp
        self.act_shape = tuple(act_shape)
        self.actions: tuple[Action, ...] = schedule.rank_actions(rank)
        self.rank_of_stage = {s: r for r, ss in enumerate(schedule.stages_of_rank) for s in ss}
        self.n_stages = len(self.rank_of_stage)
        self.chunks_per_rank = len(schedule.stages_of_rank[rank])
        self.messages = plan_messages(schedule, rank, recv_lookahead)
        mailbox = (pp_comm, backend, self.messages, self.act_shape, backend.dtype)
        slow_links = link_faults(world_rank)
        if slow_links:  # an injected slow link (tests and benchmarks): messages held back
            from hpcpipe.mpi.slowlink import SlowLinkMailbox

            self.mailbox = SlowLinkMailbox(
                *mailbox,
                blocking=blocking_sends,
                specs=slow_links,
                world_rank=world_rank,
                world_of_peer=world_ranks(pp_comm),
                step_of=lambda: self._step_no,
            )
        else:
            self.mailbox = Mailbox(*mailbox, blocking=blocking_sends)
        self._releases = self.messages.releases() if self.mailbox.needs_release else {}
        self.reducer = BucketedAllreduce(dp_comm, backend, bucket_bytes)
        # Dense gradients are reduced over dp; expert gradients (sharded over ep) only over
        # the replicas of the same experts (expert_dp_comm), so each kind has its own buffer.
        self.grads: dict[int, FlatBuffer] = {}
        self.expert_grads: dict[int, FlatBuffer] = {}
        self._views: dict[int, dict[tuple[int, str], Any]] = {}
        for s in stages:
            shapes = {(i, k): v.shape for i, p in params[s].items() for k, v in p.items()}
            expert = {key for key in shapes if is_expert_param(key[1])}
            self.grads[s] = FlatBuffer.like(
                self.xp, {k: v for k, v in shapes.items() if k not in expert}, backend.dtype
            )
            self.expert_grads[s] = FlatBuffer.like(
                self.xp, {k: v for k, v in shapes.items() if k in expert}, backend.dtype
            )
            self._views[s] = {**self.grads[s].views, **self.expert_grads[s].views}
        self.expert_reducer = BucketedAllreduce(
            expert_dp_comm if expert_dp_comm is not None else dp_comm, backend, bucket_bytes
        )
        # more nonblocking work that should advance between actions (a replica's averaging):
        # MPI moves a message only when it is called, and a rank with no stage messages (pp 1)
        # makes no MPI call between its actions otherwise
        self.background: Callable[[], None] | None = None
        self._unit_ends = {s: _unit_ends(self.grads[s], self.expert_grads[s]) for s in stages}
        self._reducing = self.reducer.comm.size > 1 or self.expert_reducer.comm.size > 1
        self.has_moe = any(is_expert_param(k[1]) for v in self._views.values() for k in v)
        self.mailbox.overlap = not self.has_moe  # MoE all-to-alls block inside F and B
        self.peak_units_overall = 0  # over every step, in chunks (stages) x microbatches
        self.memory = LiveArrays()  # bytes held between actions, measured on the arrays
        self._run_long = set(self.memory.hold("receive buffers", self.mailbox.receive_buffers()))
        self.input_bytes = self.memory.live
        """Receive buffers and the step's batch (the most over steps): held, not activations."""
        self._shared: set[int] = set(self._run_long)  # ids no context is charged for
        self.stage_bytes = {s: [0, 0] for s in stages}
        """Per stage: the most one microbatch's context and W context added (memory model)."""
        self.peak_bytes_overall = 0
        self.rec = recorder if recorder is not None else Recorder(rank, enabled=False)
        # each stage's reduction timed from its start to its completion (for the trace)
        self.reducer.clock = self.expert_reducer.clock = self.rec.now
        if self.rec.enabled:  # peers and sizes per action, so the hook only indexes
            self._peers = action_peers(schedule, rank, world_ranks(pp_comm)).tolist()
            nbytes = int(np.prod(self.act_shape)) * np.dtype(backend.dtype).itemsize
            self._nbytes = [nbytes if p >= 0 else 0 for p in self._peers]
        self._post_at = [r.post_at for r in self.messages.receives]
        # overlapped pairs, by the F half's position. Where a half's stage communicates inside
        # F and B (MoE blocks), the two halves run interleaved, each one's collectives in
        # flight while the other computes (`hpcpipe.model.steps`); stages with begin_pair /
        # end_pair (the synthetic stand-ins) overlap in their own way; a pair of stages with
        # nothing to hide runs as two actions, as the simulator's cost for it says
        self._communicates = {
            s: bool(getattr(st, "communicates", False)) for s, st in stages.items()
        }
        pairs = schedule.rank_pairs(rank)
        self._joint = frozenset(
            i
            for i in pairs
            if self._communicates[self.actions[i].stage]
            or self._communicates[self.actions[i + 1].stage]
        )
        self._pairs = {
            i: (stages[self.actions[i].stage], stages[self.actions[i + 1].stage])
            for i in pairs - self._joint
            if hasattr(stages[self.actions[i].stage], "begin_pair")
        }
        self._step_no, self._pos = -1, -1  # where this rank is, for the watchdog's report

    # ------------------------------------------------------------------ one step

    def step(
        self, step: int, inputs: list[Any] | None, targets: list[Any] | None, loss_weight: float
    ) -> StepResult:
        """Run every action of this rank for one step. inputs/targets: per microbatch (or None)."""
        for buf in (*self.grads.values(), *self.expert_grads.values()):
            buf.zero()
        self.moe_stats: list[Any] = []
        self._inputs: dict[tuple[int, int], Any] = {}  # (stage, mb) -> activation in
        self._outputs: dict[tuple[int, int], Any] = {}  # (stage, mb) -> activation out
        self._dgrad_in: dict[tuple[int, int], Any] = {}  # (stage, mb) -> dL/d(output)
        self._dgrad_out: dict[tuple[int, int], Any] = {}  # (stage, mb) -> dL/d(input)
        self._ctx: dict[tuple[int, int], Any] = {}
        self._wctx: dict[tuple[int, int], Any] = {}
        memory = self.memory
        batch = memory.hold("batch", (inputs, targets))  # slices of it feed the end stages
        self._shared = self._run_long | set(batch)
        self.input_bytes = max(self.input_bytes, memory.live)
        memory.reset_peak()
        self._live_units = self._peak_units = 0
        self._w_done = dict.fromkeys(self.stages, 0)
        self._loss_sum: Any = 0.0  # on the device until the end of the step (one copy)
        self._batch = (inputs, targets, loss_weight)
        self._m = self.schedule.num_microbatches
        times: dict[tuple[str, int], float] = {}
        compute = 0
        post_at, next_recv, n_recv = self._post_at, 0, len(self._post_at)
        post, releases = self.mailbox.post_recv, self._releases
        self._n_sent = self._n_received = 0  # the step's sends and receives so far (plan order)
        reducer, expert_reducer = self.reducer, self.expert_reducer
        rec, now = self.rec, self.rec.now
        pairs, joint = self._pairs, self._joint
        b_half: tuple[int, int] | None = None  # the B half of the pair just run: its interval
        t_step = now()
        self._step_no = step + 1  # reports number steps from 1, like the log
        for pos, action in enumerate(self.actions):
            self._pos = pos
            # receives posted ahead, as planned, so senders never wait for this rank (a pair
            # also posts those of its B half's position: both halves run now)
            last = pos + 1 if pos in joint else pos
            while next_recv < n_recv and post_at[next_recv] <= last:
                post(next_recv)
                next_recv += 1
            self.mailbox.progress()
            if reducer.busy:  # the stage reductions started so far advance between actions
                reducer.progress()
            if expert_reducer.busy:
                expert_reducer.progress()
            if self.background is not None:
                self.background()
            t0, t1 = now(), 0
            try:
                if b_half is not None:  # ran with its F half, one position earlier
                    (t0, t1), b_half = b_half, None
                elif pos in joint:
                    # the F half's record covers its own busy time, the B half's the rest
                    t1 = t0 + self._run_joint(action, self.actions[pos + 1], step)
                    b_half = (t1, now())
                else:
                    if pairs:
                        self._pair_edge(pos)
                    self._run_action(action, step)
                    if pairs and pos - 1 in pairs:
                        f_stage, b_stage = pairs[pos - 1]
                        f_stage.end_pair(b_stage)
            except Exception as exc:
                raise ActionError(self._where(step + 1, pos, exc)) from exc
            if pos in releases:
                self.mailbox.release(releases[pos])
            if not t1:
                t1 = now()
            if rec.enabled:
                rec.record(
                    action.kind,
                    action.stage,
                    action.microbatch,
                    t0,
                    t1,
                    self._nbytes[pos],
                    self._peers[pos],
                )
            key = (action.kind.name, action.stage)
            times[key] = times.get(key, 0.0) + (t1 - t0) * 1e-9
            if action.kind in (Kind.F, Kind.B, Kind.W, Kind.BW):
                compute += t1 - t0
        t0 = now()
        self._pos = len(self.actions)
        self.mailbox.drain()
        t_drained = now()
        self._pos += 1
        self.reducer.wait()
        self.expert_reducer.wait()
        self._pos = -1
        t1 = now()
        if rec.enabled:  # the drain is a WAIT; the reductions' wait is the tail of their events
            rec.record(EventKind.WAIT, -1, -1, t0, t_drained)
            for reduction in (*self.reducer.reductions, *self.expert_reducer.reductions):
                kind, s = reduction.key[0], int(reduction.key[1:])
                rec.record(
                    EventKind.ALLREDUCE,
                    s,
                    -1,
                    reduction.start,
                    reduction.done,
                    reduction.nbytes,
                    value=float(kind == "e"),
                )
        self.reducer.reductions.clear()  # read once: a step that starts none records none
        self.expert_reducer.reductions.clear()
        self.peak_units_overall = max(self.peak_units_overall, self._peak_units)
        self.peak_bytes_overall = max(self.peak_bytes_overall, self.memory.peak)
        loss_sum = self._loss_sum  # a float unless this rank holds the last stage
        if not isinstance(loss_sum, float):
            loss_sum = self.backend.scalars([loss_sum])[0]
        return StepResult(
            loss_sum,
            compute * 1e-9,
            (t1 - t_step) * 1e-9,
            self.memory.peak,
            self._peak_units / self.chunks_per_rank,
            times,
        )

    def _pair_edge(self, pos: int) -> None:
        """An overlapped pair starts at `pos`: its stages run the two halves together."""
        if pos in self._pairs:
            f_stage, b_stage = self._pairs[pos]
            f_stage.begin_pair(b_stage)

    def where(self) -> str:
        """What this rank is doing now, in schedule terms (read by the watchdog's thread)."""
        step, pos, n = self._step_no, self._pos, len(self.actions)
        if pos < 0:
            return f"pipeline rank {self.rank}: outside the pipeline actions (after step {step})"
        if pos == n:
            return (
                f"step {step}: pipeline rank {self.rank} finished its {n} actions and waits for "
                f"its own sends to complete ({self.mailbox.describe_pending()})"
            )
        if pos > n:
            return f"step {step}: pipeline rank {self.rank} waits for the gradient allreduce"
        action = self.actions[pos]
        detail = ""
        if pos in self._joint:
            detail = f" & {self.actions[pos + 1]}, an overlapped pair"
        elif action.kind in (Kind.RECV_F, Kind.RECV_B):
            peer_stage = action.stage - 1 if action.kind == Kind.RECV_F else action.stage + 1
            detail = f", waiting for pipeline rank {self.rank_of_stage[peer_stage]}"
        elif action.kind in (Kind.SEND_F, Kind.SEND_B):
            peer_stage = action.stage + 1 if action.kind == Kind.SEND_F else action.stage - 1
            detail = f", sending to pipeline rank {self.rank_of_stage[peer_stage]}"
        lo, hi = max(0, pos - 3), min(n, pos + 4)
        shown = " ".join(
            f">>{a}<<" if i == pos else str(a) for i, a in enumerate(self.actions[lo:hi], start=lo)
        )
        return (
            f"step {step}, action {pos}/{n} ({action}{detail}) of pipeline rank {self.rank}; "
            f"actions: {'... ' if lo else ''}{shown}{' ...' if hi < n else ''}"
        )

    def _where(self, step: int, pos: int, exc: Exception) -> str:
        lo, hi = max(0, pos - 6), min(len(self.actions), pos + 7)
        shown = " ".join(
            f">>{a}<<" if i == pos else str(a) for i, a in enumerate(self.actions[lo:hi], start=lo)
        )
        what = str(self.actions[pos])
        if pos in self._joint:  # either half may have failed: both run now
            what += f" & {self.actions[pos + 1]}, an overlapped pair"
        return (
            f"step {step}, action {pos} ({what}) of pipeline rank {self.rank}: "
            f"{type(exc).__name__}: {exc}\n  actions: {'... ' if lo else ''}{shown}"
            f"{' ...' if hi < len(self.actions) else ''}"
        )

    # ------------------------------------------------------------------ dispatch

    def _run_action(self, action: Action, step: int) -> None:
        s, kind, mb = action
        key = (s, mb)
        if kind == Kind.F:
            self._forward(s, mb, step)
        elif kind == Kind.B:
            maybe_fail(f"backward:{step + 1}", self.world_rank)
            self._backward_input(s, mb)
        elif kind == Kind.W:
            self._backward_weight(s, mb)
        elif kind == Kind.BW:
            maybe_fail(f"backward:{step + 1}", self.world_rank)
            self._backward_input(s, mb)
            self._backward_weight(s, mb)
        elif kind == Kind.SEND_F:
            self.mailbox.send(self._outputs.pop(key), self._n_sent)
            self.memory.drop(("out", s, mb))
            self._n_sent += 1
        elif kind == Kind.SEND_B:
            self.mailbox.send(self._dgrad_out.pop(key), self._n_sent)
            self.memory.drop(("gout", s, mb))
            self._n_sent += 1
        elif kind == Kind.RECV_F:
            self._inputs[key] = x = self.mailbox.wait_recv(self._n_received)
            self.memory.hold(("in", s, mb), x)
            self._n_received += 1
        elif kind == Kind.RECV_B:
            self._dgrad_in[key] = dy = self.mailbox.wait_recv(self._n_received)
            self.memory.hold(("gin", s, mb), dy)
            self._n_received += 1
        else:
            raise ValueError(f"unknown action kind {kind!r}")

    def _run_joint(self, f: Action, b: Action, step: int) -> int:
        """An overlapped pair: F of one microbatch and B (or BW) of another, interleaved at
        their collectives (`hpcpipe.model.steps.interleave`). Returns the F half's busy time."""
        forward = self._forward_steps(f.stage, f.microbatch, step)
        backward = self._backward_steps(b.stage, b.microbatch, step, fused=b.kind == Kind.BW)
        if self._communicates[f.stage] or not self._communicates[b.stage]:
            return interleave(forward, backward, self.rec.now)[2]
        # only B communicates: it goes first, so F computes while B's first exchange is out
        return interleave(backward, forward, self.rec.now)[3]

    def _forward(self, s: int, mb: int, step: int) -> None:
        run(self._forward_steps(s, mb, step))

    def _forward_steps(self, s: int, mb: int, step: int) -> Steps[None]:
        stage = self.stages[s]
        inputs, targets, _ = self._batch
        x = inputs[mb] if stage.is_first else self._inputs.pop((s, mb))
        maybe_fail(f"forward:{step + 1}", self.world_rank)
        args = (self.params[s], x, targets[mb] if stage.is_last else None)
        if hasattr(stage, "forward_steps"):
            y, ctx = yield from stage.forward_steps(*args, loss_weight=self._batch[2])
        else:  # a stage without collectives to pause at (the synthetic stand-ins)
            y, ctx = stage.forward(*args, loss_weight=self._batch[2])
        if self.has_moe:
            self.moe_stats.extend(stage.aux_stats(ctx).values())
        self._ctx[(s, mb)] = ctx
        memory = self.memory
        memory.drop(("in", s, mb))  # the context keeps what it needs of it
        self._calibrate(s, 0, memory.hold(("ctx", s, mb), ctx))
        self._track(+1)
        if stage.is_last:
            loss = self.xp.asarray(y, dtype=self.xp.float64)  # stays on the device
            self._loss_sum = self._loss_sum + loss * self._batch[2]
        elif self.rank_of_stage[s + 1] == self.rank:
            self._inputs[(s + 1, mb)] = y  # next stage is on this rank (V turn): no message
            memory.hold(("in", s + 1, mb), y)
        else:
            self._outputs[(s, mb)] = y
            memory.hold(("out", s, mb), y)

    def _backward_steps(self, s: int, mb: int, step: int, *, fused: bool) -> Steps[None]:
        """B (and W after it when `fused`: a BW action) as steps, for an overlapped pair."""
        maybe_fail(f"backward:{step + 1}", self.world_rank)
        yield from self._backward_input_steps(s, mb)
        if fused:
            self._backward_weight(s, mb)

    def _backward_input(self, s: int, mb: int) -> None:
        run(self._backward_input_steps(s, mb))

    def _backward_input_steps(self, s: int, mb: int) -> Steps[None]:
        stage = self.stages[s]
        dy = self._batch[2] if stage.is_last else self._dgrad_in.pop((s, mb))
        ctx = self._ctx.pop((s, mb))
        if hasattr(stage, "backward_input_steps"):
            dx, wctx = yield from stage.backward_input_steps(self.params[s], ctx, dy)
        else:
            dx, wctx = stage.backward_input(self.params[s], ctx, dy)
        self._wctx[(s, mb)] = wctx
        memory = self.memory
        memory.drop(("ctx", s, mb))
        memory.drop(("gin", s, mb))  # what W needs of it stays in its context
        self._calibrate(s, 1, memory.hold(("wctx", s, mb), wctx))
        if dx is None:
            return
        if self.rank_of_stage[s - 1] == self.rank:
            self._dgrad_in[(s - 1, mb)] = dx
            memory.hold(("gin", s - 1, mb), dx)
        else:
            self._dgrad_out[(s, mb)] = dx
            memory.hold(("gout", s, mb), dx)

    def _backward_weight(self, s: int, mb: int) -> None:
        wctx = self._wctx.pop((s, mb))
        views = self._views[s]
        last = self._w_done[s] + 1 == self._m
        # the stage's last W: each bucket starts reducing once its units are final, while the
        # next units compute (as DDP does in the backward), the rest after the last unit
        ends = self._unit_ends[s] if last and self._reducing else None
        reducer, expert_reducer = self.reducer, self.expert_reducer
        for i, g in self.stages[s].backward_weight_units(self.params[s], wctx):
            for k, v in g.items():
                views[(i, k)] += v
            if ends is not None:
                dense_end, expert_end = ends[i]
                reducer.start(self.grads[s], f"d{s}", dense_end)
                if expert_end:
                    expert_reducer.start(self.expert_grads[s], f"e{s}", expert_end)
                if reducer.busy:
                    reducer.progress()
        self.memory.drop(("wctx", s, mb))
        self._track(-1)
        self._w_done[s] += 1
        if last:
            reducer.start(self.grads[s], key=f"d{s}")
            if self.expert_grads[s].flat.size:
                expert_reducer.start(self.expert_grads[s], key=f"e{s}")

    def _track(self, dunits: int) -> None:
        self._live_units += dunits
        self._peak_units = max(self._peak_units, self._live_units)

    def _calibrate(self, s: int, which: int, held: dict[int, Any]) -> None:
        """Bytes one microbatch's context (0) or W context (1) of stage `s` adds beyond the
        receive buffers and the batch: the per-stage sizes of the memory model."""
        shared = self._shared
        n = sum(int(a.nbytes) for i, a in held.items() if i not in shared)
        sizes = self.stage_bytes[s]
        if n > sizes[which]:
            sizes[which] = n

    # ------------------------------------------------------------------ results

    def grads_tree(self, s: int) -> Params:
        """The (reduced) gradients of stage `s`, keyed like its parameters."""
        out: dict[int, dict[str, Any]] = {}
        for (i, k), v in self._views[s].items():
            out.setdefault(i, {})[k] = v
        return out

    def free(self) -> None:
        """Release what the transport and reductions keep across steps (persistent requests)."""
        self.mailbox.free()
        self.reducer.free()
        self.expert_reducer.free()

    def local_sq_norms(self) -> tuple[float, float]:
        """Squared norms of this rank's (dense, expert) gradients, in float64 (one host copy)."""
        xp = self.xp
        dense = [xp.sum(b.flat.astype(xp.float64) ** 2) for b in self.grads.values()]
        expert = [xp.sum(b.flat.astype(xp.float64) ** 2) for b in self.expert_grads.values()]
        values = self.backend.scalars([*dense, *expert])
        return float(sum(values[: len(dense)])), float(sum(values[len(dense) :]))


def _unit_ends(dense: FlatBuffer, expert: FlatBuffer) -> dict[int, tuple[int, int]]:
    """Per unit, in the order W computes them (ascending): the element below which each
    gradient buffer is final once that unit's W has run, i.e. the longest prefix of the
    buffer that holds only units done by then (whatever order the buffer lays them out in)."""
    units = sorted({i for i, _ in (*dense.offsets, *expert.offsets)})
    ends: dict[int, tuple[int, int]] = {}
    for n, i in enumerate(units):
        done = set(units[: n + 1])
        ends[i] = (_final_prefix(dense, done), _final_prefix(expert, done))
    return ends


def _final_prefix(buffer: FlatBuffer, done: set[int]) -> int:
    end = 0
    for (unit, _), (lo, hi) in sorted(buffer.offsets.items(), key=lambda kv: kv[1]):
        if unit not in done or lo != end:
            break
        end = hi
    return end
