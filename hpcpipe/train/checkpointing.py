"""Training state <-> checkpoints, independent of the layout that wrote them.

Every tensor is named by the model's global unit index (`unit0004/attn.ln.g`) and optimizer
slot (`optim/m/unit0004/attn.ln.g`), never by stage or rank, and expert tensors carry their
global expert index; so a checkpoint written at pp2 x dp2 loads at pp4 x dp1 or with another ep:
each rank asks for the units it now owns. Dense state is written by replica dp = 0 and expert
state by the first expert group (dp < ep), so nothing is written twice.

Data order and initialisation depend only on (seed, step), so a run is fully described by its
parameters, optimizer slots, optimizer step and the next step index: resuming reproduces an
uninterrupted run bit for bit.

Replicas that train apart (`[async] mode = "local"`) each write their own state under
`replica0001/...` (every rank writes: no replica owns another's), with whatever else they need
to continue (the averaging round in flight) as extra tensors and index attributes; the number
of replicas is then fixed, the pipeline layout still free.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from hpcpipe import __version__
from hpcpipe.config import ConfigError, dump_toml
from hpcpipe.io.checkpoint import (
    CheckpointError,
    ShardSpec,
    load_checkpoint,
    read_attrs,
    save_checkpoint,
)
from hpcpipe.jobcontrol import find_checkpoint, older_hint
from hpcpipe.moe.layer import is_expert_param
from hpcpipe.runtime import RunContext
from hpcpipe.train.optim import OptimState

__all__ = ["Resumed", "replica_prefix", "restore", "save"]

FORMAT_TAG = "hpcpipe-train"

IDENTITY_SECTIONS = ("model", "data", "optim", "moe", "async")
IDENTITY_KEYS = ("run.seed", "device.dtype")
"""What determines a training run's trajectory, besides the step: the model, the data and its
order, the optimizer, the training mode (`[async]`), the seed and the arithmetic precision. A
resume compares them with the checkpoint's; the layout, schedule, microbatching, cadence and
outputs may change freely."""


def _identity_of(deck: dict[str, Any]) -> dict[str, Any]:
    """The identity keys of a deck given as plain sections ({"optim": {"lr": ...}, ...})."""
    out = {f"{s}.{k}": v for s in IDENTITY_SECTIONS for k, v in (deck.get(s) or {}).items()}
    for dotted in IDENTITY_KEYS:
        section, key = dotted.split(".")
        out[dotted] = (deck.get(section) or {}).get(key)
    return json.loads(json.dumps(out, default=str))  # tuples as lists, as TOML reads them


def run_identity(config: Any) -> dict[str, Any]:
    """The deck's identity keys, flattened (`optim.lr`) to JSON values."""
    return _identity_of(config.as_dict())


def _saved_identity(attrs: dict[str, Any]) -> dict[str, Any] | None:
    """The identity a checkpoint was written with (older ones: read off its stored deck)."""
    if isinstance(attrs.get("identity"), dict):
        return attrs["identity"]
    text = attrs.get("config")
    if not isinstance(text, str):
        return None
    import tomllib

    try:
        return _identity_of(tomllib.loads(text))
    except tomllib.TOMLDecodeError:
        return None


def check_identity(
    path: Path, attrs: dict[str, Any], config: Any, allowed: tuple[str, ...]
) -> list[str]:
    """Refuse to continue another run's checkpoint: name every identity key that differs
    (unless `--allow-change` names it or its section) and how to proceed. Returns the keys
    that differ and were allowed to."""
    saved = _saved_identity(attrs)
    if saved is None:
        return []
    now = run_identity(config)

    def free(key: str) -> bool:
        return key in allowed or key.split(".")[0] in allowed

    differ = sorted(k for k in saved.keys() & now.keys() if saved[k] != now[k])
    changed = [k for k in differ if not free(k)]
    if not changed:
        return differ
    detail = "; ".join(f"{k} = {saved[k]!r} there, {now[k]!r} here" for k in changed[:6])
    more = f" (and {len(changed) - 6} more)" if len(changed) > 6 else ""
    flags = " ".join(f"--allow-change {k}" for k in changed[:6])
    raise ConfigError(
        "--resume",
        "",
        f"{path} was written by a run with other settings: {detail}{more}. Continuing it would "
        "mix two trajectories: resume with the deck that wrote it, or, if the change is "
        f"intended, add {flags}",
    )


def check_allowed(allowed: tuple[str, ...], config: Any) -> None:
    """`--allow-change` must name an identity key or section (a typo would allow nothing)."""
    known = set(IDENTITY_SECTIONS) | set(run_identity(config))
    for key in allowed:
        if key in known:
            continue
        raise ConfigError(
            "command line",
            "--allow-change",
            f"{key!r} is not compared on resume; the compared keys are the sections "
            f"{', '.join(IDENTITY_SECTIONS)} and {', '.join(IDENTITY_KEYS)}",
        )


HISTORY = "history/"
"""Tensor name prefix of the per-step metrics (rank 0's), one float64 [steps] tensor each."""


def _name(slot: str | None, unit: int, key: str) -> str:
    return f"unit{unit:04d}/{key}" if slot is None else f"optim/{slot}/unit{unit:04d}/{key}"


def _owns(ctx: RunContext, key: str) -> bool:
    dp = ctx.rankmap.coords(ctx.rank)["dp"]
    return dp < ctx.rankmap.ep if is_expert_param(key) else dp == 0


def replica_prefix(replica: int) -> str:
    """Where one of several replicas training apart keeps its tensors."""
    return f"replica{replica:04d}/"


def _walk(params: dict[int, Any], opt_state: dict[int, OptimState], prefix: str = ""):
    """(tensor name, array) for every parameter and optimizer slot this rank holds."""
    for s, tree in params.items():
        for unit, p in tree.items():
            for key, value in p.items():
                yield prefix + _name(None, unit, key), key, value
        for slot, slot_tree in opt_state[s].slots.items():
            for unit, p in slot_tree.items():
                for key, value in p.items():
                    yield prefix + _name(slot, unit, key), key, value


def save(
    ctx: RunContext,
    step: int,
    params: dict[int, Any],
    opt_state: dict[int, OptimState],
    history: dict[str, list[float]],
    *,
    replica: int | None = None,
    extra: Mapping[str, Any] | None = None,
    attrs: Mapping[str, Any] | None = None,
) -> Path:
    """Collective: checkpoint after `step` completed steps (the next run starts at `step`).

    `replica`: this rank's replica when replicas train apart (every rank writes its own, under
    `replica_prefix`); `extra`: more tensors of this rank's, by full name; `attrs`: more index
    attributes (rank 0's)."""
    cfg = ctx.config
    tensors = {}
    prefix = "" if replica is None else replica_prefix(replica)
    for name, key, value in _walk(params, opt_state, prefix):
        if replica is not None or _owns(ctx, key):
            host = ctx.backend.to_host(value)
            tensors[name] = (ShardSpec(name, host.shape, host.dtype), host)
    opt_steps = {st.step for st in opt_state.values()}
    if replica is not None and 0 in opt_state:  # replicas step apart: each keeps its count
        tensors[prefix + OPTIM_STEP] = _step_tensor(prefix + OPTIM_STEP, opt_state[0].step)
    for name, value in (extra or {}).items():
        host = ctx.backend.to_host(value)
        tensors[name] = (ShardSpec(name, host.shape, host.dtype), host)
    index = None  # only rank 0's go to the index: the others need not build (or hold) them
    if ctx.rank == 0:
        index = _index_attrs(ctx, step, opt_steps, history)
        if replica is not None:
            index["replicas"] = ctx.rankmap.dp
        index.update(attrs or {})
        for key, values in history.items():  # float64 tensors: compact, checksummed
            host = np.asarray(values, dtype=np.float64)
            tensors[HISTORY + key] = (ShardSpec(HISTORY + key, host.shape, host.dtype), host)
    ck = cfg.checkpoint
    return save_checkpoint(
        ctx.comms.world,
        ck.directory(ctx.output),
        step,
        tensors,
        writer=bool(tensors),
        attrs=index,
        keep=ck.keep,
        layout=ck.layout,
        fsync=ck.fsync,
    )


OPTIM_STEP = "optim_step"
"""A replica's optimizer step count (replicas training apart may have taken different ones),
written by the rank holding its first stage."""


def _step_tensor(name: str, step: int) -> tuple[ShardSpec, np.ndarray]:
    value = np.array([step], dtype=np.int64)
    return ShardSpec(name, value.shape, value.dtype), value


def _index_attrs(
    ctx: RunContext, step: int, opt_steps: set[int], history: dict[str, list[float]]
) -> dict[str, Any]:
    cfg = ctx.config
    return {
        "producer": FORMAT_TAG,
        "identity": run_identity(cfg),
        "config": dump_toml(cfg),
        "topology": json.dumps(
            {"world": ctx.size, **ctx.rankmap.dims, "order": list(ctx.rankmap.order)}
        ),
        "data_position": step,
        "optimizer_step": max(opt_steps) if opt_steps else 0,
        "rng": json.dumps(
            {
                "seed": cfg.run.seed,
                "data_seed": cfg.data.seed,
                "note": "init and data depend only on (seed, step)",
            }
        ),
        "history_keys": json.dumps(sorted(history)),
        "hpcpipe_version": __version__,
    }


def _resume_error(path: Path, why: str) -> ConfigError:
    return ConfigError("--resume", "", f"{path}: {why}")


def _int_attr(path: Path, attrs: dict[str, Any], key: str) -> int:
    value = attrs.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _resume_error(
            path, f"attribute {key!r} = {value!r} is not a step count: the checkpoint is damaged"
        )
    return value


Extra = Callable[[dict[str, Any]], Mapping[str, ShardSpec]]
"""A resume's further tensors, named from the checkpoint's index attributes."""


def _check_replicas(path: Path, attrs: dict[str, Any], replicas: int | None) -> None:
    """Replicas training apart resume as that many replicas; a synchronous run has one model."""
    saved = attrs.get("replicas")
    if saved is None and replicas is not None:
        raise _resume_error(
            path,
            "holds one model (a synchronous run's), not the replicas' own weights and "
            "optimizer states that async.mode = 'local' continues from: resume it with "
            "async.mode = 'sync'",
        )
    if saved is not None and replicas is None:
        raise _resume_error(
            path,
            f"holds {saved} replicas that trained apart (async.mode = 'local'), not one model: "
            "resume it with async.mode = 'local'",
        )
    if saved is not None and saved != replicas:
        raise _resume_error(
            path,
            f"holds {saved} replicas that trained apart (async.mode = 'local') and this run "
            f"has {replicas} (topology.dp): resume with topology.dp = {saved} (the pipeline "
            "layout may change)",
        )


def _read_state(
    path: Path,
    params: dict[int, Any],
    opt_state: dict[int, OptimState],
    rank: int,
    ctx: RunContext | None = None,
    replica: int | None = None,
    extra: Extra | None = None,
    per_step: int = 1,
) -> tuple[dict[str, np.ndarray], int, int, dict[str, list[float]], Any, dict[str, Any]]:
    """Everything a resume needs, read and checked (every CRC32, shape, dtype and attribute);
    nothing is applied, so a bad checkpoint leaves the freshly built model untouched."""
    try:
        attrs = read_attrs(path)
    except CheckpointError as exc:
        raise ConfigError("--resume", "", str(exc) + older_hint(path)) from None
    if attrs.get("producer") not in (None, FORMAT_TAG):
        raise ConfigError(
            "--resume",
            "",
            f"{path} was written by {attrs.get('producer')!r}, not by a training run",
        )
    if ctx is not None:
        ctx.changed = tuple(check_identity(path, attrs, ctx.config, ctx.allow_changes))
        _check_replicas(path, attrs, None if replica is None else ctx.rankmap.dp)
    step = _int_attr(path, attrs, "data_position")
    optimizer_step = _int_attr(path, attrs, "optimizer_step")
    try:
        history = json.loads(attrs.get("history", "{}"))  # older checkpoints: JSON attribute
        keys = json.loads(attrs.get("history_keys", "[]"))
        topology = json.loads(attrs["topology"]) if "topology" in attrs else None
    except (TypeError, ValueError) as exc:
        raise _resume_error(path, f"attribute 'history' or 'topology' is damaged ({exc})") from None
    if not isinstance(history, dict) or not all(isinstance(v, list) for v in history.values()):
        raise _resume_error(path, "attribute 'history' is not a table of metric lists")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise _resume_error(path, "attribute 'history_keys' is not a list of metric names")
    wanted = {}
    prefix = "" if replica is None else replica_prefix(replica)
    for name, _, value in _walk(params, opt_state, prefix):
        wanted[name] = ShardSpec(name, tuple(value.shape), np.dtype(value.dtype))
    if replica is not None:
        wanted[prefix + OPTIM_STEP] = ShardSpec(prefix + OPTIM_STEP, (1,), np.dtype(np.int64))
    wanted.update(extra(attrs) if extra is not None else {})
    if rank == 0:  # the metrics history lives on rank 0 only
        for key in keys:
            wanted[HISTORY + key] = ShardSpec(
                HISTORY + key, (step * per_step,), np.dtype(np.float64)
            )
    try:
        loaded = load_checkpoint(path, wanted)
    except CheckpointError as exc:
        raise ConfigError("--resume", "", str(exc) + older_hint(path)) from None
    for key in keys if rank == 0 else ():
        history[key] = loaded.pop(HISTORY + key).tolist()
    if replica is not None:
        optimizer_step = int(loaded.pop(prefix + OPTIM_STEP)[0])
    return loaded, step, optimizer_step, history, topology, attrs


def _agree(comm: Any, error: ConfigError | None) -> None:
    """Collective: raise the same ConfigError on every rank when any rank's load failed, so a
    shard damaged under one rank still ends the job with one message and exit code 2."""
    failed = [(r, e) for r, e in enumerate(comm.allgather(error.message if error else None)) if e]
    if not failed:
        return
    message = failed[0][1]
    if len(failed) < comm.size:  # found only where the damaged file is read: say where
        who = ", ".join(str(r) for r, _ in failed[:8]) + (", ..." if len(failed) > 8 else "")
        message += f" (found by rank {who}; no rank loaded anything)"
    raise ConfigError("--resume", "", message)


class Resumed(NamedTuple):
    """Where a resumed run starts: the step, rank 0's metrics so far, the checkpoint's index
    attributes and the extra tensors asked for."""

    step: int
    history: dict[str, list[float]]
    attrs: dict[str, Any]
    extra: dict[str, np.ndarray]


def restore(
    ctx: RunContext,
    params: dict[int, Any],
    opt_state: dict[int, OptimState],
    *,
    replica: int | None = None,
    extra: Extra | None = None,
    per_step: int = 1,
) -> Resumed:
    """Load what this rank owns now into `params`/`opt_state` (in place); `replica` and
    `extra` as `save` wrote them (`extra` names the further tensors from the index
    attributes); `per_step`: metric rows per step (a stream's updates per global batch).

    Collective. Every rank reads and checks all of its state first and the ranks agree before
    any parameter is replaced: a damaged checkpoint is a ConfigError (exit 2) on every rank.
    """
    world = ctx.comms.world
    path = find_checkpoint(world, ctx.resume, ctx.config.checkpoint.directory(ctx.output))
    error, state = None, None
    try:
        state = _read_state(path, params, opt_state, world.rank, ctx, replica, extra, per_step)
    except ConfigError as exc:
        error = exc
    _agree(world, error)
    assert state is not None
    loaded, step, optimizer_step, history, topology, attrs = state
    steps = ctx.config.run.steps
    if step >= steps:  # every rank read the same step: the same error everywhere
        raise ConfigError(
            "--resume",
            "",
            f"{path} is at step {step} and run.steps = {steps}: nothing to do; raise "
            f"run.steps to train further (e.g. --set run.steps={step + steps})",
        )
    xp = ctx.xp
    prefix = "" if replica is None else replica_prefix(replica)
    for s, tree in params.items():
        for unit, p in tree.items():
            for key in p:
                p[key] = xp.asarray(loaded.pop(prefix + _name(None, unit, key)))
        slots = {
            slot: {
                unit: {key: xp.asarray(loaded.pop(prefix + _name(slot, unit, key))) for key in p}
                for unit, p in slot_tree.items()
            }
            for slot, slot_tree in opt_state[s].slots.items()
        }
        opt_state[s] = OptimState(optimizer_step, slots)
    ctx.log(f"resumed from {path} at step {step} (written by a {topology} run)")
    history = {k: list(v)[: step * per_step] for k, v in history.items()}
    return Resumed(step, history, attrs, loaded)
