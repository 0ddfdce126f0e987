"""Job control every workload shares: the scheduler's stop signal, `status.json`, `--resume`.

A batch job lives in time slices: Slurm warns with SIGUSR1 or SIGTERM before the time limit,
the run checkpoints and exits 0, the job script reads `<output>/status.json` to decide whether
to requeue, and the next slice continues with `hpcpipe run DECK --resume`. The training and
sweep runtimes both follow that protocol through the three names here.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from hpcpipe.config import ConfigError
from hpcpipe.io.checkpoint import CheckpointError, latest_checkpoint, resolve_checkpoint

__all__ = ["STATES", "StopSignal", "catch_early_stop", "find_checkpoint", "write_status"]

STATES = ("finished", "preempted", "not-converged")
"""Values of `state` in status.json: done, stopped on a signal (requeue), gave up (do not)."""


def write_status(output: Path, state: str, step: int, checkpoint: Path | None) -> None:
    """Write `<output>/status.json` atomically; call it on one rank (rank 0).

    The job scripts read it to decide a requeue, so it is replaced in one rename and never
    seen half written.
    """
    if state not in STATES:
        raise ValueError(f"status state {state!r} is not one of {', '.join(STATES)}")
    payload = {"state": state, "step": step, "checkpoint": str(checkpoint) if checkpoint else None}
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    tmp = output / "status.json.tmp"
    tmp.write_text(json.dumps(payload) + "\n", encoding="utf-8")
    tmp.replace(output / "status.json")


def find_checkpoint(comm: Any, where: str, directory: Path | None) -> Path:
    """Collective: the checkpoint `--resume` names, on every rank of `comm`.

    `where` is "latest" (the newest complete checkpoint in `directory`) or a path. Rank 0 looks
    and broadcasts the answer, so every rank resumes from the same checkpoint or raises the
    same ConfigError (exit code 2).
    """
    path: Path | ConfigError | None = None
    if comm.rank == 0:
        try:
            if where == "latest":
                path = latest_checkpoint(directory) if directory is not None else None
                if path is None:
                    path = ConfigError(
                        "--resume", "", f"found no complete checkpoint in {directory}"
                    )
            else:
                path = resolve_checkpoint(where)
        except CheckpointError as exc:
            path = ConfigError("--resume", "", str(exc))
    path = comm.bcast(path, root=0)
    if isinstance(path, Exception):
        raise path
    return Path(path)


class _SignalThread:
    """Receives SIGUSR1 / SIGTERM on a thread of its own (`sigwait`), from process start.

    A Python signal handler only runs when the main thread returns to the interpreter, which a
    rank blocked inside an MPI call never does: a stop request would be lost and a second
    SIGTERM ignored. With the signals blocked in every thread (set before MPI starts, so MPI's
    own threads inherit the mask) and one thread waiting for them, the first signal is recorded
    for the workload's StopSignal (checkpoint at the end of the step, exit 0) and a second one
    of the same kind ends the process at once, whatever the main thread is doing.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self.listeners: list[StopSignal] = []
        self._lock = threading.Lock()
        signal.pthread_sigmask(signal.SIG_BLOCK, StopSignal.SIGNALS)
        threading.Thread(target=self._wait, name="hpcpipe-signals", daemon=True).start()

    def _wait(self) -> None:
        while True:
            signum = signal.sigwait(StopSignal.SIGNALS)
            with self._lock:
                if signum in self.received:  # asked twice: stop now, like the default action
                    name = signal.Signals(signum).name
                    print(f"hpcpipe: second {name}: exiting now", file=sys.stderr, flush=True)
                    os._exit(128 + signum)
                self.received.append(signum)
                for listener in self.listeners:
                    if listener.received is None:
                        listener.received = signum


_THREAD: list[_SignalThread] = []


def catch_early_stop() -> None:
    """Route SIGUSR1 / SIGTERM to a signal thread for the rest of the process; call it in the
    main thread before MPI starts (the CLI does).

    A scheduler that warns while the job is still starting (MPI_Init, reading the deck,
    building the model) or while a rank waits inside MPI would otherwise kill the rank or lose
    the request; this way the first StopSignal starts out stopped, so the run checkpoints at
    the first opportunity and exits 0. The same signal a second time ends the process.
    """
    if _THREAD or not hasattr(signal, "pthread_sigmask"):
        return
    with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
        _THREAD.append(_SignalThread())


class StopSignal:
    """SIGUSR1 / SIGTERM (Slurm's time-limit warning) ask for a checkpoint and a clean exit.

    The handler only sets a flag; ranks agree on it in a reduction the step or iteration does
    anyway, so every rank stops after the same one. Under the CLI the signal thread sets it
    (see `catch_early_stop`); embedded use installs ordinary handlers instead.
    """

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        self._old: dict[int, Any] = {}
        if _THREAD:
            thread = _THREAD[0]
            with thread._lock:
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
            with _THREAD[0]._lock, contextlib.suppress(ValueError):
                _THREAD[0].listeners.remove(self)
        for sig, old in self._old.items():
            signal.signal(sig, old)
