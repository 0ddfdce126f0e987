"""Summary figures and the critical path on synthetic traces whose answers are known."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from trace_synth import V_SHAPE, one_f_one_b, timeline_events, write_synthetic

from hpcpipe.analysis import critical_path, format_summary, match_messages, summarize
from hpcpipe.io.trace import EVENT_DTYPE, EventKind, read_trace
from hpcpipe.schedules.simulate import CostModel, simulate

K = EventKind
UNIFORM = CostModel(t_f=1000, t_b=1000, t_w=1000)


def _summary(tmp_path, schedule, costs, name="t.h5", **kw):
    path, sim = write_synthetic(tmp_path / name, schedule, costs, **kw)
    trace = read_trace(path)
    return trace, summarize(trace), sim


def _recv_waits(sim):
    """Per rank: total receive wait and late-sender time, computed from the simulation."""
    sched = sim.schedule
    rank_of, last = sched.rank_of_stage, sched.num_stages - 1
    end = {}
    for r in range(sched.num_ranks):
        for a, _, t1 in sim.timeline(r):
            end[(a.kind.name, a.stage, a.microbatch)] = t1
    wait = np.zeros(sched.num_ranks)
    late = np.zeros(sched.num_ranks)
    for r in range(sched.num_ranks):
        free = 0.0
        for a, t0, t1 in sim.timeline(r):
            s, kind, mb = a.stage, a.kind.name, a.microbatch
            producer = None
            if kind == "F" and s > 0 and rank_of[s - 1] != r:
                producer = end[("F", s - 1, mb)]
            elif kind in ("B", "BW") and s < last and rank_of[s + 1] != r:
                producer = end.get(("B", s + 1, mb), end.get(("BW", s + 1, mb)))
            if producer is not None:
                wait[r] += t0 - free
                late[r] += min(max(0.0, producer - free), t0 - free)
            free = t1
    return wait, late


def test_1f1b_bubble_matches_the_closed_form_and_the_simulator(tmp_path):
    p, m = 4, 8
    sched = one_f_one_b(p, m)
    _trace, s, sim = _summary(tmp_path, sched, UNIFORM, steps=3, peak_bytes=[3 << 20] * p)
    assert s.steps == (0, 1, 2) and len(s.per_step) == 3
    closed = (p - 1) / (m + p - 1)
    for st in s.per_step:
        assert st.bubble == pytest.approx(closed, abs=1e-12)
        assert st.time_ns == sim.makespan == (m + p - 1) * 3000
        assert st.peak_bytes == 3 << 20
    assert s.bubble == pytest.approx(closed, abs=1e-12)
    assert s.prediction is not None
    assert s.prediction.bubble == pytest.approx(closed, abs=1e-12)
    assert s.prediction.step_time_ns == pytest.approx(sim.makespan)
    assert s.prediction.costs_ns["F"] == [1000.0] * p
    assert s.prediction.costs_ns["BW"] == [2000.0] * p
    np.testing.assert_array_equal(s.busy_ns, 3 * sim.busy)
    wait, late = _recv_waits(sim)
    np.testing.assert_allclose(s.comm_ns, 3 * wait)
    np.testing.assert_allclose(s.late_sender_ns, 3 * late)
    np.testing.assert_array_equal(s.busy_ns + s.comm_ns + s.idle_ns, 3 * sim.makespan)
    assert np.all(s.overlap_ns == 0) and np.all(s.io_ns == 0)
    assert s.messages == 3 * 2 * m * (p - 1) and s.unmatched_sends == s.unmatched_recvs == 0
    assert s.stragglers == () and s.slow_steps == ()
    assert s.peak_bytes == 3 << 20


def test_split_backward_v_shape_with_transfer_time(tmp_path):
    costs = CostModel(t_f=1000, t_b=1500, t_w=700, comm_latency=300)
    _trace, s, sim = _summary(tmp_path, V_SHAPE, costs, steps=2)
    for st in s.per_step:
        assert st.bubble == pytest.approx(sim.bubble_fraction, abs=1e-12)
        assert st.stage_bubble == pytest.approx(sim.stage_bubble_fraction, abs=1e-12)
    pred = s.prediction
    assert pred.transfer_ns == 300
    assert pred.bubble == pytest.approx(sim.bubble_fraction, abs=1e-12)
    assert pred.step_time_ns == pytest.approx(sim.makespan)
    assert pred.costs_ns["W"] == [700.0] * 4 and "BW" not in pred.costs_ns
    _, late = _recv_waits(sim)
    np.testing.assert_allclose(s.late_sender_ns, 2 * late)
    assert late.sum() > 0


def test_clock_offsets_are_undone_and_their_absence_shows(tmp_path):
    sched = one_f_one_b(3, 4)
    offsets = [0, 7 * 10**9, -3 * 10**9]
    _, ref, _ = _summary(tmp_path, sched, UNIFORM, name="ref.h5")
    _, shifted, _ = _summary(tmp_path, sched, UNIFORM, name="shift.h5", offsets=offsets)
    np.testing.assert_array_equal(shifted.busy_ns, ref.busy_ns)
    np.testing.assert_array_equal(shifted.late_sender_ns, ref.late_sender_ns)
    assert shifted.bubble == ref.bubble
    _, raw, _ = _summary(tmp_path, sched, UNIFORM, name="raw.h5", offsets=offsets, with_clock=False)
    assert raw.per_step[0].time_ns > 10**9  # unaligned ranks look seconds apart


def test_critical_path_of_1f1b_is_all_compute(tmp_path):
    p, m = 4, 6
    trace, s, sim = _summary(tmp_path, one_f_one_b(p, m), UNIFORM)
    cp = s.per_step[0].critical
    assert cp.length_ns == sim.makespan
    assert sum(cp.breakdown.values()) == cp.length_ns
    assert cp.breakdown.get("idle", 0) == 0 and cp.breakdown.get("transfer", 0) == 0
    assert cp.breakdown["F"] + cp.breakdown["BW"] == sim.makespan
    assert cp.ranks[0] == 0 and cp.ranks[-1] == 0 and max(cp.ranks) == p - 1
    events = [trace.events[r][i] for r, i in cp.events]
    assert all(a["t_end"] <= b["t_end"] for a, b in itertools.pairwise(events))


def test_critical_path_counts_transfers_and_start_lag(tmp_path):
    costs = CostModel(t_f=1000, t_b=1000, t_w=1000, comm_latency=400)
    trace, _, sim = _summary(tmp_path, one_f_one_b(2, 2), costs)
    cp = critical_path(trace, 0)
    assert cp.length_ns == sim.makespan
    assert sum(cp.breakdown.values()) == cp.length_ns
    assert cp.breakdown["transfer"] == 2 * 400  # one forward and one backward hop


def test_stragglers_ranks_and_steps(tmp_path):
    sched = one_f_one_b(4, 4)
    sim = simulate(sched, UNIFORM)
    # two replicas of the pipeline (world ranks 0-3 and 4-7); world rank 6 runs 1.5x slower,
    # and step 2 is 1.4x slower on every rank
    a = timeline_events(sim, steps=3, stretch=lambda st, r: 1.4 if st == 2 else 1.0)
    b = timeline_events(
        sim,
        steps=3,
        world=[4, 5, 6, 7],
        stretch=lambda st, r: (1.5 if r == 2 else 1.0) * (1.4 if st == 2 else 1),
    )
    events = a + b[4:]
    topo = {"coords": {"pp": [0, 1, 2, 3] * 2, "dp": [0] * 4 + [1] * 4}}
    path, _ = write_synthetic(tmp_path / "s.h5", sched, UNIFORM, events=events, topology=topo)
    s = summarize(read_trace(path), threshold=0.1)
    flagged = dict(s.stragglers)
    assert set(flagged) == {6}, s.stragglers
    assert s.slowdown[6] == pytest.approx(1.5 / 1.25, rel=1e-9)
    assert "median time" in flagged[6]
    assert [st for st, _ in s.slow_steps] == [2]
    assert s.slow_steps[0][1] > 1.3
    loose = summarize(read_trace(path), threshold=0.5)
    assert loose.stragglers == () and loose.slow_steps == ()


def test_moe_tokens_per_expert(tmp_path):
    sched = one_f_one_b(2, 2)
    sim = simulate(sched, UNIFORM)
    events = timeline_events(sim, steps=2)
    tokens = {0: [10, 30, 20, 20], 1: [25, 25, 25, 25]}  # step -> tokens of experts 0..3
    extra = []
    for step, per_expert in tokens.items():
        for e, n in enumerate(per_expert):
            t = step * 10**6 + 50 * e
            extra.append((t, t + 10, 0, float(n), step, e, 0, -1, int(K.EXPERT)))
    events[1] = np.concatenate([events[1], np.array(extra, dtype=EVENT_DTYPE)])
    path, _ = write_synthetic(tmp_path / "m.h5", sched, UNIFORM, events=events)
    s = summarize(read_trace(path))
    assert s.experts["experts"] == 4
    assert s.experts["tokens"] == [35.0, 55.0, 45.0, 45.0]
    assert s.experts["max_over_mean"] == pytest.approx(55 / 45)
    assert s.experts["worst_step_max_over_mean"] == pytest.approx(30 / 20)
    assert "MoE: 4 experts" in format_summary(s)


def test_async_allreduce_overlap_and_exposed_comm(tmp_path):
    sched = one_f_one_b(2, 2)
    sim = simulate(sched, UNIFORM)
    events = timeline_events(sim)
    end = int(events[0]["t_end"].max())
    # rank 0: an allreduce from 1000 ns before its last action ends to 500 ns after it
    extra = np.array(
        [(end - 1000, end + 500, 4096, 0.0, 0, 0, -1, -1, int(K.ALLREDUCE))], dtype=EVENT_DTYPE
    )
    events[0] = np.concatenate([events[0], extra])
    path, _ = write_synthetic(tmp_path / "a.h5", sched, UNIFORM, events=events)
    s = summarize(read_trace(path))
    recv_wait = _recv_waits(sim)[0][0]
    assert s.comm_ns[0] == recv_wait + 1500
    assert s.overlap_ns[0] == 1000
    # the reductions: in flight 1500 ns, 1000 of them during rank 0's own last action (the
    # step's last work), 500 after it: they lengthened the step by 500 ns
    assert (s.reduce_ns[0], s.reduce_behind_compute_ns[0], s.reduce_exposed_ns[0]) == (
        1500,
        1000,
        500,
    )
    assert s.reduce_hidden == pytest.approx(1 - 500 / 1500)


def test_reductions_hidden_in_a_bubble_do_not_lengthen_the_step(tmp_path):
    """Rank 1 reduces while it idles and rank 0 still computes: hidden, though not behind rank
    1's own compute; rank 0 reduces after the step's last action: all of it exposed."""
    sched = one_f_one_b(2, 2)
    sim = simulate(sched, UNIFORM)
    events = timeline_events(sim, steps=2)
    for step in (0, 1):
        own = [e[(e["step"] == step) & (e["kind"] != K.STEP)] for e in events]
        end0, end1 = (int(o["t_end"].max()) for o in own)
        assert end1 + 300 < end0  # rank 1 finishes first in 1F1B
        rows = [
            (0, (end0, end0 + 700)),  # after everything: exposed
            (1, (end1, end1 + 300)),  # in rank 1's cooldown bubble: hidden
        ]
        for rank, (t0, t1) in rows:
            extra = np.array(
                [(t0, t1, 64, 0.0, step, rank, -1, -1, int(K.ALLREDUCE))], dtype=EVENT_DTYPE
            )
            events[rank] = np.concatenate([events[rank], extra])
    path, _ = write_synthetic(tmp_path / "h.h5", sched, UNIFORM, events=events, steps=2)
    s = summarize(read_trace(path))
    assert s.reduce_ns.tolist() == [1400, 600]
    assert s.reduce_exposed_ns.tolist() == [1400, 0]
    assert s.reduce_behind_compute_ns.tolist() == [0, 0]
    assert s.reduce_hidden == pytest.approx(600 / 2000)
    text = format_summary(s)
    assert "30.0% hidden" in text and "exposed 350 ns per step (worst rank 0: 700 ns)" in text
    assert s.as_dict()["reduce_hidden"] == pytest.approx(0.3)


def test_unmatched_messages_are_counted(tmp_path):
    sched = one_f_one_b(2, 2)
    events = timeline_events(simulate(sched, UNIFORM))
    recv = np.flatnonzero(events[1]["kind"] == K.RECV_F)[0]
    events[1] = np.delete(events[1], recv)
    path, _ = write_synthetic(tmp_path / "u.h5", sched, UNIFORM, events=events)
    trace = read_trace(path)
    msgs = match_messages(trace)
    assert (msgs.unmatched_sends, msgs.unmatched_recvs) == (1, 0)
    assert len(msgs) == 3


def test_summary_text_and_json_agree(tmp_path):
    _, s, _ = _summary(tmp_path, one_f_one_b(4, 8), UNIFORM, steps=2)
    text = format_summary(s)
    assert "pipeline bubble: measured 27.3%, predicted 27.3%" in text
    assert "1f1b (p=4, m=8)" in text and "stragglers" in text
    d = s.as_dict()
    assert d["bubble"] == pytest.approx(3 / 11)
    assert d["per_step"][1]["critical_path"]["F"] > 0
    assert d["messages"]["matched"] == 2 * 2 * 8 * 3


def test_bad_arguments(tmp_path):
    trace, _, _ = _summary(tmp_path, one_f_one_b(2, 2), UNIFORM)
    with pytest.raises(ValueError, match="steps"):
        summarize(trace, steps=[5])
    with pytest.raises(ValueError, match="threshold"):
        summarize(trace, threshold=-1)
    with pytest.raises(ValueError, match="step 9"):
        critical_path(trace, 9)
