"""A pipeline stage: a contiguous run of units, executed as F, B and W for one microbatch at a time.

The stage keeps no state between calls: F returns a context that the caller holds until B, and B
returns a weight context held until W. That is what lets a schedule keep several microbatches in
flight and delay W (zero-bubble schedules), and makes live activation memory measurable.

    y, ctx = stage.forward(params, x, targets)       # first stage: x = token ids
                                                     # last stage: y = mean loss of the microbatch
    dx, wctx = stage.backward_input(params, ctx, dy) # last stage: dy = weight of that loss
                                                     # first stage: dx is None
    grads = stage.backward_weight(params, wctx)      # {global index: {name: array}}

With MoE blocks, pass the microbatch's share of the objective to F, `stage.forward(params, x,
targets, loss_weight=w)`, which scales their auxiliary losses; `stage.aux_stats(ctx)` reports
what each MoE block routed (see docs/moe.md).

Contexts may reference the arrays passed in (W of a block's last projection needs `dy` itself), so
treat `x` as owned by the stage until B of that microbatch and `dy` until its W: a reusable
receive buffer must be copied, or not refilled, while those contexts are alive.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from hpcpipe.model.blocks import LossHead
from hpcpipe.model.layers import Array, Embedding, Layer, Module, activation_bytes, array_module
from hpcpipe.model.models import Params
from hpcpipe.model.steps import Steps, run
from hpcpipe.sleeps import sleep_until_ns

__all__ = ["Stage", "accumulate", "modelled_unit_ns", "zeros_like"]


class Stage:
    """Units ``units[r]`` for a range ``r`` of global layer indices."""

    def __init__(self, units: Sequence[Module], indices: range):
        if len(indices) == 0 or indices.step != 1:
            raise ValueError(f"a stage needs a non-empty contiguous range of units, got {indices}")
        if indices.start < 0 or indices.stop > len(units):
            raise ValueError(f"{indices} is outside the model's {len(units)} units")
        self.indices = indices
        self.units = [units[i] for i in indices]
        for i, u in zip(indices, self.units, strict=True):
            if isinstance(u, LossHead) and i != indices[-1]:
                raise ValueError(f"the loss head (unit {i}) must be the last unit of its stage")
        self.is_first = isinstance(self.units[0], Embedding)
        self.is_last = isinstance(self.units[-1], LossHead)
        self.communicates = any(hasattr(u, "forward_steps") for u in self.units)
        """Some unit pauses at collectives in F and B (MoE blocks): what a pair interleaves."""
        self.unit_ns: dict[tuple[str, int], int] | None = None
        """Set to a dict to have F, B and W time each unit: nanoseconds by (kind, global
        index), summed until the caller resets it (re-planning weighs layers by them). A unit
        that pauses at collectives is timed while it computes: a wait in an all-to-all measures
        its peers' lateness, not this rank's speed."""

        self.slowdown = 1.0
        """Each unit's F, B and W take this many times as long: an injected `kind=slow` fault
        (`hpcpipe.faults.slowdown`), a stand-in for a throttled or older device."""
        self.modelled_ns: Mapping[int, int] | None = None
        """Per global unit index, how long each of its F, B and W lasts at least: a synthetic
        device (`[device] synthetic_us_per_row`, `modelled_unit_ns`). The real arithmetic runs
        inside that time and the unit sleeps the rest, so a pipeline of more ranks than cores
        keeps the timing of one with a core each."""

    def _timed(self, kind: str, i: int, t0: int) -> None:
        if self.modelled_ns is not None:
            sleep_until_ns(t0 + self.modelled_ns.get(i, 0))
        if self.unit_ns is not None or self.slowdown > 1.0:  # else: nothing to charge
            self._charge(kind, i, time.perf_counter_ns() - t0)

    def _charge(self, kind: str, i: int, spent: int) -> None:
        """`spent` ns of compute in unit `i`: stretched by `slowdown`, added to `unit_ns`."""
        if self.slowdown > 1.0:
            extra = int(spent * (self.slowdown - 1.0))
            time.sleep(extra * 1e-9)
            spent += extra
        if self.unit_ns is not None:
            key = (kind, i)
            self.unit_ns[key] = self.unit_ns.get(key, 0) + spent

    def _computing(self, kind: str, i: int, steps: Steps[Any]) -> Steps[Any]:
        """A unit's steps, its compute between collectives charged to it (`_charge`), the
        collectives themselves (run by whoever drives the steps) not."""
        if self.unit_ns is None and self.slowdown == 1.0 and self.modelled_ns is None:
            return (yield from steps)
        spent, value = 0, None
        try:
            while True:
                t0 = time.perf_counter_ns()
                try:
                    operation = steps.send(value)
                except StopIteration as done:
                    spent += time.perf_counter_ns() - t0
                    return done.value
                spent += time.perf_counter_ns() - t0
                value = yield operation
        finally:
            steps.close()
            if self.modelled_ns is not None:  # the compute's share of the modelled time
                t0 = time.perf_counter_ns()
                sleep_until_ns(t0 + self.modelled_ns.get(i, 0) - spent)
                spent += time.perf_counter_ns() - t0
            self._charge(kind, i, spent)

    def __repr__(self) -> str:
        return f"Stage(units {self.indices.start}..{self.indices.stop - 1})"

    def init(self, seed: int, xp: Any = np, dtype: Any = "float32") -> Params:
        """This stage's parameters, identical to the same units' in any other partition."""
        return {
            i: u.init(seed, i, xp, dtype) for i, u in zip(self.indices, self.units, strict=True)
        }

    def forward(
        self, params: Params, x: Array, targets: Array | None = None, *, loss_weight: float = 1.0
    ) -> tuple[Array, Any]:
        """F for one microbatch: the output (the 0-d mean loss on the last stage) and its ctx.

        `loss_weight` is the microbatch's share of the objective (the `dy` its last stage gets
        in B); units with auxiliary losses (MoE) keep it in their ctx to scale those losses.
        """
        return run(self.forward_steps(params, x, targets, loss_weight=loss_weight))

    def forward_steps(
        self, params: Params, x: Array, targets: Array | None = None, *, loss_weight: float = 1.0
    ) -> Steps[tuple[Array, Any]]:
        """`forward` as steps (`hpcpipe.model.steps`): units that communicate (MoE blocks)
        yield their collectives, so an overlapped pair can interleave F with another B."""
        ctxs = []
        for i, unit in zip(self.indices, self.units, strict=True):
            t0 = time.perf_counter_ns()
            if isinstance(unit, LossHead):
                if targets is None:
                    raise ValueError(f"{self} ends with the loss head: forward needs targets")
                x, ctx = unit.forward(params[i], x, targets)
            elif hasattr(unit, "forward_steps"):
                x, ctx = yield from self._computing(
                    "F", i, unit.forward_steps(params[i], x, loss_weight=loss_weight)
                )
                ctxs.append(ctx)
                continue
            elif getattr(unit, "uses_loss_weight", False):
                x, ctx = unit.forward(params[i], x, loss_weight=loss_weight)  # type: ignore[call-arg]
            else:
                assert isinstance(unit, Layer)
                x, ctx = unit.forward(params[i], x)
            self._timed("F", i, t0)
            ctxs.append(ctx)
        return x, ctxs

    def aux_stats(self, ctx: Any) -> dict[int, Any]:
        """Auxiliary-loss figures of the microbatch whose F returned `ctx`, by global unit index
        (`hpcpipe.moe.MoEStats` of each MoE block; empty for a dense stage)."""
        return {
            i: unit.aux_stats(c)
            for i, unit, c in zip(self.indices, self.units, ctx, strict=True)
            if hasattr(unit, "aux_stats")
        }

    def backward_input(self, params: Params, ctx: Any, dy: Any) -> tuple[Array | None, Any]:
        """B: gradient for the previous stage (None on the first) and the ctx W needs.

        On the last stage `dy` is the weight of this microbatch's mean loss in the objective
        (tokens in the microbatch / tokens in the global batch).
        """
        return run(self.backward_input_steps(params, ctx, dy))

    def backward_input_steps(self, params: Params, ctx: Any, dy: Any) -> Steps[tuple[Any, Any]]:
        """`backward_input` as steps: units that communicate yield their collectives."""
        wctxs: list[Any] = [None] * len(self.units)
        for k in reversed(range(len(self.units))):
            i, unit = self.indices[k], self.units[k]
            if hasattr(unit, "backward_input_steps"):
                dy, wctxs[k] = yield from self._computing(
                    "B", i, unit.backward_input_steps(params[i], ctx[k], dy)
                )
                continue
            t0 = time.perf_counter_ns()
            dy, wctxs[k] = unit.backward_input(params[i], ctx[k], dy)
            self._timed("B", i, t0)
        return dy, wctxs

    def backward_weight(self, params: Params, wctx: Any) -> Params:
        """W: parameter gradients of this microbatch, keyed like `params`."""
        return dict(self.backward_weight_units(params, wctx))

    def backward_weight_units(
        self, params: Params, wctx: Any
    ) -> Iterator[tuple[int, dict[str, Array]]]:
        """W unit by unit, in the order of `params`: a caller can act on each unit's gradients
        as soon as they exist (start reducing them while the next unit computes)."""
        for i, unit, w in zip(self.indices, self.units, wctx, strict=True):
            t0 = time.perf_counter_ns()
            grads = unit.backward_weight(params[i], w)
            self._timed("W", i, t0)
            yield i, grads

    def backward(self, params: Params, ctx: Any, dy: Any) -> tuple[Array | None, Params]:
        """Fused BW: B then W at once (schedules without a B/W split)."""
        dx, wctx = self.backward_input(params, ctx, dy)
        return dx, self.backward_weight(params, wctx)

    @staticmethod
    def activation_bytes(ctx: Any) -> int:
        """Bytes held by a ctx (after F) or a wctx (after B), each buffer counted once."""
        return activation_bytes(ctx)


def modelled_unit_ns(units: Sequence[Module], us_per_row: float, rows: int) -> dict[int, int]:
    """Nanoseconds each unit's F, B and W last on a synthetic device: `us_per_row` per row of
    the microbatch for the model's heaviest unit (a block), the others in proportion to their
    FLOPs per token, the split that `train.partition = "flops"` balances."""
    flops = [u.flops_per_token() for u in units]
    heaviest = max(max(flops), 1)
    return {i: round(us_per_row * 1e3 * rows * f / heaviest) for i, f in enumerate(flops)}


def zeros_like(params: Params) -> Params:
    """Gradient accumulators shaped like `params`."""
    return {i: {k: array_module(v).zeros_like(v) for k, v in p.items()} for i, p in params.items()}


def accumulate(total: Params, grads: Params) -> Params:
    """total += grads, in place, unit by unit (microbatch gradient accumulation)."""
    for i, g in grads.items():
        for k, v in g.items():
            total[i][k] += v
    return total
