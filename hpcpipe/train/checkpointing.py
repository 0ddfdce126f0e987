"""Training state <-> checkpoints, independent of the layout that wrote them.

Every tensor is named by the model's global unit index (`unit0004/attn.ln.g`) and optimizer
slot (`optim/m/unit0004/attn.ln.g`), never by stage or rank, and expert tensors carry their
global expert index; so a checkpoint written at pp2 x dp2 loads at pp4 x dp1 or with another ep:
each rank asks for the units it now owns. Dense state is written by replica dp = 0 and expert
state by the first expert group (dp < ep), so nothing is written twice.

Data order and initialisation depend only on (seed, step), so a run is fully described by its
parameters, optimizer slots, optimizer step and the next step index: resuming reproduces an
uninterrupted run bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
from hpcpipe.jobcontrol import find_checkpoint
from hpcpipe.moe.layer import is_expert_param
from hpcpipe.runtime import RunContext
from hpcpipe.train.optim import OptimState

__all__ = ["restore", "save"]

FORMAT_TAG = "hpcpipe-train"


def _name(slot: str | None, unit: int, key: str) -> str:
    return f"unit{unit:04d}/{key}" if slot is None else f"optim/{slot}/unit{unit:04d}/{key}"


def _owns(ctx: RunContext, key: str) -> bool:
    dp = ctx.rankmap.coords(ctx.rank)["dp"]
    return dp < ctx.rankmap.ep if is_expert_param(key) else dp == 0


def _walk(params: dict[int, Any], opt_state: dict[int, OptimState]):
    """(tensor name, array) for every parameter and optimizer slot this rank holds."""
    for s, tree in params.items():
        for unit, p in tree.items():
            for key, value in p.items():
                yield _name(None, unit, key), key, value
        for slot, slot_tree in opt_state[s].slots.items():
            for unit, p in slot_tree.items():
                for key, value in p.items():
                    yield _name(slot, unit, key), key, value


def save(
    ctx: RunContext,
    step: int,
    params: dict[int, Any],
    opt_state: dict[int, OptimState],
    history: dict[str, list[float]],
) -> Path:
    """Collective: checkpoint after `step` completed steps (the next run starts at `step`)."""
    cfg = ctx.config
    tensors = {}
    for name, key, value in _walk(params, opt_state):
        if _owns(ctx, key):
            host = ctx.backend.to_host(value)
            tensors[name] = (ShardSpec(name, host.shape, host.dtype), host)
    opt_steps = {st.step for st in opt_state.values()}
    attrs = {
        "producer": FORMAT_TAG,
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
        "history": json.dumps(history),
        "hpcpipe_version": __version__,
    }
    ck = cfg.checkpoint
    return save_checkpoint(
        ctx.comms.world,
        ck.directory(ctx.output),
        step,
        tensors,
        writer=bool(tensors),
        attrs=attrs,
        keep=ck.keep,
        layout=ck.layout,
        fsync=ck.fsync,
    )


def restore(
    ctx: RunContext, params: dict[int, Any], opt_state: dict[int, OptimState]
) -> tuple[int, dict[str, list[float]]]:
    """Load what this rank owns now into `params`/`opt_state` (in place); returns the step to
    start from and the metrics history so far."""
    path = find_checkpoint(ctx.comms.world, ctx.resume, ctx.config.checkpoint.directory(ctx.output))
    try:
        attrs = read_attrs(path)
        wanted = {}
        for name, _, value in _walk(params, opt_state):
            wanted[name] = ShardSpec(name, tuple(value.shape), np.dtype(value.dtype))
        loaded = load_checkpoint(path, wanted)
    except CheckpointError as exc:
        raise ConfigError("--resume", "", str(exc)) from None
    if attrs.get("producer") not in (None, FORMAT_TAG):
        raise ConfigError(
            "--resume",
            "",
            f"{path} was written by {attrs.get('producer')!r}, not by a training run",
        )
    xp = ctx.xp
    for s, tree in params.items():
        for unit, p in tree.items():
            for key in p:
                p[key] = xp.asarray(loaded[_name(None, unit, key)])
        slots = {
            slot: {
                unit: {key: xp.asarray(loaded[_name(slot, unit, key)]) for key in p}
                for unit, p in slot_tree.items()
            }
            for slot, slot_tree in opt_state[s].slots.items()
        }
        opt_state[s] = OptimState(int(attrs["optimizer_step"]), slots)
    step = int(attrs["data_position"])
    history = json.loads(attrs.get("history", "{}"))
    ctx.log(
        f"resumed from {path} at step {step} (written by a {json.loads(attrs['topology'])} run)"
    )
    return step, {k: list(v)[:step] for k, v in history.items()}
