"""Every `hpcpipe bench` subcommand on a tiny size under real mpiexec: it runs, rank 0 prints
the table once, and --json holds well-formed rows with the expected columns. Correctness only:
nothing here asserts a timing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import INPUTS

pytestmark = pytest.mark.mpi

TINY = str(INPUTS / "train_tiny.toml")


def _bench(mpirun, tmp_path: Path, n: int, args: list[str], timeout: float = 180) -> dict:
    out = tmp_path / "result.json"
    r = mpirun(n, ["bench", *args, "--json", str(out)], timeout=timeout)
    assert r.returncode == 0, r.output
    data = json.loads(out.read_text())
    assert data["format"] == "hpcpipe-bench" and data["version"] == 1
    assert data["machine"]["ranks"] == n and data["command"].startswith(f"mpiexec -n {n} ")
    heads = [c["head"] for c in data["columns"]]
    header = " ".join(heads)
    assert r.stdout.count(heads[0]) >= 1
    assert sum(" ".join(line.split()) == header for line in r.stdout.splitlines()) == 1, (
        "rank 0 alone prints the header, once"
    )
    keys = {c["key"] for c in data["columns"]}
    for row in data["rows"]:
        if "skipped" not in row:
            assert keys <= set(row), f"row lacks {keys - set(row)}"
    return data


def _positive(rows: list[dict], *keys: str) -> None:
    for row in rows:
        for key in keys:
            assert isinstance(row[key], float | int) and math.isfinite(row[key]), (key, row)
            assert row[key] > 0, (key, row)


def test_p2p(mpirun, tmp_path):
    data = _bench(
        mpirun,
        tmp_path,
        2,
        ["p2p", "--max-bytes", "4Ki", "--factor", "16", "--repeats", "2", "--budget-mib", "1"],
    )
    assert [r["bytes"] for r in data["rows"]] == [1, 16, 256, 4096]
    _positive(data["rows"], "raw_us", "mailbox_us", "ratio", "raw_mbps", "mailbox_mbps")
    assert all(len(r["raw_us_all"]) == 2 for r in data["rows"])
    assert "max_extra_us_lt_64KiB" in data["summary"]


def test_p2p_needs_two_ranks(mpirun):
    r = mpirun(3, ["bench", "p2p", "--max-bytes", "1"], timeout=120)
    assert r.returncode == 2 and "runs on exactly 2 ranks" in r.stderr, r.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["pipeline", "no/such/deck.toml"], "no such input deck"),
        (["pipeline", TINY, "--schedules", "1f1b,zb-w"], "unknown 'zb-w'"),
        (["memory", TINY, "--set", "model.layers=-1"], "model.layers"),
    ],
)
def test_bad_input_exits_2(mpirun, args, message):
    r = mpirun(2, ["bench", *args], timeout=120)
    assert r.returncode == 2 and message in r.stderr, r.output


def test_allreduce(mpirun, tmp_path):
    args = ["allreduce", "--max-bytes", "64Ki", "--factor", "8", "--repeats", "2"]
    data = _bench(mpirun, tmp_path, 2, [*args, "--bucket-mb", "0.01"])
    assert [r["bytes"] for r in data["rows"]] == [1024, 8192, 65536]
    assert [r["buckets"] for r in data["rows"]] == [1, 1, 7]
    _positive(data["rows"], "raw_us", "bucketed_us", "ratio", "raw_gbps", "bucketed_gbps")


def test_alltoall(mpirun, tmp_path):
    data = _bench(mpirun, tmp_path, 2, ["alltoall", "--max-bytes", "8Ki", "--repeats", "2"])
    assert [r["bytes"] for r in data["rows"]] == [1024, 2048, 4096, 8192]
    _positive(data["rows"], "raw_us", "flat_us", "dispatch_us", "two_phase_us", "flat_ratio")


def test_pipeline_measured(mpirun, tmp_path):
    args = ["pipeline", TINY, "--schedules", "1f1b,zb-v,dualpipe-v", "--repeats", "2"]
    args += ["--set", "pipeline.microbatches=2"]
    data = _bench(mpirun, tmp_path, 2, [*args, "--repeats", "1"])
    rows = {r["schedule"]: r for r in data["rows"]}
    assert list(rows) == ["1f1b", "zb-v", "dualpipe-v"]
    assert "m >= 2p" in rows["dualpipe-v"]["skipped"]  # cannot run with this deck: a row says so
    ran = [rows["1f1b"], rows["zb-v"]]
    _positive(ran, "measured_ms", "replay_ms", "ratio", "step_ms")
    for row in ran:
        assert row["steps"] == 2 and len(row["per_step"]) == 2
        assert 0 <= row["bubble_pct"] < 100 and 0 <= row["bubble_replay_pct"] < 100


def test_pipeline_synthetic_oversubscribed(mpirun, tmp_path):
    args = ["pipeline", TINY, "--synthetic", "--unit-ms", "0.5", "--repeats", "2"]
    args += ["--schedules", "1f1b,interleaved-1f1b,dualpipe-v"]
    data = _bench(mpirun, tmp_path, 4, args)
    rows = {r["schedule"]: r for r in data["rows"]}
    assert "skipped" in rows["dualpipe-v"]  # needs m >= 2p
    assert data["params"]["wait"] in ("poll", "mpi")
    for row in (rows["1f1b"], rows["interleaved-1f1b"]):
        _positive([row], "plan_ms", "plan_in_order_ms", "measured_ms", "replay_ms", "ratio")
    # the plan is the simulator's: 1F1B, p=4, m=4, F=B=W=1 unit -> (m + p - 1) * 3 units
    assert rows["1f1b"]["plan_ms"] == pytest.approx(7 * 3 * 0.5)
    for row in (rows["1f1b"], rows["interleaved-1f1b"]):  # the runtime's order is the plan
        assert row["plan_in_order_ms"] == pytest.approx(row["plan_ms"])


def test_pipeline_synthetic_overlapped_pairs(mpirun, tmp_path):
    args = ["pipeline", TINY, "--synthetic", "--unit-ms", "1", "--repeats", "2"]
    args += ["--schedules", "dualpipe-v", "--overlap-pairs", "--set", "pipeline.t_alltoall=0.5"]
    data = _bench(mpirun, tmp_path, 2, args)
    rows = {r["schedule"]: r for r in data["rows"]}
    assert list(rows) == ["dualpipe-v", "dualpipe-v F&B"]
    single, paired = rows["dualpipe-v"], rows["dualpipe-v F&B"]
    _positive([single, paired], "plan_ms", "measured_ms")
    # the plan: pairs hide part of the all-to-all time inside them
    assert paired["plan_ms"] < single["plan_ms"]
    summary = data["summary"]
    assert summary["pairs_planned_saving_ms"] == pytest.approx(
        single["plan_ms"] - paired["plan_ms"]
    )
    assert 0 < summary["pairs_planned_saving_ms"] <= summary["pairs_comm_ms"]
    assert any("F&B pairs save" in t["what"] for t in data["targets"])


def test_stream_against_flushed_schedules(mpirun, tmp_path):
    """`bench stream` on 4 sleeping ranks: the flushed rows and the stream's, the plan figures
    the simulator's (1F1B flushed at p = 4, m = 8: m / (m + p - 1) of the bound; the stream's
    steady state: the bound itself), the targets reported whatever they measure."""
    args = ["stream", TINY, "--unit-ms", "1", "--repeats", "1", "--updates", "4"]
    args += ["--schedules", "1f1b,zb-h2"]
    data = _bench(mpirun, tmp_path, 4, args)
    rows = {r["schedule"]: r for r in data["rows"]}
    assert list(rows) == ["1f1b (flushed)", "zb-h2 (flushed)", "1f1b 2bw stream"]
    flushed, stream = rows["1f1b (flushed)"], rows["1f1b 2bw stream"]
    assert data["params"]["microbatches"] == 8
    assert flushed["plan"] == pytest.approx(8 / 11)
    assert stream["plan"] == pytest.approx(1.0)
    assert stream["versions"] == 2 and stream["peak_mb"] == flushed["peak_mb"] == 4
    assert rows["zb-h2 (flushed)"]["peak_mb"] > stream["peak_mb"]  # not at the same memory
    _positive(list(rows.values()), "measured", "ratio", "measured_ms")
    assert 0 < stream["whole"] <= stream["whole_plan"] * 1.05
    assert data["summary"]["best_flushed_same_memory_schedule"] == "1f1b (flushed)"
    assert {t["what"] for t in data["targets"]} == {
        "stream steady state / no-bubble bound",
        "stream vs best flushed at no more activations",
    }


FAKE_KRIPKE = """#!/bin/sh
# stands in for Kripke v1.2.x: checks the side-by-side flags, prints its timers
case "$*" in
  *"--zones 4,4,4 --groups 8 --quad 80 --legendre 0 --niter 2 --layout "*) ;;
  *) echo "unexpected flags: $*" >&2; exit 3 ;;
esac
[ "${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-0}}" = 0 ] || exit 0  # rank 0 reports, as Kripke does
printf 'TIMER_NAMES:Generate,LPlusTimes,LTimes,Population,Scattering,'
echo "Solve,Source,SweepSolver,SweepSubdomain"
echo "TIMER_DATA:0.001,0.002,0.002,0.001,0.001,0.0400,0.0001,0.0300,0.0250"
"""


def test_sweep(mpirun, tmp_path):
    kripke = tmp_path / "kripke.exe"
    kripke.write_text(FAKE_KRIPKE)
    kripke.chmod(0o755)
    args = ["sweep", "--n", "4", "--iterations", "2", "--repeats", "1"]
    args += ["--blockings", "auto,2x5", "--kripke", str(kripke), "--kripke-layouts", "ZGD,DZG"]
    data = _bench(mpirun, tmp_path, 2, args)
    cases = [(r["case"], r["ranks"]) for r in data["rows"]]
    assert cases == [
        ("1 rank, no fixup", 1),
        ("1 rank", 1),
        ("1 rank, 2x10", 1),
        ("2 x 1 rank", 1),
        ("auto", 2),
        ("2x5", 2),
        ("Kripke ZGD", 1),  # in the order asked for, 1 rank first
        ("Kripke DZG", 1),
        ("Kripke ZGD", 2),
        ("Kripke DZG", 2),
    ]
    _positive(data["rows"], "kernel_ns", "sweep_ns", "iter_ns", "core_ns")
    _positive(data["rows"][4:6], "eff", "model", "ratio")
    auto = data["rows"][4]
    assert (auto["z_block"], auto["angle_block"]) != (0, 0)  # the plan's choice, not 0
    # Kripke's timers, read back: Solve 0.04 s over 2 iterations of 4^3 x 80 x 8 unknowns
    unknowns = 4**3 * 80 * 8
    assert data["rows"][6]["iter_ns"] == pytest.approx(0.04 / 2 / unknowns * 1e9)
    assert data["rows"][8]["eff"] == pytest.approx(0.5)  # the same Solve time on 2 ranks
    wanted = {t["what"] for t in data["targets"]}
    assert "kernel / Kripke's best layout, 1 rank" in wanted
    assert "2-rank efficiency, default blocking" in wanted


def test_sweep_kripke_errors_name_the_option(mpirun, tmp_path):
    r = mpirun(2, ["bench", "sweep", "--n", "4", "--kripke", str(tmp_path / "nope")], timeout=120)
    assert r.returncode == 2 and "--kripke" in r.output and "not a file" in r.output
    r = mpirun(2, ["bench", "sweep", "--n", "4", "--kripke-layouts", "XYZ"], timeout=120)
    assert r.returncode == 2 and "Kripke's layouts are DGZ" in r.output


def test_ckpt(mpirun, tmp_path):
    args = ["ckpt", "--size-mib", "2", "--tensors", "2", "--repeats", "1", "--dir", str(tmp_path)]
    data = _bench(mpirun, tmp_path, 2, args)
    assert len(data["rows"]) == 4
    _positive(data["rows"][:3], "write_gbps", "read_gbps")
    assert data["rows"][3]["read_gbps"] > 0
    assert not list(tmp_path.glob("hpcpipe_bench_ckpt_*")), "scratch files left behind"


def test_overlap_pp2_dp2(mpirun, tmp_path):
    args = ["overlap", TINY, "--schedules", "1f1b,zb-v,dualpipe-v", "--repeats", "2"]
    data = _bench(mpirun, tmp_path, 4, args)
    rows = {r["schedule"]: r for r in data["rows"]}
    assert list(rows) == ["1f1b", "zb-v", "dualpipe-v"]
    assert (data["params"]["pp"], data["params"]["dp"]) == (2, 2)
    for row in rows.values():
        _positive([row], "reduce_ms", "step_ms")
        assert 0 <= row["hidden_pct"] <= 100 and 0 <= row["behind_compute_pct"] <= 100
        assert 0 <= row["exposed_ms"] <= row["reduce_ms"]
    assert 0 <= data["summary"]["min_hidden"] <= data["summary"]["median_hidden"] <= 1


def test_overlap_needs_replicas(mpirun):
    r = mpirun(2, ["bench", "overlap", TINY, "--pp", "2"], timeout=120)
    assert r.returncode == 2 and "at least 2 replicas" in r.stderr, r.output


def test_memory_matches_the_activation_model(mpirun, tmp_path):
    args = ["memory", TINY, "--schedules", "1f1b,zb-v", "--steps", "2"]
    data = _bench(mpirun, tmp_path, 2, args)
    assert [(r["schedule"], r["rank"]) for r in data["rows"]] == [
        ("1f1b", 0),
        ("1f1b", 1),
        ("zb-v", 0),
        ("zb-v", 1),
    ]
    _positive(data["rows"], "peak_rss_mib", "model_mib", "act_mib", "act_mb")
    for row in data["rows"]:
        # bytes held between actions, measured on the arrays, against the model in bytes: the
        # outputs waiting for their send (one activation at a time) are all the model leaves out
        assert row["act_model_mib"] <= row["act_mib"] * (1 + 1e-9), row
        assert row["act_ratio"] == pytest.approx(1.0, abs=0.10), row
        assert row["act_mb"] == row["act_model_mb"]  # the runtime ran the plan's order
    assert data["targets"][0]["met"] is True


def test_layout_ranking_on_emulated_nodes(mpirun, tmp_path):
    """Every layout of 8 ranks that fits runs once on 2 virtual nodes (10 ms steps)."""
    from hpcpipe.config import load_config
    from hpcpipe.layout.report import run_search

    deck = str(INPUTS / "layout_tiny.toml")
    args = ["layout", deck, "--repeats", "1", "--target-ms", "10"]
    data = _bench(mpirun, tmp_path, 8, args, timeout=300)
    expect = run_search(load_config(deck), 8, ranks_per_node=4, top=1 << 30).ranked
    rows = data["rows"]
    assert [r["layout"] for r in rows] == [c.layout.label for _, c in expect]
    assert rows[0]["predicted_ms"] == pytest.approx(10.0)
    _positive(rows, "predicted_ms", "measured_ms", "ratio")
    n = len(rows)
    assert sorted(r["pred_rank"] for r in rows) == list(range(1, n + 1))
    assert sorted(r["meas_rank"] for r in rows) == list(range(1, n + 1))
    assert -1.0 <= data["summary"]["spearman"] <= 1.0
    assert all(r["measured_ms"] > 0.5 * r["predicted_ms"] for r in rows)  # sleeps really ran


def test_polling_mailbox_sleeps_while_it_waits():
    """The synthetic benchmarks' ranks wait by Test + sleep on an oversubscribed node: a rank
    that spends most of a step waiting uses a small share of a core (spinning in Wait would
    use all of it: the MPI wait is the control, shown for comparison, not asserted)."""
    import subprocess
    import sys

    from conftest import clean_environ, mpiexec_command

    driver = Path(__file__).with_name("poll_driver.py")
    r = subprocess.run(
        [*mpiexec_command(), "-n", "2", sys.executable, str(driver), "poll"],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_environ(),
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["mailbox"] == "PollingMailbox"
    assert got["wall"] > 0.15  # four 50 ms forwards on rank 0 come first
    assert got["cpu"] < 0.5 * got["wall"], got
