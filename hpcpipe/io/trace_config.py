"""[trace]: whether the runtime records trace events, where they go, and which steps."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hpcpipe.config import option

if TYPE_CHECKING:
    from hpcpipe.io.trace import Recorder

__all__ = ["TraceConfig"]


@dataclass(frozen=True)
class TraceConfig:
    """[trace]: event recording (see hpcpipe.io.trace); off costs one branch per action."""

    enabled: bool = option(False, "record start and end of every action into the trace file")
    capacity: int = option(
        1 << 16,
        "events preallocated per rank; the buffer doubles when full",
        minimum=1,
        maximum=1 << 24,  # about 1 GiB of events; more would fail at allocation on every rank
    )
    path: str = option("", "trace file; empty = <run.output>/trace.h5")
    steps: tuple[int, ...] = option(
        (),
        "steps (sweep iterations) to record, numbered from 1 as the log numbers them, e.g. "
        "[2, 3]; empty = every step",
        minimum=1,
    )

    def resolve_path(self, output: str | Path) -> Path:
        """The trace file of a run whose directory is `output` (run.output)."""
        return Path(self.path) if self.path else Path(output) / "trace.h5"

    def recorder(self, rank: int) -> Recorder:
        """A `Recorder` for `rank` set up from this section (disabled when tracing is off)."""
        from hpcpipe.io.trace import Recorder

        return Recorder(rank, self.capacity, enabled=self.enabled, steps=self.steps or None)
