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


_EARLY: list[int] = []


def _remember(signum: int, frame: Any) -> None:
    if signum in _EARLY:  # asked twice before any workload could act on it: die as usual
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    _EARLY.append(signum)


def catch_early_stop() -> None:
    """Hold SIGUSR1 / SIGTERM from process start until a workload's StopSignal takes over.

    Their default action kills the process; a scheduler that warns while the job is still
    starting (MPI_Init, reading the deck, building the model) would lose the whole slice. The
    first StopSignal created afterwards starts out stopped, so the run checkpoints at the
    first opportunity and exits 0. The same signal a second time ends the process as usual.
    """
    for sig in StopSignal.SIGNALS:
        with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
            signal.signal(sig, _remember)


class StopSignal:
    """SIGUSR1 / SIGTERM (Slurm's time-limit warning) ask for a checkpoint and a clean exit.

    The handler only sets a flag; ranks agree on it in a reduction the step or iteration does
    anyway, so every rank stops after the same one.
    """

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = _EARLY[0] if _EARLY else None
        self._old: dict[int, Any] = {}
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
        """Put back the handlers that were installed before."""
        for sig, old in self._old.items():
            signal.signal(sig, old)
