"""The end-of-run comparison: what it reports, and that a difference beyond rtol fails."""

from __future__ import annotations

import numpy as np
import pytest

from hpcpipe.train.reference import ReferenceResult
from hpcpipe.train.verify import compare_with_reference

REF = ReferenceResult([2.0, 1.0], [0.0, 0.0], {0: {"w": np.array([3.0, 4.0])}})


def test_equal_runs_pass_and_say_so():
    said = []
    compare_with_reference(said.append, "single-process reference", [2.0, 1.0],
                           {0: {"w": np.array([3.0, 4.0])}}, REF, 1e-10)  # fmt: skip
    assert said == [
        "verify OK: 1 tensors vs the single-process reference, max_rel_param=0.000e+00 "
        "(all equal) max_rel_loss=0.000e+00 rtol=1e-10"
    ]


def test_a_difference_beyond_rtol_names_the_tensor_and_fails():
    said = []
    off = {0: {"w": np.array([3.0, 4.0 + 5e-6])}}  # relative norm 1e-6
    with pytest.raises(RuntimeError, match=r"differ from the flush-free reference by 1\.000e-06 "
                       r"\(at unit 0 w\)"):  # fmt: skip
        compare_with_reference(said.append, "flush-free reference", [2.0, 1.0], off, REF, 1e-8)
    assert said[0].startswith("verify FAILED: 1 tensors vs the flush-free reference")
