"""Overlapped F&B pairs: representation, lowering, proof, cost model and replay."""

from __future__ import annotations

import numpy as np
import pytest

from hpcpipe.schedules import (
    Action,
    CostModel,
    Kind,
    Schedule,
    ScheduleError,
    build_schedule,
    from_csv,
    lower,
    simulate,
    to_csv,
    validate,
)
from hpcpipe.schedules.config import PipelineConfig, cost_model
from hpcpipe.schedules.replay import replay_in_order


def paired(p: int, m: int) -> Schedule:
    return build_schedule("dualpipe-v", p, m, pairs=True)


def test_dualpipe_v_pairs_each_forward_with_the_other_chunks_backward():
    s = paired(4, 8)
    assert s.pairs.size and build_schedule("dualpipe-v", 4, 8).pairs.size == 0
    for i in s.pairs.tolist():
        f, b = s._action_at(i), s._action_at(i + 1)
        assert f.kind == Kind.F and b.kind in (Kind.B, Kind.BW)
        assert f.stage != b.stage and s.rank_of_stage[f.stage] == s.rank_of_stage[b.stage]
    # the same actions in the same order, only run as pairs
    plain = s.unpaired()
    assert np.array_equal(plain.kinds, s.kinds) and plain != s
    assert plain.fingerprint() != s.fingerprint()
    assert plain.fingerprint() == build_schedule("dualpipe-v", 4, 8).fingerprint()


def test_csv_writes_a_pair_as_one_cell_and_reads_it_back():
    s = paired(2, 4)
    text = to_csv(s)
    assert "&" in text
    back = from_csv(text)
    assert np.array_equal(back.pairs, s.pairs) and back.rank_pairs(0) == s.rank_pairs(0)
    assert to_csv(back) == text
    rows = [line for line in text.splitlines() if not line.startswith("#")]
    cell = next(c for c in rows[0].split(",") if "&" in c)
    f, b = (Action.parse(half) for half in cell.split("&"))
    assert f.kind == Kind.F and b.kind in (Kind.B, Kind.BW)


@pytest.mark.parametrize(
    ("cell", "why"),
    [
        ("0F1&0F0", "an F followed by the B or BW"),
        ("0F1&0W0", "an F followed by the B or BW"),
        ("0F1&0B0&0W0", "joins exactly two actions"),
    ],
)
def test_malformed_pairs_are_refused_naming_the_cell(cell, why):
    text = f"0F0,{cell},0BW1\n1F0,1BW0,1F1,1BW1\n"
    with pytest.raises(ValueError, match=why):
        from_csv(text)


def test_halves_that_feed_each_other_are_refused():
    # a backward needs its own forward's context: it cannot start beside it (a middle
    # stage, whose backward input comes from the next rank, and the last stage)
    middle = [["0F0", "0F1", "0BW0", "0BW1"], ["1F0&1BW0", "1F1", "1BW1"], ["2F0", "2BW0"]]
    middle[2] += ["2F1", "2BW1"]
    for rows in (middle, [["0F0", "0F1", "0BW0", "0BW1"], ["1F0&1BW0", "1F1", "1BW1"]]):
        with pytest.raises(ScheduleError, match="needs the forward half's result"):
            validate(Schedule.from_actions(rows, name="own"))
    # the last stage's backward of another microbatch may pair: it needs an earlier F
    fine = [["0F0", "0F1", "0BW0", "0BW1"], ["1F0", "1F1&1BW0", "1BW1"]]
    validate(Schedule.from_actions(fine, name="fine"))


@pytest.mark.parametrize(("p", "m"), [(2, 4), (2, 6), (3, 6), (4, 8), (4, 16), (8, 16)])
def test_lowering_keeps_pairs_whole_and_the_proof_holds(p, m):
    s = paired(p, m)
    low = validate(s)  # deadlock-free under the runtime's semantics (or it raises)
    assert low.pairs.size == s.pairs.size
    for r in range(p):
        acts, starts = low.rank_actions(r), sorted(low.rank_pairs(r))
        for i in starts:
            f, b = acts[i], acts[i + 1]
            assert f.kind == Kind.F and b.kind in (Kind.B, Kind.BW)
            # both halves' receives before the pair, both sends after it
            recv_b = (Kind.RECV_B, b.stage, b.microbatch)
            before = {(a.kind, a.stage, a.microbatch) for a in acts[:i]}
            needs_b = b.stage < 2 * p - 1 and low.rank_of_stage[b.stage + 1] != r
            assert (recv_b in before) == needs_b
            after = {(a.kind, a.stage, a.microbatch) for a in acts[i + 2 :]}
            sends_f = f.stage < 2 * p - 1 and low.rank_of_stage[f.stage + 1] != r
            assert ((Kind.SEND_F, f.stage, f.microbatch) in after) == sends_f
    # the lowered form survives the CSV round trip with its pairs
    assert from_csv(to_csv(low)).pairs.tolist() == low.pairs.tolist()


def test_pair_cost_hides_each_halfs_communication_behind_the_other():
    s = paired(2, 4)
    c = 0.25
    costs = CostModel(t_f=1.0, t_b=2.0, t_w=1.0, t_comm=c)
    sim = simulate(s, costs)
    # compute indices = positions (no SEND/RECV in the generator's form)
    for i in s.pairs.tolist():
        took_f = sim.end[i] - sim.start[i]
        took_b = sim.end[i + 1] - sim.start[i + 1]
        t_b = 3.0 if sim.kind[i + 1] == Kind.BW else 2.0
        # compute F 0.75, compute B t_b - 0.25: each half's 0.25 hides behind the other
        assert took_f == pytest.approx(1.0 - c) and took_b == pytest.approx(t_b - c)
        assert sim.start[i + 1] == pytest.approx(sim.end[i])
    # communication longer than the partner's compute shows through
    big = CostModel(t_f=1.0, t_b=1.0, t_w=1.0, t_comm=0.8)
    sim = simulate(s, big)
    i = int(s.pairs[0])
    pair = sim.end[i + 1] - sim.start[i]
    kind_b = Kind(int(sim.kind[i + 1]))
    t_b = 2.0 if kind_b == Kind.BW else 1.0
    comp_f, comp_b = 1.0 - 0.8, t_b - 0.8
    want = comp_f + comp_b + max(0.0, 0.8 - comp_b) + max(0.0, 0.8 - comp_f)
    assert pair == pytest.approx(want)


def test_a_pair_starts_when_both_inputs_are_there():
    # without communication to hide, pairing can only wait: never faster than one by one
    for p, m in [(2, 4), (4, 8), (4, 16)]:
        s = paired(p, m)
        costs = CostModel(t_f=1.0, t_b=1.0, t_w=1.0)
        sim = simulate(s, costs)
        assert sim.makespan >= simulate(s.unpaired(), costs).makespan
        low = lower(s)
        table_pos = np.flatnonzero(low.kinds < Kind.SEND_F)
        pf = np.searchsorted(table_pos, low.pairs)
        # each pair's F half starts no earlier than its B half's input was produced
        b_stage, b_mb = sim.stage[pf + 1], sim.microbatch[pf + 1]
        for j, (st, mb) in enumerate(zip(b_stage.tolist(), b_mb.tolist(), strict=True)):
            if st == 2 * p - 1:
                continue  # its input is its own F
            producer = np.flatnonzero(
                (sim.stage == st + 1)
                & (sim.microbatch == mb)
                & np.isin(sim.kind, (Kind.B, Kind.BW))
            )[0]
            assert sim.start[pf[j]] >= sim.end[producer] - 1e-9


@pytest.mark.parametrize("comm", [0.0, 0.3, 0.5])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 12)])
def test_runtime_order_replays_in_the_simulated_time(p, m, comm):
    s = paired(p, m)
    costs = CostModel(t_f=1.0, t_b=1.5, t_w=0.5, t_comm=comm)
    assert replay_in_order(validate(s), costs) == pytest.approx(simulate(s, costs).makespan)


@pytest.mark.parametrize("comm", [0.0, 0.5])
def test_a_pairs_forward_result_leaves_with_the_pair(comm):
    """The F half's SEND follows the B half (the pair is one step): its consumer on the next
    rank cannot start before the whole pair ends, in the simulator as in the lowered order."""
    s = from_csv("0F0,0F1&0BW0,0BW1\n1F0,1BW0,1F1,1BW1\n")
    costs = CostModel(t_f=1.0, t_b=5.0, t_w=0.0, t_bw=5.0, t_comm=comm)
    sim = simulate(s, costs)
    assert replay_in_order(validate(s), costs) == pytest.approx(sim.makespan)
    pair_end = sim.end[2]  # 0BW0, the pair's second half on rank 0
    f1 = [j for j in range(sim.offsets[1], sim.offsets[2]) if sim.kind[j] == Kind.F][1]
    assert sim.microbatch[f1] == 1 and sim.start[f1] >= pair_end - 1e-12


def test_pairs_save_what_they_hide_in_the_deck_cost_model():
    cfg = PipelineConfig(
        schedule="dualpipe-v", microbatches=16, t_alltoall=(0.5,), overlap_pairs=True
    )
    s = build_schedule("dualpipe-v", 4, 16, pairs=True)
    costs = cost_model(cfg, 4, s.num_stages)
    assert np.allclose(costs.stage_arrays(s.num_stages)["t_comm"], 0.25)
    saved = simulate(s.unpaired(), costs).makespan - simulate(s, costs).makespan
    assert saved > 0
    with pytest.raises(ValueError, match="only dualpipe-v defines overlapped pairs"):
        PipelineConfig(schedule="zb-v", overlap_pairs=True)


@pytest.mark.parametrize("comm", [0.0, 0.25])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (2, 8), (3, 6), (4, 8), (4, 16), (8, 16), (8, 32)])
def test_dualpipe_v_pairs_reach_the_papers_bubble(p, m, comm):
    """DualPipe's bubble (PP/2-1)(F&B + B - 3W), PP = 2p chunks here, B the full backward:
    F = B = W = 1 per chunk, each F and B holding `comm` of communication."""
    costs = CostModel(t_f=1.0, t_b=1.0, t_w=1.0, t_comm=comm)
    sim = simulate(paired(p, m), costs)
    f_and_b = (1 - comm) + (2 - comm) + max(0.0, comm - (2 - comm)) + max(0.0, comm - (1 - comm))
    assert float(sim.bubble.max()) == pytest.approx((p - 1) * (f_and_b + 2 - 3))
