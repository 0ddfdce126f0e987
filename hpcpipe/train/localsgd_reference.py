"""The single-process reference of local steps with periodic averaging (`[async] mode = local`).

R replicas start from the same seeded weights. Every step, replica r takes the r-th of R equal
contiguous shards of the global batch, splits it into microbatches, and steps its own optimizer
on the mean loss of its shard (its gradient norm clipped alone). A round is `average_every`
steps; the last step of the run always ends one. At the end of a round:

- delay 0: every replica's parameters become the mean over replicas;
- delay 1: the replicas keep going from their own parameters while the mean of this round's
  parameters travels; one round later each replica adds the correction it missed,

      theta_r <- theta_r + (mean_q snap_q - snap_r),    snap = the parameters at the last end,

  and snapshots again. At the run's last step the replicas wait for the mean instead, so every
  replica ends with the same model (the mean of the last snapshots). So does a run resumed
  from the end of a shorter one: that run's last step stays a round end taken at once
  (`at_once`), as it was.

A round ends when every replica has taken its steps, or (`taken`) when the first replica has:
then replica r takes only the first `taken[c][r]` steps of round c (the shards of the others
are skipped) and waits, its parameters unchanged, for the round's end. Either way step s
reads shard r of global batch s and the learning rate of step s.

Optimizer state (momentum, Adam moments) stays each replica's own. The logged loss of a step is
the mean of the replicas' losses (the mean over the global batch, as synchronous training logs
it). With R = 1, or average_every = 1 and plain SGD, this is synchronous training; a run under
MPI computes the same sums in another order, so it must equal this to rounding.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from hpcpipe.model.config import ModelConfig
from hpcpipe.model.models import Params, build_model
from hpcpipe.model.stage import Stage
from hpcpipe.train.data import DataConfig, build_dataset
from hpcpipe.train.optim import (
    OptimConfig,
    apply_update,
    clip_scale,
    grad_sq_norm,
    init_state,
    learning_rate,
)
from hpcpipe.train.reference import ReferenceResult, loss_and_grads, to_host

__all__ = ["round_ends", "train_local_reference"]


def round_ends(steps: int, average_every: int, at_once: Iterable[int] = ()) -> list[int]:
    """The steps (1-based counts) after which the replicas average: every `average_every`-th,
    the last, and the `at_once` ends (the last steps of earlier runs this one resumes)."""
    ends = set(range(average_every, steps + 1, average_every)) | {steps}
    return sorted(ends | {e for e in at_once if 0 < e <= steps})


def train_local_reference(
    model: ModelConfig,
    data: DataConfig,
    optim: OptimConfig,
    *,
    replicas: int,
    average_every: int,
    delay: int,
    steps: int,
    seed: int,
    microbatches: int = 1,
    dtype: Any = "float64",
    xp: Any = np,
    at_once: Iterable[int] = (),
    taken: Sequence[Sequence[int]] | None = None,
) -> ReferenceResult:
    """Train `replicas` replicas for `steps` steps, averaging as the module docstring says;
    `microbatches` per replica and step; `at_once`: earlier runs' last steps (resumed runs);
    `taken[c][r]`: the steps replica r took in round c, the first ones of the round (rounds
    that end when the first replica is done; None: every replica takes every step). Returns
    the mean losses and the final (common) parameters; a step's loss and `grad_norms` (root
    mean square) are over the replicas that took it."""
    if replicas < 1 or data.global_batch % replicas:
        raise ValueError(f"{replicas} replicas must divide the global batch of {data.global_batch}")
    if average_every < 1 or delay not in (0, 1):
        raise ValueError(f"average_every = {average_every} >= 1 and delay = {delay} in (0, 1)")
    units = build_model(model)
    stage = Stage(units, range(len(units)))
    init = stage.init(seed, xp, dtype)
    params = [init] * replicas  # updates make new arrays: the replicas share nothing written
    states = [init_state(optim, params[r]) for r in range(replicas)]
    ds = build_dataset(data, model, seed)
    at_once = {*at_once, steps}
    ordered = round_ends(steps, average_every, at_once)
    ends = set(ordered)
    if taken is not None:
        _check_taken(taken, ordered, replicas)
    snaps: list[Params] | None = None
    result = ReferenceResult([], [], {}, optimal_loss=ds.optimal_loss)
    c, begin = 0, 0  # the round and its first step
    for step in range(steps):
        lr = learning_rate(optim, step, steps)
        loss_sum = sq_sum = 0.0
        took = [r for r in range(replicas) if taken is None or step - begin < taken[c][r]]
        for r in took:
            inputs, targets = ds.shard(step, r, replicas)
            loss, grads = loss_and_grads(
                stage, params[r], xp.asarray(inputs), xp.asarray(targets), microbatches
            )
            sq = grad_sq_norm(grads)
            if not (math.isfinite(sq) and math.isfinite(loss)):
                raise FloatingPointError(
                    f"step {step + 1}, replica {r}: loss = {loss}, gradient norm^2 = {sq} "
                    "(not finite); lower optim.lr or enable optim.grad_clip"
                )
            params[r], states[r] = apply_update(
                optim,
                params[r],
                grads,
                states[r],
                lr,
                grad_scale=clip_scale(sq, optim.grad_clip),
            )
            loss_sum += loss
            sq_sum += sq
        result.losses.append(loss_sum / len(took))
        result.grad_norms.append(math.sqrt(sq_sum / len(took)))
        if step + 1 not in ends:
            continue
        c, begin = c + 1, step + 1
        last = step + 1 in at_once
        if delay == 0:
            mean = _mean(params)
            params = [mean] * replicas
            continue
        if snaps is not None:  # last round's mean arrives: each replica adds what it missed
            params = _corrected(params, snaps)
        snaps = list(params)
        if last:  # a run's end: nothing left to overlap with, the mean itself
            params = [_mean(snaps)] * replicas
            snaps = None
    result.params = to_host(params[0])
    return result


def _check_taken(taken: Sequence[Sequence[int]], ends: list[int], replicas: int) -> None:
    """Each round: every replica's steps between 1 and the round's length, and the first
    replica done (one at least) took all of them."""
    lengths = [e - b for b, e in zip([0, *ends[:-1]], ends, strict=True)]
    good = len(taken) == len(ends) and all(
        len(row) == replicas and min(row) >= 1 and max(row) == n
        for row, n in zip(taken, lengths, strict=False)
    )
    if not good:
        raise ValueError(
            f"taken must give, for each of the {len(ends)} rounds (lengths {lengths}), each of "
            f"the {replicas} replicas' steps: 1 to the round's length, which one of them took"
        )


def _mean(trees: list[Params]) -> Params:
    """The mean over replicas, summed in replica order (an allreduce sums in its own)."""
    out: Params = {}
    for i, p in trees[0].items():
        out[i] = {}
        for k in p:
            total = trees[0][i][k].copy()
            for t in trees[1:]:
                total += t[i][k]
            out[i][k] = total / len(trees)
    return out


def _corrected(params: list[Params], snaps: list[Params]) -> list[Params]:
    """theta_r + (mean of the snapshots - snap_r), per replica."""
    mean = _mean(snaps)
    return [
        {i: {k: v + (mean[i][k] - snap[i][k]) for k, v in p.items()} for i, p in theta.items()}
        for theta, snap in zip(params, snaps, strict=True)
    ]
