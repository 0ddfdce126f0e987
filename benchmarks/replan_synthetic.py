"""Figure: re-planning a 4-rank pipeline around a slow rank, on a synthetic device.

    python benchmarks/replan_synthetic.py     # pp = 4, inputs/replan_synthetic.toml, 3 repeats

benchmarks/replan.py's cases on `inputs/replan_synthetic.toml`: a 16-unit GPT whose units' F, B
and W each last a modelled time (`[device] synthetic_us_per_row`; the real arithmetic inside
it, a sleep for the rest), so that 4 pipeline ranks keep their timing on a 2-core machine. The
slow rank is pipeline rank 1, a middle rank (in a deep pipeline most ranks are): it holds 4
full blocks, where the last rank's share is lightened by the loss head. Other arguments as in
benchmarks/replan.py, e.g. `--slow-rank 3`.
"""

from __future__ import annotations

from replan import main

if __name__ == "__main__":
    main(
        figure="replan_synthetic",
        deck="inputs/replan_synthetic.toml",
        ranks=4,
        slow_rank=1,
    )
