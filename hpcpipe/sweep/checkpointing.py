"""Sweep state <-> checkpoints, independent of the rank grid that wrote them.

Source iteration is fully described by its iterate (`solver.Iterate`): the scalar flux after
N sweeps and the convergence history so far. The flux is stored as one global tensor
`flux/phi` of shape (nx, ny, nz, G); each rank writes the x-y block it owns and, on restart,
reads the block it owns now, so a checkpoint written on 2 x 2 ranks loads on 4 x 1 or 1 x 1.
Rank 0 alone writes the history. On the same grid the continued solve is bitwise equal to an
uninterrupted one (each sweep is a deterministic function of the flux); on another grid it is
equal to round-off, the angular sums running in another order.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from hpcpipe.config import ConfigError
from hpcpipe.io.checkpoint import (
    CheckpointError,
    ShardSpec,
    load_checkpoint,
    read_attrs,
    save_checkpoint,
)
from hpcpipe.io.ckpt_config import CheckpointConfig
from hpcpipe.sweep.config import SweepConfig
from hpcpipe.sweep.solver import Iterate

__all__ = ["FORMAT_TAG", "FREE_KEYS", "HISTORY", "PHI", "restore", "save"]

FORMAT_TAG = "hpcpipe-sweep"
"""The `producer` attribute: a training checkpoint is refused by name, and vice versa."""
PHI = "flux/phi"
HISTORY = ("history/dphi", "history/scale", "history/sweep_seconds")
"""The iterate's history tensors: Iterate.history, .scales, .seconds, one value per iteration."""
FREE_KEYS = frozenset(
    {"px", "py", "z_block", "angle_block", "octant_order", "tolerance", "max_iterations", "plot"}
)
"""[sweep] keys a restart may change: the rank grid, the blocking and when to stop change how
the problem is solved, not which problem; any other key names another problem."""


def _spec(cfg: SweepConfig, x_cells: slice, y_cells: slice) -> ShardSpec:
    """This rank's x-y block of the global flux (all z, all groups)."""
    shape = (cfg.nx, cfg.ny, cfg.nz, cfg.groups)
    return ShardSpec(PHI, shape, np.float64, (x_cells, y_cells))


def _plain(cfg: SweepConfig) -> dict[str, Any]:
    """The [sweep] section as JSON values (tuples become lists), comparable with a saved one."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def save(
    comm: Any,
    directory: Path,
    iterate: Iterate,
    cfg: SweepConfig,
    cells: tuple[slice, slice],
    settings: CheckpointConfig,
    *,
    converged: bool,
    config_text: str = "",
) -> Path:
    """Collective on `comm`: checkpoint `iterate`; returns its path on every rank.

    The checkpoint's step is the number of iterations done. `cells` are the (x, y) cell ranges
    this rank owns; `config_text` is the resolved deck.
    """
    spec = _spec(cfg, *cells)
    phi = iterate.phi
    host = np.asarray(phi.get() if hasattr(phi, "get") else phi)
    tensors: dict[str, tuple[ShardSpec, Any]] = {PHI: (spec, host.reshape(spec.shape))}
    if comm.rank == 0:
        values = (iterate.history, iterate.scales, iterate.seconds)
        for name, series in zip(HISTORY, values, strict=True):
            arr = np.asarray(series, dtype=np.float64)
            tensors[name] = (ShardSpec.whole(name, arr.shape, arr.dtype), arr)
    attrs = {
        "producer": FORMAT_TAG,
        "converged": bool(converged),
        "sweep": _plain(cfg),
        "grid": {"px": cfg.px, "py": cfg.py, "world": comm.size},
        "config": config_text,
    }
    return save_checkpoint(
        comm,
        directory,
        iterate.iterations,
        tensors,
        writer=True,
        attrs=attrs,
        keep=settings.keep,
        layout=settings.layout,
        fsync=settings.fsync,
    )


def _check_same_problem(path: Path, saved: Any, cfg: SweepConfig) -> None:
    if not isinstance(saved, dict):
        raise ConfigError("--resume", "", f"{path} has no [sweep] settings: not a sweep checkpoint")
    now = _plain(cfg)
    # keys added to [sweep] after the checkpoint was written (mesh_file, ...) had their default
    saved = {**_plain(SweepConfig()), **saved}
    changed = sorted(
        k for k in now.keys() | saved.keys() if k not in FREE_KEYS and now.get(k) != saved.get(k)
    )
    if changed:
        detail = "; ".join(
            f"sweep.{k} = {saved.get(k)!r} there, {now.get(k)!r} here" for k in changed[:4]
        )
        raise ConfigError(
            "--resume",
            "",
            f"{path} holds the flux of another problem ({detail}); resume with the deck that "
            "wrote it (only the rank grid, blocking, tolerance and max_iterations may change)",
        )


def restore(
    path: Path,
    cfg: SweepConfig,
    cells: tuple[slice, slice],
    xp: Any = np,
    *,
    comm: Any = None,
) -> tuple[Iterate, dict[str, Any]]:
    """Read this rank's block of the flux and the history from checkpoint `path`.

    Returns the iterate (flux as (cells, G) on `xp`) and the checkpoint's attributes. Every
    problem is a ConfigError naming the checkpoint (exit code 2), never a silent load. Nothing
    is applied here: the caller gets a new iterate only when everything read back checked. With
    `comm` (collective), the ranks agree first, so a shard damaged under one rank raises the
    same ConfigError on every rank instead of failing one rank alone.
    """
    error, result = None, None
    try:
        result = _read(path, cfg, cells)
    except ConfigError as exc:
        error = exc
    if comm is not None:
        _agree(comm, error)
    elif error is not None:
        raise error
    assert result is not None
    loaded, attrs = result
    phi = xp.asarray(loaded[PHI].reshape(-1, cfg.groups))
    history, scales, seconds = (loaded[name].tolist() for name in HISTORY)
    return Iterate(phi, history, scales, seconds), attrs


def _read(
    path: Path, cfg: SweepConfig, cells: tuple[slice, slice]
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    try:
        attrs = read_attrs(path)
        if attrs.get("producer") != FORMAT_TAG:
            raise ConfigError(
                "--resume",
                "",
                f"{path} was written by {attrs.get('producer')!r}, not by a sweep run",
            )
        _check_same_problem(path, attrs.get("sweep"), cfg)
        n = int(attrs["step"])  # iterations done
        spec = _spec(cfg, *cells)
        wanted = {PHI: spec}
        wanted.update({name: ShardSpec.whole(name, (n,), np.float64) for name in HISTORY})
        return load_checkpoint(path, wanted), attrs
    except CheckpointError as exc:
        from hpcpipe.jobcontrol import older_hint

        raise ConfigError("--resume", "", str(exc) + older_hint(path)) from None


def _agree(comm: Any, error: ConfigError | None) -> None:
    """Collective: the first failing rank's error on every rank (see restore)."""
    failed = [(r, e) for r, e in enumerate(comm.allgather(error.message if error else None)) if e]
    if not failed:
        return
    message = failed[0][1]
    if len(failed) < comm.size:  # found only where the damaged file is read: say where
        who = ", ".join(str(r) for r, _ in failed[:8]) + (", ..." if len(failed) > 8 else "")
        message += f" (found by rank {who}; no rank loaded anything)"
    raise ConfigError("--resume", "", message)
