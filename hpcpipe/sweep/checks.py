"""The sweep workload's deck checks, run before any rank communicates (and by `--dry-run` and
`plan`): physics that can converge, the rank grid, problem size, quadrature and KBA plan.
Pure: no MPI."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from hpcpipe.checks import gib, keyed, memory_bytes
from hpcpipe.config import Config, ConfigError
from hpcpipe.topology import RankMap

__all__ = ["check", "check_kernel", "check_physics"]

# Sizes past which a deck cannot be a real job on one node: rejected up front rather than
# discovered as an allocation failure (or minutes of plan building) on every rank.
MAX_SWEEP_DIRECTIONS = 100_000
"""Directions per octant of a sweep quadrature."""
MAX_PRODUCT_POLAR = 512
"""Polar points of a product quadrature (Gauss-Legendre nodes of larger sets take minutes)."""
MAX_SWEEP_TASKS = 1_000_000
"""KBA tasks per rank and sweep (octants x angle blocks x z blocks)."""


def check_physics(cfg: Any, source: str) -> None:
    """A deck that cannot converge is refused now, not after minutes of iterations: scattering
    beyond the total cross section (negative absorption; there is no fission model) and a
    tolerance of zero (the change per iteration stops at round-off). The library itself
    accepts both, for studies of the solver."""
    if not cfg.tolerance > 0:
        raise ConfigError(
            source,
            "sweep.tolerance",
            f"= {cfg.tolerance:g} can never be reached (the change per iteration stops at "
            "round-off, about 1e-15): use a positive value such as 1e-10",
        )
    for m, (totals, rows) in enumerate(zip(cfg.sigma_t, cfg.sigma_s, strict=True)):
        for g, (total, row) in enumerate(zip(totals, rows, strict=True)):
            out = sum(row)
            if out > total * (1 + 1e-12):
                ratio = f"{out / total:.3g}" if total else "infinite"
                raise ConfigError(
                    source,
                    "sweep.sigma_s",
                    f"material {m} scatters {out:g} out of group {g}, more than its sigma_t "
                    f"there ({total:g}; scattering ratio c = {ratio} > 1): absorption would "
                    "be negative and source iteration diverges. The row sum of sigma_s must "
                    "not exceed sigma_t (there is no fission model)",
                )


def check_kernel(cfg: Any, device: str, source: str) -> None:
    """The kernel asked for can run on this installation and device."""
    import numpy as np

    from hpcpipe.sweep.kernel import resolve_kernel

    try:
        resolve_kernel(cfg.kernel, np if device == "cpu" else None)
    except ValueError as exc:
        raise ConfigError(source, "sweep.kernel", f"= {cfg.kernel!r}: {exc}") from None


def check(config: Config, rankmap: RankMap, files: bool) -> None:
    """The sweep workload's checks: rank grid, problem size, quadrature and KBA plan."""
    from hpcpipe.sweep.mesh import build_problem
    from hpcpipe.sweep.plan import PlanError, blocking_for, plan_for, validate

    cfg, source = config.sweep, config.source
    check_physics(cfg, source)
    if cfg.plot:  # found now, not after the whole sweep has run
        from hpcpipe.plotting import require_matplotlib

        require_matplotlib(source, "sweep.plot")
    if cfg.px * cfg.py != rankmap.world:
        raise ConfigError(
            source,
            "sweep.px",
            f"* sweep.py = {cfg.px} * {cfg.py} = {cfg.px * cfg.py} ranks, but "
            f"this run has {rankmap.world}: launch with mpiexec -n {cfg.px * cfg.py} "
            "or set sweep.px / sweep.py to match",
        )
    if cfg.quadrature == "product" and cfg.order > MAX_PRODUCT_POLAR:
        raise ConfigError(
            source,
            "sweep.order",
            f"= {cfg.order} polar points: product sets of at most {MAX_PRODUCT_POLAR} are "
            "supported",
        )
    dirs = cfg.directions_per_octant
    if dirs > MAX_SWEEP_DIRECTIONS:
        key = "sweep.azimuthal" if cfg.azimuthal > cfg.order else "sweep.order"
        raise ConfigError(
            source,
            key,
            f"= {getattr(cfg, key.split('.')[1])} gives {dirs} directions per octant; at most "
            f"{MAX_SWEEP_DIRECTIONS} are supported",
        )
    tasks = 8 * (dirs // cfg.angle_block_size) * (cfg.nz // cfg.z_block_size)
    if tasks > MAX_SWEEP_TASKS:
        raise ConfigError(
            source,
            "sweep.z_block",
            f"= {cfg.z_block} and sweep.angle_block = {cfg.angle_block} give {tasks} pipeline "
            f"tasks per rank and sweep (at most {MAX_SWEEP_TASKS}); use larger blocks",
        )
    limit = memory_bytes()
    cells = (cfg.nx // cfg.px) * (cfg.ny // cfg.py) * cfg.nz
    need = cells * (cfg.groups * 8 * 6 + 8)
    if limit and need > limit:
        sizes = {"sweep.nx": cfg.nx, "sweep.ny": cfg.ny, "sweep.nz": cfg.nz}
        key = max(sizes, key=lambda k: sizes[k])
        raise ConfigError(
            source,
            key,
            f"is too large: sweep.nx * sweep.ny * sweep.nz = {cfg.nx} * {cfg.ny} * {cfg.nz} "
            f"cells x {cfg.groups} group(s) need about {gib(need)} per rank, more than this "
            f"node's {gib(limit)} of memory",
        )
    check_kernel(cfg, config.device.kind, source)
    try:
        unread = not files and getattr(cfg, "mesh_file", "")  # the workload reads it anyway
        problem = build_problem(dataclasses.replace(cfg, mesh_file="") if unread else cfg)
    except ValueError as exc:
        raise keyed(exc, "sweep", source) from None
    try:
        validate(plan_for(cfg, problem, blocking_for(cfg, problem, device=config.device.kind)))
    except PlanError as exc:
        word = re.match(r"[a-z_]+", str(exc))
        known = word is not None and hasattr(cfg, word.group(0))
        key = f"sweep.{word.group(0)}" if known and word else "sweep"
        raise ConfigError(source, key, f"cannot be planned: {exc}") from None
