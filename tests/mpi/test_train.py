"""Pipeline x data parallel training over real MPI equals the single-process reference.

Every run ends with `[train] verify = true`: rank 0 retrains with the single-process reference
and compares every parameter (per-tensor relative norm) and every loss; the job fails if they
differ beyond the tolerance (1e-10 in float64, 1e-5 in float32).
"""

from __future__ import annotations

import re
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcpipe.schedules import SCHEDULE_NAMES

pytestmark = pytest.mark.mpi

DECK = str(Path(__file__).resolve().parents[2] / "inputs" / "train_tiny.toml")
SCHEDULES = list(SCHEDULE_NAMES)  # every generator the registry knows (auto: test_auto_mpi)
LAYOUTS = [(2, 1), (4, 1), (2, 2), (4, 2)]


def train(mpirun, tmp_path, pp, dp, *extra, env=None, timeout=180):
    args = [
        "run",
        DECK,
        "--set",
        f"run.output={tmp_path}",
        "--set",
        f"topology.pp={pp}",
        "--set",
        f"topology.dp={dp}",
        "--set",
        "model.layers=14",
        "--set",
        "pipeline.microbatches=8",
        *extra,
    ]
    return mpirun(pp * dp, args, timeout=timeout, env=env)


QUICK = {("1f1b", 2, 2), ("zb-v", 2, 2), ("interleaved-1f1b", 4, 1), ("dualpipe-v", 4, 2)}
"""The matrix's representative cases (a fused, a split and an interleaved backward, the V
turnaround, data parallelism); the rest is marked slow (CI runs every case)."""
MATRIX = [
    pytest.param(
        s,
        pp,
        dp,
        id=f"{s}-pp{pp}dp{dp}",
        marks=() if (s, pp, dp) in QUICK else pytest.mark.slow,
    )
    for s in SCHEDULES
    for pp, dp in LAYOUTS
]


@pytest.mark.parametrize(("schedule", "pp", "dp"), MATRIX)
def test_schedule_matches_reference(mpirun, tmp_path, schedule, pp, dp):
    r = train(mpirun, tmp_path, pp, dp, "--set", f"pipeline.schedule={schedule}")
    assert r.returncode == 0, r.output
    assert "verify OK" in r.stdout, r.output
    # the runtime ran the plan's order: its live-microbatch count equals the plan's
    assert re.search(r"activations: .* counted (\[[^\]]*\]), planned \1\n", r.stdout), r.stdout
    with h5py.File(tmp_path / "metrics.h5") as f:
        assert f.attrs["format"] == "hpcpipe-metrics"
        assert f["loss"].shape == (3,)
        assert np.all(np.isfinite(f["loss"][()]))


@pytest.mark.parametrize(
    "schedule", ["zb-v", pytest.param("zb-h2", marks=pytest.mark.slow), "v-half"]
)
def test_greedy_built_orders_match_reference(mpirun, tmp_path, schedule):
    # m = 4 < 2p-1 on pp 4: ZB-V and ZB-H2 come from the greedy constructions (vgreedy,
    # listsched) and V-Half from the grid compaction, orders no hand-written generator makes
    from hpcpipe.schedules import build_schedule, simulate
    from hpcpipe.schedules.listsched import unit_costs

    sched = build_schedule(schedule, 4, 4)
    assert (
        simulate(sched, unit_costs(4)(sched.num_stages)).makespan
        == {
            "zb-v": 13.5,
            "zb-h2": 15.0,
            "v-half": 17.0,
        }[schedule]
    )
    r = train(
        mpirun,
        tmp_path,
        4,
        1,
        "--set",
        f"pipeline.schedule={schedule}",
        "--set",
        "pipeline.microbatches=4",
    )
    assert r.returncode == 0, r.output
    assert f"schedule={schedule} stages=" in r.stdout and " microbatches=4 " in r.stdout
    assert "verify OK" in r.stdout, r.output
    assert re.search(r"activations: .* counted (\[[^\]]*\]), planned \1\n", r.stdout), r.stdout


@pytest.mark.parametrize(
    ("schedule", "pp", "dp"), [("1f1b", 2, 2), pytest.param("zb-v", 4, 1, marks=pytest.mark.slow)]
)
def test_blocking_sends_at_the_least_lookahead_match_reference(mpirun, tmp_path, schedule, pp, dp):
    # Ssend for every pipeline message, receives posted exactly as far ahead as the validator
    # says is enough (one less deadlocks): if its model of the runtime were too optimistic,
    # this run would hang (and time out) instead of matching the reference
    from hpcpipe.schedules import ScheduleError, build_schedule, validate

    sched = build_schedule(schedule, pp, 8)
    with pytest.raises(ScheduleError, match=r"lookahead of (\d+)") as info:
        validate(sched, sends="blocking", lookahead=1)
    least = int(re.search(r"lookahead of (\d+)", str(info.value))[1])
    r = train(
        mpirun,
        tmp_path,
        pp,
        dp,
        "--set",
        f"pipeline.schedule={schedule}",
        "--set",
        "train.sends=blocking",
        "--set",
        f"train.recv_lookahead={least}",
    )
    assert r.returncode == 0, r.output
    assert "verify OK" in r.stdout, r.output


def test_blocking_sends_that_would_deadlock_are_refused(mpirun, tmp_path):
    r = train(
        mpirun,
        tmp_path,
        2,
        1,
        "--set",
        "pipeline.schedule=1f1b",
        "--set",
        "train.sends=blocking",
        "--set",
        "train.recv_lookahead=1",
    )
    assert r.returncode == 2, r.output
    assert "train.sends = 'blocking' deadlocks this schedule with train.recv_lookahead = 1" in (
        r.stderr
    )
    assert "it runs with a lookahead of 2 action(s)" in r.stderr
    assert "[0SEND_F1]" in r.stderr  # the grid, marked
    assert "Traceback" not in r.stderr


def test_float32_matches_reference(mpirun, tmp_path):
    r = train(
        mpirun, tmp_path, 2, 2, "--set", "device.dtype=float32", "--set", "pipeline.schedule=zb-v"
    )
    assert r.returncode == 0, r.output
    assert "verify OK" in r.stdout and "rtol=1e-05" in r.stdout


def test_progress_line_on_rank_zero_only(mpirun, tmp_path):
    r = train(mpirun, tmp_path, 2, 1)
    lines = [line for line in r.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 3
    assert re.fullmatch(
        r"step 3/3 loss=\d+\.\d{4} tok/s=\d+ bubble=\d+\.\d% mem=\S+MiB "
        r"live_mb=\S+ gnorm=\S+",
        lines[-1],
    ), lines[-1]


def test_batch_that_does_not_split_is_bad_input(mpirun, tmp_path):
    r = train(mpirun, tmp_path, 2, 2, "--set", "data.global_batch=12")
    assert r.returncode == 2
    assert "data.global_batch = 12 must be divisible by dp * pipeline.microbatches" in r.stderr


def test_unsupported_schedule_shape_is_bad_input(mpirun, tmp_path):
    r = train(
        mpirun,
        tmp_path,
        4,
        1,
        "--set",
        "pipeline.schedule=dualpipe-v",
        "--set",
        "pipeline.microbatches=4",
        "--set",
        "data.global_batch=8",
    )
    assert r.returncode == 2
    assert "DualPipeV needs m >= 2p microbatches" in r.stderr


def test_non_finite_gradients_stop_with_step_and_stage(mpirun, tmp_path):
    r = train(
        mpirun,
        tmp_path,
        2,
        1,
        "--set",
        "optim.lr=1e30",
        "--set",
        "optim.grad_clip=0.0",
        "--set",
        "train.verify=false",
    )
    assert r.returncode == 1
    assert "FloatingPointError: step " in r.stderr and "non-finite" in r.stderr
    assert "stage(s)" in r.stderr


def test_rank_failing_in_forward_ends_the_job(mpirun, tmp_path):
    r = train(
        mpirun,
        tmp_path,
        4,
        2,
        env={"HPCPIPE_INJECT_FAULT": "rank=1,at=forward:1,kind=raise"},
        timeout=60,
    )
    assert r.returncode != 0
    assert "[rank 1 on" in r.stderr and "injected fault at forward:1" in r.stderr
    assert "step 1, action" in r.stderr  # the interpreter names the step and the action
    assert r.seconds < 30


@pytest.mark.parametrize(("pp", "dp"), [(2, 1), (4, 2)])
def test_dualpipe_v_overlapped_pairs_match_reference(mpirun, tmp_path, pp, dp):
    """DualPipeV run as F&B pairs (each pair's inputs received before it, its sends after
    it) trains to the same numbers as the single-process reference."""
    r = train(
        mpirun,
        tmp_path,
        pp,
        dp,
        "--set",
        "pipeline.schedule=dualpipe-v",
        "--set",
        "pipeline.overlap_pairs=true",
        "--set",
        "pipeline.t_alltoall=0.2",
    )
    assert r.returncode == 0, r.output
    assert "verify OK" in r.stdout, r.output
    assert re.search(r"activations: .* counted (\[[^\]]*\]), planned \1\n", r.stdout), r.stdout
