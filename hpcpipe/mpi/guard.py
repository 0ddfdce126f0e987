"""One rank failing must end the whole job, loudly and fast, never hang the others.

An unhandled exception on any rank prints `[rank N on host] ...` with the traceback to stderr
and calls `MPI.COMM_WORLD.Abort`, which makes the launcher kill every rank and exit non-zero.
Bad input found identically on every rank (a deck error) exits 2 without Abort, printed once.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import TypeVar

from hpcpipe.textsafe import printable

T = TypeVar("T")

EXIT_RUNTIME = 1
EXIT_BAD_INPUT = 2


def report(text: str) -> None:
    """Write `text` and its newline to stderr in one system call: the launcher merges every
    rank's stderr, and a line written in pieces (what `print` does) can be interleaved with
    another rank's line. Writes up to 4 KiB to a pipe are atomic."""
    sys.stderr.flush()
    data = (text + "\n").encode(errors="replace")
    try:
        while data:
            data = data[os.write(2, data) :]
    except OSError:  # stderr closed: nothing more can be said
        pass


def rank_prefix() -> str:
    """`[rank N on host]`, known even before MPI is initialised (from launcher variables)."""
    rank = _launcher_rank()
    return f"[rank {rank if rank is not None else '?'} on {socket.gethostname()}]"


def _launcher_rank() -> int | None:
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            return MPI.COMM_WORLD.rank
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if var in os.environ:
            try:
                return int(os.environ[var])
            except ValueError:
                continue
    return None


def under_launcher() -> bool:
    """Whether an MPI launcher (mpiexec, srun) started this process."""
    return _launcher_rank() is not None


def launcher_rank() -> int:
    """This process's world rank as the launcher set it (0 when not under a launcher)."""
    rank = _launcher_rank()
    return 0 if rank is None else rank


def abort_on_error(fn: Callable[[], T], *, bad_input: tuple[type[BaseException], ...] = ()) -> T:
    """Run `fn`; on an unhandled exception print it with the rank prefix and abort the world.

    Exceptions in `bad_input` are reported once as `ERROR: ...` and exit with code 2 when every
    rank raised one (deck checks run identically everywhere); raised on one rank only, they
    abort the job with code 2 so that the other ranks cannot hang.
    """
    try:
        return fn()
    except SystemExit:
        raise
    except bad_input as exc:
        if _everyone_failed():
            if launcher_rank() == 0:
                report(printable(f"ERROR: {exc}"))
            _everyone_failed()  # again: no rank exits before rank 0 has written its report
            rank_zero_exits_first()
            sys.exit(EXIT_BAD_INPUT)
        report(printable(f"{rank_prefix()} ERROR: {exc}"))
        _abort(EXIT_BAD_INPUT)
        raise  # unreachable: Abort does not return
    except BaseException as exc:  # the job's last line of defence
        _report_crash(exc)
        _abort(EXIT_RUNTIME)
        raise  # unreachable: Abort does not return


REPORT_GRACE_S = 0.2
"""How long the other ranks wait after rank 0 reported bad input, so that rank 0 exits first:
Open MPI's mpirun tears the job down at the first non-zero exit, and could drop rank 0's line
still in its pipe (seen in CI's Open MPI lane: exit 2 and no ERROR line, about once in fifty
runs). MPI_Finalize waits for every rank (measured: MPICH and Open MPI both), so the ranks
finalize together before this wait (`_finalize`), or the wait would only delay rank 0 too."""


def rank_zero_exits_first() -> None:
    """After rank 0 reported bad input that every rank found: the other ranks exit
    `REPORT_GRACE_S` after it, MPI finalized first by all together where it was started.
    Nothing for a world of one (a test may go on using MPI in its process)."""
    rank = launcher_rank()
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            if MPI.COMM_WORLD.size == 1:
                return
            _finalize()
    if rank != 0:
        time.sleep(REPORT_GRACE_S)


def _finalize() -> None:
    """MPI_Finalize now, where no other thread of this process may be inside MPI (the deck
    checks fail before any starts; otherwise leave it to the exit)."""
    import threading

    from mpi4py import MPI

    if MPI.Is_initialized() and not MPI.Is_finalized() and threading.active_count() == 1:
        MPI.Finalize()


ABORT_GRACE_S = 0.5
"""Between a rank's report and MPI_Abort: the launcher forwards output through pipes, and an
abort that kills the job at once can lose the report still in them (seen with MPICH's hydra
on a loaded machine: exit 1 and an empty stderr)."""


def _abort(code: int) -> None:
    from mpi4py import MPI

    sys.stdout.flush()
    sys.stderr.flush()
    if MPI.Is_initialized() and not MPI.Is_finalized():
        time.sleep(ABORT_GRACE_S)
        MPI.COMM_WORLD.Abort(code)
    sys.exit(code)


def _everyone_failed(deadline_s: float = 5.0) -> bool:
    """Agree, with a deadline, that every rank failed; on a private communicator so that the
    agreement cannot match a collective the other ranks are still inside."""
    from mpi4py import MPI

    if not MPI.Is_initialized() or MPI.Is_finalized():
        return True  # failed before MPI started: every rank read the same deck
    comm = _agreement_comm()
    if comm.size == 1:
        return True
    req = comm.Ibarrier()
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if req.Test():
            return True
        time.sleep(0.005)
    return False


_AGREEMENT: list = []


def _agreement_comm():
    """A duplicate of COMM_WORLD made at start-up (see `prepare`), only for failure agreement."""
    from mpi4py import MPI

    return _AGREEMENT[0] if _AGREEMENT else MPI.COMM_WORLD


def prepare() -> None:
    """Call once right after MPI starts: duplicates the world for failure agreement."""
    from mpi4py import MPI

    if not _AGREEMENT:
        _AGREEMENT.append(MPI.COMM_WORLD.Dup())


def _report_crash(exc: BaseException) -> None:
    prefix = rank_prefix()
    tb = "".join(traceback.format_exception(exc)).rstrip()
    body = "\n".join(f"{prefix} {line}" for line in tb.splitlines())
    report(
        f"{prefix} unhandled {type(exc).__name__}: {exc}\n{body}\n"
        f"{prefix} aborting the whole job (MPI_Abort)"
    )
