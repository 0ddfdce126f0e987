"""[async]: training whose pipeline does not flush every step (`hpcpipe.schedules.flushfree`)."""

from __future__ import annotations

from dataclasses import dataclass

from hpcpipe.config import option

__all__ = ["AsyncConfig"]


@dataclass(frozen=True)
class AsyncConfig:
    """[async]: sync (every step flushes), or a pipeline without a flush (docs/async.md)."""

    mode: str = option(
        "sync",
        "sync: every step drains, then the optimizer steps; stash: no flush, a weight update "
        "per microbatch, every backward uses the weights its forward saw (PipeDream); 2bw: no "
        "flush, an update per global batch, at most two weight versions per stage",
        choices=("sync", "stash", "2bw"),
    )
    versions: int = option(
        0,
        "stash: the most weight versions a stage may hold (0 = as many as the schedule keeps "
        "in flight); 2bw always holds at most 2",
        minimum=0,
    )
