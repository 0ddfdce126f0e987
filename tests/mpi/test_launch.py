"""Real `mpiexec` jobs: the topology workload, failure handling and start-up checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, clean_environ

pytestmark = pytest.mark.mpi

DECK = str(Path(__file__).resolve().parents[2] / "inputs" / "topology_tiny.toml")


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_topology_check_on_n_ranks(mpirun, tmp_path, n):
    args = [
        "run",
        DECK,
        "--set",
        f"run.output={tmp_path}",
        "--set",
        "topology.dp=0",
        "--set",
        "topology.pp=" + ("2" if n > 1 else "1"),
        "--set",
        "topology.ep=" + ("2" if n >= 4 else "1"),
    ]
    r = mpirun(n, args, timeout=120)
    assert r.returncode == 0, r.output
    assert f"topology OK: {n} ranks" in r.stdout
    for dim in ("pp", "dp", "ep", "node"):
        assert f"check {dim}" in r.stdout and "FAILED" not in r.stdout
    # rank 0 alone logs: each rank appears once in the table, no duplicate progress lines
    assert r.stdout.count("topology OK") == 1
    assert (tmp_path / "config.toml").exists()


def test_eight_ranks_layout_matches_rankmap(mpirun, tmp_path):
    r = mpirun(8, ["run", DECK, "--set", f"run.output={tmp_path}"], timeout=120)
    assert r.returncode == 0, r.output
    rows = [
        line.split() for line in r.stdout.splitlines() if line.strip() and line.split()[0].isdigit()
    ]
    from hpcpipe.topology import RankMap

    m = RankMap.build(8, 4, pp=2, dp=4, ep=2)
    assert len(rows) == 8
    for row in rows:
        rank, node, local, pp, dp, ep = (int(row[0]), *map(int, row[2:7]))
        assert (node, local) == (m.node_of(rank), m.local_rank(rank))
        assert m.coords(rank) == {"pp": pp, "dp": dp, "ep": ep}


def test_dry_run_prints_resolved_deck(mpirun):
    r = mpirun(
        2,
        ["run", DECK, "--dry-run", "--set", "topology.dp=1", "--set", "topology.ep=1"],
        timeout=60,
    )
    assert r.returncode == 0, r.output
    assert "[topology]\npp = 2\ndp = 1" in r.stdout
    assert "world 2 = pp 2 x dp 1" in r.stdout


@pytest.mark.parametrize("kind", ["raise", "exit", "kill"])
def test_one_failing_rank_ends_the_job(mpirun, tmp_path, kind):
    r = mpirun(
        8,
        ["run", DECK, "--set", f"run.output={tmp_path}"],
        timeout=60,
        env={"HPCPIPE_INJECT_FAULT": f"rank=5,at=topology,kind={kind}"},
    )
    assert r.returncode != 0
    assert r.seconds < 10, f"took {r.seconds:.1f}s to end the job"
    if kind == "raise":
        assert "[rank 5 on " in r.stderr
        assert "InjectedFault: injected fault at topology on rank 5" in r.stderr
        assert "aborting the whole job" in r.stderr


def test_wrong_world_size_is_bad_input(mpirun, tmp_path):
    r = mpirun(6, ["run", DECK, "--set", f"run.output={tmp_path}"], timeout=60)
    assert r.returncode == 2
    assert r.stderr.count("ERROR:") == 1, r.stderr
    assert "topology.dp = 4: pp * dp = 2 * 4 = 8 does not equal world size 6" in r.stderr
    assert "Traceback" not in r.output


def test_group_crossing_nodes_is_an_error_when_asked(mpirun, tmp_path):
    r = mpirun(
        4,
        [
            "run",
            DECK,
            "--set",
            f"run.output={tmp_path}",
            "--set",
            "topology.dp=2",
            "--set",
            "topology.ranks_per_node=1",
        ],
        timeout=60,
    )
    assert r.returncode == 2
    assert "topology.intra_node" in r.stderr and "ep groups (size 2) cross nodes" in r.stderr


def test_bad_deck_under_mpiexec_exits_2_once(mpirun, tmp_path):
    r = mpirun(4, ["run", DECK, "--set", "device.kind=tpu"], timeout=60)
    assert r.returncode == 2
    assert r.stderr.count("ERROR:") == 1
    assert "device.kind = 'tpu' is not one of 'cpu', 'cuda'" in r.stderr


def test_unwritable_output_is_bad_input_naming_the_key(mpirun, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = mpirun(
        2,
        [
            "run",
            DECK,
            "--set",
            f"run.output={blocker}/sub",
            "--set",
            "topology.dp=1",
            "--set",
            "topology.ep=1",
        ],
        timeout=60,
    )
    assert r.returncode == 2, r.output  # found before any work, the same on every rank
    assert "run.output" in r.stderr and "[ENOTDIR]" in r.stderr
    assert "Traceback" not in r.stderr


def test_launch_from_a_process_with_mpi_initialised():
    """The test process may have MPI initialised (a test imported mpi4py.MPI): launches made
    from it must still start their own job. Open MPI's singleton sets PMIX_* with setenv,
    where os.environ does not see it; a child given env=None inherits them and its mpiexec
    exits 1 without a word (what lane 2 once did to every test after the first import)."""
    code = (
        "import subprocess, sys\n"
        "from mpi4py import MPI\n"
        "assert MPI.Is_initialized()\n"
        "from conftest import clean_environ, mpiexec_command\n"
        "cmd = [*mpiexec_command(), '-n', '2', sys.executable, '-c',\n"
        "       'import os; from mpi4py import MPI; w = MPI.COMM_WORLD; '\n"
        "       'os.write(1, f\"rank {w.rank} size {w.size}\\\\n\".encode())']\n"
        "p = subprocess.run(cmd, env=clean_environ(), capture_output=True, text=True, timeout=90)\n"
        "print(p.returncode, p.stdout, p.stderr)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT / "tests",
        env=clean_environ(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # one os.write per rank: a single write of a short line is never split, where print's
    # text and newline can interleave with the other rank's ("sizesize 2\n 2")
    assert proc.stdout.startswith("0 "), proc.stdout
    assert "rank 0 size 2" in proc.stdout and "rank 1 size 2" in proc.stdout, proc.stdout
