"""The [pipeline] deck section and the text `hpcpipe plan` prints from it."""

from __future__ import annotations

import numpy as np
import pytest

from hpcpipe.config import ConfigError, parse_section
from hpcpipe.schedules import build_schedule, lower, to_csv
from hpcpipe.schedules.config import PipelineConfig, cost_model, stage_shares
from hpcpipe.schedules.report import load_schedule, plan_report


def parse(table):
    return parse_section(PipelineConfig, table, "deck.toml", "pipeline")


def test_defaults_and_a_full_section():
    assert parse({}) == PipelineConfig()
    cfg = parse(
        {
            "schedule": "interleaved-1f1b",
            "microbatches": 16,
            "virtual_stages": 3,
            "t_f": [1, 2],
            "t_b": [2.0],
            "t_w": [1.5],
            "comm_latency": 0.01,
            "comm_bandwidth": 1e9,
            "message_bytes": 4e6,
            "activation_memory": [2.0],
            "activation_freed_by_b": 0.25,
        }
    )
    assert cfg.t_f == (1.0, 2.0) and cfg.virtual_stages == 3


@pytest.mark.parametrize(
    "table, match",
    [
        ({"schedule": "csv"}, "pipeline.schedule_csv must name a CSV file"),
        ({"schedule_csv": "x.csv"}, "pipeline.schedule_csv is only read when schedule = 'csv'"),
        ({"schedule": "zb-v", "virtual_stages": 2}, "pipeline.virtual_stages only interleaved"),
        ({"schedule": "pipedream"}, "pipeline.schedule = 'pipedream' is not one of"),
        ({"t_f": [-1.0]}, r"pipeline.t_f = -1.0 must be >= 0"),
        ({"t_b": []}, "pipeline.t_b needs at least one value"),
        ({"comm_bandwidth": 0.0}, "pipeline.comm_bandwidth = 0.0 must be > 0"),
        ({"microbatches": 0}, "pipeline.microbatches = 0 must be >= 1"),
        ({"activation_freed_by_b": 1.5}, "must be <= 1.0"),
        ({"stages": 4}, "pipeline.stages is not a known key"),
    ],
)
def test_bad_sections_name_the_key(table, match):
    with pytest.raises(ConfigError, match=match):
        parse(table)


def test_stage_shares_split_the_model():
    assert stage_shares([2.0], 4, 4).tolist() == [2.0] * 4
    assert stage_shares([2.0], 4, 8).tolist() == [1.0] * 8  # V chunks are half a stage
    assert stage_shares([1.0, 3.0], 2, 4).tolist() == [0.5, 0.5, 1.5, 1.5]
    assert stage_shares([1.0, 1.0, 2.0, 2.0], 2, 2).tolist() == [2.0, 4.0]
    assert np.allclose(stage_shares([1.0, 2.0, 3.0], 3, 2), [2.0, 4.0])


def test_cost_model_from_the_deck():
    cfg = PipelineConfig(t_f=(2.0,), comm_latency=0.5, message_bytes=10.0, comm_bandwidth=5.0)
    costs = cost_model(cfg, 4, 8)
    assert np.allclose(costs.t_f, 1.0) and costs.comm_time == pytest.approx(2.5)


def test_plan_report_draws_and_compares():
    text = plan_report(PipelineConfig(schedule="zb-v", microbatches=8), 4, compare=True)
    assert "pipeline schedule zb-v: p=4 ranks, 8 stages" in text
    assert "    0 |F0 F1 F2 F3 F4 F5 F6 f0 b0 w0" in text
    assert "predicted makespan 25.5;" in text and "stage bubble 0.0%" in text
    assert "*zb-v" in text
    for name in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "v-half", "v-min"):
        assert f"\n {name} " in text
    assert (
        " 1f1b              1         33   27.3%     27.3%         4       27  22.2%  (p-1)(F+B+W)"
        in text
    )


def test_compare_gives_no_bound_for_overlapped_pairs():
    # a pair's halves hide communication the bound charges in full: no bound, no gap
    cfg = PipelineConfig(
        schedule="dualpipe-v", microbatches=8, overlap_pairs=True, t_alltoall=(0.5,)
    )
    text = plan_report(cfg, 4, compare=True)
    row = next(line for line in text.splitlines() if line.startswith("*dualpipe-v"))
    assert row.split()[6:8] == ["-", "-"], row
    assert " zb-v              2 " in text and "- for overlapped pairs" in text


def test_compare_skips_unsupported_schedules_with_the_reason():
    text = plan_report(PipelineConfig(microbatches=6), 4, compare=True)
    assert (
        "interleaved-1f1b  skipped: interleaved 1F1B needs m divisible by p (got p=4, m=6)" in text
    )
    assert "dualpipe-v        skipped: DualPipeV needs m >= 2p microbatches (got p=4, m=6)" in text


def test_unsupported_choice_is_a_config_error():
    with pytest.raises(
        ConfigError, match=r"pipeline.schedule = 'dualpipe-v': DualPipeV needs m >= 2p"
    ):
        plan_report(PipelineConfig(schedule="dualpipe-v", microbatches=4), 4)


def test_png_timeline(tmp_path):
    out = tmp_path / "plan.png"
    text = plan_report(PipelineConfig(schedule="zb-h1", microbatches=8), 4, png=str(out))
    assert f"timeline written to {out}" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_csv_schedule_from_the_deck(tmp_path):
    path = tmp_path / "mine.csv"
    path.write_text(to_csv(lower(build_schedule("1f1b", 2, 4))))
    cfg = PipelineConfig(schedule="csv", schedule_csv=str(path), microbatches=4)
    assert load_schedule(cfg, 2).num_ranks == 2
    text = plan_report(cfg, 2, compare=True)
    assert "pipeline schedule 1f1b: p=2 ranks" in text and "*csv" in text
    with pytest.raises(ConfigError, match=r"has 2 rank rows but topology\.pp = 4"):
        plan_report(cfg, 4)
    with pytest.raises(ConfigError, match=r"pipeline\.microbatches = 3 but"):
        plan_report(PipelineConfig(schedule="csv", schedule_csv=str(path), microbatches=3), 2)
    with pytest.raises(ConfigError, match=r"pipeline\.schedule_csv cannot be read"):
        plan_report(PipelineConfig(schedule="csv", schedule_csv=str(tmp_path / "no.csv")), 2)
    path.write_text("0F0,0BW0\n1F0,1X0\n")
    with pytest.raises(ConfigError, match="line 2, cell 2: '1X0' is not an action"):
        plan_report(PipelineConfig(schedule="csv", schedule_csv=str(path), microbatches=1), 2)


def test_invalid_csv_schedule_shows_the_grid(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0BW0,0F1,0BW1\n1F0,1F1,1BW0,1BW1\n")
    cfg = PipelineConfig(schedule="csv", schedule_csv=str(path), microbatches=2)
    with pytest.raises(ConfigError, match="dependency cycle") as info:
        plan_report(cfg, 2)
    assert "rank |" in str(info.value) and "[1F1]" in str(info.value)
