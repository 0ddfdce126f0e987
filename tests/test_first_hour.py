"""A newcomer's first hour: planning every deck without MPI, plots with a clear message when
matplotlib is missing, one step numbering, --verbose on every rank, injection points that fire.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import INPUTS, ROOT, clean_environ, run_cli

SWEEP = str(INPUTS / "sweep_tiny.toml")
TRAIN = str(INPUTS / "train_tiny.toml")

NO_MATPLOTLIB = """
import sys
class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Hide())
import importlib.util
_find = importlib.util.find_spec
importlib.util.find_spec = lambda n, *a: None if n.split(".")[0] == "matplotlib" else _find(n, *a)
from hpcpipe.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _without_matplotlib(args: list[str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", NO_MATPLOTLIB, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_environ(),
    )


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (["plan", TRAIN, "--png", "t.png"], "--png"),
        (["plan", TRAIN, "--pareto-png", "f.png"], "--pareto-png"),
        (["plan", SWEEP, "--png", "s.png"], "--png"),
        (["run", SWEEP, "--dry-run", "--set", "sweep.plot=true"], "sweep.plot"),
    ],
    ids=["plan-png", "pareto-png", "sweep-plan-png", "sweep.plot"],
)
def test_every_plotting_path_says_matplotlib_is_missing_before_any_work(tmp_path, args, key):
    r = _without_matplotlib(args, tmp_path if args[0] == "plan" else ROOT)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert key in r.stderr and "needs matplotlib" in r.stderr, r.stderr
    assert "pip install" in r.stderr
    assert not list(tmp_path.glob("*.png"))


def test_plan_of_a_deck_that_leaves_the_world_open_says_what_it_assumed():
    r = run_cli(["plan", str(INPUTS / "gpt_pp4.toml")])
    assert r.returncode == 0, r.output
    assert r.stdout.startswith("note: topology.dp = 0"), r.stdout
    assert "planning for world 4, the smallest" in r.stdout
    assert "world 4 = pp 4 x dp 1" in r.stdout


def test_sweep_plan_shows_the_kba_plan_not_pipeline_tables(tmp_path):
    r = run_cli(
        ["plan", SWEEP, "--set", "sweep.px=4", "--set", "sweep.py=2", "--png", "k.png"],
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.output
    assert "KBA plan: 4 x 2 ranks" in r.stdout and "parallel efficiency" in r.stdout
    assert "wavefront of the first octant" in r.stdout and "stage chart" in r.stdout
    for pipeline_word in ("dim    size", "makespan", "1f1b", "dp "):
        assert pipeline_word not in r.stdout, pipeline_word
    assert max(len(line) for line in r.stdout.splitlines()) <= 120
    assert (tmp_path / "k.png").read_bytes()[:4] == b"\x89PNG"
    wrong = run_cli(["plan", SWEEP, "--world", "3"])
    assert wrong.returncode == 2 and "a sweep's world is px * py" in wrong.stderr


def test_sweep_decks_plan_without_world_and_big_ones_stay_narrow():
    r = run_cli(
        [
            "plan",
            SWEEP,
            "--set",
            "sweep.px=8",
            "--set",
            "sweep.py=8",
            "--set",
            "sweep.nx=64",
            "--set",
            "sweep.ny=64",
            "--set",
            "sweep.nz=64",
            "--set",
            "sweep.z_block=1",
        ]
    )
    assert r.returncode == 0, r.output
    assert max(len(line) for line in r.stdout.splitlines()) <= 120
    assert "one column = " in r.stdout and "more ranks" in r.stdout


def test_dry_run_without_a_launcher_starts_no_mpi():
    code = (
        "import sys; from hpcpipe.cli import main; "
        f"rc = main(['run', {TRAIN!r}, '--dry-run', '--world', '4']); "
        "assert 'mpi4py' not in sys.modules, 'dry run imported mpi4py'; sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=clean_environ(),
    )
    assert proc.returncode == 0, proc.stderr
    assert "[topology]" in proc.stdout and "world 4 = pp 2 x dp 2" in proc.stdout
    bad = run_cli(["run", TRAIN, "--world", "4"])
    assert bad.returncode == 2 and "--world is for --dry-run" in bad.stderr


@pytest.mark.mpi
def test_verbose_prefixes_every_rank_and_steps_count_from_one(mpirun, tmp_path):
    import h5py

    r = mpirun(
        2,
        [
            "run",
            TRAIN,
            "--verbose",
            "--set",
            f"run.output='{tmp_path}'",
            "--set",
            "topology.pp=2",
            "--set",
            "trace.enabled=true",
            "--set",
            "run.steps=2",
        ],
        timeout=120,
    )
    assert r.returncode == 0, r.output
    steps = [ln for ln in r.stdout.splitlines() if " step " in ln and "loss=" in ln]
    assert steps and all(ln.startswith(("[rank 0] ", "[rank 1] ")) for ln in steps), r.stdout
    assert any(ln.startswith("[rank 0] step 1/2") for ln in steps), r.stdout
    from hpcpipe.io.trace import read_trace

    trace = read_trace(tmp_path / "trace.h5")
    assert trace.steps == (1, 2)  # as the log numbers them
    with h5py.File(tmp_path / "metrics.h5") as f:
        assert f["step"][()].tolist() == [1, 2]


@pytest.mark.mpi
def test_backward_injection_point_fires(mpirun, tmp_path):
    r = mpirun(
        2,
        ["run", TRAIN, "--set", f"run.output='{tmp_path}'", "--set", "run.steps=3"],
        env={"HPCPIPE_INJECT_FAULT": "rank=1,at=backward:2,kind=raise"},
        timeout=120,
    )
    assert r.returncode != 0, r.output
    assert "injected fault at backward:2 on rank 1" in r.stderr, r.stderr
    assert "step 2/3" not in r.stdout  # step 2 never completed
