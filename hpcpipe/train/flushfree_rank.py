"""The interpreter of a pipeline without a flush: one rank runs the whole stream of a
`FlushFreePlan`, each action on the weight version the plan gives it, and applies each update
where the plan lands it.

It is the synchronous interpreter (`PipelineRank`) with two additions around each action: the
stage's parameters are set to the version the action's microbatch reads (weight stashing:
versions stay alive until their last W), and after the weight gradient that completes a window
the stage updates its newest version with that window's gradients, clipped by the stage's own
norm. The gradient buffer holds one window at a time, so a stage's W must come in window order.
"""

from __future__ import annotations

from typing import Any

from hpcpipe.model.models import Params
from hpcpipe.schedules.flushfree import FlushFreePlan
from hpcpipe.schedules.ir import Action, Kind
from hpcpipe.train.optim import (
    OptimConfig,
    OptimState,
    apply_update,
    clip_scale,
    grad_sq_norm,
    learning_rate,
)
from hpcpipe.train.pipeline import PipelineRank

__all__ = ["FlushFreeRank"]

_WEIGHT_GRADIENT = (Kind.W, Kind.BW)


class FlushFreeRank(PipelineRank):
    """`PipelineRank` over a flush-free plan's lowered stream (see the module docstring)."""

    def __init__(
        self,
        plan: FlushFreePlan,
        lowered: Any,
        rank: int,
        stages: dict,
        params: dict[int, Params],
        optim: OptimConfig,
        opt_state: dict[int, OptimState],
        **kwargs: Any,
    ):
        super().__init__(lowered, rank, stages, params, **kwargs)
        self.plan, self.optim, self.opt_state = plan, optim, opt_state
        self.versions: dict[int, list[Params | None]] = {}
        # (stage, microbatch) of the W (or BW) after which updates land, and how many
        compute = [a for a in self.actions if a.kind in (Kind.F, Kind.B, Kind.W, Kind.BW)]
        self._lands: dict[tuple[int, int], int] = {}
        for s in stages:
            for k, pos in enumerate(plan.landing[s]):
                a = compute[int(pos)]
                assert a.stage == s and a.kind in _WEIGHT_GRADIENT, (a, s, k)
                self._lands[(s, a.microbatch)] = self._lands.get((s, a.microbatch), 0) + 1
            for pos, a in enumerate(compute):  # one window in the gradient buffer at a time
                k = a.microbatch // plan.window
                early = k and pos < plan.landing[s, k - 1]
                if a.stage == s and a.kind in _WEIGHT_GRADIENT and early:
                    raise ValueError(
                        f"stage {s} computes a weight gradient of window {k} before update "
                        f"{k - 1} lands: a pipeline without a flush needs each stage's W in "
                        "window order"
                    )
        self.start_stream(0, plan.updates)

    def start_stream(self, before: int, total: int) -> None:
        """A new stream from the stages' current parameters (`self.params`): `before` updates
        came earlier in the run, of `total` (the learning-rate schedule spans the run)."""
        self.versions = {s: [self.params[s]] for s in self.stages}
        self._newest = dict.fromkeys(self.stages, 0)
        self._mb_loss: dict[int, Any] = {}
        self._before, self._total = before, total

    def _run_action(self, action: Action, step: int) -> None:
        s, kind, mb = action
        if kind in (Kind.F, Kind.B, Kind.W, Kind.BW):
            v = int(self.plan.version[s, mb])
            if kind == Kind.F and v != self._newest[s]:  # the plan and this run disagree
                raise RuntimeError(
                    f"stage {s}: F of microbatch {mb} should read version {v}, but this rank "
                    f"has made {self._newest[s]} updates"
                )
            self.params[s] = self.versions[s][v]
        super()._run_action(action, step)
        if kind in _WEIGHT_GRADIENT:
            for _ in range(self._lands.get((s, mb), 0)):
                self._update(s)

    def _forward_steps(self, s: int, mb: int, step: int):
        before, self._loss_sum = self._loss_sum, 0.0
        yield from super()._forward_steps(s, mb, step)
        if self.stages[s].is_last:
            self._mb_loss[mb] = self._loss_sum  # this microbatch's weighted loss alone
        self._loss_sum = before + self._loss_sum

    def _update(self, s: int) -> None:
        """Update k of stage s: window k's gradients (the whole buffer) onto the newest."""
        k = self._newest[s]
        grads = self.grads_tree(s)
        sq = grad_sq_norm(grads)
        lr = learning_rate(self.optim, self._before + k, self._total)
        new, self.opt_state[s] = apply_update(
            self.optim,
            self.versions[s][-1],
            grads,
            self.opt_state[s],
            lr,
            grad_scale=clip_scale(sq, self.optim.grad_clip),
        )
        self.versions[s].append(new)
        self._newest[s] = k + 1
        for buf in (self.grads[s], self.expert_grads[s]):
            buf.zero()
        later = self.plan.version[s, (k + 1) * self.plan.window :]
        oldest = int(later.min()) if later.size else k + 1
        for old in range(oldest):  # no later microbatch reads it: free it
            self.versions[s][old] = None

    def finish_stream(self) -> list[Any]:
        """After the stream (drained): every stage's parameters are its newest version; the
        weighted loss of each update (on the rank holding the last stage; empty elsewhere)."""
        for s in self.stages:
            self.params[s] = self.versions[s][-1]
        if not self._mb_loss:
            return []
        w = self.plan.window
        return [
            sum(self._mb_loss[j] for j in range(k * w, (k + 1) * w))
            for k in range(self.plan.updates)
        ]
