"""Re-planning's pure parts: rank speeds from unit times, the re-balanced partition and its
predicted gain, the switching rule, the slow-rank fault and the [replan] deck checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcpipe.config import ConfigError, load_config
from hpcpipe.faults import slowdown
from hpcpipe.model.models import balance, balance_placement
from hpcpipe.schedules import build_schedule
from hpcpipe.train.replan import (
    Measured,
    Proposal,
    ReplanConfig,
    Replanner,
    action_costs,
    estimate_speeds,
)

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "inputs" / "train_tiny.toml"

EMBED, BLOCK, HEAD = ("Embedding", 10), ("Block", 100), ("LossHead", 20)
GROUPS = [EMBED, *[BLOCK] * 6, HEAD]  # train_tiny's 8 units
SECONDS = {EMBED: 1.0, BLOCK: 4.0, HEAD: 3.0}  # per step on a rank of speed 1


def _measured(schedule, ranges, slowness):
    """What the interpreter would time: each unit's F, B and W a third of its cost times its
    rank's slowness, each action its units' share plus 0.1 s outside them (messages)."""
    from collections import Counter

    owner = {s: r for r, row in enumerate(schedule.stages_of_rank) for s in row}
    counts = Counter((a.kind.name, a.stage) for row in schedule.actions for a in row)
    parts = {"F": ("F",), "B": ("B",), "W": ("W",), "BW": ("B", "W")}
    units, stages = {}, {}
    for s, rg in enumerate(ranges):
        for i in rg:
            for kind in ("F", "B", "W"):
                units[(kind, i)] = SECONDS[GROUPS[i]] * slowness[owner[s]] / 3
    for (kind, s), n in counts.items():
        if kind in parts:
            inside = sum(units[(k, i)] for k in parts[kind] for i in ranges[s])
            stages[(kind, s)] = inside / n + 0.1
    return Measured(stages, units)


def test_balance_gives_a_slow_rank_less_work():
    assert [len(r) for r in balance([1.0] * 8, 2)] == [4, 4]
    # [6, 2] and [5, 3] both have a heaviest stage of 6: the flatter one wins
    assert [len(r) for r in balance([1.0] * 8, 2, scale=[1.0, 2.0])] == [6, 2]
    assert [len(r) for r in balance([1.0] * 8, 2, scale=[3.0, 1.0])] == [2, 6]
    with pytest.raises(ValueError, match="scale must give 2"):
        balance([1.0] * 8, 2, scale=[1.0])
    # a V placement: rank 0 holds stages 0 and 3; slowing it moves work to rank 1
    even = balance_placement([1.0] * 8, 4, [(0, 3), (1, 2)])
    slow = balance_placement([1.0] * 8, 4, [(0, 3), (1, 2)], rank_scale=[2.0, 1.0])
    assert [len(r) for r in even] == [2, 2, 2, 2]
    load0 = len(slow[0]) + len(slow[3])
    assert load0 < 4 and sum(len(r) for r in slow) == 8


def test_speeds_from_units_of_one_type_on_several_ranks():
    rank = {i: 0 if i < 4 else 1 for i in range(8)}
    seconds = {i: SECONDS[GROUPS[i]] * (2.0 if rank[i] == 1 else 1.0) for i in range(8)}
    assert estimate_speeds(seconds, rank, GROUPS, 2, {}).tolist() == [1.0, 2.0]
    # a rank holding no block: timed against learnt costs, else taken as nominal
    rank = {i: 0 if i in (0, 7) else 1 for i in range(8)}
    seconds = {i: SECONDS[GROUPS[i]] * (3.0 if rank[i] == 0 else 1.0) for i in range(8)}
    assert estimate_speeds(seconds, rank, GROUPS, 2, {}).tolist() == [1.0, 1.0]
    learnt = {g: SECONDS[g] for g in (EMBED, HEAD)}
    assert estimate_speeds(seconds, rank, GROUPS, 2, learnt).tolist() == pytest.approx([3.0, 1.0])


@pytest.mark.parametrize("slow_rank", [0, 1])
def test_a_slow_rank_gives_layers_away_and_the_gain_is_predicted(slow_rank):
    schedule = build_schedule("1f1b", 2, 4)
    current = (range(0, 4), range(4, 8))
    slowness = [2.0 if r == slow_rank else 1.0 for r in (0, 1)]
    planner = Replanner(ReplanConfig(enabled=True), schedule, GROUPS)
    proposal = planner.propose(current, _measured(schedule, current, slowness))
    assert proposal.slowness == pytest.approx(tuple(slowness))
    sizes = [len(r) for r in proposal.ranges]
    assert sizes[slow_rank] < 4 and sum(sizes) == 8
    assert proposal.predicted_new < proposal.predicted_now
    assert 0.1 < proposal.gain < 0.5
    assert planner.nominal[BLOCK] == pytest.approx(SECONDS[BLOCK])
    # the same prediction as the simulator fed with what the new partition then measures
    again = Replanner(ReplanConfig(enabled=True), schedule, GROUPS)
    after = again.propose(proposal.ranges, _measured(schedule, proposal.ranges, slowness))
    assert after.predicted_now == pytest.approx(proposal.predicted_new, rel=1e-9)
    assert not after.changes


@pytest.mark.parametrize(
    "extra, sizes", [(0.5, [5, 3]), (1.0, [5, 3]), (2.0, [6, 2]), (4.0, [7, 1])]
)
def test_time_a_stage_spends_outside_its_units_moves_units_off_it(extra, sizes):
    """Equal ranks, but every action of stage 1 spends `extra` s outside its units (sends,
    the loss): the unit work alone balances at [4, 4]; the simulator finds the faster
    partition, and predicts it as the simulator fed that partition's own costs does."""
    from hpcpipe.schedules.simulate import simulate
    from hpcpipe.train.replan import cost_model

    schedule = build_schedule("1f1b", 2, 4)
    current = (range(0, 4), range(4, 8))

    def measured(ranges):
        m = _measured(schedule, ranges, [1.0, 1.0])
        stages = {k: v + extra * (k[1] == 1) for k, v in m.stage_seconds.items()}
        return Measured(stages, m.unit_seconds)

    balanced = balance_placement([SECONDS[g] for g in GROUPS], 2, schedule.stages_of_rank)
    assert [len(r) for r in balanced] == [4, 4]
    proposal = Replanner(ReplanConfig(enabled=True), schedule, GROUPS).propose(
        current, measured(current)
    )
    assert [len(r) for r in proposal.ranges] == sizes
    truth = simulate(schedule, cost_model(measured(proposal.ranges).stage_seconds, 2)).makespan
    assert proposal.predicted_new == pytest.approx(truth, rel=1e-9)
    assert proposal.predicted_new < proposal.predicted_now


def test_checks_search_again_only_when_a_partition_changes(monkeypatch):
    """The descent costs simulations per stage boundary: a check whose balanced and current
    partitions are those of the last search reuses its answer."""
    import hpcpipe.train.replan as replan

    calls = []
    descend = replan._descend
    monkeypatch.setattr(replan, "_descend", lambda *a: calls.append(1) or descend(*a))
    schedule = build_schedule("1f1b", 2, 4)
    planner = Replanner(ReplanConfig(enabled=True), schedule, GROUPS)
    even = (range(0, 4), range(4, 8))
    for _ in range(3):
        assert not planner.propose(even, _measured(schedule, even, [1.0, 1.0])).changes
    assert len(calls) == 1
    slow = planner.propose(even, _measured(schedule, even, [1.0, 2.0]))
    assert slow.changes and len(calls) == 2
    planner.propose(slow.ranges, _measured(schedule, slow.ranges, [1.0, 2.0]))
    assert len(calls) == 3


def test_replan_search_finds_a_schedule_for_the_new_stage_costs():
    """With `search`, the proposal also re-searches the schedule for the costs the new
    partition leaves, on the same placement and within the current activation peak: its
    predicted step is the simulator's for that schedule, faster than 1F1B's bubble allows,
    and the search runs again only when the partitions change."""
    import hpcpipe.schedules.search as searching
    from hpcpipe.schedules.simulate import CostModel, simulate
    from hpcpipe.train.replan import cost_model

    schedule = build_schedule("1f1b", 2, 4)
    current = (range(0, 4), range(4, 8))
    slowness = [1.0, 2.0]
    plain = Replanner(ReplanConfig(enabled=True), schedule, GROUPS)
    planner = Replanner(ReplanConfig(enabled=True, search=True), schedule, GROUPS)
    base = plain.propose(current, _measured(schedule, current, slowness))
    ours = planner.propose(current, _measured(schedule, current, slowness))
    assert ours.ranges == base.ranges and ours.predicted_now == base.predicted_now
    assert ours.schedule is not None and ours.changes
    assert ours.predicted_new < base.predicted_new * 0.99
    assert "schedule 1f1b -> " in ours.describe()
    new = ours.schedule
    assert new.stages_of_rank == schedule.stages_of_rank  # nothing moves but layers
    truth = _measured(schedule, ours.ranges, slowness).stage_seconds
    costs = cost_model(truth, 2)
    assert simulate(new, costs).makespan == pytest.approx(ours.predicted_new, rel=1e-9)
    peak = simulate(schedule, CostModel(activation=1.0)).peak_memory.max()
    assert simulate(new, CostModel(activation=1.0)).peak_memory.max() <= peak + 1e-9
    calls = []
    real = searching.search
    searching.search = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        planner.propose(current, _measured(schedule, current, slowness))
    finally:
        searching.search = real
    assert calls == []  # the same partitions: the last search's answer
    # once switched, the next check measures the new plan and proposes nothing: no flapping
    after = Replanner(ReplanConfig(enabled=True, search=True), new, GROUPS)
    again = after.propose(ours.ranges, _measured(new, ours.ranges, slowness))
    assert not again.changes


def test_replan_search_keeps_only_schedules_blocking_sends_can_run():
    """With train.sends = "blocking" a searched schedule must be proven deadlock-free for the
    run's lookahead, as the deck's own is before the run: the W-deferring order found for a
    slow rank needs 2 receives ahead, so with 1 the re-plan keeps 1F1B and moves layers only."""
    from hpcpipe.schedules.errors import ScheduleError
    from hpcpipe.schedules.validate import validate

    schedule = build_schedule("1f1b", 2, 4)
    current = (range(0, 4), range(4, 8))
    measured = _measured(schedule, current, [1.0, 2.0])
    free = Replanner(ReplanConfig(enabled=True, search=True), schedule, GROUPS)
    found = free.propose(current, measured).schedule
    assert found is not None
    with pytest.raises(ScheduleError):
        validate(validate(found), sends="blocking", lookahead=1)
    tight = Replanner(
        ReplanConfig(enabled=True, search=True), schedule, GROUPS, blocking_lookahead=1
    )
    proposal = tight.propose(current, measured)
    assert proposal.schedule is None and proposal.changes  # the partition still moves
    roomy = Replanner(
        ReplanConfig(enabled=True, search=True), schedule, GROUPS, blocking_lookahead=2
    )
    assert roomy.propose(current, measured).schedule is not None


def test_replan_search_may_split_the_batch_another_way():
    """With the replica's rows known, microbatch counts in [p, 4p] dividing them are searched
    too, each microbatch's costs and activations scaled by its rows (the time outside the
    units, messages and dispatch, stays per action), within the activation bytes of now. Two
    microbatches of 1F1B on 2 ranks leave a large bubble: four fill it better."""
    from hpcpipe.schedules.simulate import CostModel, simulate

    schedule = build_schedule("1f1b", 2, 2)
    current = (range(0, 4), range(4, 8))
    measured = _measured(schedule, current, [1.0, 1.0])
    fixed = Replanner(ReplanConfig(enabled=True, search=True), schedule, GROUPS)
    split = Replanner(ReplanConfig(enabled=True, search=True), schedule, GROUPS, rows=16)
    same_m, other_m = fixed.propose(current, measured), split.propose(current, measured)
    assert same_m.schedule.num_microbatches == 2  # rows unknown (MoE): the count stays
    assert other_m.schedule.num_microbatches == 4
    assert other_m.predicted_new < same_m.predicted_new < same_m.predicted_now
    # activation bytes: 4 microbatches of half the rows hold no more than 2 whole ones did
    held = simulate(other_m.schedule, CostModel(activation=0.5)).peak_memory.max()
    assert held <= simulate(schedule, CostModel(activation=1.0)).peak_memory.max()


def test_equal_ranks_keep_their_partition():
    schedule = build_schedule("zb-v", 2, 4)
    current = (range(0, 3), range(3, 4), range(4, 6), range(6, 8))
    planner = Replanner(ReplanConfig(enabled=True), schedule, GROUPS)
    proposal = planner.propose(current, _measured(schedule, current, [1.0, 1.0]))
    assert proposal.slowness == (1.0, 1.0)
    assert proposal.gain < 0.05
    assert not planner.decide(proposal)


def _proposal(gain: float, changes: bool = True) -> Proposal:
    current = (range(0, 4), range(4, 8))
    ranges = (range(0, 5), range(5, 8)) if changes else current
    return Proposal(ranges, current, (1.0, 2.0), 1.0, 1.0 - gain)


def test_the_switching_rule_has_a_threshold_and_a_cooldown():
    planner = Replanner(
        ReplanConfig(min_gain=0.1, cooldown=2, confirm=False), build_schedule("1f1b", 2, 4), []
    )
    assert not planner.decide(_proposal(0.05))  # below min_gain: noise
    assert not planner.decide(_proposal(0.5, changes=False))  # nothing to change
    assert planner.decide(_proposal(0.3))
    assert not planner.decide(_proposal(0.3))  # cooldown: first check after the switch
    assert not planner.decide(_proposal(0.3))  # ... and the second
    assert planner.decide(_proposal(0.3))


def test_a_plan_made_for_a_slowdown_is_left_when_the_slowdown_ends():
    """Below min_gain a switch waits, unless the slowdown the running plan was made for has
    eased by more than min_gain: then it is left for any predicted gain (and only then)."""

    def proposal(gain: float, slowness: tuple[float, float]) -> Proposal:
        current, ranges = (range(0, 5), range(5, 8)), (range(0, 4), range(4, 8))
        return Proposal(ranges, current, slowness, 1.0, 1.0 - gain)

    planner = Replanner(
        ReplanConfig(min_gain=0.05, cooldown=0, confirm=False), build_schedule("1f1b", 2, 4), []
    )
    assert not planner.decide(proposal(0.03, (1.0, 2.0)))  # before any switch: min_gain
    assert planner.decide(proposal(0.4, (1.0, 2.0)))
    assert planner.planned_for == (1.0, 2.0)
    assert not planner.decide(proposal(0.03, (1.0, 1.97)))  # as slow as planned: noise
    assert not planner.decide(proposal(0.0, (1.0, 1.0)))  # eased, but nothing to gain
    assert planner.decide(proposal(0.03, (1.0, 1.0)))  # the slowdown ended
    assert planner.planned_for == (1.0, 1.0)
    # a plan made for equal ranks: noise in either direction needs min_gain
    assert not planner.decide(proposal(0.03, (1.0, 1.08)))
    assert not planner.decide(proposal(0.03, (1.08, 1.0)))
    assert planner.decide(proposal(0.06, (1.0, 1.08)))
    # the slowdown moved to another rank, as slow: no easing
    planner.planned_for = (1.0, 2.0)
    assert not planner.decide(proposal(0.03, (2.0, 1.0)))


def test_a_switch_of_schedule_alone_sets_no_slowdown_to_ease():
    """A schedule-only switch (replan.search, the same layers) measured in a noisy window
    must not let the next window's noise switch again below min_gain."""
    same = (range(0, 4), range(4, 8))
    schedule_only = Proposal(same, same, (1.0, 1.08), 1.0, 0.9, build_schedule("zb-h1", 2, 4))
    planner = Replanner(
        ReplanConfig(min_gain=0.05, cooldown=0, confirm=False), build_schedule("1f1b", 2, 4), []
    )
    assert planner.decide(schedule_only)
    assert planner.planned_for == ()
    again = Proposal(same, same, (1.0, 1.0), 1.0, 0.98, build_schedule("zb-h2", 2, 4))
    assert not planner.decide(again)


def test_a_switch_needs_the_gain_in_two_windows_in_a_row():
    """With `confirm` (the default) a proposal that clears min_gain waits; the next check
    predicts that same plan from its own window, and the switch is to it if the gain holds.
    A window whose noise made one rank look slow proposes a plan the next window does not
    confirm: nothing moves."""
    schedule = build_schedule("1f1b", 2, 4)
    even = (range(0, 4), range(4, 8))
    planner = Replanner(ReplanConfig(enabled=True), schedule, GROUPS)
    first = planner.propose(even, _measured(schedule, even, [1.0, 2.0]))
    assert first.changes and first.gain > 0.1 and first.recheck is None
    assert planner.decide(first) is None and planner.waiting()
    second = planner.propose(even, _measured(schedule, even, [1.0, 1.8]))
    again = second.recheck
    assert again is not None and again.ranges == first.ranges
    # the same plan, predicted from the second window: as the simulator fed with what that
    # partition measures at the second window's speeds
    truth = Replanner(ReplanConfig(enabled=True), schedule, GROUPS).propose(
        first.ranges, _measured(schedule, first.ranges, [1.0, 1.8])
    )
    assert again.predicted_new == pytest.approx(truth.predicted_now, rel=1e-9)
    assert again.predicted_new != pytest.approx(first.predicted_new, rel=1e-3)
    assert again.predicted_now == pytest.approx(second.predicted_now, rel=1e-12)
    assert planner.decide(second) is again and not planner.waiting()
    assert planner.planned_for == pytest.approx((1.0, 1.8))

    noisy = Replanner(ReplanConfig(enabled=True), schedule, GROUPS)
    spike = noisy.propose(even, _measured(schedule, even, [1.0, 1.3]))
    assert spike.gain >= 0.05 and noisy.decide(spike) is None and noisy.waiting()
    quiet = noisy.propose(even, _measured(schedule, even, [1.0, 1.0]))
    assert quiet.recheck is not None and quiet.recheck.gain < 0.05  # not confirmed
    assert noisy.decide(quiet) is None and not noisy.waiting()
    # and a confirmation counts only for the plan it was proposed against
    assert noisy.decide(noisy.propose(even, _measured(schedule, even, [1.0, 2.0]))) is None
    assert noisy.waiting()
    other = (range(0, 3), range(3, 8))
    assert noisy.propose(other, _measured(schedule, other, [1.0, 2.0])).recheck is None
    assert noisy.propose(even, _measured(schedule, even, [1.0, 2.0])).recheck is not None


def test_confirmation_with_the_cooldown_and_a_slowdown_that_eases():
    """A check within the cooldown cannot switch but may propose: the first check past it
    confirms. A plan made for a slow rank is left at once when the slowdown eases (evidence,
    not noise: no second window)."""
    schedule = build_schedule("1f1b", 2, 4)
    even = (range(0, 4), range(4, 8))

    def check(planner, ranges, slowness):
        return planner.decide(planner.propose(ranges, _measured(schedule, ranges, slowness)))

    planner = Replanner(ReplanConfig(enabled=True, cooldown=1), schedule, GROUPS)
    assert check(planner, even, [1.0, 1.3]) is None and planner.waiting()
    moved = check(planner, even, [1.0, 1.3])
    assert moved is not None and moved.ranges != even
    now = moved.ranges
    # rank 1 slows further (not an easing): the check in the cooldown proposes, the next confirms
    assert check(planner, now, [1.0, 2.5]) is None and planner.waiting()
    again = check(planner, now, [1.0, 2.5])
    assert again is not None and len(again.ranges[1]) < len(now[1])

    eased = Replanner(ReplanConfig(enabled=True, cooldown=0), schedule, GROUPS)
    assert check(eased, even, [1.0, 2.0]) is None
    slow = check(eased, even, [1.0, 2.0])
    assert slow is not None and not eased.waiting()
    back = check(eased, slow.ranges, [1.0, 1.0])  # the first window after the slowdown
    assert back is not None and [len(r) for r in back.ranges] == [4, 4]

    off = Replanner(ReplanConfig(enabled=True, confirm=False), schedule, GROUPS)
    first = off.propose(even, _measured(schedule, even, [1.0, 2.0]))
    assert off.decide(first) is first and not off.waiting()  # switches on the first window


def test_a_searched_schedule_is_confirmed_from_the_next_window():
    """With `search` the pending plan's schedule is simulated again with the next window's
    costs for its partition (and its microbatches' rows)."""
    schedule = build_schedule("1f1b", 2, 2)
    even = (range(0, 4), range(4, 8))
    planner = Replanner(ReplanConfig(enabled=True, search=True), schedule, GROUPS, rows=16)
    first = planner.propose(even, _measured(schedule, even, [1.0, 2.0]))
    assert first.schedule is not None and first.schedule.num_microbatches != 2
    assert planner.decide(first) is None
    second = planner.propose(even, _measured(schedule, even, [1.0, 2.0]))
    assert second.recheck.schedule is first.schedule
    assert second.recheck.predicted_new == pytest.approx(first.predicted_new, rel=1e-9)
    assert planner.decide(second) is second.recheck


def test_action_costs_are_per_action_medians():
    schedule = build_schedule("1f1b", 2, 4)
    window = [{("F", 0): 4.0, ("BW", 0): 8.0}, {("F", 0): 8.0, ("BW", 0): 8.0}, {("F", 0): 6.0}]
    costs = action_costs(schedule, 0, window)
    assert costs == {("F", 0): 1.5, ("BW", 0): 2.0}  # over 4 microbatches; a missing step is 0


def test_slow_fault_stretches_a_rank_from_a_step(monkeypatch):
    import hpcpipe.faults as faults

    monkeypatch.setattr(faults, "_SPEC", None)
    monkeypatch.setenv("HPCPIPE_INJECT_FAULT", "rank=1,at=step:5,kind=slow,factor=3,until=9")
    assert [slowdown(step, 1) for step in (4, 5, 8, 9)] == [1.0, 3.0, 3.0, 1.0]
    assert slowdown(5, 0) == 1.0
    faults.maybe_fail("step:5", 1)  # a slow rank is not a failing one
    monkeypatch.setattr(faults, "_SPEC", None)
    monkeypatch.setenv("HPCPIPE_INJECT_FAULT", "rank=1,at=backward:5,kind=slow")
    with pytest.raises(ValueError, match="kind = slow needs at = step:N"):
        slowdown(5, 1)
    monkeypatch.setattr(faults, "_SPEC", None)
    monkeypatch.setenv("HPCPIPE_INJECT_FAULT", "rank=1,at=step:1,kind=slow,factor=0.5")
    with pytest.raises(ValueError, match="must be >= 1"):
        slowdown(5, 1)


def test_slow_link_fault_holds_one_links_messages_not_compute(monkeypatch):
    import hpcpipe.faults as faults

    monkeypatch.setattr(faults, "_SPEC", None)
    monkeypatch.setenv(
        "HPCPIPE_INJECT_FAULT",
        "rank=1,link=2,at=step:5,kind=slow,delay_ms=20,until=9;rank=3,at=step:2,kind=slow",
    )
    specs = faults.link_faults(2)  # either end of the link
    assert specs == faults.link_faults(1) and faults.link_faults(0) == []
    assert [faults.link_delay(specs, step, 2, 1) for step in (4, 5, 8, 9)] == [
        0.0,
        0.02,
        0.02,
        0.0,
    ]
    assert faults.link_delay(specs, 5, 1, 2) == 0.02  # both ways
    assert faults.link_delay(specs, 5, 1, 0) == 0.0  # another link
    assert slowdown(5, 1) == 1.0 and slowdown(5, 2) == 1.0  # the compute is untouched
    assert slowdown(5, 3) == 2.0  # a compute fault beside it still applies
    monkeypatch.setattr(faults, "_SPEC", None)
    monkeypatch.setenv("HPCPIPE_INJECT_FAULT", "rank=1,link=2,kind=slow,delay_ms=-1")
    with pytest.raises(ValueError, match=r"delay_ms = -1\.0 must be >= 0"):
        faults.link_delay(faults.link_faults(1), 3, 1, 2)


def _check(overrides: list[str]) -> None:
    from hpcpipe.topology import RankMap
    from hpcpipe.train.checks import check

    config = load_config(TINY, ["topology.pp=2", "topology.dp=1", *overrides])
    check(config, RankMap.build(2, 2, pp=2, dp=1), files=False)


@pytest.mark.parametrize(
    ("override", "key", "says"),
    [
        ("replan.speeds=[1, 1, 1]", "replan.speeds", "one speed per pipeline rank (2)"),
        ("replan.speeds=[1, 0]", "replan.speeds", ">= 0.001"),
        ("replan.check_every=1", "replan.check_every", ">= 2"),
        ("replan.min_gain=2", "replan.min_gain", "<= 0.9"),
        ("replan.enabled=3", "replan.enabled", "true or false"),
        ("replan.confirm='yes'", "replan.confirm", "true or false"),
        ("replan.often=1", "replan.often", "not a known key"),
    ],
)
def test_bad_replan_keys_name_the_key(override, key, says):
    with pytest.raises(ConfigError) as info:
        _check([override])
    text = str(info.value)
    assert key in text and says in text, text


def test_speeds_conflict_with_an_explicit_partition():
    with pytest.raises(ConfigError, match=r"replan\.speeds .* no effect with train\.stage_units"):
        _check(["replan.speeds=[1, 0.5]", "train.stage_units=[4, 4]"])


def test_speeds_known_in_advance_shape_the_first_partition(cli):
    r = cli(["plan", str(TINY), "--world", "2", "--set", "topology.pp=2"])
    assert r.returncode == 0, r.output
    assert "layer partition balanced by flops: stage_units [4, 4]" in r.stdout
    r = cli(["plan", str(TINY), "--world", "2", "--set", "topology.pp=2", "--set",
             "replan.speeds=[1, 0.5]"])  # fmt: skip
    assert r.returncode == 0, r.output
    assert "for rank speeds [1.0, 0.5] (replan.speeds): stage_units [5, 3]" in r.stdout
