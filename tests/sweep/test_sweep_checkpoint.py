"""Sweep checkpoints and job control in one process: the solver's stop/continue contract, the
checkpoint's contents, resume, the stop signal and status.json, and the refusals on resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from hpcpipe import faults
from hpcpipe.config import ConfigError, dump_toml, load_config
from hpcpipe.io.checkpoint import (
    ShardSpec,
    load_checkpoint,
    read_attrs,
    save_checkpoint,
    verify_checkpoint,
)
from hpcpipe.io.ckpt_config import CheckpointConfig
from hpcpipe.jobcontrol import StopSignal
from hpcpipe.sweep import checkpointing
from hpcpipe.sweep.mesh import build_problem
from hpcpipe.sweep.output import read_flux
from hpcpipe.sweep.solver import ConvergenceError, Iterate, LocalCells, SerialSweeper, solve
from hpcpipe.sweep.workload import run_sweep

TINY = Path(__file__).resolve().parents[2] / "inputs" / "sweep_tiny.toml"
QUIET = {"log": lambda _m: None}


class _StopAt:
    """A solver Control that asks to stop at one iteration and records what it was told."""

    def __init__(self, at: int):
        self.at, self.current = at, 0
        self.ends: list[tuple[int, bool, bool]] = []
        self.last: Iterate | None = None

    def begin(self, iteration: int) -> None:
        self.current = iteration

    def stop_requested(self) -> bool:
        return self.current == self.at

    def end(self, iterate: Iterate, final: bool, stopping: bool) -> None:
        self.ends.append((iterate.iterations, final, stopping))
        self.last = iterate


def _serial(cfg, **kw):
    problem = build_problem(cfg)
    return solve(
        problem,
        LocalCells(problem),
        SerialSweeper(problem),
        tolerance=cfg.tolerance,
        max_iterations=cfg.max_iterations,
        **kw,
    )


def test_solver_stops_on_request_and_continues_bit_for_bit():
    cfg = load_config(TINY).sweep
    whole = _serial(cfg)
    control = _StopAt(4)
    first = _serial(cfg, control=control)
    assert first.stopped and not first.converged and first.iterations == 4
    assert first.message == ""  # stopped, not failed
    assert control.ends == [
        (1, False, False),
        (2, False, False),
        (3, False, False),
        (4, False, True),
    ]
    problem = build_problem(cfg)
    seen = control.last  # what a checkpoint stores, copied as a reload would
    assert seen is not None and np.array_equal(seen.phi, first.phi)
    start = Iterate(seen.phi.copy(), list(seen.history), list(seen.scales), list(seen.seconds))
    rest = _StopAt(0)
    second = solve(
        problem,
        LocalCells(problem),
        SerialSweeper(problem),
        tolerance=cfg.tolerance,
        max_iterations=cfg.max_iterations,
        start=start,
        control=rest,
    )
    assert second.converged and not second.stopped
    assert second.iterations == whole.iterations and rest.ends[0][0] == 5
    assert rest.ends[-1] == (whole.iterations, True, False)
    assert np.array_equal(second.phi, whole.phi)
    assert np.array_equal(second.history, whole.history)


def test_stop_on_the_last_iteration_finishes_instead():
    cfg = load_config(TINY).sweep
    whole = _serial(cfg)
    result = _serial(cfg, control=_StopAt(whole.iterations))
    assert result.converged and not result.stopped


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """An uninterrupted one-process run of the tiny deck with a checkpoint every 8 iterations."""
    config = load_config(TINY)
    out = tmp_path_factory.mktemp("sweep-ckpt") / "full"
    result = run_sweep(
        config.sweep,
        MPI.COMM_SELF,
        out,
        config_text=dump_toml(config),
        checkpoint=CheckpointConfig(every=8, keep=0, fsync=False),
        **QUIET,
    )
    return out, config, result


def test_checkpoint_holds_the_iterate(full):
    out, config, result = full
    sweep = config.sweep
    steps = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    last = f"step_{result.iterations:06d}"
    assert steps == ["step_000008", "step_000016", "step_000024", last]
    path = out / "checkpoints" / "step_000016"
    assert verify_checkpoint(path) == []
    attrs = read_attrs(path)
    assert attrs["producer"] == checkpointing.FORMAT_TAG and attrs["step"] == 16
    assert attrs["converged"] is False and read_attrs(out / "checkpoints" / last)["converged"]
    assert attrs["grid"] == {"px": 1, "py": 1, "world": 1}
    assert attrs["sweep"]["sigma_t"] == [list(r) for r in sweep.sigma_t]
    assert "[sweep]" in attrs["config"]
    shape = (sweep.nx, sweep.ny, sweep.nz, sweep.groups)
    spec = checkpointing._spec(sweep, slice(0, sweep.nx), slice(0, sweep.ny))
    assert spec.global_shape == shape
    dphi = ShardSpec.whole(checkpointing.HISTORY[0], (16,), np.float64)
    loaded = load_checkpoint(path, {"phi": spec, "dphi": dphi})
    assert np.array_equal(loaded["dphi"], result.history[:16])
    assert loaded["phi"].shape == shape and np.all(loaded["phi"] >= 0) and loaded["phi"].max() > 0
    status = json.loads((out / "status.json").read_text())
    assert status == {
        "state": "finished",
        "step": result.iterations,
        "checkpoint": str(out / "checkpoints" / last),
    }


def test_resume_from_a_checkpoint_is_bitwise(full, tmp_path):
    out, config, result = full
    lines: list[str] = []
    again = run_sweep(
        config.sweep,
        MPI.COMM_SELF,
        tmp_path,
        config_text=dump_toml(config),
        resume=str(out / "checkpoints" / "step_000016"),
        log=lines.append,
    )
    assert any("resumed from" in ln and "at iteration 16" in ln for ln in lines), lines
    assert not any(ln.startswith("iter 16 ") for ln in lines)  # iteration 16 is not redone
    assert again.iterations == result.iterations
    assert np.array_equal(again.phi, result.phi)
    assert np.array_equal(again.history, result.history)
    a, _ = read_flux(out / "flux.h5")
    b, attrs = read_flux(tmp_path / "flux.h5")
    assert np.array_equal(a, b) and attrs["iterations"] == result.iterations


def test_signal_checkpoints_writes_status_and_resumes(full, tmp_path, monkeypatch):
    _, config, result = full
    monkeypatch.setattr(faults, "_SPEC", [{"rank": "0", "at": "sweep-iteration:3", "kind": "usr1"}])
    lines: list[str] = []
    stop = StopSignal()
    try:
        stopped = run_sweep(
            config.sweep,
            MPI.COMM_SELF,
            tmp_path,
            config_text=dump_toml(config),
            checkpoint=CheckpointConfig(fsync=False),
            stop=stop,
            log=lines.append,
        )
    finally:
        stop.restore()
    assert stopped.stopped and stopped.iterations == 3
    assert any(ln.startswith("stopping on signal after iteration 3/200") for ln in lines), lines
    checkpoint = tmp_path / "checkpoints" / "step_000003"
    status = json.loads((tmp_path / "status.json").read_text())
    assert status == {"state": "preempted", "step": 3, "checkpoint": str(checkpoint)}
    assert not (tmp_path / "flux.h5").exists()  # not an answer yet
    monkeypatch.setattr(faults, "_SPEC", [])
    done = run_sweep(
        config.sweep,
        MPI.COMM_SELF,
        tmp_path,
        config_text=dump_toml(config),
        resume="latest",
        **QUIET,
    )
    assert done.converged and np.array_equal(done.phi, result.phi)
    assert json.loads((tmp_path / "status.json").read_text())["state"] == "finished"


def test_not_converged_status(tmp_path):
    config = load_config(TINY, ["sweep.max_iterations=3"])
    with pytest.raises(ConvergenceError, match="did not converge"):
        run_sweep(config.sweep, MPI.COMM_SELF, tmp_path, **QUIET)
    status = json.loads((tmp_path / "status.json").read_text())
    assert status == {"state": "not-converged", "step": 3, "checkpoint": None}


@pytest.mark.parametrize(
    ("overrides", "step", "message"),
    [
        (["sweep.nx=4"], 16, "sweep.nx = 8 there, 4 here"),
        (["sweep.sigma_s=[[[0.4, 0.3], [0.0, 0.8]], [[0.1, 0.1], [0.0, 0.5]]]"], 16, "sigma_s"),
        (["sweep.max_iterations=16"], 16, "raise sweep.max_iterations"),
        ([], "last", "has already converged"),
    ],
)
def test_resume_refuses_what_it_cannot_continue(full, tmp_path, overrides, step, message):
    out, _, result = full
    config = load_config(TINY, overrides)
    step = result.iterations if step == "last" else step
    where = out / "checkpoints" / f"step_{step:06d}"
    with pytest.raises(ConfigError, match=message) as err:
        run_sweep(config.sweep, MPI.COMM_SELF, tmp_path, resume=str(where), **QUIET)
    assert str(where) in str(err.value)


def test_resume_refuses_a_missing_checkpoint_and_a_foreign_one(full, tmp_path):
    config = load_config(TINY)
    with pytest.raises(ConfigError, match="found no complete checkpoint"):
        run_sweep(config.sweep, MPI.COMM_SELF, tmp_path, resume="latest", **QUIET)
    w = np.zeros(3)
    foreign = save_checkpoint(
        None, tmp_path / "other", 1, {"w": (ShardSpec.whole("w", (3,), w.dtype), w)}, writer=True
    )
    with pytest.raises(ConfigError, match="not by a sweep run"):
        run_sweep(config.sweep, MPI.COMM_SELF, tmp_path, resume=str(foreign), **QUIET)


def test_blocking_and_tolerance_may_change_on_resume(full, tmp_path):
    out, _, result = full
    where = str(out / "checkpoints" / "step_000016")
    config = load_config(TINY, ["sweep.angle_block=0", "sweep.z_block=0"])
    reblocked = run_sweep(config.sweep, MPI.COMM_SELF, tmp_path / "a", resume=where, **QUIET)
    # another angle blocking sums directions in another order: equal to round-off
    assert reblocked.iterations == result.iterations
    np.testing.assert_allclose(reblocked.phi, result.phi, rtol=1e-12, atol=0)
    config = load_config(TINY, ["sweep.tolerance=1e-12"])
    tighter = run_sweep(config.sweep, MPI.COMM_SELF, tmp_path / "b", resume=where, **QUIET)
    assert tighter.converged and tighter.iterations > result.iterations
    assert tighter.history[-1] <= 1e-12 < result.history[-1]
