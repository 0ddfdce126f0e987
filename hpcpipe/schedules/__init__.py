"""Pipeline schedules as data: build, lower, validate, simulate and draw them. No MPI here.

A `Schedule` is frozen data (placement + each rank's ordered actions). Generators build the
published schedules; `lower` adds explicit SEND/RECV actions; `validate` proves a schedule runs
(every dependency met, no deadlock under blocking send/receive) and returns the lowered form
the runtime executes; `simulate` predicts time, bubbles and memory under a `CostModel`.
"""

from hpcpipe.schedules.errors import ScheduleError, format_step_grid
from hpcpipe.schedules.ir import (
    Action,
    Kind,
    Schedule,
    from_csv,
    read_csv,
    to_csv,
    write_csv,
)
from hpcpipe.schedules.lower import lower, strip_comm
from hpcpipe.schedules.registry import SCHEDULE_NAMES, build_schedule, stages_per_rank
from hpcpipe.schedules.simulate import CostModel, SimResult, simulate
from hpcpipe.schedules.validate import validate

__all__ = [
    "SCHEDULE_NAMES",
    "Action",
    "CostModel",
    "Kind",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "build_schedule",
    "format_step_grid",
    "from_csv",
    "lower",
    "read_csv",
    "simulate",
    "stages_per_rank",
    "strip_comm",
    "to_csv",
    "validate",
    "write_csv",
]
