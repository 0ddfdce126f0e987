"""The compiled planning passes that large schedules (and long searches) take (the structure
check, the lowering's placement, the message check, the search's greedy, the V family's block
peaks and compaction) give the NumPy and Python paths' answers bit for bit, and every broken
schedule the same error."""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest

from hpcpipe.schedules import (
    SCHEDULE_NAMES,
    Kind,
    Schedule,
    ScheduleError,
    _compiled,
    build_schedule,
    from_csv,
    lower,
    simulate,
    to_csv,
    validate,
)
from hpcpipe.schedules._table import _build_table, compute_table
from hpcpipe.schedules.blocks import compacted_v, half_block, min_block, repeated_peak
from hpcpipe.schedules.listsched import Policy, Problem, list_schedule, unit_costs
from hpcpipe.schedules.vfamily import climbs, rank_rows
from hpcpipe.schedules.vshape import building_block

pytest.importorskip("numba")

lowering = importlib.import_module("hpcpipe.schedules.lower")
validation = importlib.import_module("hpcpipe.schedules.validate")
table_module = importlib.import_module("hpcpipe.schedules._table")
ALL, NONE = 0, 1 << 40  # thresholds: every schedule compiled, then none


def _cases():
    for name in SCHEDULE_NAMES:
        for p, m in ((2, 4), (4, 8), (5, 10), (8, 16)):
            for kw in ({}, {"pairs": True}) if name == "dualpipe-v" else ({},):
                try:
                    yield (
                        f"{name}-{p}-{m}{'-pairs' if kw else ''}",
                        build_schedule(name, p, m, **kw),
                    )
                except ValueError:
                    continue


CASES = list(_cases())


def _arrays(sched: Schedule) -> tuple:
    return (sched.offsets, sched.kinds, sched.stages, sched.microbatches, sched.pairs)


def _same(a: tuple, b: tuple) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("label,sched", CASES, ids=[c[0] for c in CASES])
def test_compiled_table_and_placement_equal_the_numpy_ones(label, sched):
    kernel = _compiled.kernel("_table_numba", "dependencies")
    ours = table_module._compiled_table(sched, kernel)
    assert ours is not None
    theirs = _build_table(sched)
    for field in ("pos", "kind", "stage", "mb", "rank", "offsets", "f_at", "b_at", "dep", "cross"):
        x, y = getattr(ours, field), getattr(theirs, field)
        assert x.dtype == y.dtype, field
        np.testing.assert_array_equal(x, y, err_msg=field)
    for field in ("pair_dep", "pair_cross", "timed_dep"):
        x, y = getattr(ours, field), getattr(theirs, field)
        assert (x is None) == (y is None)
        if x is not None:
            np.testing.assert_array_equal(x, y, err_msg=field)
    placed, pos = lowering._place_compiled(theirs, _compiled.kernel("_lower_numba", "place"))
    numpy_placed, numpy_pos = lowering._place(theirs)
    _same((*_arrays(placed), pos), (*_arrays(numpy_placed), numpy_pos))
    _same((pos,), (np.flatnonzero(placed.kinds < Kind.SEND_F),))


@pytest.mark.parametrize("label,sched", CASES, ids=[c[0] for c in CASES])
def test_validate_and_simulate_compiled_equal_numpy(label, sched, monkeypatch):
    answers = []
    for threshold in (ALL, NONE):
        monkeypatch.setattr(_compiled, "COMPILED_ACTIONS", threshold)
        table_module._last.clear()
        lowered = validate(sched)
        answers.append((_arrays(lowered), simulate(sched).end, simulate(lowered).end))
    _same(answers[0][0], answers[1][0])
    np.testing.assert_array_equal(answers[0][1], answers[1][1])
    np.testing.assert_array_equal(answers[0][2], answers[1][2])


@pytest.mark.parametrize("label,sched", CASES, ids=[c[0] for c in CASES])
def test_the_compiled_message_check_passes_the_lowerings_own_placement(label, sched):
    lowered = lower(sched)
    table = table_module._build_table(lowered)
    monkeypatch = pytest.MonkeyPatch()
    with monkeypatch.context() as patch:
        patch.setattr(_compiled, "COMPILED_ACTIONS", ALL)
        # a pair's messages sit around the whole pair, not next to their half: NumPy proves it
        assert validation._compiled_adjacent(lowered, table) == (not sched.pairs.size)


ONE_F_ONE_B = [
    ["0F0", "0F1", "0BW0", "0BW1"],
    ["1F0", "1BW0", "1F1", "1BW1"],
]


def _v_turnaround_swapped() -> tuple[list, dict]:
    s = build_schedule("zb-v", 2, 2)
    rows = [[str(a) for a in r] for r in s.actions]
    i, j = rows[1].index("1F0"), rows[1].index("2F0")
    rows[1][i], rows[1][j] = rows[1][j], rows[1][i]
    return rows, {"stages_of_rank": s.stages_of_rank}


BROKEN = {
    "missing W": ([["0F0", "0B0", "0W0"], ["1F0", "1B0"]], {}),
    "B before F": ([["0F0", "0F1", "0BW0", "0BW1"], ["1F0", "1BW1", "1F1", "1BW0"]], {}),
    "W before B": ([["0F0", "0B0", "0W0"], ["1F0", "1W0", "1B0"]], {}),
    "duplicate F": ([["0F0", "0F0", "0BW0"]], {}),
    "missing F": ([["0F0", "0BW0", "0BW1"]], {"num_microbatches": 2}),
    "fused and split": ([["0F0", "0BW0", "0W0"]], {}),
    "wrong rank": ([["0F0", "1F0", "0BW0"], ["1BW0"]], {"stages_of_rank": [(0,), (1,)]}),
    "V turnaround": _v_turnaround_swapped(),
    "cycle": ([["0F0", "0BW0", "0F1", "0BW1"], ["1F0", "1F1", "1BW0", "1BW1"]], {}),
}


@pytest.mark.parametrize("rows,kw", BROKEN.values(), ids=BROKEN.keys())
def test_broken_schedules_fail_alike_on_both_paths(rows, kw, monkeypatch):
    sched = Schedule.from_actions(rows, **kw)
    kernel = _compiled.kernel("_table_numba", "dependencies")
    if rows is not BROKEN["cycle"][0]:  # a cycle has a sound structure: the timing finds it
        assert table_module._compiled_table(sched, kernel) is None
    messages = []
    for threshold in (ALL, NONE):
        monkeypatch.setattr(_compiled, "COMPILED_ACTIONS", threshold)
        table_module._last.clear()
        with pytest.raises(ScheduleError) as info:
            validate(sched)
        messages.append(str(info.value))
    assert messages[0] == messages[1]


def _misplaced() -> dict[str, str]:
    ok = to_csv(lower(Schedule.from_actions(ONE_F_ONE_B)))
    v = to_csv(lower(build_schedule("zb-v", 2, 2)))
    sends = ok.replace("1RECV_F0,1F0", "1F0,1RECV_F0")
    return {
        "received late": sends,
        "sent early": ok.replace("0F1,0SEND_F1", "0SEND_F1,0F1"),
        "no receive": ok.replace("1RECV_F1,", ""),
        "twice": ok.replace("0SEND_F1,", "0SEND_F1,0SEND_F1,"),
        "off the end": ok.replace("0F0,", "0RECV_F0,0F0,", 1),
        "same rank": v.replace("1F0,", "1F0,1SEND_F0,", 1).replace("2F0,", "2RECV_F0,2F0,", 1),
        "no pair": ok.replace("0SEND_F1,", "").replace("1RECV_F1,", ""),
        "channel order": ok.replace("0SEND_F0,0F1,0SEND_F1", "0F1,0SEND_F1,0SEND_F0"),
    }


@pytest.mark.parametrize("text", _misplaced().values(), ids=_misplaced().keys())
def test_the_compiled_message_check_doubts_every_broken_message(text, monkeypatch):
    sched = from_csv(text)
    table = compute_table(sched)
    monkeypatch.setattr(_compiled, "COMPILED_ACTIONS", ALL)
    assert not validation._compiled_adjacent(sched, table)
    with pytest.raises(ScheduleError):
        validation._check_messages(sched, table, np.zeros(table.n, dtype=np.int64))


def test_without_numba_every_pass_takes_numpy(monkeypatch):
    sched = build_schedule("zb-v", 4, 8)
    expected = _arrays(validate(sched))
    monkeypatch.setattr(_compiled, "COMPILED_ACTIONS", ALL)
    monkeypatch.setattr(_compiled, "kernel", lambda module, name: None)
    table_module._last.clear()
    _same(_arrays(validate(sched)), expected)


def _greedy_cases():
    """Problems the search's greedy meets: both placements, uneven stages, B that frees part
    of the activations, transfers, every policy knob; caps from the floor up."""
    rng = np.random.default_rng(7)
    for case in range(120):
        p, m = int(rng.integers(1, 7)), int(rng.integers(1, 13))
        v = bool(case % 3)
        stages = 2 * p if v else p

        def pick(*xs: float, n: int = stages) -> tuple[float, ...]:
            return tuple(float(x) for x in rng.choice(xs, n))

        prob = dataclasses.replace(
            Problem.build(p, m, unit_costs(p), v),
            dur=(pick(0.5, 1.0, 1.3, 2.0), pick(0.7, 1.0, 2.0), pick(0.3, 1.0, 1.1)),
            act=pick(0.25, 0.5, 1.0, 1 / 3),
            b_frees=float(rng.choice([0.0, 0.5, 1 / 3])),
            comm=float(rng.choice([0.0, 0.1, 0.37])),
        )
        depth = None if case % 2 else tuple(int(d) for d in rng.integers(1, m + 1, p))
        policy = Policy(
            v,
            [None, 0, 1, 2, 3][case % 5],
            "up" if v and case % 4 == 1 else "old",
            depth,
            late_f=v and case % 7 < 3,
            reserve=1 + (case // 3) % 3,
            flips=tuple(
                sorted({int(d): int(a) for d, a in rng.integers(0, [2 * m, 3], (3, 2))}.items())
            )
            if case % 4 == 0
            else (),
        )
        cap = prob.floor * float(rng.choice([1.0, 1.5, 2.0, 3.0, 10.0]))
        yield prob, cap, policy, case % 3 == 0


def test_the_compiled_greedy_gives_the_python_loops_run(monkeypatch):
    runs = []
    for threshold in (NONE, ALL):
        monkeypatch.setattr(_compiled, "COMPILED_ACTIONS", threshold)
        runs.append([list_schedule(*case) for case in _greedy_cases()])
    for python, compiled in zip(*runs, strict=True):
        assert python is not None and compiled is not None
        assert (python.makespan, python.depth_bound, python.ends) == (
            compiled.makespan,
            compiled.depth_bound,
            compiled.ends,
        )
        for ours, theirs in zip(python.order, compiled.order, strict=True):
            np.testing.assert_array_equal(ours, theirs)
        assert (python.alts is None) == (compiled.alts is None)
        if python.alts is not None:
            np.testing.assert_array_equal(python.alts, compiled.alts)
    assert len({run.makespan for run in runs[0]}) > 50  # the cases differ
    tracked = [run.alts for run in runs[0] if run.alts is not None]
    assert len(tracked) > 40 and sum(a.size for a in tracked) > 500  # choices were counted
    # and the flips changed runs: the same cases without them give other orders
    for threshold in (NONE, ALL):
        monkeypatch.setattr(_compiled, "COMPILED_ACTIONS", threshold)
        plain = [
            list_schedule(prob, cap, dataclasses.replace(policy, flips=()))
            for prob, cap, policy, _ in _greedy_cases()
        ]
        flipped = [
            i
            for i, (case, run) in enumerate(zip(_greedy_cases(), plain, strict=True))
            if case[2].flips
            and any(
                not np.array_equal(a, b) for a, b in zip(run.order, runs[0][i].order, strict=True)
            )
        ]
        assert len(flipped) > 10


def test_many_small_passes_switch_to_the_kernels_once_their_numpy_cost_adds_up(monkeypatch):
    monkeypatch.setattr(_compiled, "COMPILED_ACTIONS", 1000)
    monkeypatch.setattr(_compiled, "_numpy_actions", 0)
    assert not _compiled.wanted(600)
    assert not _compiled.wanted(100, weight=3)  # 900 so far
    assert _compiled.wanted(250, weight=4)  # one pass worth a kernel on its own
    assert not _compiled.wanted(100)  # 1000 reached by this one
    assert _compiled.wanted(1)  # from now on


def _blocks():
    """The family's blocks and the published ones, and random rows (slots shared by several
    actions, a rank with no free slot between its Bs)."""
    rng = np.random.default_rng(11)
    for p in (1, 2, 3, 5, 8, 12):
        for m in (1, 2, p, 2 * p + 1, 4 * p):
            for climb in climbs(p):
                yield rank_rows(building_block(p, climb), p), m
            yield min_block(p), m
            yield half_block(p), m
    for _ in range(200):
        p, m = int(rng.integers(1, 9)), int(rng.integers(1, 20))
        yield rng.integers(0, 4 * p + 6, (p, 4)), m


def test_the_compiled_block_peak_gives_the_numpy_one(monkeypatch):
    peaks = []
    for threshold in (NONE, ALL):
        monkeypatch.setattr(_compiled, "COMPILED_ACTIONS", threshold)
        peaks.append([repeated_peak(block, m) for block, m in _blocks()])
    assert peaks[0] == peaks[1]
    assert len(set(peaks[0])) > 10  # the cases differ


def test_the_compiled_compaction_gives_the_python_one(monkeypatch):
    """The V family's blocks compacted by the kernel (the search builds ten at p = 64, m =
    256) are the Python path's schedules, action for action."""
    built = []
    for threshold in (NONE, ALL):
        monkeypatch.setattr(_compiled, "COMPILED_ACTIONS", threshold)
        monkeypatch.setattr(_compiled, "_numpy_actions", 0)
        built.append(
            [
                _arrays(compacted_v("x", len(block), m, block))
                for block, m in _blocks()
                if len(block) <= 8 and m <= 2 * len(block) + 1
            ]
        )
    assert len(built[0]) > 300
    for python, compiled in zip(*built, strict=True):
        assert all((a == b).all() for a, b in zip(python, compiled, strict=True))
    assert len({a[1].tobytes() for a in built[0]}) > 100  # the cases differ
