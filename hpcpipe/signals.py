"""Stop requests: the scheduler's time-limit signals and Ctrl-C, received on a thread of their own.

A batch scheduler warns before the time limit with SIGUSR1 or SIGTERM; a person at a terminal
presses Ctrl-C (SIGINT). All three mean the same: finish the step, checkpoint, write
`status.json` and exit 0; the same signal a second time means now (exit 128 + signal, 130 for
Ctrl-C), one line, no tracebacks.

This module imports nothing heavy on purpose: `hpcpipe run` calls `catch_stop_signals` before
NumPy (whose BLAS starts threads at import) or MPI (which starts its own) is loaded, because a
thread inherits the signal mask it is created with, and a signal delivered to a thread that
does not block it is lost to the run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any

from hpcpipe.console import say
from hpcpipe.mpi.guard import launcher_rank

__all__ = ["StopSignal", "catch_stop_signals"]


class StopSignal:
    """A stop request: a flag set by SIGUSR1, SIGTERM or SIGINT, read between steps.

    Ranks agree on it in a reduction the step or iteration does anyway, so every rank stops
    after the same one. Under the CLI the signal thread sets it (see `catch_stop_signals`);
    embedded use installs ordinary handlers instead.
    """

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int | None = None
        self._old: dict[int, Any] = {}
        if _THREAD:
            thread = _THREAD[0]
            with thread.lock:
                self.received = thread.received[0] if thread.received else None
                thread.listeners.append(self)
            return
        for sig in self.SIGNALS:
            # outside the main thread (embedded use) there is no signal handling
            with contextlib.suppress(ValueError):
                self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signum

    @property
    def flag(self) -> float:
        """1.0 once a signal arrived, else 0.0: ready to be summed or maxed over ranks."""
        return 1.0 if self.received is not None else 0.0

    def restore(self) -> None:
        """Stop listening: put back the handlers that were installed before."""
        if _THREAD:
            with _THREAD[0].lock, contextlib.suppress(ValueError):
                _THREAD[0].listeners.remove(self)
        for sig, old in self._old.items():
            signal.signal(sig, old)


class _SignalThread:
    """Receives the stop signals on a thread of its own (`sigwait`), from process start.

    A Python signal handler only runs when the main thread returns to the interpreter, which a
    rank blocked inside an MPI call never does: a stop request would be lost and a second one
    ignored. With the signals blocked in every thread and one thread waiting for them, the
    first signal is recorded for the workload's StopSignal and a second one of the same kind
    ends the process at once, whatever the main thread is doing.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self.listeners: list[StopSignal] = []
        self.lock = threading.Lock()
        signal.pthread_sigmask(signal.SIG_BLOCK, StopSignal.SIGNALS)
        threading.Thread(target=self._wait, name="hpcpipe-signals", daemon=True).start()

    def _wait(self) -> None:
        while True:
            signum = signal.sigwait(StopSignal.SIGNALS)
            name = signal.Signals(signum).name
            with self.lock:
                if signum in self.received:  # asked twice: stop now, like the default action
                    if launcher_rank() == 0:  # one line for the job, not one per rank
                        say(f"hpcpipe: second {name}: exiting now", err=True)
                    os._exit(128 + signum)
                if signum == signal.SIGINT and launcher_rank() == 0:
                    say(
                        f"hpcpipe: {name}: stopping after this step with a checkpoint "
                        "(press Ctrl-C again to exit at once)",
                        err=True,
                    )
                self.received.append(signum)
                for listener in self.listeners:
                    if listener.received is None:
                        listener.received = signum


_THREAD: list[_SignalThread] = []


def catch_stop_signals() -> None:
    """Route the stop signals to a signal thread for the rest of the process; call it in the
    main thread before any other thread exists (the CLI does, first thing for `run`).

    A request that arrives while the job is still starting (MPI_Init, reading the deck,
    building the model) or while a rank waits inside MPI is then kept, not lost or fatal: the
    first StopSignal starts out stopped, so the run checkpoints at the first opportunity.
    """
    if _THREAD or not hasattr(signal, "pthread_sigmask"):
        return
    with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
        _THREAD.append(_SignalThread())
