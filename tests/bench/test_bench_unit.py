"""`hpcpipe bench` without mpiexec: registry and CLI, result tables, the plan-side figures."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, clean_environ

from hpcpipe.bench import BENCHMARKS, Column, Report, benchmark
from hpcpipe.bench.model import step_figures
from hpcpipe.bench.sizes import met_from, parse_bytes, size_range
from hpcpipe.bench.table import read_report
from hpcpipe.config import ConfigError
from hpcpipe.schedules import SCHEDULE_NAMES, CostModel, Kind, build_schedule, simulate, validate
from hpcpipe.schedules.ir import from_csv
from hpcpipe.schedules.replay import action_counts, measured_costs, replay_in_order

NAMES = (
    "p2p",
    "allreduce",
    "alltoall",
    "pipeline",
    "stream",
    "layout",
    "sweep",
    "ckpt",
    "overlap",
    "memory",
)


def test_help_lists_every_benchmark(cli):
    r = cli(["bench", "--help"])
    assert r.returncode == 0, r.output
    for name in NAMES:
        assert f"    {name}" in r.stdout
    assert set(BENCHMARKS) == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_each_benchmark_has_json_and_repeats(cli, name):
    r = cli(["bench", name, "--help"])
    assert r.returncode == 0, r.output
    assert "--json PATH" in r.stdout and "--repeats" in r.stdout


def test_cli_parser_never_imports_mpi4py():
    code = (
        "import sys; from hpcpipe.cli import build_parser; "
        "build_parser().parse_args(['bench', 'pipeline', '--synthetic']); "
        "assert 'mpi4py' not in sys.modules, sorted(m for m in sys.modules if 'mpi' in m)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=clean_environ()
    )
    assert r.returncode == 0, r.stderr


def test_runner_targets_resolve():
    code = (
        "from hpcpipe.bench.cli import BENCHMARKS; "
        "print(sorted(b.name for b in BENCHMARKS.values() if callable(b.runner())))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=clean_environ()
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(sorted(NAMES))


def test_registry_refuses_duplicates_and_bad_targets():
    with pytest.raises(ValueError, match="registered twice"):
        benchmark("p2p", "again", "hpcpipe.bench.p2p:run")(lambda p: None)
    with pytest.raises(ValueError, match="module:function"):
        benchmark("not-a-benchmark", "x", "hpcpipe.bench.p2p")(lambda p: None)
    assert "not-a-benchmark" not in BENCHMARKS


def test_bad_sizes_are_usage_errors(cli):
    r = cli(["bench", "p2p", "--max-bytes", "12 parsecs"])
    assert r.returncode == 2 and "is not a size" in r.stderr


def test_parse_bytes_and_ranges():
    assert parse_bytes("1") == 1
    assert parse_bytes("64Ki") == parse_bytes("64K") == parse_bytes("64KiB") == 65536
    assert parse_bytes("64MiB") == 64 << 20
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("0")
    assert size_range(1, 64 << 20, 2)[-1] == 64 << 20 and len(size_range(1, 64 << 20, 2)) == 27
    assert size_range(1024, 5000, 4) == [1024, 4096, 5000]
    with pytest.raises(ConfigError):
        size_range(10, 1, 2)
    with pytest.raises(ConfigError):
        size_range(1, 10, 1)
    rows = [{"bytes": b, "r": r} for b, r in ((1, 1.5), (2, 1.01), (4, 1.2), (8, 1.0), (16, 1.04))]
    assert met_from(rows, "r", 1.05) == 8
    assert met_from(rows, "r", 1.0) is None


def test_report_round_trips_through_json(tmp_path):
    report = Report(
        "demo",
        ["a title"],
        [Column("name", "name", "", 6, "<"), Column("x", "x us", ".2f", 8), Column("ok", "ok")],
        params={"n": np.int64(3)},
    )
    report.add({"name": "a", "x": 1.234567, "ok": True, "extra": np.arange(2)})
    report.add({"name": "b", "x": float("nan"), "ok": False})
    report.note("done")
    text = report.render()
    lines = text.splitlines()
    assert lines[0] == "# a title" and lines[-1] == "# done"
    assert lines[2].split() == ["a", "1.23", "yes"]
    assert lines[3].split() == ["b", "-", "NO"]
    path = report.write(tmp_path / "r.json", machine={"cores": 2})
    data = json.loads(path.read_text())  # strict JSON: NaN became null
    assert data["rows"][1]["x"] is None and data["rows"][0]["extra"] == [0, 1]
    again, raw = read_report(path)
    assert again.render() == text and raw["machine"] == {"cores": 2}
    path.write_text(json.dumps({**data, "version": 99}))
    with pytest.raises(ValueError, match="rerun the benchmark"):
        read_report(path)


def _synthetic_step(schedule, costs: CostModel, stretch: float = 1.0):
    """What a perfect runtime would measure: every rank busy exactly as simulated."""
    sim = simulate(schedule, costs)
    arrays = costs.stage_arrays(schedule.num_stages)
    key = {0: ("F", "t_f"), 1: ("B", "t_b"), 2: ("W", "t_w"), 3: ("BW", "t_bw")}
    times = []
    for r in range(schedule.num_ranks):
        lo, hi = sim.offsets[r], sim.offsets[r + 1]
        mine: dict[tuple[str, int], float] = {}
        for k, s in zip(sim.kind[lo:hi], sim.stage[lo:hi], strict=True):
            name, field = key[int(k)]
            mine[(name, int(s))] = mine.get((name, int(s)), 0.0) + float(arrays[field][s])
        times.append(mine)
    spans = [(10.0, 10.0 + sim.makespan * stretch)] * schedule.num_ranks
    return sim, spans, times


@pytest.mark.parametrize("name", ["1f1b", "zb-v", "interleaved-1f1b", "gpipe"])
def test_step_figures_of_a_perfect_step(name):
    schedule = validate(build_schedule(name, 4, 8))
    costs = CostModel(t_f=1.0, t_b=1.5, t_w=0.5)
    sim, spans, times = _synthetic_step(schedule, costs)
    fig = step_figures(schedule, spans, times, plan=costs)
    assert fig["ratio"] == pytest.approx(1.0) and fig["plan_ratio"] == pytest.approx(1.0)
    assert fig["bubble"] == pytest.approx(sim.bubble_fraction)
    assert fig["bubble_replay"] == pytest.approx(sim.bubble_fraction)
    slow = step_figures(schedule, *_synthetic_step(schedule, costs, stretch=1.25)[1:])
    assert slow["ratio"] == pytest.approx(1.25)
    assert slow["bubble"] > sim.bubble_fraction


def test_measured_costs_per_stage_and_fused_backward():
    schedule = build_schedule("1f1b", 2, 4)
    times = {("F", 0): 4.0, ("F", 1): 8.0, ("BW", 0): 6.0, ("BW", 1): 10.0}
    c = measured_costs(schedule, times)
    assert np.allclose(c.t_f, [1.0, 2.0]) and np.allclose(c.t_bw, [1.5, 2.5])
    assert np.allclose(np.asarray(c.t_b) + np.asarray(c.t_w), [1.5, 2.5])


def test_measured_costs_average_over_the_actions_a_schedule_runs():
    # DualPipe-V fuses B and W for most microbatches of a stage and splits a few
    schedule = build_schedule("dualpipe-v", 2, 8)
    counts = action_counts(schedule)
    assert counts[("F", 0)] == 8 and counts[("BW", 0)] + counts[("B", 0)] == 8
    assert counts[("B", 0)] == counts[("W", 0)] > 0
    costs = CostModel(t_f=1.0, t_b=2.0, t_w=0.5, t_bw=2.5)
    arrays = costs.stage_arrays(schedule.num_stages)
    field = {"F": "t_f", "B": "t_b", "W": "t_w", "BW": "t_bw"}
    totals = {key: n * float(arrays[field[key[0]]][key[1]]) for key, n in counts.items()}
    got = measured_costs(schedule, totals)
    for name in ("t_f", "t_b", "t_w", "t_bw"):
        assert np.allclose(getattr(got, name), arrays[name]), name


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_the_lowered_order_runs_in_the_simulators_time(name):
    # every receive sits just before its consumer, so keeping the lowered order costs nothing
    schedule = build_schedule(name, 4, 8)
    lowered = validate(schedule)
    for costs in (CostModel(t_f=1.0, t_b=1.3, t_w=0.7), CostModel()):
        assert replay_in_order(lowered, costs) == pytest.approx(simulate(schedule, costs).makespan)
    for r in range(lowered.num_ranks):
        actions = lowered.rank_actions(r)
        for i, a in enumerate(actions):
            if a.kind in (Kind.RECV_F, Kind.RECV_B):
                use = actions[i + 1]
                assert (use.stage, use.microbatch) == (a.stage, a.microbatch)


def test_a_hand_written_order_can_cost_time():
    # rank 1 receives microbatch 2's activation before running BW0: valid, but it then
    # waits for F2 where it could already run BW0
    order = from_csv(
        "0F0,0SEND_F0,0F1,0SEND_F1,0F2,0SEND_F2,0RECV_B0,0BW0,0RECV_B1,0BW1,0RECV_B2,0BW2\n"
        "1RECV_F0,1F0,1RECV_F1,1RECV_F2,1BW0,1SEND_B0,1F1,1BW1,1SEND_B1,1F2,1BW2,1SEND_B2\n"
    )
    lowered = validate(order)
    costs = CostModel(t_f=1.0, t_b=1.0, t_w=1.0)
    assert replay_in_order(lowered, costs) > simulate(order, costs).makespan


def test_targets_are_a_column_and_results_carry_their_commit(tmp_path):
    """A missed target is shown as `wanted` beside `got`, never as an alarming verdict line,
    and every result file records the commit, date and source files it was measured on."""
    import json

    from hpcpipe.bench.table import Column, Report, read_report

    report = Report("demo", ["a demo"], [Column("x", "x", "d")])
    report.add({"x": 1})
    report.target("mailbox / raw (worst size)", "<= 1.05", "1.204", False, "median 1.05")
    text = report.render()
    assert "MISSED" not in text and "FAIL" not in text
    assert text.splitlines()[-2].split() == ["#", "target", "wanted", "got"]
    last = text.splitlines()[-1]
    assert last.startswith("# mailbox / raw (worst size)") and last.split()[-5:] == [
        "<=",
        "1.05",
        "1.204",
        "median",
        "1.05",
    ]
    path = report.write(tmp_path / "r.json")
    data = json.loads(path.read_text())
    measured = data["measured"]
    assert set(measured) == {"commit", "dirty", "date", "sources"} and measured["date"]
    # the code that wrote it is among the sources it records (report.py's staleness reads them)
    assert {"hpcpipe/bench/table.py", "hpcpipe/_sources.py"} <= set(measured["sources"])
    back, _ = read_report(path)
    assert back.render() == text and back.targets[0].met is False


def test_a_result_measured_with_changed_sources_is_stamped_dirty(tmp_path):
    """The stamp's `dirty` looks at the sources the run loaded, from the top of the work tree
    whatever folder git runs in (it once asked about `hpcpipe/` under hpcpipe/bench/ and so
    never fired), and a change elsewhere does not count."""
    from hpcpipe.bench.table import provenance

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    source = tmp_path / "hpcpipe" / "bench" / "table.py"  # a source every report loads
    source.parent.mkdir(parents=True)
    source.write_text("x = 1\n")
    (tmp_path / "notes.txt").write_text("a\n")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    below = tmp_path / "hpcpipe" / "bench"
    assert provenance(below)["dirty"] is False
    (tmp_path / "notes.txt").write_text("b\n")
    assert provenance(below)["dirty"] is False
    source.write_text("x = 2\n")
    assert provenance(below)["dirty"] is True
