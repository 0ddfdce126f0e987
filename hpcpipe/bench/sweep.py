"""Sweep speed against Kripke's figures and the KBA model, on Kripke's own problem.

Problem: `hpcpipe.sweep.problems.kripke_config` (Kripke's built-in geometry: 3 materials,
n^3 zones, 8 groups, 80 directions, isotropic, diamond difference), `--iterations` source
iterations from phi = 0, as Kripke's `--niter` runs them. The figures are Kripke's, per
zone x direction x group ("unknown") and iteration, in ns:

    kernel  time in the sweep kernel per unknown of the rank (Kripke: SweepSubdomain), mean
            over ranks
    sweep   sweep wall time per unknown of the whole problem (Kripke: SweepSolver)
    iter    iteration wall time per unknown of the whole problem (Kripke: Solve / niter; its
            "grind time"): source, sweep, convergence check
    core    iter x ranks: the core time an unknown costs, constant under perfect scaling

Every case runs once per repetition, the repetitions interleaved and the order of the
parallel cases rotated (so drift, other load and what ran just before hit all cases alike),
after one warm-up solve per case (hpcpipe compiles or loads its kernel
once per process). Ranks not in a case sleep (`idle_barrier`), leaving their core.

    eff     iter(1 rank, fix-up on) / (ranks x iter(ranks)), per repetition, then the median;
            on the "P x 1 rank" row (every rank solving the whole problem alone, all at once)
            iter(1 rank) / iter(that): the speed a core keeps when all cores are busy
    model   the same with the ranks' iteration predicted: the 1-rank time outside the sweep
            divided by the ranks, plus the sweep from the KBA cost model (blocking.py) with
            its per-unknown and per-task costs fitted to the two 1-rank blockings of this run
            (whole octants, and z-blocks of 2 cells)

`--kripke EXE` also runs Kripke (v1.2.x; every `--kripke-layouts`, 1 rank and all ranks) in
the same repetitions, with the flags `kripke_command` gives, and compares.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from hpcpipe.bench.harness import median
from hpcpipe.bench.table import Column, Report
from hpcpipe.config import ConfigError
from hpcpipe.console import say
from hpcpipe.mpi.idle import idle_barrier
from hpcpipe.sweep.blocking import KERNEL_COSTS, SweepCost, predict_makespan
from hpcpipe.sweep.config import SweepConfig
from hpcpipe.sweep.kernel import resolve_kernel
from hpcpipe.sweep.mesh import build_problem
from hpcpipe.sweep.parallel import KBASweeper
from hpcpipe.sweep.plan import PlanError, blocking_for, plan_for
from hpcpipe.sweep.problems import kripke_config
from hpcpipe.sweep.solver import Iterate, LocalCells, solve

__all__ = ["KRIPKE_LAYOUTS", "kripke_command", "parse_kripke", "run"]

KRIPKE_LAYOUTS = ("DGZ", "DZG", "GDZ", "GZD", "ZDG", "ZGD")
GROUPS = 8
ORDER = 8  # S8: 80 directions
PER_OCTANT = ORDER * (ORDER + 2) // 8  # 10 directions per octant
DIRECTIONS = 8 * PER_OCTANT
SMALL = (2, 10)  # the second 1-rank blocking the model is fitted to (same angle blocks)

COLUMNS = [
    Column("case", "case", "", 16, "<"),
    Column("ranks", "ranks", "d", 5),
    Column("z_block", "zblk", "d", 4),
    Column("angle_block", "ablk", "d", 4),
    Column("kernel_ns", "kernel ns", ".2f", 9),
    Column("sweep_ns", "sweep ns", ".2f", 8),
    Column("iter_ns", "iter ns", ".2f", 7),
    Column("core_ns", "core ns", ".2f", 7),
    Column("eff", "eff", ".3f", 5),
    Column("model", "model", ".3f", 5),
    Column("ratio", "meas/model", ".3f", 10),
]


def kripke_command(
    exe: str, n: int, iterations: int, layout: str, ranks: int, mpiexec: str = "mpiexec"
) -> list[str]:
    """Kripke's command line for the side-by-side problem (its flags, v1.2.x): `--quad 80` is
    its 80-direction set, `--legendre 0` isotropic scattering; the 3 materials, the geometry
    and diamond difference are built in."""
    cmd = [exe, "--zones", f"{n},{n},{n}", "--groups", str(GROUPS), "--quad", str(DIRECTIONS)]
    cmd += ["--legendre", "0", "--niter", str(iterations), "--layout", layout]
    cmd += ["--procs", f"{ranks},1,1"]
    return [mpiexec, "-n", str(ranks), *cmd] if ranks > 1 else cmd


def parse_kripke(text: str) -> dict[str, float]:
    """Kripke's timers (seconds) from its `TIMER_NAMES:` / `TIMER_DATA:` lines."""
    names = re.search(r"^TIMER_NAMES:(.*)$", text, re.M)
    data = re.search(r"^TIMER_DATA:(.*)$", text, re.M)
    if not names or not data:
        raise ValueError("Kripke printed no TIMER_NAMES / TIMER_DATA lines")
    keys, values = names.group(1).split(","), data.group(1).split(",")
    if len(keys) != len(values):
        raise ValueError(f"Kripke's timer lines disagree: {len(keys)} names, {len(values)} values")
    return {k.strip(): float(v) for k, v in zip(keys, values, strict=True)}


def _clean_env() -> dict[str, str]:
    """This process's environment without the launcher's variables, for a nested mpiexec."""
    drop = ("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_", "MPICH_", "I_MPI_")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


def _run_kripke(cmd: list[str], n: int, iterations: int, ranks: int) -> dict[str, Any]:
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=_clean_env(), timeout=1800, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    t = parse_kripke(proc.stdout)
    unknowns = n**3 * DIRECTIONS * GROUPS
    per = iterations * unknowns
    return {
        "kernel_s": t["SweepSubdomain"] / iterations,  # rank 0's (Kripke times rank 0)
        "kernel_ns": t["SweepSubdomain"] * ranks / per * 1e9,
        "sweep_ns": t["SweepSolver"] / per * 1e9,
        "iter_s": t["Solve"] / iterations,
        "iter_ns": t["Solve"] / per * 1e9,
    }


class _Tally:
    """solver.Control that adds up each iteration's sweep wall and kernel time."""

    def __init__(self, sweeper: KBASweeper):
        self.sweeper = sweeper
        self.sweep = self.kernel = 0.0

    def begin(self, iteration: int) -> None:
        pass

    def stop_requested(self) -> bool:
        return False

    def end(self, iterate: Iterate, final: bool, stopping: bool) -> None:
        self.sweep += self.sweeper.timing.wall
        self.kernel += self.sweeper.timing.busy


class _Case:
    """One measured configuration: its sweeper built once, solved once per repetition."""

    def __init__(self, name: str, cfg: SweepConfig, comm: MPI.Comm, iterations: int):
        self.name, self.cfg, self.comm, self.iterations = name, cfg, comm, iterations
        self.problem = build_problem(cfg)
        kernel = resolve_kernel(cfg.kernel)
        self.blocking = blocking_for(cfg, self.problem, kernel)
        self.plan = plan_for(cfg, self.problem, self.blocking)
        self.sweeper = KBASweeper(self.problem, self.plan, comm)
        self.cells = LocalCells(self.problem, self.sweeper.x_cells, self.sweeper.y_cells)
        self.runs: list[dict[str, float]] = []
        self._solve(1)  # warm-up: the kernel is compiled (or loaded from numba's cache)

    def _solve(self, iterations: int) -> tuple[float, _Tally]:
        tally = _Tally(self.sweeper)
        self.comm.Barrier()
        t0 = time.perf_counter()
        solve(
            self.problem,
            self.cells,
            self.sweeper,
            tolerance=0.0,
            max_iterations=iterations,
            control=tally,
        )
        return time.perf_counter() - t0, tally

    def measure(self) -> None:
        wall, tally = self._solve(self.iterations)
        it = self.iterations
        local = np.array([wall / it, tally.sweep / it, tally.kernel / it])
        worst, total = np.empty(3), np.empty(3)
        self.comm.Allreduce(local, worst, op=MPI.MAX)
        self.comm.Allreduce(local, total, op=MPI.SUM)
        mean = total / self.comm.size
        self.runs.append({"iter_s": worst[0], "sweep_s": worst[1], "kernel_s": mean[2]})

    def free(self) -> None:
        self.sweeper.free()


def _whole(base: SweepConfig, n: int) -> SweepConfig:
    """One task per octant: the 1-rank blocking (what `auto` picks there)."""
    return dataclasses.replace(base, z_block=n, angle_block=PER_OCTANT)


def _blockings(text: str) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for item in filter(None, text.split(",")):
        if item == "auto":
            out.append((0, 0))
            continue
        try:
            z, a = (int(v) for v in item.split("x"))
        except ValueError:
            z = a = -1
        if min(z, a) < 1:
            raise ConfigError("--blockings", "", f"= {text!r}: expected auto or ZxA like 8x10")
        out.append((z, a))
    if not out:
        raise ConfigError("--blockings", "", f"= {text!r}: give at least one blocking")
    return out


def _row(case: str, ranks: int, zb: int, ab: int, runs: list[dict[str, float]], n: int) -> dict:
    unknowns = n**3 * DIRECTIONS * GROUPS
    per_rank = unknowns / ranks
    iters = [r["iter_s"] for r in runs]
    return {
        "case": case,
        "ranks": ranks,
        "z_block": zb,
        "angle_block": ab,
        "kernel_ns": median([r["kernel_s"] for r in runs]) / per_rank * 1e9,
        "sweep_ns": median([r["sweep_s"] for r in runs]) / unknowns * 1e9,
        "iter_ns": median(iters) / unknowns * 1e9,
        "core_ns": median(iters) * ranks / unknowns * 1e9,
        "iter_s": iters,
    }


def _fit(whole: _Case, small: _Case) -> SweepCost:
    """Per-unknown and per-task cost from the two 1-rank blockings' sweep times."""
    rows, times = [], []
    for case in (whole, small):
        plan = case.plan
        unknowns = case.problem.mesh.cells * case.problem.quadrature.total * GROUPS
        rows.append([len(plan.tasks[0]), unknowns])
        times.append(median([r["sweep_s"] for r in case.runs]))
    per_task, per_unknown = np.linalg.solve(np.array(rows, dtype=float), np.array(times))
    base = KERNEL_COSTS[whole.blocking.kernel]
    return dataclasses.replace(
        base, per_task=max(0.0, float(per_task)), per_unknown=float(per_unknown)
    )


def _model_eff(case: _Case, one: _Case, cost: SweepCost, ranks: int) -> float:
    """Predicted efficiency: the 1-rank time outside the sweep split over the ranks, plus the
    modelled sweep of this case's plan."""
    p = case.plan
    sweep = predict_makespan(
        p.px, p.py, p.local_shape, p.directions, GROUPS, p.z_block, p.angle_block, cost, p.order
    )
    outside = median([r["iter_s"] - r["sweep_s"] for r in one.runs])
    t_one = median([r["iter_s"] for r in one.runs])
    return t_one / (ranks * (outside / ranks + sweep))


def run(comm: MPI.Comm, args: argparse.Namespace) -> Report:
    p, n, iterations, repeats = comm.size, args.n, args.iterations, args.repeats
    blockings = _blockings(args.blockings)
    if n < 2 or n % p:
        raise ConfigError("--n", "", f"= {n} zones per side must be divisible by {p} ranks")
    if iterations < 1:
        raise ConfigError("--iterations", "", f"= {iterations}: run at least 1 iteration")
    layouts = [x for x in args.kripke_layouts.split(",") if x]
    bad = [x for x in layouts if x not in KRIPKE_LAYOUTS]
    if bad:
        raise ConfigError(
            "--kripke-layouts",
            "",
            f"= {bad[0]!r}: Kripke's layouts are {', '.join(KRIPKE_LAYOUTS)}",
        )
    kripke = args.kripke
    if kripke and not Path(kripke).is_file():
        raise ConfigError("--kripke", "", f"= {kripke!r} is not a file (Kripke's kripke.exe)")
    mpiexec = args.kripke_mpiexec or str(Path(sys.executable).parent / "mpiexec")
    if kripke and p > 1 and not shutil.which(mpiexec):
        raise ConfigError("--kripke-mpiexec", "", f"= {mpiexec!r}: no such launcher")
    unknowns = n**3 * DIRECTIONS * GROUPS
    report = Report(
        "sweep",
        [
            f"Kripke's problem: {n}^3 zones, 3 materials, S8 (80 directions), {GROUPS} "
            f"groups, isotropic, diamond difference; {iterations} iterations from phi = 0, "
            f"{unknowns / 1e6:.1f} M unknowns; medians of {repeats} interleaved repetitions",
            "ns per unknown and iteration: kernel (per unknown of the rank, as Kripke's "
            "SweepSubdomain), sweep (SweepSolver), iter (Solve / niter: Kripke's grind time), "
            "core = iter x ranks",
            "eff = iter(1 rank, fix-up on) / (ranks x iter); model = the same from the KBA "
            "cost model fitted to the two 1-rank blockings; hpcpipe cases run with "
            f"sweep.kernel = {args.kernel!r}",
        ],
        COLUMNS,
        params={
            "n": n,
            "groups": GROUPS,
            "order": ORDER,
            "iterations": iterations,
            "repeats": repeats,
            "kernel": args.kernel,
            "kripke": bool(kripke),
        },
        stream=comm.rank == 0,
    )
    report.start()
    base = kripke_config(n, GROUPS, ORDER, kernel=args.kernel)
    one_cases: dict[str, _Case] = {}
    if comm.rank == 0:
        whole = _whole(base, n)
        small = dataclasses.replace(base, z_block=SMALL[0], angle_block=SMALL[1])
        for key, name, cfg in (
            ("off", "1 rank, no fixup", dataclasses.replace(whole, fixup=False)),
            ("on", "1 rank", whole),
            ("small", f"1 rank, {SMALL[0]}x{SMALL[1]}", small),
        ):
            one_cases[key] = _Case(name, cfg, MPI.COMM_SELF, iterations)
    idle_barrier(comm)
    # every rank alone on the whole problem at once: what a core delivers when all are busy
    crowd = _Case(f"{p} x 1 rank", _whole(base, n), MPI.COMM_SELF, iterations)
    many: list[_Case] = []
    for zb, ab in blockings:
        cfg = dataclasses.replace(base, px=p, z_block=zb, angle_block=ab)
        try:
            many.append(_Case("auto" if zb == 0 else f"{zb}x{ab}", cfg, comm, iterations))
        except PlanError as exc:
            report.note(f"blocking {zb}x{ab} skipped: {exc}")
    kripke_runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for rep in range(repeats):
        if comm.rank == 0:
            for case in one_cases.values():
                case.measure()
            if kripke:
                for layout in layouts:
                    for ranks in sorted({1, p}):
                        cmd = kripke_command(kripke, n, iterations, layout, ranks, mpiexec)
                        run_ = _run_kripke(cmd, n, iterations, ranks)
                        kripke_runs.setdefault((layout, ranks), []).append(run_)
        idle_barrier(comm)
        if p > 1:
            comm.Barrier()
            crowd.measure()
        k = rep % max(1, len(many))  # rotate, so no case always runs first
        for case in [*many[k:], *many[:k]]:
            case.measure()
        if comm.rank == 0:
            say(f"# repetition {rep + 1}/{repeats} done", err=True)
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    if comm.rank == 0:
        on = one_cases["on"]
        cost = _fit(on, one_cases["small"])
        summary["fitted_cost"] = {"per_unknown_s": cost.per_unknown, "per_task_s": cost.per_task}
        for key in ("off", "on", "small"):
            c = one_cases[key]
            rows.append(_row(c.name, 1, c.plan.z_block, c.plan.angle_block, c.runs, n))
        t_one = np.array([r["iter_s"] for r in on.runs])
        if p > 1:
            row = _row(crowd.name, 1, n, PER_OCTANT, crowd.runs, n)
            row["eff"] = median(t_one / np.array(row["iter_s"]))
            rows.append(row)
            summary["crowded_core"] = row["eff"]
        for case in many:
            row = _row(case.name, p, case.plan.z_block, case.plan.angle_block, case.runs, n)
            if p > 1:
                row["eff"] = median(t_one / (p * np.array(row["iter_s"])))
                row["model"] = _model_eff(case, on, cost, p)
                row["ratio"] = row["eff"] / row["model"]
            rows.append(row)
        for (layout, ranks), runs in sorted(kripke_runs.items(), key=lambda kv: kv[0][1]):
            rows.append(
                {
                    "case": f"Kripke {layout}",
                    "ranks": ranks,
                    "kernel_ns": median([r["kernel_ns"] for r in runs]),
                    "sweep_ns": median([r["sweep_ns"] for r in runs]),
                    "iter_ns": median([r["iter_ns"] for r in runs]),
                    "core_ns": median([r["iter_ns"] for r in runs]) * ranks,
                    "iter_s": [r["iter_s"] for r in runs],
                }
            )
        _kripke_eff(rows, p)
    rows = comm.bcast(rows, root=0)
    summary = comm.bcast(summary, root=0)
    for row in rows:
        report.add({c.key: row.get(c.key) for c in COLUMNS} | row)
    report.summary.update(summary)
    for case in [*one_cases.values(), crowd, *many]:
        case.free()
    _targets(report, rows, p)
    if "crowded_core" in summary:
        c = summary["crowded_core"]
        report.note(
            f"{p} x 1 rank: every rank solves the whole problem alone at the same time; its eff "
            f"= iter(1 rank) / iter(that) = {c:.3f} is what one core keeps of its speed when "
            f"all {p} are busy on the same work (a rank of the {p}-rank grid holds 1/{p} of the "
            "data, which caches better: its efficiency may pass this)"
        )
    if "fitted_cost" in summary:
        f = summary["fitted_cost"]
        report.note(
            f"KBA model fitted to the 1-rank blockings: {f['per_task_s'] * 1e6:.1f} us per task "
            f"+ {f['per_unknown_s'] * 1e9:.2f} ns per unknown (built-in for the plan: "
            f"{KERNEL_COSTS['numba'].per_task * 1e6:.0f} us + "
            f"{KERNEL_COSTS['numba'].per_unknown * 1e9:.2f} ns, numba)"
        )
    return report


def _kripke_eff(rows: list[dict[str, Any]], p: int) -> None:
    """Kripke's efficiency per layout: its own 1-rank iteration over p x its p-rank one."""
    ones = {r["case"]: r for r in rows if r["case"].startswith("Kripke") and r["ranks"] == 1}
    for r in rows:
        if r["case"].startswith("Kripke") and r["ranks"] == p > 1 and r["case"] in ones:
            t1 = np.array(ones[r["case"]]["iter_s"])
            r["eff"] = median(t1 / (p * np.array(r["iter_s"])))


def _targets(report: Report, rows: list[dict[str, Any]], p: int) -> None:
    by = {(r["case"], r["ranks"]): r for r in rows}
    off, on = by.get(("1 rank, no fixup", 1)), by.get(("1 rank", 1))
    auto = by.get(("auto", p))
    kripke = [r for r in rows if r["case"].startswith("Kripke")]
    best = {
        (k, ranks): min((r[k] for r in kripke if r["ranks"] == ranks), default=None)
        for k in ("kernel_ns", "iter_ns")
        for ranks in (1, p)
    }
    if off is not None:
        report.target("kernel, 1 rank (ns)", "<= 11", f"{off['kernel_ns']:.2f}",
                      off["kernel_ns"] <= 11)  # fmt: skip
        if best[("kernel_ns", 1)]:
            ratio = off["kernel_ns"] / best[("kernel_ns", 1)]
            report.target("kernel / Kripke's best layout, 1 rank", "<= 1.3", f"{ratio:.2f}",
                          ratio <= 1.3)  # fmt: skip
    if off is not None and on is not None:
        ratio = on["kernel_ns"] / off["kernel_ns"]
        report.target("kernel fix-up on / off, 1 rank", "<= 1.3", f"{ratio:.2f}", ratio <= 1.3)
        report.target("iteration, 1 rank (ns)", "<= 16.5", f"{on['iter_ns']:.2f}",
                      on["iter_ns"] <= 16.5)  # fmt: skip
        if best[("iter_ns", 1)]:
            ratio = on["iter_ns"] / best[("iter_ns", 1)]
            report.target("iteration / Kripke's best, 1 rank", "< 1", f"{ratio:.2f}", ratio < 1)
    if auto is not None and p > 1:
        report.target(f"iteration, {p} ranks (ns)", "<= 10", f"{auto['iter_ns']:.2f}",
                      auto["iter_ns"] <= 10)  # fmt: skip
        if best[("iter_ns", p)]:
            ratio = auto["iter_ns"] / best[("iter_ns", p)]
            report.target(f"iteration / Kripke's best, {p} ranks", "< 1", f"{ratio:.2f}",
                          ratio < 1)  # fmt: skip
        report.target(f"{p}-rank efficiency, default blocking", ">= 0.85", f"{auto['eff']:.3f}",
                      auto["eff"] >= 0.85)  # fmt: skip
        report.target("KBA measured / model, default blocking", ">= 0.95",
                      f"{auto['ratio']:.3f}", auto["ratio"] >= 0.95)  # fmt: skip
