"""The job scripts on a real Slurm: sbatch each one on a tiny deck and check what it produced.

Needs a running Slurm controller (tests/slurm/start-local-slurm.sh starts one on this machine;
CI does). Without one the tests skip with the reason, except under CI, where they must run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INPUTS = ROOT / "inputs"
JOBSCRIPTS = ROOT / "jobscripts"

pytestmark = [pytest.mark.mpi, pytest.mark.slurm]


def _slurm_problem() -> str | None:
    if shutil.which("sbatch") is None:
        return "sbatch is not installed (tests/slurm/start-local-slurm.sh installs and starts it)"
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"scontrol ping failed: {exc}"
    if "UP" not in ping.stdout:
        return f"no Slurm controller answers: {ping.stdout.strip() or ping.stderr.strip()}"
    return None


@pytest.fixture(scope="module", autouse=True)
def slurm():
    problem = _slurm_problem()
    if problem:
        if os.environ.get("CI"):
            pytest.fail(f"Slurm must run in CI: {problem}")
        pytest.skip(problem)


def sbatch(script: str, deck: Path, workdir: Path, *sbatch_args: str, **env: str) -> int:
    """Submit `jobscripts/<script>` with hpcpipe's environment; returns the job id."""
    full_env = {
        **os.environ,
        "HPCPIPE_PYTHON": sys.executable,
        "HPCPIPE_JOBSCRIPTS": str(JOBSCRIPTS),
        **env,
    }
    cmd = [
        "sbatch",
        "--parsable",
        "--export=ALL",
        f"--chdir={workdir}",
        f"--output={workdir}/job-%A_%a.out"
        if "--array" in " ".join(sbatch_args)
        else f"--output={workdir}/job.out",
        *sbatch_args,
        str(JOBSCRIPTS / script),
        str(deck),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip().split(";")[0])


def job_info(job: int) -> dict[str, str]:
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", str(job)], capture_output=True, text=True, timeout=30
    ).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def wait(job: int, timeout: float = 240, until=None) -> dict[str, str]:
    """Poll until the job ends (or `until(info)` holds); fails the test on timeout."""
    deadline = time.monotonic() + timeout
    info: dict[str, str] = {}
    while time.monotonic() < deadline:
        info = job_info(job)
        if until is not None and until(info):
            return info
        if until is None and info.get("JobState") in FINAL:
            return info
        time.sleep(0.5)
    subprocess.run(["scancel", str(job)], timeout=30)
    pytest.fail(f"job {job} did not finish in {timeout}s: {info}")


def wait_array(job: int, tasks: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(
            ["squeue", "-h", "-j", str(job)], capture_output=True, text=True, timeout=30
        ).stdout
        if not out.strip():
            return
        time.sleep(1)
    subprocess.run(["scancel", str(job)], timeout=30)
    pytest.fail(f"array job {job} ({tasks} tasks) did not finish in {timeout}s")


def test_train_job_runs_and_verifies(tmp_path):
    job = sbatch(
        "train.sbatch",
        INPUTS / "train_tiny.toml",
        tmp_path,
        "-n",
        "4",
        HPCPIPE_OUTPUT=str(tmp_path / "run"),
    )
    info = wait(job)
    log = (tmp_path / "job.out").read_text()
    assert info["JobState"] == "COMPLETED", log
    assert "verify OK" in log and "tasks=4" in log
    assert json.loads((tmp_path / "run" / "status.json").read_text())["state"] == "finished"


def test_moe_job(tmp_path):
    job = sbatch(
        "moe.sbatch",
        INPUTS / "moe_tiny.toml",
        tmp_path,
        "-n",
        "4",
        HPCPIPE_OUTPUT=str(tmp_path / "run"),
        HPCPIPE_SET="run.steps=3",
    )
    info = wait(job)
    log = (tmp_path / "job.out").read_text()
    assert info["JobState"] == "COMPLETED", log
    assert "verify OK" in log and "tok/expert=" in log


def test_sweep_job(tmp_path):
    job = sbatch(
        "sweep.sbatch",
        INPUTS / "sweep_tiny.toml",
        tmp_path,
        "-n",
        "4",
        HPCPIPE_OUTPUT=str(tmp_path / "run"),
        HPCPIPE_SET="sweep.px=2 sweep.py=2",
    )
    info = wait(job)
    log = (tmp_path / "job.out").read_text()
    assert info["JobState"] == "COMPLETED", log
    assert (tmp_path / "run" / "flux.h5").exists() and (tmp_path / "run" / "flux.xmf").exists()


def test_deck_that_does_not_fit_the_allocation_fails_before_launch(tmp_path):
    job = sbatch(
        "train.sbatch",
        INPUTS / "train_tiny.toml",
        tmp_path,
        "-n",
        "3",
        HPCPIPE_OUTPUT=str(tmp_path / "run"),
    )
    info = wait(job)
    log = (tmp_path / "job.out").read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"].startswith("2:"), info
    assert "topology.pp = 2 does not divide world size 3" in log
    assert "does not fit 3 tasks" in log
    assert not (tmp_path / "run").exists()  # no rank was started


def test_wrong_mpi_plugin_is_detected(tmp_path):
    # --mpi=none: each task starts its own 1-rank MPI world; hpcpipe must notice and stop
    job = sbatch(
        "train.sbatch",
        INPUTS / "train_tiny.toml",
        tmp_path,
        "-n",
        "2",
        HPCPIPE_OUTPUT=str(tmp_path / "run"),
        HPCPIPE_MPI_PLUGIN="none",
        HPCPIPE_SET="topology.dp=1",
    )
    info = wait(job)
    log = (tmp_path / "job.out").read_text()
    assert info["JobState"] == "FAILED", log
    assert "every task started its own single-rank job" in log


def test_time_limit_signal_checkpoints_requeues_and_resumes(tmp_path, mpirun):
    """USR1 to the batch shell (what --signal=B:USR1@T delivers before the time limit): the ranks
    checkpoint and exit 0, the script requeues the job, the restart resumes; the final
    parameters equal an uninterrupted run's, bit for bit."""
    assert "#SBATCH --signal=B:USR1@" in (JOBSCRIPTS / "train.sbatch").read_text()
    steps = "run.steps=200 run.log_every=20 train.verify=false train.save_params=true"
    job = sbatch(
        "train.sbatch",
        INPUTS / "train_tiny.toml",
        tmp_path,
        "-n",
        "4",
        HPCPIPE_OUTPUT=str(tmp_path / "run"),
        HPCPIPE_SET=steps,
    )
    log = tmp_path / "job.out"
    wait(job, until=lambda info: log.exists() and "step 21/200" in log.read_text())
    subprocess.run(["scancel", "--signal=USR1", "--batch", str(job)], check=True, timeout=30)
    # requeued jobs wait ~2 minutes before they are eligible again; release it sooner, but not
    # within the same seconds as the requeue: slurmd refuses a credential issued in the second
    # the old one was revoked ("Job credential revoked")
    wait(job, until=lambda info: info.get("Restarts") == "1" and info["JobState"] == "PENDING")
    time.sleep(3)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True, timeout=30)
    info = wait(job)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED", text
    assert "stopping on signal after step" in text
    assert "requeueing" in text and "restart=1" in text and "resumed from" in text
    assert json.loads((tmp_path / "run" / "status.json").read_text())["state"] == "finished"

    straight = tmp_path / "straight"
    r = mpirun(
        4,
        [
            "run",
            str(INPUTS / "train_tiny.toml"),
            *[a for s in [f"run.output={straight}", *steps.split()] for a in ("--set", s)],
        ],
        timeout=240,
    )
    assert r.returncode == 0, r.output
    import h5py
    import numpy as np

    with h5py.File(tmp_path / "run" / "params.h5") as a, h5py.File(straight / "params.h5") as b:
        names: list[str] = []
        a.visit(lambda n: names.append(n) if isinstance(a[n], h5py.Dataset) else None)
        assert names
        for n in names:
            assert np.array_equal(a[n][()], b[n][()]), n


def test_array_job_and_trace_table(tmp_path, cli):
    job = sbatch(
        "array.sbatch",
        INPUTS / "train_tiny.toml",
        tmp_path,
        "-n",
        "4",
        "--array=0-1",
        ARRAY_SCHEDULES="1f1b zb-v",
        ARRAY_MICROBATCHES="4",
        HPCPIPE_SET="run.steps=2 train.verify=false",
    )
    wait_array(job, 2)
    traces = sorted((tmp_path / "runs" / f"array-{job}").glob("*/trace.h5"))
    assert [t.parent.name for t in traces] == ["1f1b-m4", "zb-v-m4"], list(tmp_path.rglob("*"))
    r = cli(["trace", "table", *map(str, traces)])
    assert r.returncode == 0, r.output
    assert "1f1b-m4" in r.stdout and "zb-v-m4" in r.stdout


def test_dry_run_prints_the_launch(tmp_path):
    env = {
        **os.environ,
        "HPCPIPE_PYTHON": sys.executable,
        "HPCPIPE_DRY_RUN": "1",
        "SLURM_NTASKS": "4",
        "SLURM_JOB_ID": "0",
        "HPCPIPE_JOBSCRIPTS": str(JOBSCRIPTS),
    }
    out = subprocess.run(
        ["bash", str(JOBSCRIPTS / "train.sbatch"), str(INPUTS / "train_tiny.toml")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "srun --mpi=pmi2" in out.stdout and "[topology]" in out.stdout
