"""The local-steps reference: one replica, or SGD averaged every step, is synchronous training;
rounds and delays change the trajectory exactly as the averaging rule says."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hpcpipe.model import ModelConfig, Stage, build_model
from hpcpipe.train.data import DataConfig, build_dataset
from hpcpipe.train.localsgd_reference import round_ends, train_local_reference
from hpcpipe.train.optim import OptimConfig, apply_update, init_state, learning_rate
from hpcpipe.train.reference import loss_and_grads, train_reference

GPT = ModelConfig(kind="gpt", layers=2, d_model=16, n_heads=2, d_ff=32, vocab=10, seq_len=8)
DATA = DataConfig(global_batch=8, markov_branching=3)
ADAMW = OptimConfig(lr=3e-3, weight_decay=0.1, grad_clip=0.0, warmup=1)
SGD = dataclasses.replace(ADAMW, kind="sgd", weight_decay=0.0, lr=0.05)


def local(optim=ADAMW, **kw):
    args = dict(replicas=2, average_every=2, delay=0, steps=5, seed=3, microbatches=2)
    args.update(kw)
    return train_local_reference(GPT, DATA, optim, **args)


def rel(a, b) -> float:
    num = sum(float(np.sum((a[i][k] - b[i][k]) ** 2)) for i in b for k in b[i])
    den = sum(float(np.sum(b[i][k] ** 2)) for i in b for k in b[i])
    return (num / den) ** 0.5


def test_round_ends_include_the_last_step():
    assert round_ends(7, 2) == [2, 4, 6, 7]
    assert round_ends(6, 3) == [3, 6]
    assert round_ends(2, 5) == [2]
    assert round_ends(3, 1) == [1, 2, 3]


@pytest.mark.parametrize(("every", "delay"), [(1, 0), (3, 0), (2, 1)])
def test_one_replica_is_the_synchronous_trainer_bit_for_bit(every, delay):
    ref = train_reference(GPT, DATA, ADAMW, steps=5, seed=3, microbatches=2)
    ours = local(replicas=1, average_every=every, delay=delay)
    assert ours.losses == ref.losses
    assert rel(ours.params, ref.params) == 0.0


def test_sgd_averaged_every_step_is_synchronous_training():
    """SGD with momentum is linear in the gradients: the mean of the replicas' steps is the
    step on the mean gradient (to rounding)."""
    ref = train_reference(GPT, DATA, SGD, steps=4, seed=3, microbatches=4)
    ours = local(SGD, replicas=2, average_every=1, steps=4)
    np.testing.assert_allclose(ours.losses, ref.losses, rtol=1e-12)
    assert rel(ours.params, ref.params) < 1e-12


def test_adam_keeps_each_replicas_state_so_it_is_not_synchronous():
    ref = train_reference(GPT, DATA, ADAMW, steps=4, seed=3, microbatches=4)
    ours = local(replicas=2, average_every=1, steps=4)
    assert ours.losses[0] == pytest.approx(ref.losses[0], rel=1e-12)  # the same first weights
    assert rel(ours.params, ref.params) > 1e-6


def test_rounds_and_delay_each_change_the_trajectory():
    a, b, c = local(average_every=1), local(average_every=2), local(average_every=2, delay=1)
    assert a.losses[:1] == b.losses[:1] == c.losses[:1]
    assert rel(a.params, b.params) > 1e-6 and rel(b.params, c.params) > 1e-6


def test_delay_one_applies_the_missed_correction_a_round_late():
    """Replay the rule by hand, with two replicas and rounds of one step."""
    units = build_model(GPT)
    stage = Stage(units, range(len(units)))
    theta = [stage.init(3, np, "float64")] * 2
    states = [init_state(ADAMW, theta[0])] * 2
    ds = build_dataset(DATA, GPT, 3)
    snaps = None
    steps = 3
    for step in range(steps):
        for r in range(2):
            x, t = ds.shard(step, r, 2)
            _, g = loss_and_grads(stage, theta[r], x, t, 2)
            lr = learning_rate(ADAMW, step, steps)
            theta[r], states[r] = apply_update(ADAMW, theta[r], g, states[r], lr)
        if snaps is not None:
            theta = [
                {
                    i: {
                        k: v + ((snaps[0][i][k] + snaps[1][i][k]) / 2 - s[i][k])
                        for k, v in p.items()
                    }
                    for i, p in th.items()
                }
                for th, s in zip(theta, snaps, strict=True)
            ]
        snaps = list(theta)
    final = {i: {k: (v + snaps[1][i][k]) / 2 for k, v in p.items()} for i, p in snaps[0].items()}
    ours = local(average_every=1, delay=1, steps=steps)
    assert rel(ours.params, final) < 1e-14


def test_bad_arguments():
    with pytest.raises(ValueError, match="replicas must divide"):
        local(replicas=3)
    with pytest.raises(ValueError, match="delay"):
        local(delay=2)


def test_rounds_ended_by_the_first_replica_replay_the_steps_each_took():
    """taken[c][r]: replica r takes the first taken[c][r] steps of round c, then waits with its
    parameters unchanged; a step's loss is over the replicas that took it. Replayed by hand:
    rounds of 2 steps, delay 0; replica 1 skips step 2, replica 0 skips step 4."""
    units = build_model(GPT)
    stage = Stage(units, range(len(units)))
    theta = [stage.init(3, np, "float64")] * 2
    states = [init_state(ADAMW, theta[0])] * 2
    ds = build_dataset(DATA, GPT, 3)
    taken, steps, losses = [[2, 1], [1, 2]], 4, []
    for step in range(steps):
        c, j = divmod(step, 2)
        mine = []
        for r in range(2):
            if j >= taken[c][r]:
                continue
            x, t = ds.shard(step, r, 2)
            loss, g = loss_and_grads(stage, theta[r], x, t, 2)
            lr = learning_rate(ADAMW, step, steps)
            theta[r], states[r] = apply_update(ADAMW, theta[r], g, states[r], lr)
            mine.append(loss)
        losses.append(sum(mine) / len(mine))
        if j == 1:
            mean = {
                i: {k: (v + theta[1][i][k]) / 2 for k, v in p.items()} for i, p in theta[0].items()
            }
            theta = [mean, mean]
    ours = local(average_every=2, steps=steps, taken=taken)
    np.testing.assert_allclose(ours.losses, losses, rtol=1e-13)
    assert rel(ours.params, theta[0]) < 1e-14
    full = local(average_every=2, steps=steps)
    assert ours.losses[0] == full.losses[0] and ours.losses[1] != full.losses[1]
    # every replica taking every step is the default, bit for bit
    again = local(average_every=2, delay=1, steps=steps, taken=[[2, 2], [2, 2]])
    assert again.losses == local(average_every=2, delay=1, steps=steps).losses


@pytest.mark.parametrize(
    "taken",
    [
        [[2, 1]],  # a round missing
        [[2, 1, 1], [2, 2]],  # a replica too many
        [[2, 0], [2, 2]],  # a replica that took no step
        [[1, 1], [2, 2]],  # nobody took the whole round
        [[3, 1], [2, 2]],  # more steps than the round has
    ],
)
def test_bad_taken_is_refused(taken):
    with pytest.raises(ValueError, match="taken must give"):
        local(average_every=2, steps=4, taken=taken)
