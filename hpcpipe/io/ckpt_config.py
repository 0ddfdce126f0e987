"""[checkpoint]: when, where and how checkpoints are written (read by the train and sweep
runtimes, which call hpcpipe.io.checkpoint)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hpcpipe.config import option

__all__ = ["CheckpointConfig"]


@dataclass(frozen=True)
class CheckpointConfig:
    """[checkpoint]: cadence, retention, file layout and durability of checkpoints."""

    every: int = option(
        0,
        "checkpoint every N steps (training) or source iterations (sweep); 0 = only at the "
        "time-limit signal",
        minimum=0,
    )
    keep: int = option(
        3,
        "complete checkpoints kept; older ones are deleted only after a newer one is "
        "complete (0 = keep all)",
        minimum=0,
    )
    layout: str = option(
        "auto",
        "shards: one HDF5 file per writing rank; shared: one file written collectively "
        "(needs h5py with parallel HDF5); auto: shards, or shared for very many writers "
        "when h5py is parallel",
        choices=("auto", "shards", "shared"),
    )
    dir: str = option("", "checkpoint directory; empty = <run.output>/checkpoints")
    fsync: bool = option(
        True, "fsync files and directories before a checkpoint is declared complete"
    )

    def directory(self, output: str | Path) -> Path:
        """Where checkpoints go for a run whose output directory is `output`."""
        return Path(self.dir) if self.dir else Path(output) / "checkpoints"
