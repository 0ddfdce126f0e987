"""The deck checks of local steps with periodic averaging (`[async] mode = "local"`): pure, no
MPI, also run by `--dry-run` and `plan`."""

from __future__ import annotations

from hpcpipe.config import Config, ConfigError
from hpcpipe.topology import RankMap

__all__ = ["UNSUPPORTED", "check_local"]

UNSUPPORTED = (
    "async.mode = 'local' (replicas averaging every few steps) does not support it yet: set "
    "async.mode = 'sync'"
)


def check_local(config: Config, rankmap: RankMap) -> None:
    """The deck checks of local steps (pure, no MPI: also `--dry-run` and `plan`)."""
    problems = [
        ("topology.ep", rankmap.ep > 1, f"= {rankmap.ep}: runs pp x dp only (ep = 1)"),
        ("moe.enabled", config.moe.enabled, "= true: MoE layers are not averaged yet"),
        ("replan.enabled", config.replan.enabled, "= true: local replicas are not re-planned"),
    ]
    for key, bad, why in problems:
        if bad:
            raise ConfigError(config.source, key, f"{why}; {UNSUPPORTED}")
    every, rounds = config.checkpoint.every, config.sections["async"].average_every
    if every < config.run.steps and every % rounds:  # the run's last step always ends a round
        raise ConfigError(
            config.source,
            "checkpoint.every",
            f"= {every} is not a multiple of async.average_every = {rounds}: replicas "
            "checkpoint at the end of a round, where the averaging is; use "
            f"checkpoint.every = {max(rounds, every - every % rounds)}",
        )
