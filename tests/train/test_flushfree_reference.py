"""The flush-free reference: synchronous tables give the synchronous trainer bit for bit,
stale tables give exactly the updates their versions define."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hpcpipe.model import ModelConfig, Stage, build_model
from hpcpipe.schedules.flushfree import flush_free
from hpcpipe.train.data import DataConfig, build_dataset
from hpcpipe.train.flushfree_reference import train_flush_free_reference
from hpcpipe.train.optim import OptimConfig
from hpcpipe.train.reference import loss_and_grads, train_reference

GPT = ModelConfig(kind="gpt", layers=4, d_model=16, n_heads=2, d_ff=32, vocab=10, seq_len=8)
DATA = DataConfig(global_batch=8, markov_branching=3)
OPTIM = OptimConfig(lr=3e-3, weight_decay=0.1, grad_clip=0.0, warmup=1)
PARTS = [range(0, 2), range(2, 4), range(4, 6)]  # embedding + 4 blocks + head = 6 units
WINDOW, UPDATES = 4, 3


def synchronous() -> np.ndarray:
    return np.tile(np.arange(WINDOW * UPDATES) // WINDOW, (len(PARTS), 1))


def same(a, b) -> bool:
    return all(np.array_equal(a[i][k], b[i][k]) for i in b for k in b[i])


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_synchronous_versions_are_the_synchronous_trainer(kind):
    optim = dataclasses.replace(OPTIM, kind=kind)
    ref = train_reference(GPT, DATA, optim, steps=UPDATES, seed=3, microbatches=WINDOW)
    ours = train_flush_free_reference(
        GPT,
        DATA,
        optim,
        stage_units=PARTS,
        version=synchronous(),
        window=WINDOW,
        microbatches=WINDOW,
        seed=3,
    )
    assert ours.losses == ref.losses
    assert same(ours.params, ref.params)


def test_one_stage_clips_like_the_synchronous_trainer():
    """One stage: its own gradient norm is the global one."""
    optim = dataclasses.replace(OPTIM, grad_clip=0.05)
    ref = train_reference(GPT, DATA, optim, steps=UPDATES, seed=3, microbatches=WINDOW)
    ours = train_flush_free_reference(
        GPT,
        DATA,
        optim,
        stage_units=[range(6)],
        version=synchronous()[:1],
        window=WINDOW,
        microbatches=WINDOW,
        seed=3,
    )
    assert same(ours.params, ref.params)


@pytest.mark.parametrize("window", [1, 2, 4])
def test_stale_versions_give_the_updates_they_define(window):
    """Every microbatch reads version 0: with plain SGD, the weights after the last update are
    version 0 minus lr times every window's mean gradient at version 0 (window 1: an update
    per microbatch, PipeDream's)."""
    optim = OptimConfig(kind="sgd", lr=0.05, momentum=0.0, grad_clip=0.0)
    m = WINDOW  # microbatches per global batch
    ours = train_flush_free_reference(
        GPT,
        DATA,
        optim,
        stage_units=PARTS,
        version=np.zeros((len(PARTS), 2 * m), dtype=np.int64),
        window=window,
        microbatches=m,
        seed=3,
    )
    units = build_model(GPT)
    stage = Stage(units, range(len(units)))
    start = stage.init(3, np, "float64")
    ds = build_dataset(DATA, GPT, 3)
    rows = DATA.global_batch // m
    expected = {i: dict(p) for i, p in start.items()}
    losses = [0.0] * (2 * m // window)
    for j in range(2 * m):  # microbatch j: block j % m of global batch j // m
        inputs, targets = ds.global_batch(j // m)
        block = slice((j % m) * rows, (j % m + 1) * rows)
        loss, grads = loss_and_grads(stage, start, inputs[block], targets[block])
        losses[j // window] += loss / window
        for i in expected:
            for name in expected[i]:
                expected[i][name] = expected[i][name] - optim.lr / window * grads[i][name]
    np.testing.assert_allclose(ours.losses, losses, rtol=1e-12)
    for i in expected:
        for name in expected[i]:
            np.testing.assert_allclose(ours.params[i][name], expected[i][name], rtol=1e-12)


def test_a_flush_free_plan_trains_on_stale_weights_but_still_learns():
    plan = flush_free("1f1b", len(PARTS), window=WINDOW, updates=8, max_versions=2)
    optim = dataclasses.replace(OPTIM, lr=1e-2)
    sync = train_reference(GPT, DATA, optim, steps=8, seed=3, microbatches=WINDOW)
    ours = train_flush_free_reference(
        GPT,
        DATA,
        optim,
        stage_units=PARTS,
        version=plan.version,
        window=WINDOW,
        microbatches=WINDOW,
        seed=3,
    )
    assert ours.losses[0] == sync.losses[0]  # the first window reads version 0 everywhere
    assert ours.losses[1:] != sync.losses[1:]  # then stale weights change the trajectory
    assert ours.losses[-1] < 0.9 * ours.losses[0]


def test_bad_tables_are_refused():
    ahead = synchronous()
    ahead[0, 0] = 1
    with pytest.raises(ValueError, match="has not made yet"):
        train_flush_free_reference(
            GPT,
            DATA,
            OPTIM,
            stage_units=PARTS,
            version=ahead,
            window=WINDOW,
            microbatches=WINDOW,
            seed=3,
        )
    with pytest.raises(ValueError, match="cover the model's 6 units"):
        train_flush_free_reference(
            GPT,
            DATA,
            OPTIM,
            stage_units=[range(0, 2), range(2, 4), range(4, 5)],
            version=synchronous(),
            window=WINDOW,
            microbatches=WINDOW,
            seed=3,
        )
