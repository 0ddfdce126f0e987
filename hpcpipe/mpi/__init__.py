"""The one MPI layer: every module that imports mpi4py lives here (plus the process entry,
hpcpipe.runtime, and the benchmarks). Workloads get communicators, channels and collectives from
it and never name mpi4py themselves; staging, synchronisation, tags and failure handling live
here once.

- `comms`: communicators from a RankMap, node discovery;
- `p2p`: the pipeline's message channel (`Mailbox`);
- `collectives`: the bucketed data-parallel allreduce and named small reductions;
- `experts`: the expert-parallel all-to-all (`ExpertGroup`);
- `faces`: the sweep's face exchange between KBA neighbours (`FaceChannel`);
- `clock`: clock alignment and rank translation for traces;
- `guard`, `watchdog`: failure handling (`guard` imports mpi4py only when it must, so the CLI
  can use it before MPI starts).
"""

from typing import Any, TypeAlias

Comm: TypeAlias = Any
"""An MPI communicator (mpi4py's `MPI.Comm`), as workloads receive it: they call its methods
but never import mpi4py to name its type."""
