"""The message plan: per-channel tags are safe (each channel received in the order it is sent)
for every schedule, receive buffers are recycled by the plan's live count and never handed to
a new message while the last one may still be read, and the validator refuses a schedule whose
channel order differs."""

from __future__ import annotations

import itertools

import pytest

from hpcpipe.schedules import SCHEDULE_NAMES, ScheduleError, build_schedule, validate
from hpcpipe.schedules.ir import Kind, Schedule, from_csv
from hpcpipe.schedules.messages import (
    assign_slots,
    channel_order_error,
    channel_tag,
    ping_pong,
    plan_messages,
)

CASES = [(name, p, m) for name in SCHEDULE_NAMES for p, m in ((2, 4), (4, 8), (4, 12))]


def _lowered(name: str, p: int, m: int) -> Schedule:
    return validate(build_schedule(name, p, m))  # every registered schedule builds at these


@pytest.mark.parametrize(("name", "p", "m"), CASES)
def test_every_schedule_receives_each_channel_in_send_order(name, p, m):
    assert channel_order_error(_lowered(name, p, m)) is None


@pytest.mark.parametrize(("name", "p", "m"), CASES)
def test_buffers_are_never_shared_by_two_live_messages(name, p, m):
    sched = _lowered(name, p, m)
    for rank in range(p):
        plan = plan_messages(sched, rank, lookahead=4)
        lo = int(sched.offsets[rank])
        kinds = sched.kinds[lo : int(sched.offsets[rank + 1])].tolist()
        recv_at = [i for i, k in enumerate(kinds) if k in (Kind.RECV_F, Kind.RECV_B)]
        assert len(recv_at) == len(plan.receives)
        by_buffer: dict[tuple[int, int], list] = {}
        for r, at in zip(plan.receives, recv_at, strict=True):
            assert r.post_at <= at <= r.release_after  # posted before it is waited for
            by_buffer.setdefault((r.tag, r.slot), []).append(r)
        for uses in by_buffer.values():
            for a, b in itertools.pairwise(uses):
                assert b.post_at > a.release_after, (a, b)  # the earlier one is done with
        assert sum(plan.slots.values()) == len(by_buffer)


def test_buffer_count_follows_the_plan_not_the_microbatches():
    counts = {
        m: [
            plan_messages(validate(build_schedule("1f1b", 4, m)), r).receive_buffers
            for r in range(4)
        ]
        for m in (8, 32, 64)
    }
    assert counts[8] == counts[32] == counts[64]
    gpipe = [plan_messages(validate(build_schedule("gpipe", 4, 16)), r).slots for r in range(4)]
    assert gpipe[3] == {channel_tag(3, 0): 16}  # GPipe holds every activation: m buffers


def test_greedy_assignment_uses_the_peak_overlap():
    slots, count = assign_slots([(0, 0, 5), (0, 1, 2), (0, 3, 9), (0, 6, 7), (1, 0, 1)])
    assert slots == [0, 1, 1, 0, 0] and count == {0: 2, 1: 1}
    with pytest.raises(ValueError, match="order of start"):
        assign_slots([(0, 5, 6), (0, 1, 2)])


def test_sends_of_a_rank_name_receiving_stage_and_peer():
    sched = validate(ping_pong(3))
    zero, one = plan_messages(sched, 0, 1), plan_messages(sched, 1, 1)
    assert [(d.stage, d.microbatch, d.direction, d.peer) for d in zero.sends] == [
        (1, mb, 0, 1) for mb in range(3)
    ]
    assert [(d.stage, d.direction, d.peer) for d in one.sends] == [(0, 1, 0)] * 3
    assert zero.slots == {channel_tag(0, 1): 1} and zero.send_slots == {channel_tag(1, 0): 1}
    assert zero.describe(1024) == (
        "p2p plan: 3 receives/step on 1 channels in 1 persistent buffers (lookahead 1), 1 KiB"
    )
    assert "+ 1 staged send buffers, 2 KiB" in zero.describe(1024, staged=True)


def test_a_channel_received_out_of_send_order_is_named_and_refused_by_the_validator():
    # rank 1 takes microbatch 1's activation before microbatch 0's: with one tag per channel
    # MPI would hand it microbatch 0's
    bad = from_csv(
        "# hpcpipe schedule name=swapped microbatches=2 placement=0;1\n"
        "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0W0,0RECV_B1,0B1,0W1\n"
        "1RECV_F1,1RECV_F0,1F0,1B0,1SEND_B0,1W0,1F1,1B1,1SEND_B1,1W1\n"
    )
    why = channel_order_error(bad)
    assert why is not None and "activations into stage 1" in why
    assert "sent in the order [0, 1] but received in the order [1, 0]" in why
    with pytest.raises(ScheduleError, match="1RECV_F1 is received before 1RECV_F0, but their"):
        validate(bad)
