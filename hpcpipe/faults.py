"""Deliberate faults for testing that failures end the whole job (never a hang).

Set `HPCPIPE_INJECT_FAULT="rank=3,at=topology,kind=raise"` (kind: raise, exit, kill, hang, or
usr1/term/int, which send the process the scheduler's time-limit warning, its termination
signal or a Ctrl-C; `at`
names an injection point such as `topology`, `step:5`, `forward:5`, `backward:5`, `allreduce`,
`alltoall`, `checkpoint`, `checkpoint-commit` or `sweep-iteration:2`, the start of a sweep's
second source iteration); `hit=N` fires on the N-th time the rank reaches the point (default 1),
so a fault can land in the third allreduce or during the second checkpoint.
`kind=slow` makes a rank slow instead of failing: `rank=1,at=step:5,kind=slow,factor=2` runs
every compute action of rank 1 twice as long from step 5 on (`until=N`: up to step N - 1), what
a throttled or older GPU does to a pipeline (`slowdown`).
Unset, `maybe_fail` and `slowdown` cost one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import time

__all__ = ["InjectedFault", "maybe_fail", "slowdown"]

_SIGNALS = {"usr1": signal.SIGUSR1, "term": signal.SIGTERM, "int": signal.SIGINT}
_SPEC: dict[str, str] | None = None
_HITS = [0]


class InjectedFault(RuntimeError):
    """Raised by an injected `kind=raise` fault."""


def _spec() -> dict[str, str]:
    global _SPEC
    if _SPEC is None:
        raw = os.environ.get("HPCPIPE_INJECT_FAULT", "")
        _SPEC = dict(item.split("=", 1) for item in raw.split(",") if "=" in item)
    return _SPEC


def maybe_fail(point: str, rank: int | None = None) -> None:
    """Trigger the configured fault if this rank (default: the world rank) is at the point."""
    spec = _spec()
    if not spec or spec.get("at") != point:
        return
    if rank is None:
        from hpcpipe.mpi.guard import launcher_rank

        rank = launcher_rank()
    if int(spec.get("rank", "-1")) != rank:
        return
    _HITS[0] += 1
    if _HITS[0] != int(spec.get("hit", "1")):
        return
    kind = spec.get("kind", "raise")
    if kind == "slow":
        return  # not a failure: `slowdown` reads it
    if kind == "raise":
        raise InjectedFault(f"injected fault at {point} on rank {rank}")
    if kind == "exit":
        os._exit(3)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind in _SIGNALS:
        os.kill(os.getpid(), _SIGNALS[kind])
        return
    if kind == "hang":
        while True:
            time.sleep(1)
    raise ValueError(
        f"HPCPIPE_INJECT_FAULT: kind = {kind!r} is not raise, exit, kill, usr1, term, int, "
        "hang, slow"
    )


def slowdown(step: int, rank: int) -> float:
    """The factor a `kind=slow` fault stretches this rank's compute by at `step` (1 = none)."""
    spec = _spec()
    if not spec or spec.get("kind") != "slow" or int(spec.get("rank", "-1")) != rank:
        return 1.0
    at = spec.get("at", "step:1")
    if not at.startswith("step:"):
        raise ValueError(f"HPCPIPE_INJECT_FAULT: kind = slow needs at = step:N, not {at!r}")
    first, until = int(at[5:]), int(spec.get("until", "0"))
    if step < first or (until and step >= until):
        return 1.0
    factor = float(spec.get("factor", "2"))
    if not factor >= 1.0:
        raise ValueError(f"HPCPIPE_INJECT_FAULT: factor = {factor} must be >= 1")
    return factor
