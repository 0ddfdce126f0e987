"""The pipeline transport over real MPI: persistent receive buffers recycled by the plan across
microbatches and steps with every message intact, and a clear error for a message of the wrong
size (the stage, microbatch and sender named)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_json_driver

pytestmark = pytest.mark.mpi

DRIVER = Path(__file__).resolve().parent / "p2p_driver.py"


def _run(ranks: int, *what: str) -> list[dict]:
    return run_json_driver(ranks, DRIVER, *what)


def test_persistent_buffers_are_reused_across_microbatches_and_steps():
    (record,) = _run(4, "reuse")
    for rank in record["ranks"]:
        assert rank["ok"] and rank["same_requests"], rank
    # 1F1B, p=4, m=8: stage 3 gets 8 activations a step in 3 buffers (lookahead 3)
    last = record["ranks"][-1]
    assert last["messages_per_step"] == 8 and last["buffers"] < 8


@pytest.mark.parametrize(("n", "says"), [(7, "has 56 bytes, expected 160"), (40, "160 bytes")])
def test_a_message_of_the_wrong_size_names_stage_microbatch_and_sender(n, says):
    (record,) = _run(2, "wrong-size", str(n))
    error = record["error"]
    assert error is not None
    assert "activation into stage 1, microbatch 0, from pipeline rank 0" in error, error
    assert says in error, error
