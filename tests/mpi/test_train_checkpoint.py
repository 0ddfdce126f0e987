"""Training checkpoints over real MPI: bitwise resume, resharding, signals and crashes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import read_losses, read_params

pytestmark = pytest.mark.mpi

INPUTS = Path(__file__).resolve().parents[2] / "inputs"
DECK = str(INPUTS / "train_tiny.toml")
MOE_DECK = str(INPUTS / "moe_tiny.toml")


def sets(*items: str) -> list[str]:
    return [a for s in items for a in ("--set", s)]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """An uninterrupted 6-step pp2 x dp2 run with a checkpoint every 2 steps."""
    from conftest import run_mpi

    out = tmp_path_factory.mktemp("full")
    r = run_mpi(
        4,
        [
            "run",
            DECK,
            *sets(
                f"run.output={out}", "run.steps=6", "checkpoint.every=2", "train.save_params=true"
            ),
        ],
        timeout=180,
    )
    assert r.returncode == 0, r.output
    return out


def test_resume_is_bitwise_equal(mpirun, tmp_path, full_run):
    assert json.loads((full_run / "status.json").read_text())["state"] == "finished"
    r = mpirun(
        4,
        [
            "run",
            DECK,
            "--resume",
            str(full_run / "checkpoints" / "step_000004"),
            *sets(f"run.output={tmp_path}", "run.steps=6", "train.save_params=true"),
        ],
        timeout=180,
    )
    assert r.returncode == 0, r.output
    assert "resumed from" in r.stdout and "at step 4" in r.stdout
    a, b = read_params(full_run), read_params(tmp_path)
    assert a.keys() == b.keys() and len(a) > 10
    for name in a:
        assert np.array_equal(a[name], b[name]), name
    assert np.array_equal(read_losses(full_run), read_losses(tmp_path))


def test_resume_of_a_finished_run_says_there_is_nothing_to_do(mpirun, tmp_path, full_run):
    args = ["run", DECK, "--resume", str(full_run / "checkpoints")]
    r = mpirun(4, [*args, *sets(f"run.output={tmp_path}", "run.steps=6")], timeout=120)
    assert r.returncode == 2, r.output
    assert "is at step 6 and run.steps = 6: nothing to do" in r.stderr, r.output
    assert "--set run.steps=12" in r.stderr and "MISMATCH" not in r.output


@pytest.mark.parametrize(("pp", "dp"), [(4, 1), (1, 2), (2, 1)])
def test_resume_on_another_layout_matches_reference(mpirun, tmp_path, full_run, pp, dp):
    r = mpirun(
        pp * dp,
        [
            "run",
            DECK,
            "--resume",
            str(full_run / "checkpoints"),
            *sets(
                f"run.output={tmp_path}", "run.steps=8", f"topology.pp={pp}", f"topology.dp={dp}"
            ),
        ],
        timeout=180,
    )
    assert r.returncode == 0, r.output
    assert "at step 6" in r.stdout  # the latest complete checkpoint
    assert "verify OK" in r.stdout  # 8 steps in all equal the single-process reference


def test_moe_checkpoint_loads_with_another_ep(mpirun, tmp_path):
    # MoE routing (capacity, aux losses) is defined per microbatch, so the objective stays the
    # same only while dp x microbatches (the rows of a microbatch) stays the same: 2 x 4 = 4 x 2.
    first, second = tmp_path / "a", tmp_path / "b"
    r = mpirun(
        4,
        ["run", MOE_DECK, *sets(f"run.output={first}", "run.steps=2", "checkpoint.every=2")],
        timeout=180,
    )
    assert r.returncode == 0, r.output
    r = mpirun(
        4,
        [
            "run",
            MOE_DECK,
            "--resume",
            str(first / "checkpoints"),
            *sets(
                f"run.output={second}",
                "run.steps=4",
                "topology.pp=1",
                "topology.dp=4",
                "topology.ep=4",
                "pipeline.microbatches=2",
            ),
        ],
        timeout=180,
    )
    assert r.returncode == 0, r.output
    assert "verify OK" in r.stdout


def test_time_limit_signal_checkpoints_and_exits_zero(mpirun, tmp_path, full_run):
    r = mpirun(
        4,
        ["run", DECK, *sets(f"run.output={tmp_path}", "run.steps=6", "train.save_params=true")],
        env={"HPCPIPE_INJECT_FAULT": "rank=2,at=step:3,kind=usr1"},
        timeout=180,
    )
    assert r.returncode == 0, r.output
    assert "stopping on signal after step 3/6" in r.stdout
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "preempted" and status["step"] == 3
    r = mpirun(
        4,
        [
            "run",
            DECK,
            "--resume",
            *sets(f"run.output={tmp_path}", "run.steps=6", "train.save_params=true"),
        ],
        timeout=180,
    )
    assert r.returncode == 0, r.output
    assert json.loads((tmp_path / "status.json").read_text())["state"] == "finished"
    a, b = read_params(full_run), read_params(tmp_path)
    assert all(np.array_equal(a[n], b[n]) for n in a)


def test_rank_killed_while_writing_leaves_last_checkpoint_good(mpirun, cli, tmp_path):
    r = mpirun(
        4,
        ["run", DECK, *sets(f"run.output={tmp_path}", "run.steps=6", "checkpoint.every=2")],
        env={"HPCPIPE_INJECT_FAULT": "rank=2,at=checkpoint,kind=kill"},
        timeout=120,
    )
    assert r.returncode != 0
    assert r.seconds < 60
    ckpts = tmp_path / "checkpoints"
    complete = sorted(
        p.name
        for p in ckpts.iterdir()
        if p.name.startswith("step_") and not p.name.endswith(".tmp")
    )
    # the fault fires in the first checkpoint a writer makes: nothing complete may be half-made
    for name in complete:
        v = cli(["ckpt", "verify", str(ckpts / name)])
        assert v.returncode == 0, v.output
    if not complete:
        resumed = mpirun(4, ["run", DECK, "--resume", *sets(f"run.output={tmp_path}")], timeout=60)
        assert resumed.returncode == 2 and "found no complete checkpoint" in resumed.stderr


def test_resume_without_checkpoint_is_bad_input(mpirun, tmp_path):
    r = mpirun(
        2, ["run", DECK, "--resume", *sets(f"run.output={tmp_path}", "topology.dp=1")], timeout=60
    )
    assert r.returncode == 2
    assert "found no complete checkpoint" in r.stderr
