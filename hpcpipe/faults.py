"""Deliberate faults for testing that failures end the whole job (never a hang).

Set `HPCPIPE_INJECT_FAULT="rank=3,at=topology,kind=raise"` (kind: raise, exit, kill, hang, or
usr1/term/int, which send the process the scheduler's time-limit warning, its termination
signal or a Ctrl-C; `at`
names an injection point such as `topology`, `step:5`, `forward:5`, `backward:5`, `allreduce`,
`alltoall`, `checkpoint`, `checkpoint-commit`, `replan` (during a re-plan's layer move) or
`sweep-iteration:2`, the start of a sweep's
second source iteration); `hit=N` fires on the N-th time the rank reaches the point (default 1),
so a fault can land in the third allreduce or during the second checkpoint.
`kind=slow` makes a rank slow instead of failing: `rank=1,at=step:5,kind=slow,factor=2` runs
every compute action of rank 1 twice as long from step 5 on (`until=N`: up to step N - 1), what
a throttled or older GPU does to a pipeline (`slowdown`). With `link=P` it slows a link
instead of the compute: `rank=1,link=2,at=step:5,kind=slow,delay_ms=20` delivers every
pipeline message between world ranks 1 and 2 (either way) 20 ms after it arrived from step 5
on (`link_delay`), what a congested or slower network path does. Several faults are separated
by `;`:
`rank=1,at=step:2,kind=slow,factor=4;rank=0,at=replan,kind=raise` makes rank 1 slow and then
fails rank 0 in the middle of the re-plan that follows.
Unset, `maybe_fail` and `slowdown` cost one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import time

__all__ = ["InjectedFault", "link_delay", "link_faults", "maybe_fail", "slowdown"]

_SIGNALS = {"usr1": signal.SIGUSR1, "term": signal.SIGTERM, "int": signal.SIGINT}
_SPEC: list[dict[str, str]] | None = None
_HITS: dict[int, int] = {}


class InjectedFault(RuntimeError):
    """Raised by an injected `kind=raise` fault."""


def _specs() -> list[dict[str, str]]:
    global _SPEC
    if _SPEC is None:
        raw = os.environ.get("HPCPIPE_INJECT_FAULT", "")
        parts = (
            dict(i.split("=", 1) for i in part.split(",") if "=" in i) for part in raw.split(";")
        )
        _SPEC = [spec for spec in parts if spec]
    return _SPEC


def maybe_fail(point: str, rank: int | None = None) -> None:
    """Trigger the configured fault if this rank (default: the world rank) is at the point."""
    specs = _specs()
    if not specs:
        return
    for n, spec in enumerate(specs):
        if spec.get("at") == point:
            if rank is None:
                from hpcpipe.mpi.guard import launcher_rank

                rank = launcher_rank()
            if int(spec.get("rank", "-1")) == rank:
                _fire(spec, n, point, rank)


def _fire(spec: dict[str, str], n: int, point: str, rank: int) -> None:
    _HITS[n] = _HITS.get(n, 0) + 1
    if _HITS[n] != int(spec.get("hit", "1")):
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


def _active(spec: dict[str, str], step: int) -> bool:
    """Whether a `kind=slow` spec applies at `step` (`at=step:N`, `until=M`)."""
    at = spec.get("at", "step:1")
    if not at.startswith("step:"):
        raise ValueError(f"HPCPIPE_INJECT_FAULT: kind = slow needs at = step:N, not {at!r}")
    first, until = int(at[5:]), int(spec.get("until", "0"))
    return first <= step and not (until and step >= until)


def link_faults(rank: int) -> list[dict[str, str]]:
    """The `kind=slow,link=P` specs on a link of this world rank (either end)."""
    return [
        s
        for s in _specs()
        if s.get("kind") == "slow"
        and "link" in s
        and rank in (int(s.get("rank", "-1")), int(s["link"]))
    ]


def link_delay(specs: list[dict[str, str]], step: int, rank: int, peer: int) -> float:
    """Seconds a message between world ranks `rank` and `peer` is held at `step` (0: none)."""
    for spec in specs:
        if {int(spec.get("rank", "-1")), int(spec["link"])} == {rank, peer} and _active(spec, step):
            delay = float(spec.get("delay_ms", "1")) * 1e-3
            if not delay >= 0.0:
                raise ValueError(f"HPCPIPE_INJECT_FAULT: delay_ms = {delay * 1e3} must be >= 0")
            return delay
    return 0.0


def slowdown(step: int, rank: int) -> float:
    """The factor a `kind=slow` fault stretches this rank's compute by at `step` (1 = none)."""
    spec = next(
        (
            s
            for s in _specs()
            if s.get("kind") == "slow" and "link" not in s and int(s.get("rank", "-1")) == rank
        ),
        None,
    )
    if spec is None or not _active(spec, step):
        return 1.0
    factor = float(spec.get("factor", "2"))
    if not factor >= 1.0:
        raise ValueError(f"HPCPIPE_INJECT_FAULT: factor = {factor} must be >= 1")
    return factor
