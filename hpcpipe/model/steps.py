"""Computations that pause at their collectives, so one rank can interleave two of them.

DualPipe's overlapped pair (`F&B`) runs the forward of one microbatch beside the backward of
another so that each half's MoE all-to-alls are in flight while the other half computes. In one
Python process that needs the halves to stop at each collective and hand control back: a layer
written as a generator does exactly that. It yields a `Collective` (an MPI operation ready to
go) and receives its result when it resumes:

    recv = yield from group.exchange_steps(rows, plan.forward)

`run` drives one such generator alone, each collective blocking (what a plain F or B does);
`interleave` drives two, starting each half's collective and waiting for it only after the
other half has computed up to its own next one. The order in which collectives are started
depends only on the two generators' structure, never on timing, so every rank of a group
starts them in the same order, as MPI requires of collectives on one communicator.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, Protocol, TypeVar

__all__ = ["Collective", "Pending", "Steps", "interleave", "run"]

T = TypeVar("T")
U = TypeVar("U")


class Pending(Protocol):
    """A started collective."""

    def wait(self) -> Any:
        """Block until it completes; its result."""


class Collective(Protocol):
    """A collective ready to go: now (blocking) or started and waited for later."""

    def run(self) -> Any:
        """Run it to completion; its result."""

    def start(self) -> Pending:
        """Start it without waiting."""


Steps = Generator[Collective, Any, T]
"""A computation that yields each collective it needs and is resumed with its result."""


def run(steps: Steps[T]) -> T:
    """Drive `steps` alone, each collective run to completion where it is yielded."""
    try:
        op = next(steps)
        while True:
            op = steps.send(op.run())
    except StopIteration as stop:
        return stop.value


def interleave(
    first: Steps[T], second: Steps[U], clock: Callable[[], int]
) -> tuple[T, U, int, int]:
    """Drive two computations together on this rank: each one's collectives are in flight
    while the other computes. Returns both results and the time (in `clock` units) spent on
    each, computing or waiting for its own collectives.

    `first` computes up to its first collective and starts it, then `second` does the same;
    from then on the halves take turns: wait for this half's collective, compute up to its next
    one and start it, switch. A half that has finished leaves the other to go on alone.
    """
    halves: list[Steps[Any]] = [first, second]
    pending: list[Pending | None] = [None, None]
    results: list[Any] = [None, None]
    busy = [0, 0]
    live = [True, True]

    def advance(i: int, value: Any) -> None:
        t = clock()
        try:
            pending[i] = halves[i].send(value).start()
        except StopIteration as stop:
            live[i], pending[i], results[i] = False, None, stop.value
        busy[i] += clock() - t

    advance(0, None)
    advance(1, None)
    while live[0] or live[1]:
        for i in (0, 1):
            if live[i]:
                op = pending[i]
                assert op is not None
                t = clock()
                value = op.wait()
                busy[i] += clock() - t
                advance(i, value)
    return results[0], results[1], busy[0], busy[1]
