"""Faults under real mpiexec: a killed, raising or hung rank ends the whole job fast and loudly,
leaves no process behind and never damages the last good checkpoint; stop signals in any phase
checkpoint and exit 0; a schedule that would deadlock is refused before anything runs.

Every job here runs in its own session, so "no process left behind" is checked exactly: after
mpiexec returns, nothing in that session may still be alive.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import INPUTS, ROOT, Result, clean_environ, mpiexec_command, run_cli

TRAIN = str(INPUTS / "train_tiny.toml")
MOE = str(INPUTS / "moe_tiny.toml")
SWEEP = str(INPUTS / "sweep_tiny.toml")
END_WITHIN_S = 30.0  # the bound for a killed rank to end the job


def sets(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("--set", pair)]


def session_members(sid: int) -> list[str]:
    """Live processes of session `sid` (zombies are dead: they only wait to be reaped)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        state, session = fields[0], int(fields[3])
        if session == sid and state != "Z":
            found.append(f"{entry.name} {stat[: stat.rindex(')') + 1]}")
    return found


def launch(n: int, args: list[str], *, fault: str = "", timeout: float = 90) -> Result:
    """`mpiexec -n N python -m hpcpipe ARGS` in a new session; asserts nothing outlives it."""
    env = {**clean_environ(), "HPCPIPE_INJECT_FAULT": fault}
    cmd = [*mpiexec_command(), "-n", str(n), sys.executable, "-m", "hpcpipe", *args]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"job did not end in {timeout}s (hang)\nstdout:\n{out}\nstderr:\n{err}")
    seconds = time.monotonic() - t0
    deadline = time.monotonic() + 5  # the launcher may still be reaping its children
    while (left := session_members(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("processes left behind after mpiexec exited:\n" + "\n".join(left))
    return Result(proc.returncode, out, err, seconds)


def complete_checkpoints(output: Path) -> list[Path]:
    ckpts = output / "checkpoints"
    if not ckpts.is_dir():
        return []
    return sorted(
        p for p in ckpts.iterdir() if p.name.startswith("step_") and not p.name.endswith(".tmp")
    )


def assert_checkpoints_verify(output: Path) -> list[Path]:
    found = complete_checkpoints(output)
    for path in found:
        v = run_cli(["ckpt", "verify", str(path)])
        assert v.returncode == 0, f"{path} does not verify:\n{v.output}"
    return found


# ---------------------------------------------------------------- killed ranks

KILLS = {
    # name: (deck, ranks, fault, extra settings)
    "forward": (TRAIN, 4, "rank=3,at=forward:3,kind=kill", ()),
    "allreduce": (TRAIN, 4, "rank=1,at=allreduce,hit=4,kind=kill", ()),
    "alltoall": (MOE, 4, "rank=2,at=alltoall,hit=40,kind=kill", ("run.steps=8",)),
    "checkpoint": (TRAIN, 4, "rank=2,at=checkpoint,hit=2,kind=kill", ()),
}


@pytest.mark.parametrize("where", sorted(KILLS))
def test_sigkilled_rank_ends_the_job(tmp_path, where):
    deck, n, fault, extra = KILLS[where]
    args = ["run", deck, *sets(f"run.output={tmp_path}", "run.steps=6", "checkpoint.every=1")]
    r = launch(n, [*args, *sets(*extra)], fault=fault)
    assert r.returncode != 0, r.output
    assert r.seconds < END_WITHIN_S, f"the job took {r.seconds:.1f}s to end:\n{r.output}"
    good = assert_checkpoints_verify(tmp_path)
    # the fault lands after at least one complete checkpoint (step 1): it must have survived
    assert good, f"no complete checkpoint survived the kill at {where}:\n{r.output}"
    assert (
        not (tmp_path / "status.json").exists()
        or "finished" not in (tmp_path / "status.json").read_text()
    )


def test_resume_after_a_kill_reproduces_the_uninterrupted_run(tmp_path):
    full = tmp_path / "full"
    r = launch(
        4, ["run", TRAIN, *sets(f"run.output={full}", "run.steps=5", "train.save_params=true")]
    )
    assert r.returncode == 0, r.output
    killed = tmp_path / "killed"
    base = sets(
        f"run.output={killed}", "run.steps=5", "checkpoint.every=1", "train.save_params=true"
    )
    r = launch(4, ["run", TRAIN, *base], fault="rank=1,at=allreduce,hit=4,kind=kill")
    assert r.returncode != 0
    assert assert_checkpoints_verify(killed)
    r = launch(4, ["run", TRAIN, "--resume", *base])
    assert r.returncode == 0, r.output
    import h5py
    import numpy as np

    with h5py.File(full / "params.h5") as a, h5py.File(killed / "params.h5") as b:
        names: list[str] = []
        a.visititems(lambda k, v: names.append(k) if isinstance(v, h5py.Dataset) else None)
        assert names
        for name in names:
            assert np.array_equal(a[name][()], b[name][()]), name


# ---------------------------------------------------------------- exceptions


@pytest.mark.parametrize("seed", [11, 22, 33])
def test_exception_at_a_random_step_names_the_rank(tmp_path, seed):
    rng = random.Random(seed)
    rank, step = rng.randrange(4), rng.randrange(1, 6)
    point = rng.choice([f"step:{step}", f"forward:{step}", "allreduce"])
    fault = f"rank={rank},at={point},kind=raise" + (f",hit={step}" if point == "allreduce" else "")
    r = launch(4, ["run", TRAIN, *sets(f"run.output={tmp_path}", "run.steps=6")], fault=fault)
    assert r.returncode == 1, r.output
    assert f"[rank {rank} on " in r.stderr
    assert "InjectedFault" in r.stderr
    assert r.seconds < END_WITHIN_S


# ---------------------------------------------------------------- hangs


def test_watchdog_turns_a_hang_into_a_report_from_every_rank(tmp_path):
    r = launch(
        4,
        ["run", TRAIN, *sets(f"run.output={tmp_path}", "run.steps=6", "run.watchdog_s=3")],
        fault="rank=3,at=forward:2,kind=hang",
        timeout=60,
    )
    assert r.returncode == 1, r.output
    assert r.seconds < 25, f"watchdog_s=3 but the job took {r.seconds:.1f}s"
    for rank in range(4):
        line = next(
            (ln for ln in r.stderr.splitlines() if f"[rank {rank} on " in ln and "watchdog:" in ln),
            None,
        )
        assert line is not None, f"rank {rank} did not report:\n{r.stderr}"
        assert "step 2" in line and "run.watchdog_s = 3" in line
    # the hung rank is in its forward; its pipeline peer waits on it
    assert "(1F0)" in r.stderr or "1F0<<" in r.stderr, r.stderr
    assert "waiting for pipeline rank 1" in r.stderr, r.stderr


def test_watchdog_catches_a_hung_sweep_iteration(tmp_path):
    r = launch(
        4,
        [
            "run",
            SWEEP,
            *sets(f"run.output={tmp_path}", "sweep.px=2", "sweep.py=2", "run.watchdog_s=2"),
        ],
        fault="rank=0,at=sweep-iteration:3,kind=hang",
        timeout=60,
    )
    assert r.returncode == 1, r.output
    assert "sweep iteration 3 has run" in r.stderr
    assert "receiving faces from" in r.stderr, r.stderr  # a neighbour names its blocked task


def test_deadlocking_hand_written_schedule_is_refused_before_running(tmp_path):
    # rank 0 waits for microbatch 0's backward before starting microbatch 1, while rank 1
    # insists on microbatch 1 first: a cycle no amount of buffering can break
    csv = tmp_path / "deadlock.csv"
    csv.write_text(
        "# hpcpipe schedule name=hand microbatches=2 placement=0;1\n"
        "0F0,0BW0,0F1,0BW1\n"
        "1F1,1BW1,1F0,1BW0\n",
        encoding="utf-8",
    )
    r = launch(
        2,
        [
            "run",
            TRAIN,
            *sets(
                f"run.output={tmp_path / 'out'}",
                "topology.dp=1",
                "pipeline.schedule=csv",
                f"pipeline.schedule_csv={csv}",
                "pipeline.microbatches=2",
                "run.watchdog_s=5",
            ),
        ],
        timeout=60,
    )
    assert r.returncode == 2, r.output
    assert "pipeline.schedule" in r.stderr and "deadlock" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert "step 1/" not in r.stdout  # refused before the first step


# ---------------------------------------------------------------- stop signals

PHASES = {
    # phase: fault that sends the signal to one rank inside it
    "startup": "rank=0,at=startup,kind={sig}",
    "forward": "rank=3,at=forward:2,kind={sig}",
    "allreduce": "rank=1,at=allreduce,hit=3,kind={sig}",
    "checkpoint": "rank=2,at=checkpoint,hit=2,kind={sig}",
    "between-steps": "rank=0,at=step:3,kind={sig}",
}


@pytest.mark.parametrize(
    ("phase", "sig"),
    [
        pytest.param(
            phase,
            sig,
            id=f"{phase}-{sig}",
            marks=()
            if (phase, sig) in {("forward", "usr1"), ("checkpoint", "term")}
            else pytest.mark.slow,
        )
        for phase in sorted(PHASES)
        for sig in ("usr1", "term")
    ],
)
def test_stop_signal_in_any_phase_checkpoints_and_exits_zero(tmp_path, phase, sig):
    fault = PHASES[phase].format(sig=sig)
    args = ["run", TRAIN, *sets(f"run.output={tmp_path}", "run.steps=8", "checkpoint.every=2")]
    r = launch(4, args, fault=fault)
    assert r.returncode == 0, r.output
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "preempted", status
    assert status["step"] < 8
    good = assert_checkpoints_verify(tmp_path)
    assert good and Path(status["checkpoint"]).name == good[-1].name
    assert "stopping on signal" in r.stdout


def test_stop_signal_in_an_alltoall_checkpoints_and_exits_zero(tmp_path):
    args = ["run", MOE, *sets(f"run.output={tmp_path}", "run.steps=6", "checkpoint.every=2")]
    r = launch(4, args, fault="rank=2,at=alltoall,hit=20,kind=usr1")  # inside step 2
    assert r.returncode == 0, r.output
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "preempted" and status["step"] == 2, status
    assert [p.name for p in assert_checkpoints_verify(tmp_path)] == ["step_000002"]


def test_stop_signal_in_a_sweep_iteration_checkpoints_and_exits_zero(tmp_path):
    args = ["run", SWEEP, *sets(f"run.output={tmp_path}", "sweep.px=2", "sweep.py=2")]
    r = launch(4, args, fault="rank=3,at=sweep-iteration:2,kind=term")
    assert r.returncode == 0, r.output
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "preempted" and status["step"] == 2, status
