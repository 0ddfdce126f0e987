"""The bucketed data-parallel allreduce over real MPI: persistent collectives where the MPI
library has them (created once, started every step), the nonblocking fallback where it does
not (MPI 3 and mpi4py 3, CI's second lane), both exactly equal to the sum."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_json_driver

pytestmark = pytest.mark.mpi

DRIVER = Path(__file__).resolve().parent / "collectives_driver.py"


@pytest.mark.parametrize("ranks", [2, 3])
def test_bucketed_allreduce_persistent_and_fallback_are_exact(ranks):
    records = run_json_driver(ranks, DRIVER)[-1]
    fallback = records["fallback"]
    assert fallback == {
        "path": "nonblocking",
        "exact": True,
        "requests": 0,
        "reused": True,
        "progressed": True,
        "timed": True,
    }
    auto = records["auto"]
    assert auto["exact"] is True and auto["timed"] is True
    if records["mpi4"]:  # asked of the launched MPI: this process never initialises one
        # 3 + 2 buckets, created in the first step and the same objects in every later one
        assert auto == {
            "path": "persistent",
            "exact": True,
            "requests": 5,
            "reused": True,
            "progressed": True,
            "timed": True,
        }
    else:
        assert auto["path"] == "nonblocking" and auto["requests"] == 0 and auto["progressed"]
