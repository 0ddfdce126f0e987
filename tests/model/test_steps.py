"""Interleaving two computations at their collectives (`hpcpipe.model.steps`)."""

from __future__ import annotations

import itertools
import random
import time

import pytest

from hpcpipe.model.steps import Operation, interleave, run


class FakeCollective:
    """Logs when it is started and waited for; its result is its name. `delay`: seconds a
    wait takes (when it completes depends on timing, never the order of what follows)."""

    def __init__(self, log: list[str], name: str, delay: float = 0.0):
        self.log, self.name, self.delay = log, name, delay

    def start(self) -> FakeCollective:
        self.log.append(f"start {self.name}")
        self.started = time.perf_counter()
        return self

    def test(self) -> bool:
        """Done yet? (what a driver that followed completions would ask)"""
        return time.perf_counter() >= self.started + self.delay

    def wait(self) -> str:
        time.sleep(max(0.0, self.started + self.delay - time.perf_counter()))
        self.log.append(f"wait {self.name}")
        return self.name


def op(log: list[str], name: str, phases: int = 1, delay: float = 0.0) -> Operation:
    """An operation of `phases` collectives (a two-phase exchange has 2)."""

    def blocking() -> str:
        log.append(f"run {name}")
        return name

    def steps():
        for k in range(phases - 1):
            yield FakeCollective(log, f"{name}.{k}", delay)
        return (yield FakeCollective(log, name, delay))

    return Operation(blocking, steps)


def half(log: list[str], name: str, collectives: int, phases: int = 1, delay: float = 0.0):
    """Computes, then pauses at each of its operations; returns what they gave back."""
    got = []
    for k in range(collectives):
        log.append(f"compute {name}{k}")
        got.append((yield op(log, f"{name}{k}", phases, delay)))
    log.append(f"compute {name}{collectives}")
    return got


def test_run_drives_one_computation_with_blocking_operations():
    log: list[str] = []
    assert run(half(log, "F", 2, phases=2)) == ["F0", "F1"]
    assert log == ["compute F0", "run F0", "compute F1", "run F1", "compute F2"]


def test_each_half_computes_while_the_other_halfs_collective_is_out():
    log: list[str] = []
    clock = itertools.count().__next__
    f, b, t_f, t_b = interleave(half(log, "F", 2), half(log, "B", 2), clock)
    assert (f, b) == (["F0", "F1"], ["B0", "B1"])
    assert log == [
        "compute F0", "start F0",  # F up to its first collective
        "compute B0", "start B0",  # B computes while F0 is out
        "wait F0", "compute F1", "start F1",  # B0 is out meanwhile
        "wait B0", "compute B1", "start B1",
        "wait F1", "compute F2",  # F done
        "wait B1", "compute B2",
    ]  # fmt: skip
    assert t_f > 0 and t_b > 0


def test_each_phase_of_an_operation_is_a_collective_of_its_own():
    log: list[str] = []
    interleave(half(log, "F", 1, phases=2), half(log, "B", 1), lambda: 0)
    assert log == [
        "compute F0", "start F0.0",
        "compute B0", "start B0",
        "wait F0.0", "start F0",  # the second phase starts once the first is in
        "wait B0", "compute B1",
        "wait F0", "compute F1",
    ]  # fmt: skip


def test_a_half_without_collectives_runs_between_the_others_start_and_wait():
    log: list[str] = []
    f, b, _, _ = interleave(half(log, "F", 1), half(log, "B", 0), lambda: 0)
    assert (f, b) == (["F0"], [])
    assert log == ["compute F0", "start F0", "compute B0", "wait F0", "compute F1"]


def test_the_order_of_starts_does_not_depend_on_when_collectives_complete():
    """What every rank of a group must share: the start order, whatever the timing."""
    rng = random.Random(7)
    orders = set()
    for _ in range(5):
        log: list[str] = []
        delays = [rng.uniform(0, 2e-3) for _ in range(2)]
        interleave(
            half(log, "F", 3, phases=2, delay=delays[0]),
            half(log, "B", 1, delay=delays[1]),
            time.perf_counter_ns,
        )
        orders.add(tuple(e for e in log if e.startswith("start")))
    assert orders == {
        ("start F0.0", "start B0", "start F0", "start F1.0", "start F1", "start F2.0", "start F2")
    }


def test_an_error_in_one_half_closes_the_other():
    closed = []

    def failing():
        yield op([], "F0")
        raise RuntimeError("F failed")

    def other():
        try:
            yield op([], "B0")
            yield op([], "B1")
        finally:
            closed.append("B")

    with pytest.raises(RuntimeError, match="F failed"):
        interleave(failing(), other(), lambda: 0)
    assert closed == ["B"]
