"""[async]: training without a flush every step (`hpcpipe.schedules.flushfree`) or without a
barrier every step (data-parallel replicas that average every few steps)."""

from __future__ import annotations

from dataclasses import dataclass

from hpcpipe.config import ConfigError, option

__all__ = ["AsyncConfig"]


@dataclass(frozen=True)
class AsyncConfig:
    """[async]: sync (every step flushes and reduces), a pipeline without a flush, or local
    steps with periodic averaging (docs/async.md)."""

    mode: str = option(
        "sync",
        "sync: every step drains, then the optimizer steps; stash: no flush, a weight update "
        "per microbatch, every backward uses the weights its forward saw (PipeDream); 2bw: no "
        "flush, an update per global batch, at most two weight versions per stage; local: "
        "each data-parallel replica steps on its own shard and the replicas average their "
        "parameters every average_every steps",
        choices=("sync", "stash", "2bw", "local"),
    )
    versions: int = option(
        0,
        "stash: the most weight versions a stage may hold (0 = as many as the schedule keeps "
        "in flight); 2bw always holds at most 2",
        minimum=0,
    )
    flush_every: int = option(
        0,
        "stash, 2bw: global batches between two flushes of the stream (it drains there; "
        "checkpoints and stop signals are taken there); 0 = the whole run is one stream",
        minimum=0,
    )
    average_every: int = option(
        1,
        "local: optimizer steps between two parameter averagings (1 = every step); the last "
        "step always averages, so the run ends with one model",
        minimum=1,
    )
    round_end: str = option(
        "all",
        "local: when a round ends; all: once every replica has taken average_every steps (a "
        "straggler holds the others back); first: once the first replica has, the others "
        "ending theirs after the step they are in (a straggler takes fewer steps, its shard of "
        "the rest is skipped; the steps each replica took are recorded for the reference)",
        choices=("all", "first"),
    )
    delay: int = option(
        0,
        "local: 0 averages at the round's end (every replica waits for the slowest); 1 starts "
        "the averaging there and applies it one round later, while the replicas go on",
        choices=(0, 1),
    )

    def check(self, source: str) -> None:
        """Keys read by one mode only, set under another: bad input, not silently ignored."""
        if self.mode != "local":
            for key, value, default in (
                ("average_every", self.average_every, 1),
                ("delay", self.delay, 0),
                ("round_end", self.round_end, "all"),
            ):
                if value != default:
                    raise ConfigError(
                        source,
                        f"async.{key}",
                        f"= {value!r} is read with async.mode = 'local' only (mode is "
                        f"{self.mode!r}): set async.mode = 'local' or remove the key",
                    )
        if self.mode not in ("stash", "2bw") and self.flush_every:
            raise ConfigError(
                source,
                "async.flush_every",
                f"= {self.flush_every} is read with async.mode = 'stash' or '2bw' only (mode is "
                f"{self.mode!r}): remove the key",
            )
        if self.mode != "stash" and self.versions:
            raise ConfigError(
                source,
                "async.versions",
                f"= {self.versions} is read with async.mode = 'stash' only (mode is "
                f"{self.mode!r}): remove the key",
            )
