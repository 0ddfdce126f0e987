"""Broken schedules are rejected with the reason and the rank x step grid, marked."""

from __future__ import annotations

import re

import pytest

from hpcpipe.schedules import (
    Schedule,
    ScheduleError,
    build_schedule,
    format_step_grid,
    from_csv,
    lower,
    simulate,
    strip_comm,
    to_csv,
    validate,
)

ONE_F_ONE_B = [
    ["0F0", "0F1", "0BW0", "0BW1"],
    ["1F0", "1BW0", "1F1", "1BW1"],
]


def _fails(rows, match, **kw):
    with pytest.raises(ScheduleError, match=match) as info:
        validate(Schedule.from_actions(rows, **kw))
    text = str(info.value)
    assert re.search(r"rank \|", text), text  # the grid header
    assert "[" in text and "]" in text, text  # an offending cell is marked
    return info.value


def test_hand_written_1f1b_is_valid():
    lowered = validate(Schedule.from_actions(ONE_F_ONE_B))
    assert lowered.rank_strings(0) == [
        "0F0",
        "0SEND_F0",
        "0F1",
        "0SEND_F1",
        "0RECV_B0",
        "0BW0",
        "0RECV_B1",
        "0BW1",
    ]


def test_missing_w_is_rejected():
    rows = [
        ["0F0", "0B0", "0W0"],
        ["1F0", "1B0"],
    ]
    err = _fails(rows, r"stage 1 microbatch 0 has 1 B but 0 W")
    assert (1, 1) in err.marks


def test_b_before_f_is_rejected():
    rows = [["0F0", "0F1", "0BW0", "0BW1"], ["1F0", "1BW1", "1F1", "1BW0"]]
    err = _fails(rows, r"rank 1 runs 1BW1 before 1F1")
    assert (1, 1) in err.marks and (1, 2) in err.marks


def test_w_before_b_is_rejected():
    rows = [["0F0", "0B0", "0W0"], ["1F0", "1W0", "1B0"]]
    _fails(rows, r"rank 1 runs 1W0 before 1B0, which it needs \(W needs its B first\)")


def test_duplicate_and_missing_forward_are_rejected():
    _fails([["0F0", "0F0", "0BW0"]], r"stage 0 microbatch 0 has 2 F")
    _fails([["0F0", "0BW0", "0BW1"]], r"stage 0 microbatch 1 has 0 F", num_microbatches=2)


def test_fused_and_split_backward_together_are_rejected():
    _fails([["0F0", "0BW0", "0W0"]], r"has BW and also 1 W")


def test_action_on_the_wrong_rank_is_rejected():
    _fails(
        [["0F0", "1F0", "0BW0"], ["1BW0"]],
        r"rank 0 runs 1F0 but stage 1 is placed on rank 1",
        stages_of_rank=[(0,), (1,)],
    )


def test_v_turnaround_out_of_order_is_rejected():
    s = build_schedule("zb-v", 2, 2)
    rows = [list(r) for r in s.actions]
    i, j = (
        rows[1].index(next(a for a in rows[1] if str(a) == "1F0")),
        next(k for k, a in enumerate(rows[1]) if str(a) == "2F0"),
    )
    rows[1][i], rows[1][j] = rows[1][j], rows[1][i]
    _fails(
        rows,
        r"runs 2F0 before 1F0, which it needs \(a forward needs the previous stage's forward\)",
        stages_of_rank=s.stages_of_rank,
    )


def test_cross_rank_dependency_cycle_is_rejected():
    # rank 0 waits for 0BW0 (needs 1BW0) before sending F1; rank 1 wants F1 before BW0
    rows = [["0F0", "0BW0", "0F1", "0BW1"], ["1F0", "1F1", "1BW0", "1BW1"]]
    err = _fails(rows, r"dependency cycle: no rank can start its next action")
    assert "rank 1 step 1 1F1 waits for 0F1 (rank 0 step 2)" in str(err)


def test_deadlock_under_the_runtimes_semantics_is_rejected():
    # Sends never block (the runtime hands them to MPI and completes them at the end of the
    # step), so the classic 1F1B exchange with both ranks sending first is fine...
    exchange = """
    0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0BW0,0RECV_B1,0BW1
    1RECV_F0,1F0,1BW0,1SEND_B0,1RECV_F1,1F1,1BW1,1SEND_B1
    """
    assert validate(from_csv(exchange)).name == "csv"
    # ... but a receive waits for its send: rank 0 wanting the gradient before it sends the
    # activation it is computed from cannot finish
    stuck = """
    0F0,0RECV_B0,0SEND_F0,0BW0
    1RECV_F0,1F0,1BW0,1SEND_B0
    """
    with pytest.raises(ScheduleError, match="deadlock \\(sends never block") as info:
        validate(from_csv(stuck))
    text = str(info.value)
    assert "rank 0 waits at step 1 in 0RECV_B0 for 1SEND_B0, which rank 1 has not reached" in text
    assert "rank 1 waits at step 0 in 1RECV_F0 for 0SEND_F0" in text
    assert "[0RECV_B0]" in text and "[1RECV_F0]" in text


def test_blocking_sends_deadlock_where_nonblocking_ones_do_not():
    # the same exchange with synchronous sends: each rank's second message waits for a
    # receive its peer posts only one action before using it, and each peer is itself stuck
    # in a send; two actions of lookahead post it in time
    exchange = from_csv(
        """
    0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0BW0,0RECV_B1,0BW1
    1RECV_F0,1F0,1BW0,1SEND_B0,1RECV_F1,1F1,1BW1,1SEND_B1
    """
    )
    validate(exchange)  # nonblocking: fine
    validate(exchange, sends="blocking", lookahead=2)
    with pytest.raises(ScheduleError, match="deadlock with blocking sends") as info:
        validate(exchange, sends="blocking", lookahead=1)
    text = str(info.value)
    assert (
        "rank 0 waits at step 3 in 0SEND_F1 (synchronous) until rank 1 posts the receive, "
        "1 action(s) before its RECV: at step 4; rank 1 is at step 3" in text
    )
    assert "rank 1 waits at step 3 in 1SEND_B0" in text
    assert "it runs with a lookahead of 2 action(s)" in text
    assert "[0SEND_F1]" in text and "[1SEND_B0]" in text


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-v", "v-half", "dualpipe-v"])
def test_blocking_sends_need_a_lookahead_the_validator_finds(name):
    # the least lookahead the error names is exact: it runs, one less deadlocks
    sched = build_schedule(name, 4, 8)
    with pytest.raises(ScheduleError, match=r"it runs with a lookahead of (\d+)") as info:
        validate(sched, sends="blocking", lookahead=1)
    least = int(re.search(r"it runs with a lookahead of (\d+)", str(info.value))[1])
    validate(sched, sends="blocking", lookahead=least)
    if least > 1:
        with pytest.raises(ScheduleError):
            validate(sched, sends="blocking", lookahead=least - 1)


def test_send_mode_and_lookahead_are_checked():
    sched = build_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match="sends must be one of"):
        validate(sched, sends="eager")
    with pytest.raises(ValueError, match="lookahead must be >= 1"):
        validate(sched, sends="blocking", lookahead=0)


def test_messages_out_of_place_are_rejected():
    ok = """
    0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0BW0,0RECV_B1,0BW1
    1RECV_F0,1F0,1BW0,1RECV_F1,1SEND_B0,1F1,1BW1,1SEND_B1
    """
    late = ok.replace("1RECV_F1,1SEND_B0,1F1", "1SEND_B0,1F1,1RECV_F1")
    with pytest.raises(ScheduleError, match="1RECV_F1 is received after 1F1 needs it"):
        validate(from_csv(late))
    early = ok.replace("1BW1,1SEND_B1", "1SEND_B1,1BW1")
    with pytest.raises(ScheduleError, match="1SEND_B1 is sent before 1BW1 computes it"):
        validate(from_csv(early))


def test_message_errors_name_the_message():
    base = to_csv(lower(Schedule.from_actions(ONE_F_ONE_B)))
    no_recv = base.replace("1RECV_F1,", "")
    with pytest.raises(
        ScheduleError, match="0SEND_F1 on rank 0 has no matching 1RECV_F1 on rank 1"
    ):
        validate(from_csv(no_recv))
    twice = base.replace("0SEND_F1,", "0SEND_F1,0SEND_F1,")
    with pytest.raises(ScheduleError, match=r"0SEND_F1 appears 2 time\(s\) and 1RECV_F1 1 time"):
        validate(from_csv(twice))
    with pytest.raises(ScheduleError, match="stage 0 receives no forward input"):
        validate(from_csv(base.replace("0F0,", "0RECV_F0,0F0,", 1)))
    v = to_csv(lower(build_schedule("zb-v", 2, 2)))
    extra = v.replace("1F0,", "1F0,1SEND_F0,", 1).replace("2F0,", "2RECV_F0,2F0,", 1)
    with pytest.raises(ScheduleError, match="stages 1 and 2 are both on rank 1"):
        validate(from_csv(extra))


def test_missing_message_pair_is_rejected():
    lowered = to_csv(lower(Schedule.from_actions(ONE_F_ONE_B)))
    stripped = lowered.replace("0SEND_F1,", "").replace("1RECV_F1,", "")
    with pytest.raises(ScheduleError, match=r"stage 0 -> 1 microbatch 1 crosses from rank 0 to 1"):
        validate(from_csv(stripped))


def test_grid_marks_and_windows_large_schedules():
    s = build_schedule("1f1b", 40, 60)
    grid = format_step_grid(s, [(20, 70)])
    assert "[20" in grid
    assert "(showing steps" in grid and "ranks 0, 19, 20, 21, 39 of 40" in grid
    assert "..." in grid


def test_lowering_is_idempotent_and_strippable():
    s = build_schedule("interleaved-1f1b", 3, 6, v=2)
    lowered = lower(s)
    assert lower(lowered) is lowered
    assert strip_comm(lowered) == s
    assert strip_comm(s) is s


def test_simulate_refuses_a_cyclic_schedule():
    rows = [["0F0", "0BW0", "0F1", "0BW1"], ["1F0", "1F1", "1BW0", "1BW1"]]
    with pytest.raises(ScheduleError, match="dependency cycle"):
        simulate(Schedule.from_actions(rows))


def test_deadlock_check_falls_back_to_simulation_for_other_orders(monkeypatch):
    import sys

    validation = sys.modules["hpcpipe.schedules.validate"]
    calls = []
    original = validation._nonblocking_run
    monkeypatch.setattr(validation, "_nonblocking_run", lambda *a: calls.append(a) or original(*a))
    # rank 0 waits for B0 before it computes F1: valid, but not in the time order of the
    # quick certificate, so the execution is simulated
    text = """
    0F0,0SEND_F0,0RECV_B0,0F1,0SEND_F1,0BW0,0RECV_B1,0BW1
    1RECV_F0,1F0,1BW0,1SEND_B0,1RECV_F1,1F1,1BW1,1SEND_B1
    """
    sched = from_csv(text)
    assert validate(sched) is sched
    assert len(calls) == 1
    validate(lower(build_schedule("zb-v", 3, 6)))  # generated: the certificate, no simulation
    validate(build_schedule("interleaved-1f1b", 3, 6))
    validate(build_schedule("dualpipe-v", 4, 8))
    assert len(calls) == 1


def test_a_schedule_error_keeps_its_grid_when_pickled():
    """The grid is drawn lazily; a pickled error (a process pool) still carries all of it."""
    import pickle

    err = _fails([["0F0", "0B0", "0W0"], ["1F0", "1B0"]], r"has 1 B but 0 W")
    copy = pickle.loads(pickle.dumps(err))
    assert isinstance(copy, ScheduleError) and str(copy) == str(err)
    assert re.search(r"rank \|", str(copy))
