"""`hpcpipe bench`: OSU-style benchmarks of hpcpipe against raw MPI, the simulator and the disk.

Each benchmark is a registered subcommand (`hpcpipe.bench.registry`): warm-up, barrier, timed
loop, rank 0 prints a table, `--json PATH` writes the same rows. Methods compared in one table
run interleaved in the same job, so they share the machine's noise, and every figure is a median
over repetitions. Nothing here imports mpi4py at module level except the benchmark modules
themselves, which the CLI imports only when one is run.
"""

from hpcpipe.bench import cli as _cli  # noqa: F401  (declares the benchmarks)
from hpcpipe.bench.registry import BENCHMARKS, Benchmark, benchmark
from hpcpipe.bench.table import Column, Report

__all__ = ["BENCHMARKS", "Benchmark", "Column", "Report", "benchmark"]
