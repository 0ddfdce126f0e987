"""Planning at scale: p=1024 ranks, m=4096 microbatches (8.4M actions, 25M once lowered)."""

from __future__ import annotations

import time

from hpcpipe.schedules import build_schedule, simulate, validate


def test_1024_ranks_4096_microbatches_in_under_10_seconds():
    # CPU time of this process, not wall time: on a shared test machine other jobs' time
    # would count against us. The work is single-threaded numpy, so CPU time is what it costs.
    p, m = 1024, 4096
    t0 = time.process_time()
    sched = build_schedule("1f1b", p, m)
    lowered = validate(sched)
    result = simulate(sched)
    seconds = time.process_time() - t0
    assert lowered.num_actions == 2 * p * m + 4 * (p - 1) * m
    assert result.makespan == (m + p - 1) * 3.0
    assert result.peak_memory[0] == p
    assert seconds < 10.0, f"build + validate + simulate took {seconds:.1f}s of CPU"
