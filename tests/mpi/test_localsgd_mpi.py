"""Data parallelism without a barrier every step (`[async] mode = "local"`) over real MPI.

Every run ends with `[train] verify = true`: rank 0 retrains the replicas one after another in
one process (`hpcpipe.train.localsgd_reference`, the same rounds and delay) and compares every
parameter and every step's mean loss; the job fails beyond 1e-10 in float64.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import read_losses, read_params

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


# Checkpoints of replicas that train apart: each replica's own weights and optimizer state, and
# with delay 1 the averaging round in flight; a resume continues bit for bit.


def _sets(**kv) -> list[str]:
    return [x for k, v in kv.items() for x in ("--set", f"{k.replace('__', '.')}={v}")]


DELAY1 = _sets(
    async__mode="local",
    async__average_every=2,
    async__delay=1,
    train__save_params="true",
)


@pytest.fixture(scope="module")
def local_full(tmp_path_factory):
    """An uninterrupted 8-step pp2 x dp2 run, delay 1, checkpoints after steps 4 and 8."""
    from conftest import run_mpi

    out = tmp_path_factory.mktemp("local_full")
    r = run_mpi(
        4,
        ["run", DECK, *DELAY1, *_sets(run__output=out, run__steps=8, checkpoint__every=4)],
        timeout=180,
    )
    assert r.returncode == 0, r.output
    assert "verify OK" in r.stdout, r.output
    return out


def test_local_resume_with_a_round_in_flight_is_bitwise_equal(mpirun, tmp_path, local_full):
    """Step 4 is a round end (delay 1): the round it started is in the checkpoint and lands at
    step 6, as in the uninterrupted run."""
    with h5py.File(local_full / "checkpoints" / "step_000004" / "index.h5") as f:
        assert int(f.attrs["local_pending"]) == 1 and int(f.attrs["replicas"]) == 2
    r = mpirun(
        4,
        [
            "run",
            DECK,
            "--resume",
            str(local_full / "checkpoints" / "step_000004"),
            *DELAY1,
            *_sets(run__output=tmp_path, run__steps=8),
        ],
        timeout=180,
    )
    assert r.returncode == 0, r.output
    assert "at step 4" in r.stdout and "verify OK" in r.stdout, r.output
    a, b = read_params(local_full), read_params(tmp_path)
    assert a.keys() == b.keys() and len(a) > 10
    assert all(np.array_equal(a[n], b[n]) for n in a), [n for n in a if not (a[n] == b[n]).all()]
    assert np.array_equal(read_losses(local_full), read_losses(tmp_path))


def test_local_stop_signal_checkpoints_at_a_round_end_and_resumes_bitwise(
    mpirun, tmp_path, local_full
):
    """SIGUSR1 during step 3: round (3, 4) carries it; with delay 1 its figures arrive at the
    next round end (step 6), which checkpoints and stops."""
    r = mpirun(
        4,
        ["run", DECK, *DELAY1, *_sets(run__output=tmp_path, run__steps=8)],
        env={"HPCPIPE_INJECT_FAULT": "rank=2,at=step:3,kind=usr1"},
        timeout=180,
    )
    assert r.returncode == 0, r.output
    assert "stopping on signal after step 6/8 (the end of a round)" in r.stdout, r.output
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "preempted" and status["step"] == 6
    r = mpirun(
        4,
        ["run", DECK, "--resume", *DELAY1, *_sets(run__output=tmp_path, run__steps=8)],
        timeout=180,
    )
    assert r.returncode == 0, r.output
    assert "at step 6" in r.stdout and "verify OK" in r.stdout, r.output
    a, b = read_params(local_full), read_params(tmp_path)
    assert all(np.array_equal(a[n], b[n]) for n in a)
    assert np.array_equal(read_losses(local_full), read_losses(tmp_path))


@pytest.mark.parametrize("delay", [0, 1])
def test_local_resume_past_the_end_on_another_pipeline_layout(mpirun, tmp_path, delay):
    """A finished 4-step pp2 x dp2 run continued to 7 steps at pp1 x dp2: its last step stays a
    round end taken at once, and the whole equals the reference of that."""
    first = tmp_path / "first"
    common = _sets(async__mode="local", async__average_every=3, async__delay=delay)
    r = mpirun(
        4,
        ["run", DECK, *common, *_sets(run__output=first, run__steps=4, checkpoint__every=3)],
        timeout=180,
    )
    assert r.returncode == 0 and "verify OK" in r.stdout, r.output
    r = mpirun(
        2,
        [
            "run",
            DECK,
            "--resume",
            str(first / "checkpoints"),
            *common,
            *_sets(run__output=tmp_path / "more", run__steps=7, topology__pp=1),
        ],
        timeout=180,
    )
    assert r.returncode == 0, r.output
    assert "at step 4" in r.stdout and "verify OK" in r.stdout, r.output
    assert len(read_losses(tmp_path / "more")) == 7


def test_local_resume_with_another_cadence_allowed_keeps_one_row_per_step(
    mpirun, tmp_path, local_full
):
    """--allow-change async.average_every: the checkpoint's step still ends a round, so no
    step is logged twice; verify says it cannot retrace the change. A round in flight (delay
    1) cannot go on under delay 0: exit 2 naming async.delay."""
    ckpt = str(local_full / "checkpoints" / "step_000004")
    r = mpirun(
        4,
        ["run", DECK, "--resume", ckpt, "--allow-change", "async.average_every", *DELAY1,
         *_sets(run__output=tmp_path, run__steps=8, async__average_every=3)],
        timeout=180,
    )  # fmt: skip
    assert r.returncode == 0, r.output
    assert "verify skipped" in r.stdout, r.output
    losses = read_losses(tmp_path)
    assert losses.shape == (8,) and np.isfinite(losses).all()
    r = mpirun(
        4,
        ["run", DECK, "--resume", ckpt, "--allow-change", "async.delay", *DELAY1,
         *_sets(run__output=tmp_path / "d0", run__steps=8, async__delay=0)],
        timeout=180,
    )  # fmt: skip
    assert r.returncode == 2, r.output
    assert "holds an averaging round in flight" in r.stderr, r.output
    assert "resume with async.delay = 1" in r.stderr


def test_local_resume_with_other_replicas_is_bad_input(mpirun, tmp_path, local_full):
    r = mpirun(
        4,
        [
            "run",
            DECK,
            "--resume",
            str(local_full / "checkpoints"),
            *DELAY1,
            *_sets(run__output=tmp_path, run__steps=12, topology__pp=1),
        ],
        timeout=120,
    )
    assert r.returncode == 2, r.output
    assert "holds 2 replicas" in r.stderr and "topology.dp = 2" in r.stderr, r.output


# Rounds that end when the first replica is done (async.round_end = "first"): a straggler takes
# fewer steps; the steps each replica took are recorded, and the reference replays them.

FIRST = _sets(
    async__mode="local",
    async__average_every=4,
    async__delay=1,
    async__round_end="first",
)


def test_rounds_ended_by_the_first_replica_replay_exactly(mpirun, tmp_path):
    """Replica 1's second pipeline rank computes 4x slower from step 2: it ends its rounds
    early, the fast replica takes every step; the run equals the reference replaying the
    recorded steps; a checkpoint keeps them and a resume verifies the whole run."""
    slow = {"HPCPIPE_INJECT_FAULT": "rank=3,at=step:2,kind=slow,factor=4"}
    out = tmp_path / "first"
    r = mpirun(
        4,
        ["run", DECK, *FIRST, *_sets(run__output=out, run__steps=12, checkpoint__every=4)],
        env=slow,
        timeout=180,
    )
    assert r.returncode == 0, r.output
    assert "a round ends when the first replica is done" in r.stdout
    assert "verify OK" in r.stdout, r.output
    with h5py.File(out / "metrics.h5") as f:
        taken = f["replica_steps"][()]
        walls, losses = f["wall_time"][()], f["loss"][()]
    assert taken.shape == (3, 2) and (taken[:, 0] == 4).all() and (taken >= 1).all()
    assert taken[:, 1].sum() < taken[:, 0].sum(), taken  # the straggler skipped steps
    assert losses.shape == walls.shape == (12,) and np.isfinite(losses).all()
    r = mpirun(
        4,
        [
            "run",
            DECK,
            "--resume",
            str(out / "checkpoints" / "step_000004"),
            *FIRST,
            *_sets(run__output=tmp_path / "resumed", run__steps=12),
        ],
        env=slow,
        timeout=180,
    )
    assert r.returncode == 0, r.output
    assert "at step 4" in r.stdout and "verify OK" in r.stdout, r.output
    with h5py.File(tmp_path / "resumed" / "metrics.h5") as f:
        assert f["replica_steps"][0].tolist() == taken[0].tolist()  # the round before, kept


def test_rounds_ended_by_the_first_replica_without_a_straggler(mpirun, tmp_path):
    """pp1 x dp4, delay 0: whoever is first, the reference replays the steps taken."""
    first0 = _sets(async__mode="local", async__average_every=2, async__round_end="first")
    r = mpirun(
        4,
        ["run", DECK, *first0, *_sets(run__output=tmp_path, run__steps=6, topology__pp=1)],
        timeout=180,
    )
    assert r.returncode == 0, r.output
    assert "verify OK" in r.stdout, r.output
