"""Planning at scale: p=1024 ranks, m=4096 microbatches (8.4M actions, 25M once lowered).

Only the answer is checked here; how long it takes is a benchmark (benchmarks/plan_scale.py),
because a timed assertion fails on any busy machine.
"""

from __future__ import annotations

from hpcpipe.schedules import build_schedule, simulate, validate


def test_1024_ranks_4096_microbatches_are_planned_exactly():
    p, m = 1024, 4096
    sched = build_schedule("1f1b", p, m)
    lowered = validate(sched)
    result = simulate(sched)
    assert lowered.num_actions == 2 * p * m + 4 * (p - 1) * m
    assert result.makespan == (m + p - 1) * 3.0
    assert result.peak_memory[0] == p
