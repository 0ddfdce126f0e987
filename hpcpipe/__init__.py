"""hpcpipe: MPI-native pipeline, data and expert parallelism, and pipelined mesh sweeps.

Plans (rank maps, schedules, dispatch plans, sweep orders) are frozen data built by pure functions;
the MPI runtime is a thin interpreter that executes them.
"""

__version__ = "0.1.0"

import os as _os

if _os.environ.get("HPCPIPE_SOURCES_LOG"):  # a figure being measured: log the code it runs
    # (a standard-library-only module: importing more here, numpy say, would start its BLAS
    # threads before the CLI limits them per rank)
    from hpcpipe._sources import log_at_exit as _log_at_exit

    _log_at_exit()
