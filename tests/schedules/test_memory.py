"""The memory model in bytes per stage against the simulator's unit model."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hpcpipe.schedules import CostModel, build_schedule, simulate
from hpcpipe.schedules.memory import activation_peaks


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-v", "v-half", "interleaved-1f1b"])
def test_activation_peaks_agree_with_the_simulator(name):
    schedule = build_schedule(name, 4, 8)
    n = schedule.num_stages
    held = activation_peaks(schedule, [1.0] * n, [1.0] * n)
    assert np.allclose(held, simulate(schedule, CostModel(activation=1.0)).peak_memory)
    freed = activation_peaks(schedule, [1.0] * n, [0.0] * n)
    assert np.allclose(freed, simulate(schedule, CostModel(b_frees=1.0)).peak_memory)
    sizes = np.arange(1.0, n + 1.0)
    scaled = activation_peaks(schedule, sizes, 0.25 * sizes)
    assert np.all(scaled <= activation_peaks(schedule, sizes, sizes) + 1e-12)
    assert all(math.isfinite(x) and x > 0 for x in scaled)


def test_fused_backward_peaks_between_its_b_and_w_halves():
    # 1F1B on 2 ranks, m=4: rank 0 runs F0 F1 BW0 ...; inside BW0 the B half turns F0's 1.0
    # into W's 1.5 (W also needs the output gradient) while F1's 1.0 is still alive
    schedule = build_schedule("1f1b", 2, 4)
    peaks = activation_peaks(schedule, [1.0, 1.0], [1.5, 1.5])
    assert peaks.tolist() == [2.5, 1.5]
