"""Interleaving two computations at their collectives (`hpcpipe.model.steps`)."""

from __future__ import annotations

import itertools

from hpcpipe.model.steps import interleave, run


class FakeCollective:
    """Logs when it is run, started and waited for; its result is its name."""

    def __init__(self, log: list[str], name: str):
        self.log, self.name = log, name

    def run(self) -> str:
        self.log.append(f"run {self.name}")
        return self.name

    def start(self) -> FakeCollective:
        self.log.append(f"start {self.name}")
        return self

    def wait(self) -> str:
        self.log.append(f"wait {self.name}")
        return self.name


def half(log: list[str], name: str, collectives: int):
    """Computes, then pauses at each of its collectives; returns what they gave back."""
    got = []
    for k in range(collectives):
        log.append(f"compute {name}{k}")
        got.append((yield FakeCollective(log, f"{name}{k}")))
    log.append(f"compute {name}{collectives}")
    return got


def test_run_drives_one_computation_with_blocking_collectives():
    log: list[str] = []
    assert run(half(log, "F", 2)) == ["F0", "F1"]
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


def test_a_half_without_collectives_runs_between_the_others_start_and_wait():
    log: list[str] = []
    f, b, _, _ = interleave(half(log, "F", 1), half(log, "B", 0), lambda: 0)
    assert (f, b) == (["F0"], [])
    assert log == ["compute F0", "start F0", "compute B0", "wait F0", "compute F1"]


def test_uneven_halves_finish_alone_in_a_fixed_order():
    """The order of starts depends only on the halves' structure (the same on every rank)."""
    orders = []
    for _ in range(2):
        log: list[str] = []
        interleave(half(log, "F", 3), half(log, "B", 1), lambda: 0)
        orders.append([e for e in log if e.startswith("start")])
    assert orders[0] == orders[1] == ["start F0", "start B0", "start F1", "start F2"]
