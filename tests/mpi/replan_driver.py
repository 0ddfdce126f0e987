"""A training run whose plan switches mid-run to a given schedule and microbatch count, as a
re-plan with [replan] search does (`Trainer._repartition` with a schedule), then verifies
against the single-process reference: the switch changes how the batch is split and in which
order the actions run, not the mathematics.

    mpiexec -n 2 python tests/mpi/replan_driver.py DECK OUTPUT SCHEDULE M [KEY=VALUE ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    from mpi4py import MPI

    from hpcpipe.bench.training import world_context
    from hpcpipe.config import load_config
    from hpcpipe.runtime import RunContext
    from hpcpipe.schedules import build_schedule
    from hpcpipe.train.workload import Trainer

    deck, output, name, m, *sets = sys.argv[1:]
    comm = MPI.COMM_WORLD
    config = load_config(
        deck,
        [
            *sets,
            f"run.output={output}",
            "run.steps=6",
            "train.verify=true",
            "replan.enabled=true",
            "replan.check_every=1000",
        ],
    )
    quiet = world_context(comm, config)  # what `hpcpipe run` builds, logging on rank 0
    ctx = RunContext(quiet.config, quiet.rankmap, quiet.comms, quiet.backend, quiet.output)
    trainer = Trainer(ctx)
    before = trainer.m
    for step in range(3):
        trainer.step(step)
    schedule = build_schedule(name, trainer.schedule.num_ranks, int(m))
    trainer._repartition(trainer.ranges, 0.0, schedule)
    for step in range(3, 6):
        trainer.step(step)
    ctx.log(f"switched: {before} -> {trainer.m} microbatches, schedule {trainer.schedule.name}")
    trainer.finish(complete=True)
    return 0


if __name__ == "__main__":
    from hpcpipe.mpi.guard import abort_on_error

    sys.exit(abort_on_error(main))
