"""Job control every workload shares: the scheduler's stop signal, `status.json`, `--resume`.

A batch job lives in time slices: Slurm warns with SIGUSR1 or SIGTERM before the time limit,
the run checkpoints and exits 0, the job script reads `<output>/status.json` to decide whether
to requeue, and the next slice continues with `hpcpipe run DECK --resume`. The training and
sweep runtimes both follow that protocol through the three names here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpcpipe.config import ConfigError
from hpcpipe.console import say
from hpcpipe.io.checkpoint import CheckpointError, latest_checkpoint, resolve_checkpoint
from hpcpipe.signals import StopSignal

__all__ = [
    "STATES",
    "StopSignal",
    "find_checkpoint",
    "older_hint",
    "write_status",
]

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


def older_hint(path: Path) -> str:
    """What to say after a damaged checkpoint: the older complete ones beside it, if any."""
    from hpcpipe.io.ckpt_store import older_checkpoints

    older = older_checkpoints(Path(path))
    if not older:
        return ""
    names = ", ".join(p.name for p in older)
    return (
        f"; older checkpoints here: {names} (newest first): check one with `hpcpipe ckpt "
        f"verify {older[0]}` and resume from it with --resume {older[0]}"
    )


def find_checkpoint(comm: Any, where: str, directory: Path | None) -> Path:
    """Collective: the checkpoint `--resume` names, on every rank of `comm`.

    `where` is "latest" (the newest complete checkpoint in `directory`) or a path. Rank 0 looks
    and broadcasts the answer, so every rank resumes from the same checkpoint or raises the
    same ConfigError (exit code 2).
    """
    path: Path | ConfigError | None = None
    if comm.rank == 0:
        notes: list[str] = []
        try:
            if where == "latest":
                path = latest_checkpoint(directory, notes) if directory is not None else None
                if path is None:
                    path = ConfigError(
                        "--resume", "", f"found no complete checkpoint in {directory}"
                    )
            else:
                path = resolve_checkpoint(where, notes)
        except CheckpointError as exc:
            path = ConfigError("--resume", "", str(exc))
        for note in notes:
            say(f"WARNING: --resume: {note}", err=True)
    path = comm.bcast(path, root=0)
    if isinstance(path, Exception):
        raise path
    return Path(path)
