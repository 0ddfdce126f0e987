"""`hpcpipe plan` runs without MPI and lays out thousands of ranks."""

from __future__ import annotations

import sys

from conftest import clean_environ


def test_plan_4096_ranks_without_mpi(cli):
    r = cli(["plan", "--world", "4096", "--ranks-per-node", "8", "--set", "topology.ep=4"])
    assert r.returncode == 0, r.output
    assert "world 4096 = pp 2 x dp 2048 (ep 4 inside dp); 512 node(s) of 8 rank(s)" in r.stdout
    assert "ep        4    1024       1            1  no" in r.stdout


def test_plan_does_not_import_mpi4py():
    import subprocess

    code = (
        "import sys; from hpcpipe.cli import main; main(['plan', '--world', '64']); "
        "assert 'mpi4py' not in sys.modules, 'plan imported mpi4py'"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_environ(),
    )
    assert proc.returncode == 0, proc.stderr


def test_help_lists_commands(cli):
    r = cli(["--help"])
    assert r.returncode == 0
    assert "run" in r.stdout and "plan" in r.stdout
