"""Deliberate faults for testing that failures end the whole job (never a hang).

Set `HPCPIPE_INJECT_FAULT="rank=3,at=topology,kind=raise"` (kind: raise, exit, kill, hang, or
usr1/term/int, which send the process the scheduler's time-limit warning, its termination
signal or a Ctrl-C; `at`
names an injection point such as `topology`, `step:5`, `forward:5`, `backward:5`, `allreduce`,
`alltoall`, `checkpoint`, `checkpoint-commit` or `sweep-iteration:2`, the start of a sweep's
second source iteration); `hit=N` fires on the N-th time the rank reaches the point (default 1),
so a fault can land in the third allreduce or during the second checkpoint.
Unset, `maybe_fail` costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import time

__all__ = ["InjectedFault", "maybe_fail"]

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
        f"HPCPIPE_INJECT_FAULT: kind = {kind!r} is not raise, exit, kill, usr1, term, int, hang"
    )
