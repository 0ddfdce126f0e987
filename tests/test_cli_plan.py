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


def test_plan_exports_the_resolved_schedule_and_reads_it_back(cli, tmp_path):
    """`plan --csv` writes what the deck resolves to (the search's pick for 'auto'); the file
    runs as schedule = 'csv' and plans to the same timeline and figures."""
    from conftest import INPUTS

    from hpcpipe.schedules import read_csv

    text = (INPUTS / "train_auto.toml").read_text()
    assert "memory_budget" in text
    out = tmp_path / "auto.csv"
    first = cli(["plan", str(INPUTS / "train_auto.toml"), "--csv", str(out)])
    assert first.returncode == 0, first.output
    assert f"schedule written to {out}" in first.stdout
    assert "without pipeline.memory_budget" in first.stdout
    sched = read_csv(out)
    assert sched.name == "auto" and sched.num_microbatches == 8
    # the same deck without the search's budget, running the exported file
    deck = tmp_path / "from_csv.toml"
    deck.write_text("\n".join(ln for ln in text.splitlines() if "memory_budget" not in ln))
    sets = ["--set", "pipeline.schedule=csv", "--set", f"pipeline.schedule_csv={out}"]
    again = cli(["plan", str(deck), *sets])
    assert again.returncode == 0, again.output

    def timeline(stdout: str) -> list[str]:
        """The grid rows and the predicted figures."""
        return [
            ln
            for ln in stdout.splitlines()
            if ("|" in ln and ln.startswith("    ")) or ln.startswith("predicted makespan")
        ]

    assert timeline(first.stdout) and timeline(again.stdout) == timeline(first.stdout)
    bad = cli(["plan", str(deck), "--csv", str(tmp_path / "no" / "such" / "x.csv")])
    assert bad.returncode == 2 and "--csv" in bad.stderr and "cannot write" in bad.stderr
    assert not list(tmp_path.rglob(".*.tmp"))
    sweep = cli(["plan", str(INPUTS / "sweep_tiny.toml"), "--csv", str(tmp_path / "s.csv")])
    assert sweep.returncode == 2 and "a sweep deck has none" in sweep.stderr


def test_overlap_pairs_on_a_schedule_without_pairs_is_bad_input(cli):
    from conftest import INPUTS

    r = cli(["plan", str(INPUTS / "train_tiny.toml"), "--set", "pipeline.overlap_pairs=true"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "pipeline.overlap_pairs" in r.stderr and "only dualpipe-v defines" in r.stderr
    sets = ["pipeline.schedule=dualpipe-v", "pipeline.overlap_pairs=true"]
    sets.append("pipeline.microbatches=4")
    ok = cli(["plan", str(INPUTS / "train_tiny.toml"), *(x for s in sets for x in ("--set", s))])
    assert ok.returncode == 0, ok.output
    assert "&: the backward half of an overlapped F&B pair" in ok.stdout
