"""Ctrl-C and closed pipes: a person at a terminal stops a run or reads only the head of the
output. Neither may cost a traceback per rank, a lost checkpoint or an error exit.

Ctrl-C is a stop request like the scheduler's SIGTERM (checkpoint, status.json, exit 0); a
second one exits at once with 130 and one line. Output piped into `head` ends quietly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import INPUTS, ROOT, clean_environ, mpiexec_command

TRAIN = str(INPUTS / "train_tiny.toml")


def _start(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**clean_environ(), **(env or {})},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job is
    )


def _wait_for(proc: subprocess.Popen, text: str, timeout: float = 60) -> list[str]:
    """Read stdout lines until one contains `text`; returns what was read."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if text in line:
            return seen
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"never printed {text!r}:\n{''.join(seen)}\n{proc.stderr.read()}")


def _finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"did not end after Ctrl-C (hang)\n{out}\n{err}")
    return proc.returncode, out, err


def _long_run(output: Path) -> list[str]:
    return [
        "run",
        TRAIN,
        "--set",
        f"run.output='{output}'",
        "--set",
        "run.steps=100000",
        "--set",
        "checkpoint.every=100000",
        "--set",
        "topology.pp=1",
    ]


def test_ctrl_c_checkpoints_and_exits_zero_in_one_process(tmp_path):
    proc = _start([sys.executable, "-m", "hpcpipe", *_long_run(tmp_path)])
    _wait_for(proc, "step 2/")
    os.killpg(proc.pid, signal.SIGINT)
    rc, out, err = _finish(proc)
    assert rc == 0, out + err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "SIGINT: stopping after this step with a checkpoint" in err
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "preempted" and status["checkpoint"], status
    assert Path(status["checkpoint"]).is_dir()
    assert f"stopping on signal after step {status['step']}/100000" in out


def test_second_ctrl_c_exits_130_with_one_line(tmp_path):
    # the checkpoint the first Ctrl-C asks for hangs: the second must end the run anyway
    fault = {"HPCPIPE_INJECT_FAULT": "rank=0,at=checkpoint,kind=hang"}
    proc = _start([sys.executable, "-m", "hpcpipe", *_long_run(tmp_path)], env=fault)
    _wait_for(proc, "step 2/")
    os.killpg(proc.pid, signal.SIGINT)
    assert "SIGINT: stopping" in proc.stderr.readline()  # the first one was taken
    os.killpg(proc.pid, signal.SIGINT)
    rc, _, err = _finish(proc)
    assert rc == 130, err
    assert err.splitlines() == ["hpcpipe: second SIGINT: exiting now"], err


@pytest.mark.mpi
def test_ctrl_c_under_mpiexec_checkpoints_without_tracebacks(tmp_path):
    args = [*_long_run(tmp_path)[:-2], "--set", "topology.pp=2"]
    proc = _start([*mpiexec_command(), "-n", "4", sys.executable, "-m", "hpcpipe", *args])
    _wait_for(proc, "step 2/")
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal does: the whole foreground group
    rc, out, err = _finish(proc, timeout=90)
    assert rc == 0, out + err
    assert "Traceback" not in err, err
    hpcpipe_lines = [ln for ln in err.splitlines() if ln.startswith("hpcpipe:")]
    assert len(hpcpipe_lines) == 1, err  # rank 0 speaks for the job
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "preempted" and Path(status["checkpoint"]).is_dir(), status


def test_stop_signal_reaches_a_run_whose_blas_has_threads(tmp_path):
    """A signal is delivered to any thread that does not block it: BLAS threads started before
    the run blocked the stop signals would swallow them (seen with one rank on many cores)."""
    proc = subprocess.run(
        [sys.executable, "-m", "hpcpipe", *_long_run(tmp_path), "--set", "run.steps=6"],
        cwd=ROOT,
        env={
            **clean_environ(),
            "OPENBLAS_NUM_THREADS": "2",
            "OMP_NUM_THREADS": "2",
            "HPCPIPE_INJECT_FAULT": "rank=0,at=step:2,kind=usr1",
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "stopping on signal after step 2/6" in proc.stdout, proc.stdout + proc.stderr


def _head_one(args: list[str]) -> tuple[int, str, str]:
    """`hpcpipe ARGS | head -1`: read one line, close the pipe, let the writer notice."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcpipe", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_environ(),
    )
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    return proc.wait(timeout=120), first, err


@pytest.mark.parametrize(
    "args",
    [
        ["plan", "--world", "65536", "--rows", "65536"],
        [
            "run",
            "inputs/gpt_pp4.toml",
            "--dry-run",
            "--world",
            "65536",
            "--set",
            "topology.ep=1",
            "--set",
            "data.global_batch=131072",
            "--set",
            "pipeline.microbatches=8",
        ],
    ],
    ids=["plan", "dry-run"],
)
def test_output_piped_into_head_ends_quietly(args):
    rc, first, err = _head_one(args)
    assert first.strip(), err
    assert rc == 0, (rc, err)
    assert all(line.startswith("note:") for line in err.splitlines()), err
