"""Turn a hang into an error report: a per-rank thread that fires when one phase overruns.

A rank blocked in a receive that will never match, or in a collective a dead peer never joins,
burns the allocation silently. Each rank runs a `Watchdog`; workloads wrap every step (sweep
iteration, checkpoint) in `phase(...)` and keep a cheap "where am I" callback current. When a
phase runs longer than `run.watchdog_s`, the thread prints `[rank N on host] watchdog: ...` with
the rank's current action, waits a short grace period so the other ranks (which time out at
about the same moment) can print theirs, and aborts the job through `MPI_Abort`.

The thread only reads two attributes per poll; the phase bookkeeping on the hot path is two
attribute stores, so the watchdog costs nothing measurable per step.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from hpcpipe.mpi.guard import ABORT_GRACE_S, EXIT_RUNTIME, rank_prefix, report

__all__ = ["Watchdog"]

Where = Callable[[], str]


class Watchdog:
    """Abort the job when a phase takes longer than `limit_s` seconds (0 turns it off)."""

    def __init__(
        self,
        limit_s: float,
        *,
        key: str = "run.watchdog_s",
        grace_s: float = 2.0,
        poll_s: float | None = None,
        abort: Callable[[int], None] | None = None,
    ):
        self.limit_s, self.key, self.grace_s = float(limit_s), key, grace_s
        self.poll_s = poll_s if poll_s is not None else min(0.5, max(0.02, self.limit_s / 20))
        self._abort = abort or _mpi_abort
        self._armed: tuple[str, Where | None, float, float] | None = None
        """(label, where, started, limit) of the running phase, or None."""
        self._stop = threading.Event()
        self.fired: str | None = None
        self._thread: threading.Thread | None = None
        if self.limit_s > 0:
            self._thread = threading.Thread(
                target=self._watch, name="hpcpipe-watchdog", daemon=True
            )
            self._thread.start()

    @property
    def enabled(self) -> bool:
        return self._thread is not None

    @contextmanager
    def phase(self, label: str, where: Where | None = None) -> Iterator[None]:
        """Arm the watchdog for the body; `where()` says what this rank is doing if it fires."""
        self.arm(label, where)
        try:
            yield
        finally:
            self.disarm()

    def arm(self, label: str, where: Where | None = None, limit_s: float | None = None) -> None:
        """Start timing a phase (for loops whose begin and end sit in different calls);
        `limit_s` overrides the limit for this phase only."""
        if self._thread is None:
            return
        limit = self.limit_s if limit_s is None else float(limit_s)
        # one assignment: the thread never sees a label from one phase with another's clock
        self._armed = (label, where, time.monotonic(), limit)

    def disarm(self) -> None:
        self._armed = None

    def close(self) -> None:
        """Stop the thread (the job ended normally)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ thread

    def _watch(self) -> None:
        reported = None
        while not self._stop.wait(self.poll_s):
            armed = self._armed  # one read: a consistent snapshot of the phase
            if (
                armed is not None
                and armed is not reported
                and time.monotonic() - armed[2] > armed[3]
            ):
                reported = armed
                self._fire(armed)

    def _fire(self, armed: tuple[str, Where | None, float, float]) -> None:
        label, where_fn, started, limit = armed
        try:
            where = where_fn() if where_fn is not None else "(no detail)"
        except Exception as exc:  # the report must not die on a half-updated state
            where = f"(could not describe: {type(exc).__name__}: {exc})"
        # the limit is kept as given (a deadline minus its start is not always that number)
        over = f"{self.key} = {limit:g}" if limit == self.limit_s else f"its limit of {limit:g} s"
        self.fired = (
            f"{rank_prefix()} watchdog: {label} has run {time.monotonic() - started:.1f} s, "
            f"over {over}; this rank is at: {where}"
        )
        report(self.fired)
        # the other ranks time out within a poll interval: let their reports out first
        if self._stop.wait(self.grace_s):
            return
        if self._armed is not armed:  # the phase ended after all: keep watching
            report(f"{rank_prefix()} watchdog: {label} finished late")
            return
        report(
            f"{rank_prefix()} watchdog: aborting the job (MPI_Abort); raise {self.key} if "
            "this phase is legitimately slow"
        )
        self._abort(EXIT_RUNTIME)


def _mpi_abort(code: int) -> None:
    """MPI_Abort from this thread; if the MPI library cannot abort from here, exit hard (the
    launcher then ends the other ranks)."""
    backstop = threading.Timer(10.0, os._exit, args=(code,))
    backstop.daemon = True
    backstop.start()
    from mpi4py import MPI

    sys.stdout.flush()
    sys.stderr.flush()
    if MPI.Is_initialized() and not MPI.Is_finalized():
        time.sleep(ABORT_GRACE_S)  # let the launcher forward every rank's report first
        MPI.COMM_WORLD.Abort(code)
    os._exit(code)
