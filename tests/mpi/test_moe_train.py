"""Expert-parallel training (pp x dp x ep) over real MPI equals the all-experts-local reference."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.mpi

DECK = str(Path(__file__).resolve().parents[2] / "inputs" / "moe_tiny.toml")

PAIRS = ["pipeline.schedule=dualpipe-v", "moe.every=1"]
LAYOUTS = [  # (ranks, pp, dp, ep, extra overrides)
    (2, 1, 2, 1, []),
    (4, 1, 4, 2, []),
    (4, 1, 4, 4, []),
    (4, 2, 2, 2, []),
    (8, 2, 4, 4, []),
    (8, 2, 4, 2, ["pipeline.schedule=zb-v"]),
    (
        4,
        2,
        2,
        2,
        ["moe.hierarchical=true", "topology.ranks_per_node=1", "topology.cross_node=ignore"],
    ),
    (4, 1, 4, 4, ["moe.dropless=true", "moe.top_k=1"]),
    # DualPipeV's overlapped F&B pairs, an MoE block in every stage: both halves' exchanges in
    # flight together, flat and two-phase
    (4, 2, 2, 2, ["pipeline.overlap_pairs=true", *PAIRS]),
    # MoE in every other block: pairs of a stage with and one without (B first when only B has)
    (4, 2, 2, 2, ["pipeline.overlap_pairs=true", "pipeline.schedule=dualpipe-v", "moe.every=2"]),
    (
        4,
        2,
        2,
        2,
        [
            "pipeline.overlap_pairs=true",
            *PAIRS,
            "moe.hierarchical=true",
            "topology.ranks_per_node=1",
            "topology.cross_node=ignore",
        ],
    ),
]


@pytest.mark.parametrize(
    ("n", "pp", "dp", "ep", "extra"),
    LAYOUTS,
    ids=[
        f"pp{p}dp{d}ep{e}{'-' + x[0] if x else ''}{'-' + x[-3] if len(x) > 3 else ''}"
        for _, p, d, e, x in LAYOUTS
    ],
)
def test_moe_layout_matches_reference(mpirun, tmp_path, n, pp, dp, ep, extra):
    sets = [
        f"run.output={tmp_path}",
        "run.steps=3",
        f"topology.pp={pp}",
        f"topology.dp={dp}",
        f"topology.ep={ep}",
        *extra,
    ]
    r = mpirun(n, ["run", DECK, *[a for s in sets for a in ("--set", s)]], timeout=240)
    assert r.returncode == 0, r.output
    assert "verify OK" in r.stdout, r.output
    assert "tok/expert=" in r.stdout and "dropped=" in r.stdout


def test_experts_not_divisible_by_ep(mpirun, tmp_path):
    r = mpirun(
        4,
        [
            "run",
            DECK,
            "--set",
            f"run.output={tmp_path}",
            "--set",
            "topology.pp=1",
            "--set",
            "topology.dp=4",
            "--set",
            "topology.ep=4",
            "--set",
            "moe.experts=6",
        ],
        timeout=60,
    )
    assert r.returncode == 2, r.output
    assert "moe.experts" in r.stderr and r.stderr.count("ERROR:") == 1


def test_moe_trace_records_all_to_all_and_expert_load(mpirun, cli, tmp_path):
    r = mpirun(
        4,
        [
            "run",
            DECK,
            "--set",
            f"run.output={tmp_path}",
            "--set",
            "run.steps=2",
            "--set",
            "trace.enabled=true",
        ],
        timeout=240,
    )
    assert r.returncode == 0, r.output
    from hpcpipe.io.trace import EventKind, read_trace

    trace = read_trace(tmp_path / "trace.h5")
    kinds = {int(k) for ev in trace.events for k in ev["kind"]}
    assert {int(EventKind.ALLTOALL), int(EventKind.EXPERT)} <= kinds
    s = cli(["trace", "summary", str(tmp_path / "trace.h5")])
    assert s.returncode == 0 and "MoE: 4 experts, tokens per expert" in s.stdout, s.output


@pytest.mark.parametrize("paired", [False, True], ids=["action-by-action", "pairs"])
def test_pairs_keep_both_halves_exchanges_in_flight(mpirun, tmp_path, paired):
    """In an overlapped pair one half's all-to-all is still out when the other half's starts;
    run action by action (the same order), exchanges on a rank never overlap in time."""
    sets = [
        f"run.output={tmp_path}",
        "run.steps=2",
        "trace.enabled=true",
        "topology.pp=2",
        "topology.dp=2",
        "topology.ep=2",
        *PAIRS,
        f"pipeline.overlap_pairs={str(paired).lower()}",
    ]
    r = mpirun(4, ["run", DECK, *[a for s in sets for a in ("--set", s)]], timeout=240)
    assert r.returncode == 0, r.output
    assert "verify OK" in r.stdout, r.output
    import numpy as np

    from hpcpipe.io.trace import EventKind, read_trace

    trace = read_trace(tmp_path / "trace.h5")
    for rank, ev in enumerate(trace.events):
        a2a = np.sort(ev[ev["kind"] == int(EventKind.ALLTOALL)], order="t_start")
        assert len(a2a) == 64, (rank, len(a2a))  # 4 per MoE block per microbatch, 2 steps
        overlapping = int(np.sum(a2a["t_start"][1:] < a2a["t_end"][:-1]))
        if paired:
            assert overlapping > 0, rank
        else:
            assert overlapping == 0, rank


def test_an_error_inside_a_pair_names_both_halves(mpirun, tmp_path):
    """The B half of rank 0's first pair (0F3 & 3BW1) raises: the job ends with exit 1 and the
    report names the pair, whichever half failed."""
    sets = [
        f"run.output={tmp_path}",
        "run.steps=2",
        "topology.pp=2",
        "topology.dp=2",
        "topology.ep=2",
        "pipeline.schedule=dualpipe-v",
        "pipeline.overlap_pairs=true",
    ]
    r = mpirun(
        4,
        ["run", DECK, *[a for s in sets for a in ("--set", s)]],
        timeout=120,
        env={"HPCPIPE_INJECT_FAULT": "rank=0,at=backward:1,kind=raise,hit=2"},
    )
    assert r.returncode == 1, r.output
    assert "[rank 0 on " in r.stderr and "InjectedFault" in r.stderr, r.stderr
    assert "(0F3 & 3BW1, an overlapped pair)" in r.stderr, r.stderr
