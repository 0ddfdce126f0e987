"""Bad input around the deck: missing, unreadable or odd deck files, run directories that cannot
be written (a file in the way, a read-only or full file system), a world that does not fit the
deck, and a launch that contradicts the Slurm allocation. Each must exit 2 with one message that
names the file or key, without a traceback and without hanging; a disk that fills up during a
run must fail fast and leave the previous checkpoint loadable.

Tests run as root in CI, where `chmod 000` stops nobody: unreadable decks are a FIFO (whose read
would block forever), a path under a regular file, and a real EACCES from a child process that
runs as root without the capabilities to override file permissions (dropped from its bounding
set with prctl before exec). File systems are real tmpfs mounts (read-only: `-o ro` or
`remount,ro`; full: `-o size=...` filled up); without permission to mount, those tests skip with
the reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import clean_environ

from hpcpipe.config import ConfigError
from hpcpipe.preflight import SlurmLayout, check_slurm, slurm_layout

ROOT = Path(__file__).resolve().parents[2]
INPUTS = ROOT / "inputs"
TOPOLOGY = str(INPUTS / "topology_tiny.toml")  # pp 2 x dp 4, ranks_per_node 4
TRAIN = str(INPUTS / "train_tiny.toml")  # pp 2 x dp rest, float64, verify


def assert_bad_input(r, *pieces: str) -> None:
    """Exit 2, one ERROR line naming every piece, no traceback."""
    assert r.returncode == 2, r.output
    assert "Traceback" not in r.output, r.output
    assert r.stderr.count("ERROR:") == 1, r.stderr
    for piece in pieces:
        assert piece in r.stderr, (piece, r.stderr)


# ---------------------------------------------------------------- the deck file


@pytest.mark.mpi
def test_missing_deck(cli, mpirun, tmp_path):
    deck = str(tmp_path / "nope.toml")
    assert_bad_input(cli(["run", deck, "--dry-run"]), deck, "no such input deck")
    assert_bad_input(mpirun(2, ["run", deck], timeout=60), deck, "no such input deck")


def test_deck_is_a_directory(cli, tmp_path):
    assert_bad_input(cli(["run", str(tmp_path), "--dry-run"]), str(tmp_path), "is a directory")


def test_deck_under_a_file(cli, tmp_path):
    (tmp_path / "file").write_text("x")
    deck = str(tmp_path / "file" / "deck.toml")
    assert_bad_input(cli(["run", deck, "--dry-run"]), deck, "a parent in the path is a file")


def test_deck_is_a_fifo_and_does_not_block(cli, tmp_path):
    fifo = tmp_path / "deck.toml"
    os.mkfifo(fifo)  # reading it would wait for a writer forever
    r = cli(["run", str(fifo), "--dry-run"], timeout=30)
    assert_bad_input(r, str(fifo), "not a regular file")


def test_schedule_csv_that_is_a_fifo_does_not_block(cli, tmp_path):
    fifo = tmp_path / "schedule.csv"
    os.mkfifo(fifo)
    sets = ["--set", "pipeline.schedule=csv", "--set", f"pipeline.schedule_csv={fifo}"]
    for args in (
        ["run", "--dry-run", "--set", "topology.pp=1", *sets],
        ["plan", "--world", "2", *sets],
    ):
        r = cli(args, timeout=30)
        assert_bad_input(r, "pipeline.schedule_csv", str(fifo), "not a regular file")


PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 24, 1, 2


def _drop_file_capabilities() -> None:
    """In the child before exec: remove root's right to ignore file permissions (the
    capabilities DAC_OVERRIDE and DAC_READ_SEARCH) from the bounding set, so the exec'd Python
    runs as root that obeys `chmod` (uid 0 still owns and can reach its own interpreter)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            os._exit(77)  # not permitted (no CAP_SETPCAP): the test skips


def test_unreadable_deck(tmp_path):
    """A real EACCES: root ignores permission bits, so the child gives up that right first."""
    deck = tmp_path / "deck.toml"
    deck.write_text("[run]\nsteps = 1\n")
    deck.chmod(0o000)
    r = subprocess.run(
        [sys.executable, "-m", "hpcpipe", "run", str(deck), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        preexec_fn=_drop_file_capabilities if os.geteuid() == 0 else None,
        env=clean_environ(),
    )
    if r.returncode == 77:
        pytest.skip("cannot drop CAP_DAC_OVERRIDE here (prctl PR_CAPBSET_DROP refused)")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert f"ERROR: {deck}: cannot be read (permission denied)" in r.stderr, r.stderr


# ---------------------------------------------------------------- the run directory


@contextlib.contextmanager
def tmpfs(where: Path, size: str, *, read_only: bool = False) -> Iterator[Path]:
    """A real tmpfs of `size` mounted at `where` (skips when mounting is not permitted)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs these tests as root)")
    where.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if r.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True, timeout=30).returncode:
            subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def fill(directory: Path, leave_bytes: int = 0) -> None:
    """Write a filler file until the file system has at most `leave_bytes` free."""
    free = shutil.disk_usage(directory).free - leave_bytes
    with open(directory / "filler", "wb") as fh:
        chunk = b"\0" * 4096
        try:
            while free > 0:
                fh.write(chunk[: min(len(chunk), free)])
                fh.flush()
                free -= len(chunk)
        except OSError:
            pass


TOPO_2 = ["--set", "topology.dp=1", "--set", "topology.ep=1"]  # topology_tiny on 2 ranks


@pytest.mark.mpi
def test_output_under_a_file(mpirun, tmp_path):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "run"
    r = mpirun(2, ["run", TOPOLOGY, "--set", f"run.output={out}", *TOPO_2], timeout=60)
    assert_bad_input(r, "run.output", str(out), "[ENOTDIR]")


@pytest.mark.mpi
def test_output_on_a_read_only_file_system(mpirun, tmp_path):
    with tmpfs(tmp_path / "ro", "64k", read_only=True) as mnt:
        r = mpirun(2, ["run", TOPOLOGY, "--set", f"run.output={mnt}/run", *TOPO_2], timeout=60)
        assert_bad_input(r, "run.output", f"{mnt}/run", "Read-only file system [EROFS]")
        # the output is fine but the checkpoint directory is not: named as checkpoint.dir
        args = ["--set", f"run.output={tmp_path}/run", "--set", f"checkpoint.dir={mnt}/ck"]
        r = mpirun(2, ["run", TOPOLOGY, *args, *TOPO_2], timeout=60)
        assert_bad_input(r, "checkpoint.dir", "[EROFS]")


@pytest.mark.mpi
def test_existing_output_remounted_read_only(mpirun, tmp_path):
    with tmpfs(tmp_path / "remount", "64k") as mnt:
        (mnt / "run").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True, timeout=30)
        r = mpirun(2, ["run", TOPOLOGY, "--set", f"run.output={mnt}/run", *TOPO_2], timeout=60)
        assert_bad_input(r, "run.output", "[EROFS]")


@pytest.mark.mpi
def test_output_on_a_full_file_system(mpirun, tmp_path):
    with tmpfs(tmp_path / "full", "64k") as mnt:
        fill(mnt)
        r = mpirun(2, ["run", TOPOLOGY, "--set", f"run.output={mnt}/run", *TOPO_2], timeout=60)
        assert_bad_input(r, "run.output", "No space left on device [ENOSPC]")


TRAIN_ARGS = ["--set", "train.verify=false", "--set", "checkpoint.every=1"]


@pytest.mark.mpi
def test_full_disk_mid_run(mpirun, cli, tmp_path):
    """A good checkpoint at step 1 on a 1 MiB tmpfs, then the disk filled so that the step-2
    checkpoint (about 460 KiB) cannot be written: the resumed run must fail fast, say ENOSPC
    and where, and leave `latest` on the step-1 checkpoint, which still verifies."""
    with tmpfs(tmp_path / "small", "1m") as mnt:
        out = mnt / "run"
        args = ["run", TRAIN, *TRAIN_ARGS, "--set", f"run.output={out}"]
        first = mpirun(2, [*args, "--set", "run.steps=1"], timeout=120)
        assert first.returncode == 0, first.output
        fill(mnt, leave_bytes=100 << 10)
        more = ["--set", "run.steps=3", "--set", "trace.enabled=true", "--resume"]
        r = mpirun(2, [*args, *more], timeout=60)
        assert r.returncode != 0, r.output
        assert r.seconds < 30, f"took {r.seconds:.1f}s to fail"
        assert "No space left on device" in r.output and "step_000002" in r.output
        assert (out / "checkpoints" / "latest").read_text().strip() == "step_000001"
        assert not (out / "checkpoints" / "step_000002").exists()
        verify = cli(["ckpt", "verify", str(out)], timeout=60)
        assert verify.returncode == 0, verify.output
        assert "step_000001 (step 1)" in verify.stdout and "every CRC32 matches" in verify.stdout
        assert r.returncode == 1, r.output  # a clean all-ranks error, not a crash
        assert "Segmentation fault" not in r.output and "Exception ignored" not in r.output


# ---------------------------------------------------------------- the world and the allocation


@pytest.mark.mpi
def test_world_that_does_not_fit_a_fixed_layout(mpirun, tmp_path):
    r = mpirun(6, ["run", TOPOLOGY, "--set", f"run.output={tmp_path}"], timeout=60)
    assert_bad_input(
        r, "topology.dp = 4", "does not equal world size 6", "mpiexec -n 8", "topology.dp = 0"
    )


@pytest.mark.mpi
def test_world_that_does_not_fit_pp(mpirun, tmp_path):
    r = mpirun(
        6, ["run", TRAIN, "--dry-run", "--set", "topology.pp=4", "--set", "pipeline.microbatches=8"]
    )
    assert_bad_input(r, "topology.pp = 4 does not divide world size 6", "mpiexec -n 4 or 8")


SLURM_2x2 = {"SLURM_JOB_ID": "1", "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "2(x2)"}


@pytest.mark.mpi
def test_world_smaller_than_the_slurm_allocation(mpirun):
    env = {**SLURM_2x2, "SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "4(x2)"}
    r = mpirun(4, ["run", TOPOLOGY, "--dry-run", "--set", "topology.dp=2"], env=env, timeout=60)
    assert_bad_input(r, "SLURM_NTASKS = 8", "MPI world has 4 rank(s)", "mpiexec -n 8")


@pytest.mark.mpi
def test_ranks_per_node_that_contradicts_slurm(mpirun):
    env = {**SLURM_2x2, "SLURM_NTASKS": "4"}
    args = ["run", TOPOLOGY, "--dry-run", "--set", "topology.dp=2"]  # ranks_per_node = 4
    r = mpirun(4, args, env=env, timeout=60)
    assert_bad_input(r, "topology.ranks_per_node = 4", "SLURM_TASKS_PER_NODE=2(x2)", "or 2")
    # virtual nodes inside Slurm's nodes are allowed, with a warning
    one_node = {**env, "SLURM_NNODES": "1", "SLURM_TASKS_PER_NODE": "4"}
    r = mpirun(4, [*args, "--set", "topology.ranks_per_node=2"], env=one_node, timeout=60)
    assert r.returncode == 0, r.output
    assert "WARNING: topology.ranks_per_node = 2 splits Slurm's nodes" in r.stderr
    # discovered nodes: mpiexec put all 4 ranks on this machine, Slurm expected 2 nodes
    r = mpirun(4, [*args, "--set", "topology.ranks_per_node=0"], env=env, timeout=60)
    assert r.returncode == 0, r.output
    assert "MPI finds the ranks on 1 node(s) but Slurm allocated 2" in r.stderr


@pytest.mark.mpi
def test_matching_slurm_allocation_runs(mpirun, tmp_path):
    env = {**SLURM_2x2, "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "4", "SLURM_NNODES": "1"}
    args = ["run", TOPOLOGY, "--set", "topology.dp=2", "--set", f"run.output={tmp_path}"]
    r = mpirun(4, args, env=env, timeout=60)
    assert r.returncode == 0, r.output
    assert "WARNING" not in r.stderr


# pure checks of the Slurm rules, for launches mpiexec cannot imitate (srun-started ranks)


def test_slurm_layout_rules():
    srun = {
        "SLURM_NTASKS": "8",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_STEP_TASKS_PER_NODE": "3,1",
        "SLURM_TASKS_PER_NODE": "4(x2)",
    }
    layout = slurm_layout(srun, srun_launched=True)
    step_vars = ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE")
    assert layout == SlurmLayout(4, step_vars[0], (3, 1), step_vars[1], "3,1")
    # mpiexec inside a job step (bootstrapping through srun): nothing can be concluded
    assert slurm_layout(srun, srun_launched=False) is None
    batch = {"SLURM_NTASKS": "6", "SLURM_NTASKS_PER_NODE": "3", "SLURM_JOB_NUM_NODES": "2"}
    layout = slurm_layout(batch, srun_launched=False)
    assert layout is not None and layout.per_node == (3, 3) and layout.tasks == 6
    assert slurm_layout({}, srun_launched=False) is None
    assert slurm_layout({"SLURM_TASKS_PER_NODE": "junk"}, srun_launched=False) is None
    # uneven nodes: 4 + 2 ranks; virtual nodes of 2 fit, of 4 (straddling at rank 4..5) fit,
    # of 3 straddle
    uneven = SlurmLayout(6, "SLURM_NTASKS", (4, 2), "SLURM_TASKS_PER_NODE", "4,2")
    assert check_slurm(uneven, 6, 2, "deck") != []
    assert check_slurm(uneven, 6, 4, "deck") != []
    with pytest.raises(ConfigError, match=r"topology.ranks_per_node = 3 .* 4,2"):
        check_slurm(uneven, 6, 3, "deck")
    with pytest.raises(ConfigError, match="SLURM_NTASKS = 6 tasks"):
        check_slurm(uneven, 5, 0, "deck")
    assert check_slurm(None, 5, 3, "deck") == []
