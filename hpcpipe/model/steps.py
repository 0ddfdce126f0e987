"""Computations that pause at their communication, so one rank can interleave two of them.

DualPipe's overlapped pair (`F&B`) runs the forward of one microbatch beside the backward of
another so that each half's MoE all-to-alls are in flight while the other half computes. In one
Python process that needs the halves to stop at each exchange and hand control back: a layer
written as a generator does exactly that. It yields an `Operation` (a communication step) and
receives its result when it resumes:

    recv = yield group.alltoallv_op(rows, plan.forward)

`run` drives one such generator alone: each operation runs at once, blocking, on the same fast
path a direct call takes (what a plain F or B does). `interleave` drives two: each operation is
broken into its MPI collectives (`Operation.steps`, e.g. the two phases of a hierarchical
exchange), and each collective is started, the other half computes up to its own next one, and
only then is it waited for. The order in which collectives start depends only on the two
generators' structure, never on timing, so every rank of a group starts them in the same order,
as MPI requires of collectives on one communicator.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, Protocol, TypeVar

__all__ = ["Collective", "Operation", "Pending", "Steps", "immediate", "interleave", "run"]

T = TypeVar("T")
U = TypeVar("U")


class Pending(Protocol):
    """A started collective."""

    def wait(self) -> Any:
        """Block until it completes; its result."""


class Collective(Protocol):
    """One MPI collective with its buffers ready, to be started now and waited for later."""

    def start(self) -> Pending:
        """Start it without waiting."""


class Operation:
    """One communication step of a computation: `run()` does it now, blocking; `steps()` is a
    generator that yields each of its collectives (`Collective`) and returns the same result."""

    __slots__ = ("_args", "_run", "_steps")

    def __init__(
        self,
        run: Callable[..., Any],
        steps: Callable[..., Generator[Collective, Any, Any]],
        *args: Any,
    ):
        self._run, self._steps, self._args = run, steps, args

    def run(self) -> Any:
        return self._run(*self._args)

    def steps(self) -> Generator[Collective, Any, Any]:
        return self._steps(*self._args)


Steps = Generator[Operation, Any, T]
"""A computation that yields each communication step it needs and is resumed with its result."""


def immediate(fn: Callable[..., T]) -> Callable[..., Generator[Collective, Any, T]]:
    """`fn` as `Operation.steps` for work with nothing to wait for (no communication)."""

    def steps(*args: Any) -> Generator[Collective, Any, T]:
        yield from ()
        return fn(*args)

    return steps


def run(steps: Steps[T]) -> T:
    """Drive `steps` alone, each operation run to completion where it is yielded."""
    try:
        op = next(steps)
        while True:
            op = steps.send(op.run())
    except StopIteration as stop:
        return stop.value


def _collectives(steps: Steps[T]) -> Generator[Collective, Any, T]:
    """`steps` with each operation broken into the collectives it is made of."""
    value = None
    try:
        while True:
            op = steps.send(value)
            value = yield from op.steps()
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
    halves = [_collectives(first), _collectives(second)]
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

    try:
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
    finally:  # an error in one half: the other is closed (its cleanup runs), never resumed
        for half in halves:
            half.close()
    return results[0], results[1], busy[0], busy[1]
