"""Deliberate faults for testing that failures end the whole job (never a hang).

Set `HPCPIPE_INJECT_FAULT="rank=3,at=topology,kind=raise"` (kind: raise, exit, kill, hang, or
usr1, which sends the process the scheduler's time-limit warning; `at`
names an injection point such as `topology`, `step:5`, `forward`, `allreduce`, `checkpoint`,
or `sweep-iteration:2`, the start of a sweep's second source iteration).
Unset, `maybe_fail` costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import time

__all__ = ["InjectedFault", "maybe_fail"]

_SPEC: dict[str, str] | None = None


class InjectedFault(RuntimeError):
    """Raised by an injected `kind=raise` fault."""


def _spec() -> dict[str, str]:
    global _SPEC
    if _SPEC is None:
        raw = os.environ.get("HPCPIPE_INJECT_FAULT", "")
        _SPEC = dict(item.split("=", 1) for item in raw.split(",") if "=" in item)
    return _SPEC


def maybe_fail(point: str, rank: int) -> None:
    """Trigger the configured fault if this rank is at the configured injection point."""
    spec = _spec()
    if not spec or spec.get("at") != point or int(spec.get("rank", "-1")) != rank:
        return
    kind = spec.get("kind", "raise")
    if kind == "raise":
        raise InjectedFault(f"injected fault at {point} on rank {rank}")
    if kind == "exit":
        os._exit(3)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "usr1":
        os.kill(os.getpid(), signal.SIGUSR1)
        return
    if kind == "hang":
        while True:
            time.sleep(1)
    raise ValueError(f"HPCPIPE_INJECT_FAULT: kind = {kind!r} is not raise, exit, kill, usr1, hang")
