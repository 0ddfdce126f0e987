"""Pipelines without a flush over real MPI equal their single-process reference.

Every run ends with `[train] verify = true`: rank 0 retrains with the flush-free reference
(the same weight versions in one process) and compares every parameter and every update's
loss; the job fails beyond 1e-10 in float64.
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
CASES = [
    pytest.param("1f1b", "2bw", 4, id="1f1b-2bw-pp4"),
    pytest.param("1f1b", "stash", 2, id="1f1b-stash-pp2"),
    pytest.param("zb-v", "2bw", 2, id="zb-v-2bw-pp2", marks=pytest.mark.slow),
    pytest.param("zb-h1", "stash", 4, id="zb-h1-stash-pp4", marks=pytest.mark.slow),
    pytest.param("interleaved-1f1b", "2bw", 2, id="interleaved-2bw-pp2", marks=pytest.mark.slow),
]


def stream(mpirun, tmp_path, schedule, mode, pp, *extra):
    return mpirun(pp, stream_args(tmp_path, schedule, mode, pp, *extra), timeout=180)


def stream_args(tmp_path, schedule, mode, pp, *extra):
    return [
        "run",
        DECK,
        "--set",
        f"run.output={tmp_path}",
        "--set",
        f"topology.pp={pp}",
        "--set",
        "topology.dp=1",
        "--set",
        f"pipeline.schedule={schedule}",
        "--set",
        "pipeline.microbatches=8",
        "--set",
        "model.layers=10",
        "--set",
        "run.steps=5",
        "--set",
        f"async.mode={mode}",
        *extra,
    ]


@pytest.mark.parametrize(("schedule", "mode", "pp"), CASES)
def test_stream_matches_the_flush_free_reference(mpirun, tmp_path, schedule, mode, pp):
    r = stream(mpirun, tmp_path, schedule, mode, pp)
    assert r.returncode == 0, r.output
    assert "verify OK" in r.stdout, r.output
    updates = 5 * 8 if mode == "stash" else 5
    assert f"{updates} updates of {1 if mode == 'stash' else 8} microbatch(es)" in r.stdout
    with h5py.File(tmp_path / "metrics.h5") as f:
        losses = f["loss"][()]
    assert losses.shape == (updates,) and np.isfinite(losses).all()
    logged = [float(x) for x in re.findall(r"update \d+/\d+ loss=([\d.]+)", r.stdout)]
    np.testing.assert_allclose(logged[-1], losses[-1], atol=5e-5)


def test_stale_weights_change_the_trajectory_but_not_the_first_update(mpirun, tmp_path):
    """Against the synchronous run of the same deck: the first global batch reads version 0
    everywhere in both; after it, stashed versions make the losses differ."""
    a = stream(mpirun, tmp_path / "stream", "1f1b", "2bw", 4)
    b = stream(mpirun, tmp_path / "sync", "1f1b", "sync", 4)
    assert a.returncode == 0 and b.returncode == 0, a.output + b.output
    with (
        h5py.File(tmp_path / "stream" / "metrics.h5") as f,
        h5py.File(tmp_path / "sync" / "metrics.h5") as g,
    ):
        ours, sync = f["loss"][()], g["loss"][()]
    assert ours[0] == pytest.approx(sync[0], rel=1e-12)
    assert not np.allclose(ours[1:], sync[1:], rtol=1e-6)


def test_what_a_stream_cannot_do_yet_exits_2_naming_the_key(mpirun, tmp_path):
    r = stream(mpirun, tmp_path, "1f1b", "2bw", 2, "--set", "trace.enabled=true")
    assert r.returncode == 2, r.output
    assert "trace.enabled = true: a stream is not traced" in r.output
    # checkpoints are written where the stream flushes: a flush cadence that divides them
    r = stream(mpirun, tmp_path, "1f1b", "2bw", 2, "--set", "checkpoint.every=3",
               "--set", "async.flush_every=2")  # fmt: skip
    assert r.returncode == 2, r.output
    assert "checkpoint.every = 3: a stream is checkpointed where it flushes" in r.output
    assert "set async.flush_every to a divisor of 3" in r.output


def test_a_rank_failing_inside_the_stream_ends_the_job(mpirun, tmp_path):
    """A forward that raises on rank 1 mid-stream: every rank ends (exit 1), rank 1 named."""
    r = mpirun(
        2,
        ["run", DECK, "--set", f"run.output={tmp_path}", "--set", "topology.pp=2",
         "--set", "topology.dp=1", "--set", "async.mode=2bw"],
        env={"HPCPIPE_INJECT_FAULT": "rank=1,at=forward:1,kind=raise"},
        timeout=60,
    )  # fmt: skip
    assert r.returncode == 1, r.output
    assert "[rank 1 on" in r.stderr and "injected fault at forward:1" in r.stderr, r.output


# Streams flushed every few global batches: checkpoints and stop signals there, resumed bit
# for bit; the reference trains the whole run's weight-version table (the streams' tables).


FLUSHED = ["--set", "async.flush_every=2", "--set", "train.save_params=true"]


@pytest.fixture(scope="module")
def flushed_full(tmp_path_factory):
    """An uninterrupted 5-global-batch stash run on pp 2, flushed after batches 2 and 4 (three
    streams: 2, 2 and 1 batches) and checkpointed at each flush."""
    from conftest import run_mpi

    out = tmp_path_factory.mktemp("flushed")
    r = stream(run_mpi, out, "1f1b", "stash", 2, *FLUSHED, "--set", "checkpoint.every=2")
    assert r.returncode == 0, r.output
    assert "verify OK" in r.stdout and "stream of global batches 3-4" in r.stdout, r.output
    return out


def test_flushes_change_the_trajectory_where_they_drain(flushed_full, mpirun, tmp_path):
    """The first stream is the unflushed run's first 2 batches; after the flush the weight
    versions (and so the losses) differ."""
    r = stream(mpirun, tmp_path, "1f1b", "stash", 2)
    assert r.returncode == 0, r.output
    ours, one = read_losses(flushed_full), read_losses(tmp_path)
    assert ours.shape == one.shape == (40,)
    assert np.array_equal(ours[:16], one[:16])
    assert not np.allclose(ours[16:], one[16:], rtol=1e-9)


def test_stream_resume_from_a_flush_is_bitwise_equal(flushed_full, mpirun, tmp_path):
    r = stream(
        mpirun, tmp_path, "1f1b", "stash", 2, *FLUSHED,
        "--resume", str(flushed_full / "checkpoints" / "step_000002"),
    )  # fmt: skip
    assert r.returncode == 0, r.output
    assert "at step 2" in r.stdout and "verify OK" in r.stdout, r.output
    a, b = read_params(flushed_full), read_params(tmp_path)
    assert a.keys() == b.keys() and len(a) > 10
    assert all(np.array_equal(a[n], b[n]) for n in a)
    assert np.array_equal(read_losses(flushed_full), read_losses(tmp_path))


def test_stream_stop_signal_checkpoints_at_the_next_flush(flushed_full, mpirun, tmp_path):
    r = mpirun(
        2,
        stream_args(tmp_path, "1f1b", "stash", 2, *FLUSHED),
        env={"HPCPIPE_INJECT_FAULT": "rank=1,at=step:3,kind=usr1"},
        timeout=180,
    )
    assert r.returncode == 0, r.output
    assert "stopping on signal after global batch 4/5 (a flush of the stream)" in r.stdout
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "preempted" and status["step"] == 4
    r = stream(mpirun, tmp_path, "1f1b", "stash", 2, *FLUSHED, "--resume")
    assert r.returncode == 0 and "verify OK" in r.stdout, r.output
    a, b = read_params(flushed_full), read_params(tmp_path)
    assert all(np.array_equal(a[n], b[n]) for n in a)
    assert np.array_equal(read_losses(flushed_full), read_losses(tmp_path))


def test_stream_resume_past_the_end_and_on_another_layout(flushed_full, mpirun, tmp_path):
    """Continued to 7 global batches: the finished run's last batch stays a flush, and the
    reference retraces it. On another pipeline layout the run goes on; verify says why it
    cannot retrace the streams before."""
    more = ["--set", "run.steps=7", "--resume", str(flushed_full / "checkpoints")]
    r = stream(mpirun, tmp_path / "same", "1f1b", "stash", 2, *FLUSHED, *more)
    assert r.returncode == 0, r.output
    assert "at step 5" in r.stdout and "verify OK" in r.stdout, r.output
    assert read_losses(tmp_path / "same").shape == (56,)
    r = stream(mpirun, tmp_path / "other", "1f1b", "stash", 4, *FLUSHED, *more)
    assert r.returncode == 0, r.output
    assert "verify skipped: the streams before global batch 5 ran another pipeline" in r.stdout
