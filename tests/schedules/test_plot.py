"""ASCII and PNG pictures of a simulated schedule."""

from __future__ import annotations

from hpcpipe.schedules import CostModel, build_schedule, simulate
from hpcpipe.schedules.plot import ascii_timeline, plot_timeline


def test_ascii_grid_is_the_papers_picture():
    text = ascii_timeline(simulate(build_schedule("1f1b", 2, 2)))
    assert text.splitlines()[:2] == [
        "    0 |F0 F1 .. .. X0 -- .. X1 -- ",
        "    1 |.. F0 X0 -- F1 X1 -- .. .. ",
    ]
    assert "one column = 1 time units" in text


def test_ascii_marks_second_chunk_and_cuts():
    r = simulate(build_schedule("zb-v", 2, 4), CostModel(t_f=0.5, t_b=0.5, t_w=0.5))
    first = ascii_timeline(r).splitlines()[0]
    assert first.startswith("    0 |F0 F1 F2 f0 b0 w0")
    cut = ascii_timeline(simulate(build_schedule("1f1b", 40, 80)), max_width=60, max_ranks=4)
    assert "(first 13 of 357 columns; first 4 of 40 ranks)" in cut
    assert len(cut.splitlines()) == 5


def test_png(tmp_path):
    out = plot_timeline(simulate(build_schedule("v-min", 3, 6)), tmp_path / "t.png")
    assert out.stat().st_size > 1000


def test_legend_lists_what_is_drawn_and_the_hatching():
    from hpcpipe.schedules.plot import legend_entries

    fused = [label for _, label in legend_entries(simulate(build_schedule("1f1b", 2, 4)))]
    assert fused == ["F forward", "B+W fused backward"]
    split_v = [k for k, _ in legend_entries(simulate(build_schedule("zb-v", 2, 4)))]
    assert split_v[-1] is None and len(split_v) == 4  # F, B, W and the hatched second stage
