"""The compiled worklist that times large schedules gives the NumPy rounds' answer bit for bit,
and finds the same stuck actions on a dependency cycle."""

from __future__ import annotations

import numpy as np
import pytest

from hpcpipe.schedules import (
    SCHEDULE_NAMES,
    Schedule,
    ScheduleError,
    _compiled,
    _rank_order,
    build_schedule,
    simulate,
)
from hpcpipe.schedules._table import compute_table

pytest.importorskip("numba")


def _cases():
    for name in SCHEDULE_NAMES:
        for p, m in ((2, 4), (4, 8), (5, 10), (8, 16)):
            try:
                kw = {"pairs": True} if name == "dualpipe-v" else {}
                yield name, build_schedule(name, p, m, **kw)
            except ValueError:
                continue


@pytest.mark.parametrize("name,sched", list(_cases()), ids=lambda x: getattr(x, "name", x))
def test_compiled_and_numpy_timings_are_identical(name, sched):
    table = compute_table(sched)
    dep = table.dep if table.timed_dep is None else table.timed_dep
    rng = np.random.default_rng(7)
    n = table.n
    dur, delay = rng.uniform(0.25, 2.0, n), rng.uniform(0.0, 0.4, n)
    delay2 = rng.uniform(0.0, 0.4, n) if table.pair_dep is not None else None
    for args in ((dur, delay, delay2), (dur, delay, None), (None, None, None)):
        ours = _rank_order.run_in_rank_order(
            table.offsets, dep, table.pair_dep, *args, compiled=True
        )
        rounds = _rank_order.run_in_rank_order(
            table.offsets, dep, table.pair_dep, *args, compiled=False
        )
        assert ours[2] is None and rounds[2] is None
        np.testing.assert_array_equal(ours[0], rounds[0])
        np.testing.assert_array_equal(ours[1], rounds[1])


def test_unit_time_ends_are_whole_rounds():
    sched = build_schedule("zb-v", 4, 8)
    table = compute_table(sched)
    _, end, _ = _rank_order.run_in_rank_order(
        table.offsets, table.dep, None, None, None, None, compiled=True
    )
    assert np.array_equal(end, np.round(end)) and end[:-1].min() >= 1


def test_a_cycle_stops_both_paths_at_the_same_actions(monkeypatch):
    # rank 0 waits for 0BW0 (needs 1BW0) before sending F1; rank 1 wants F1 before BW0
    rows = [
        ["0F0", "0BW0", "0F1", "0BW1", "0F2", "0BW2"],
        ["1F0", "1F1", "1BW0", "1BW1", "1F2", "1BW2"],
    ]
    sched = Schedule.from_actions(rows)
    table = compute_table(sched)
    stuck = [
        _rank_order.run_in_rank_order(table.offsets, table.dep, None, None, None, None, compiled=c)[
            2
        ]
        for c in (True, False)
    ]
    assert stuck[0] is not None and stuck[1] is not None
    np.testing.assert_array_equal(stuck[0], stuck[1])
    messages = []
    for threshold in (0, 1 << 40):  # every schedule compiled, then none
        monkeypatch.setattr(_compiled, "COMPILED_ACTIONS", threshold)
        with pytest.raises(ScheduleError, match="dependency cycle") as info:
            simulate(sched)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    assert "1F1 waits for 0F1" in messages[0]
