"""Every generator builds a schedule the validator proves, over a grid of (p, m, v); the
placements are the published ones; unsupported (p, m, v) fail with a message that says why."""

from __future__ import annotations

import pytest

from hpcpipe.schedules import (
    SCHEDULE_NAMES,
    Kind,
    ScheduleError,
    build_schedule,
    stages_per_rank,
    strip_comm,
    validate,
)
from hpcpipe.schedules.dualpipe import dualpipe_v
from hpcpipe.schedules.interleaved import interleaved_1f1b

SPLIT = {"zb-h1", "zb-h2", "zb-v", "v-half", "v-min"}  # B and W separate everywhere


def _supported(name, p, m, v=None):
    if name == "interleaved-1f1b":
        return m % p == 0
    if name == "dualpipe-v":
        return m >= 2 * p
    return True


def _check(s, name, p, m, v=None):
    lowered = validate(s)
    assert strip_comm(lowered) == s
    assert s.num_ranks == p and s.num_microbatches == m
    per = stages_per_rank(name, v)
    assert s.num_stages == per * p
    if per == 2 and name != "interleaved-1f1b":
        assert s.stages_of_rank == tuple((r, 2 * p - 1 - r) for r in range(p))
    elif name == "interleaved-1f1b":
        assert s.stages_of_rank == tuple(tuple(c * p + r for c in range(per)) for r in range(p))
    else:
        assert s.stages_of_rank == tuple((r,) for r in range(p))
    kinds = set(s.kinds.tolist())
    if name in SPLIT:
        assert kinds == {Kind.F, Kind.B, Kind.W}
    elif name in ("gpipe", "1f1b", "interleaved-1f1b"):
        assert kinds == {Kind.F, Kind.BW}
    return lowered


@pytest.mark.parametrize("name", [n for n in SCHEDULE_NAMES if n != "interleaved-1f1b"])
def test_every_small_case_validates(name):
    count = 0
    for p in range(1, 7):
        for m in range(1, 14):
            if _supported(name, p, m):
                _check(build_schedule(name, p, m), name, p, m)
                count += 1
    assert count == (42 if name == "dualpipe-v" else 78)  # every supported (p, m) was built


def test_interleaved_small_cases_validate():
    for p in range(1, 6):
        for v in range(1, 4):
            for m in range(p, 4 * p + 1, p):
                _check(interleaved_1f1b(p, m, v), "interleaved-1f1b", p, m, v)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_large_cases_validate(name):
    p, m = 16, 64
    lowered = _check(build_schedule(name, p, m), name, p, m)
    # every cross-rank hand-over has one send and one receive; same-rank ones have none
    comm = lowered.kinds >= Kind.SEND_F
    rank_of = lowered.rank_of_stage
    crossings = sum(int(rank_of[s] != rank_of[s + 1]) for s in range(lowered.num_stages - 1))
    assert int(comm.sum()) == 4 * crossings * m


def test_v_turnaround_has_no_message():
    lowered = validate(build_schedule("zb-v", 4, 8))
    last_rank = [str(a) for a in lowered.actions[3]]
    assert not any(a.startswith(("3SEND_F", "4RECV_F", "4SEND_B", "3RECV_B")) for a in last_rank)
    assert "3SEND_F0" not in last_rank and "4RECV_F0" not in last_rank


def test_1f1b_order_is_the_classic_one():
    s = build_schedule("1f1b", 4, 6)
    assert s.rank_strings(0)[:5] == ["0F0", "0F1", "0F2", "0F3", "0BW0"]
    assert s.rank_strings(3)[:4] == ["3F0", "3BW0", "3F1", "3BW1"]


def test_zb_h1_defers_w_by_rank():
    s = build_schedule("zb-h1", 4, 8)
    assert s.rank_strings(3)[:6] == ["3F0", "3B0", "3F1", "3B1", "3F2", "3B2"]
    assert s.rank_strings(0)[3:6] == ["0F3", "0B0", "0W0"]


def test_interleaved_rejects_m_not_divisible_by_p():
    with pytest.raises(
        ValueError, match=r"interleaved 1F1B needs m divisible by p \(got p=4, m=6\)"
    ):
        build_schedule("interleaved-1f1b", 4, 6)
    with pytest.raises(ValueError, match="v >= 1"):
        interleaved_1f1b(2, 2, 0)


def test_dualpipe_v_needs_two_microbatches_per_rank():
    with pytest.raises(ValueError, match=r"DualPipeV needs m >= 2p microbatches \(got p=4, m=7\)"):
        dualpipe_v(4, 7)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("p, m", [(0, 4), (4, 0), (2.0, 4), (True, 4)])
def test_bad_counts_are_rejected(name, p, m):
    with pytest.raises(ValueError, match=r"must be (>= 1|an integer)"):
        build_schedule(name, p, m)


def test_registry_names_and_v():
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'"):
        build_schedule("pipedream", 2, 2)
    with pytest.raises(ValueError, match="zb-v holds 2 stage"):
        build_schedule("zb-v", 2, 4, v=3)
    assert build_schedule("zb-v", 2, 4, v=2).num_stages == 4
    assert build_schedule("1f1b", 2, 4, v=1).num_stages == 2
    assert build_schedule("interleaved-1f1b", 2, 4, v=3).num_stages == 6
    assert stages_per_rank("interleaved-1f1b") == 2
    with pytest.raises(ValueError, match="unknown schedule"):
        stages_per_rank("nope")


def test_generated_schedules_are_not_accidentally_broken():
    # the validator is not a rubber stamp: dropping one action from a generated schedule fails
    s = build_schedule("zb-h2", 3, 6)
    rows = [list(r) for r in s.actions]
    rows[1].pop(4)
    from hpcpipe.schedules import Schedule

    with pytest.raises(ScheduleError):
        validate(Schedule.from_actions(rows, stages_of_rank=s.stages_of_rank, num_microbatches=6))
