"""Data parallelism without a barrier every step (`[async] mode = "local"`) over real MPI.

Every run ends with `[train] verify = true`: rank 0 retrains the replicas one after another in
one process (`hpcpipe.train.localsgd_reference`, the same rounds and delay) and compares every
parameter and every step's mean loss; the job fails beyond 1e-10 in float64.
"""

from __future__ import annotations

import re
from pathlib import Path

import h5py
import numpy as np
import pytest

pytestmark = pytest.mark.mpi

DECK = str(Path(__file__).resolve().parents[2] / "inputs" / "train_tiny.toml")


def local(mpirun, tmp_path, ranks, pp, *extra, env=None):
    sets = {
        "run.output": tmp_path,
        "topology.pp": pp,
        "run.steps": 5,
        "async.mode": "local",
        "async.average_every": 2,
    }
    args = [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
    return mpirun(ranks, ["run", DECK, *args, *extra], timeout=180, env=env)


@pytest.mark.parametrize(
    ("ranks", "pp", "schedule", "delay"),
    [
        pytest.param(4, 2, "1f1b", 0, id="pp2dp2-1f1b-delay0"),
        pytest.param(4, 2, "zb-v", 1, id="pp2dp2-zb-v-delay1"),
        pytest.param(4, 1, "1f1b", 1, id="pp1dp4-delay1"),
    ],
)
def test_replicas_averaging_every_few_steps_match_the_reference(
    mpirun, tmp_path, ranks, pp, schedule, delay
):
    r = local(
        mpirun,
        tmp_path,
        ranks,
        pp,
        "--set",
        f"pipeline.schedule={schedule}",
        "--set",
        f"async.delay={delay}",
    )
    assert r.returncode == 0, r.output
    assert re.search(r"verify OK: .* local-steps reference", r.stdout), r.output
    assert f"averaging every 2 step(s) with delay {delay} (3 round(s))" in r.stdout
    with h5py.File(tmp_path / "metrics.h5") as f:
        losses = f["loss"][()]
    assert losses.shape == (5,) and np.isfinite(losses).all()  # every step, logged by round
    logged = [float(x) for x in re.findall(r"step \d+/5 loss=([\d.]+)", r.stdout)]
    np.testing.assert_allclose(logged[-1], losses[-1], atol=5e-5)


def test_local_steps_differ_from_synchronous_training_after_the_first(mpirun, tmp_path):
    a = local(mpirun, tmp_path / "local", 4, 2)
    b = mpirun(
        4,
        ["run", DECK, "--set", f"run.output={tmp_path / 'sync'}", "--set", "run.steps=5"],
        timeout=180,
    )
    assert a.returncode == 0 and b.returncode == 0, a.output + b.output
    with (
        h5py.File(tmp_path / "local" / "metrics.h5") as f,
        h5py.File(tmp_path / "sync" / "metrics.h5") as g,
    ):
        ours, sync = f["loss"][()], g["loss"][()]
    assert ours[0] == pytest.approx(sync[0], rel=1e-12)  # the same weights see the same batch
    assert abs(ours[-1] - sync[-1]) > 1e-6  # replicas drift between averagings


def test_a_slow_replica_changes_timing_not_results(mpirun, tmp_path):
    """One replica's rank computes 3x slower from step 2: with delay 1 the others run ahead
    by a round; the parameters still equal the reference."""
    r = local(
        mpirun,
        tmp_path,
        4,
        2,
        "--set",
        "async.delay=1",
        env={"HPCPIPE_INJECT_FAULT": "rank=3,at=step:2,kind=slow,factor=3"},
    )
    assert r.returncode == 0, r.output
    assert "verify OK" in r.stdout, r.output


def test_a_rank_failing_in_a_round_ends_the_job(mpirun, tmp_path):
    r = local(
        mpirun,
        tmp_path,
        4,
        2,
        "--set",
        "async.delay=1",
        env={"HPCPIPE_INJECT_FAULT": "rank=2,at=step:3,kind=raise"},
    )
    assert r.returncode != 0
    assert "[rank 2" in r.output and "injected" in r.output.lower(), r.output


def test_non_finite_gradients_in_one_replica_end_the_job_naming_the_step(mpirun, tmp_path):
    """The replica's ranks name the stages among themselves (no world-wide collective the
    other replicas would never join) and the job ends, not hangs."""
    r = local(
        mpirun,
        tmp_path,
        4,
        2,
        "--set",
        "optim.lr=1e30",
        "--set",
        "optim.grad_clip=0.0",
        "--set",
        "train.verify=false",
    )
    assert r.returncode == 1, r.output
    assert "FloatingPointError: step " in r.stderr and "stage(s)" in r.stderr, r.output
