"""hpcpipe: MPI-native pipeline, data and expert parallelism, and pipelined mesh sweeps.

Plans (rank maps, schedules, dispatch plans, sweep orders) are frozen data built by pure functions;
the MPI runtime is a thin interpreter that executes them.
"""

__version__ = "0.1.0"
