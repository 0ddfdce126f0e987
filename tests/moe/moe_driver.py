"""MPI driver: a small MoE gpt trained for one step in pp x dp x ep layouts against the
single-process model with every expert local. Run under mpiexec; rank 0 prints one JSON line
per case.

    mpiexec -n 4 python tests/moe/moe_driver.py            # the cases for 4 ranks

Each case runs F, B and W of every microbatch with the real `ExpertGroup` (GPipe order, p2p
between stages), reduces non-expert gradients over dp and expert gradients over the
expert-data-parallel group, gathers everything on rank 0 and compares with the reference:
microbatch losses, stage-boundary activations, aux/z losses and kept counts per MoE block,
initial parameters and every gradient. Two-phase cases also rerun flat and compare bitwise.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, replace
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
from mpi4py import MPI

from hpcpipe.model import ModelConfig, Stage, accumulate, build_model, partition
from hpcpipe.moe import MoEConfig, MoETransformerBlock, is_expert_param
from hpcpipe.mpi.comms import build_comms, discover_nodes
from hpcpipe.mpi.experts import ExpertGroup
from hpcpipe.topology import RankMap

MODEL = ModelConfig(kind="gpt", layers=2, d_model=8, n_heads=2, d_ff=12, vocab=11, seq_len=4)
ROWS_MB = 3  # rows per microbatch: 12 tokens
MICROBATCHES = 2
SEED = 5


@dataclass(frozen=True)
class Case:
    name: str
    pp: int
    dp: int
    ep: int
    moe: MoEConfig
    ranks_per_node: int = 0
    skew: bool = False  # every token gets the same router input: most experts get nothing
    capacity: int | None = None  # fixed per-expert capacity (0 = every token dropped)


def moe(experts: int, top_k: int = 2, **kw: Any) -> MoEConfig:
    base = {"capacity_factor": 1.0, "aux_loss_coef": 0.05, "z_loss_coef": 0.01, "every": 1}
    return MoEConfig(experts=experts, top_k=top_k, **{**base, **kw})


CASES: dict[int, list[Case]] = {
    2: [
        Case("ep2", 1, 2, 2, moe(4)),
        Case("pp2-ep1-k1", 2, 1, 1, moe(4, 1, capacity_factor=1.25)),
        Case("dp2-ep1-dropless", 1, 2, 1, moe(4, 2, dropless=True)),
    ],
    4: [
        Case("ep4", 1, 4, 4, moe(4)),
        Case("pp2-dp2-ep2", 2, 2, 2, moe(4)),
        Case("dp4-ep2-k1", 1, 4, 2, moe(4, 1)),
        Case("ep4-skewed", 1, 4, 4, moe(4), skew=True),
        Case("ep4-all-dropped", 1, 4, 4, moe(4), capacity=0),
        Case("ep4-dropless-skewed", 1, 4, 4, moe(4, 2, dropless=True), skew=True),
    ],
    8: [
        Case("ep8-2nodes", 1, 8, 8, moe(8, hierarchical=True), ranks_per_node=4),
        Case("ep8-4nodes", 1, 8, 8, moe(8, hierarchical=True), ranks_per_node=2),
        Case("pp2-ep4-2nodes", 2, 4, 4, moe(8, hierarchical=True), ranks_per_node=2),
        Case("ep8-4nodes-skewed", 1, 8, 8, moe(8, hierarchical=True), ranks_per_node=2, skew=True),
    ],
}


def batch(rows: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(SEED)
    shape = (rows, MODEL.seq_len)
    return rng.integers(0, MODEL.vocab, shape), rng.integers(0, MODEL.vocab, shape)


def adjust(units: list, params: dict[int, dict[str, np.ndarray]], case: Case) -> None:
    """Case-specific edits applied identically to the parallel and the reference model."""
    for i, unit in enumerate(units):
        if not isinstance(unit, MoETransformerBlock) or i not in params:
            continue
        if case.capacity is not None:
            unit.moe.fixed_capacity = case.capacity
        if case.skew:
            p = params[i]
            p["moe.ln.g"][...] = 0.0
            p["moe.ln.b"][...] = 3.0 * p["moe.router.w"][:, 0]


def split(units: list, pp: int) -> list[range]:
    return partition(units, pp, by=[2, 2]) if pp == 2 else [range(len(units))]


def run_parallel(case: Case, world: MPI.Comm) -> dict[str, Any]:
    """F/B/W of every microbatch of this rank's replica; returns what rank 0 compares."""
    rankmap = RankMap.build(
        world.size, case.ranks_per_node or world.size, case.pp, case.dp, case.ep
    )
    info, node_comm = discover_nodes(world, case.ranks_per_node)
    comms = build_comms(world, rankmap, node_comm, info)
    c = rankmap.coords(world.rank)
    group = ExpertGroup.from_comms(comms, case.moe.experts, hierarchical=case.moe.hierarchical)
    units = build_model(MODEL, case.moe, group)
    ranges = split(units, case.pp)
    stage = Stage(units, ranges[c["pp"]])
    params = stage.init(SEED, np, "float64")
    adjust(units, params, case)
    init = {i: {k: v.copy() for k, v in p.items()} for i, p in params.items()}
    pp_comm = comms.group("pp")
    rows = case.dp * MICROBATCHES * ROWS_MB
    x_all, t_all = batch(rows)
    weight = ROWS_MB / rows
    out: dict[str, Any] = {"loss": {}, "act": {}, "aux": {}}
    ctxs, sends = [], []
    for k in range(MICROBATCHES):
        g = c["dp"] * MICROBATCHES + k  # the reference's microbatch index
        sl = slice(g * ROWS_MB, (g + 1) * ROWS_MB)
        if stage.is_first:
            x = x_all[sl]
        else:
            x = np.empty((ROWS_MB, MODEL.seq_len, MODEL.d_model))
            pp_comm.Recv(x, source=c["pp"] - 1, tag=k)
        y, ctx = stage.forward(params, x, t_all[sl] if stage.is_last else None, loss_weight=weight)
        ctxs.append(ctx)
        for i, s in stage.aux_stats(ctx).items():
            out["aux"][(g, i)] = (
                float(s.aux_loss),
                float(s.z_loss),
                s.kept.tolist(),
                s.routed.tolist(),
            )
        if stage.is_last:
            out["loss"][g] = float(y)
        else:
            out["act"][g] = y
            sends.append(pp_comm.Isend(np.ascontiguousarray(y), dest=c["pp"] + 1, tag=k))
    MPI.Request.Waitall(sends)
    wctxs, sends = [], []
    for k in range(MICROBATCHES):
        if stage.is_last:
            dy: Any = weight
        else:
            dy = np.empty((ROWS_MB, MODEL.seq_len, MODEL.d_model))
            pp_comm.Recv(dy, source=c["pp"] + 1, tag=100 + k)
        dx, wctx = stage.backward_input(params, ctxs[k], dy)
        wctxs.append(wctx)
        if not stage.is_first:
            sends.append(pp_comm.Isend(np.ascontiguousarray(dx), dest=c["pp"] - 1, tag=100 + k))
    MPI.Request.Waitall(sends)
    grads = None
    for wctx in wctxs:
        g_mb = stage.backward_weight(params, wctx)
        grads = g_mb if grads is None else accumulate(grads, g_mb)
    assert grads is not None
    # non-expert gradients: sum over dp; expert gradients: over the expert-data-parallel group
    edp, dp_comm = comms.expert_dp, comms.group("dp")
    for p in grads.values():
        for name, v in p.items():
            (edp if is_expert_param(name) else dp_comm).Allreduce(MPI.IN_PLACE, v, op=MPI.SUM)
    keep = (
        {
            i: {k: v for k, v in p.items() if is_expert_param(k) or c["dp"] == 0}
            for i, p in grads.items()
        }
        if c["dp"] < case.ep
        else {}
    )
    out["grads"] = keep
    out["init"] = (
        {
            i: {k: v for k, v in p.items() if is_expert_param(k) or c["dp"] == 0}
            for i, p in init.items()
        }
        if c["dp"] < case.ep
        else {}
    )
    out["nodes"], out["local"] = group.layout.nodes, group.layout.local_size
    group.free()
    comms.free()
    return out


def run_reference(case: Case) -> dict[str, Any]:
    """The same microbatches through one stage holding every unit and every expert."""
    units = build_model(MODEL, case.moe)
    full = Stage(units, range(len(units)))
    params = full.init(SEED, np, "float64")
    adjust(units, params, case)
    ranges = split(units, case.pp)
    rows = case.dp * MICROBATCHES * ROWS_MB
    x_all, t_all = batch(rows)
    weight = ROWS_MB / rows
    out: dict[str, Any] = {"loss": {}, "act": {}, "aux": {}, "init": params}
    grads = None
    for g in range(case.dp * MICROBATCHES):
        sl = slice(g * ROWS_MB, (g + 1) * ROWS_MB)
        loss, ctx = full.forward(params, x_all[sl], t_all[sl], loss_weight=weight)
        out["loss"][g] = float(loss)
        for i, s in full.aux_stats(ctx).items():
            out["aux"][(g, i)] = (
                float(s.aux_loss),
                float(s.z_loss),
                s.kept.tolist(),
                s.routed.tolist(),
            )
        if case.pp == 2:
            head = Stage(units, ranges[0])
            out["act"][g] = head.forward(params, x_all[sl], loss_weight=weight)[0]
        _, wctx = full.backward_input(params, ctx, weight)
        g_mb = full.backward_weight(params, wctx)
        grads = g_mb if grads is None else accumulate(grads, g_mb)
    out["grads"] = grads
    return out


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {"loss": {}, "act": {}, "aux": {}, "grads": {}, "init": {}}
    for part in parts:
        for key in ("loss", "act", "aux"):
            merged[key].update(part[key])
        for key in ("grads", "init"):
            for i, p in part[key].items():
                merged[key].setdefault(i, {}).update(p)
    return merged


def rel(a: Any, b: Any) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def compare(got: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    worst = {"loss": 0.0, "act": 0.0, "aux": 0.0, "grad": 0.0}
    for g, v in ref["loss"].items():
        worst["loss"] = max(worst["loss"], rel(got["loss"][g], v))
    for g, v in ref["act"].items():
        worst["act"] = max(worst["act"], rel(got["act"][g], v))
    counts_equal = set(got["aux"]) == set(ref["aux"])
    for key, (aux, z, kept, routed) in ref["aux"].items():
        a2, z2, kept2, routed2 = got["aux"][key]
        worst["aux"] = max(worst["aux"], rel(a2, aux), rel(z2, z))
        counts_equal &= kept == kept2 and routed == routed2
    names_equal = {(i, k) for i, p in ref["grads"].items() for k in p} == {
        (i, k) for i, p in got["grads"].items() for k in p
    }
    where = ""
    for i, p in ref["grads"].items():
        for k, v in p.items():
            r = rel(got["grads"][i][k], v) if i in got["grads"] and k in got["grads"][i] else 1.0
            if r > worst["grad"]:
                worst["grad"], where = r, f"unit {i} {k}"
    init_equal = all(
        np.array_equal(got["init"][i][k], v) for i, p in ref["init"].items() for k, v in p.items()
    )
    dropped = sum(sum(r) - sum(k) for _, _, k, r in ref["aux"].values())
    routed = sum(sum(r) for _, _, _, r in ref["aux"].values())
    idle = sum(k.count(0) for _, _, k, _ in ref["aux"].values())
    return {
        "max_rel": worst,
        "worst_grad": where,
        "counts_equal": counts_equal,
        "grad_names_equal": names_equal,
        "init_equal": init_equal,
        "n_grads": sum(len(p) for p in ref["grads"].values()),
        "n_expert_grads": sum(is_expert_param(k) for p in ref["grads"].values() for k in p),
        "dropped_fraction": dropped / routed,
        "idle_expert_microbatches": idle,
    }


def bitwise_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """This rank's outputs and gradients of two runs are identical bit for bit."""
    same = a["loss"] == b["loss"] and a["aux"] == b["aux"]
    same &= all(np.array_equal(a["act"][g], b["act"][g]) for g in a["act"])
    same &= all(
        np.array_equal(a["grads"][i][k], b["grads"][i][k])
        for i in a["grads"]
        for k in a["grads"][i]
    )
    return bool(same)


def main() -> int:
    world = MPI.COMM_WORLD
    for case in CASES.get(world.size, []):
        mine = run_parallel(case, world)
        record: dict[str, Any] = {
            "case": case.name,
            "ranks": world.size,
            "pp": case.pp,
            "dp": case.dp,
            "ep": case.ep,
            "hierarchical": case.moe.hierarchical,
            "nodes": mine["nodes"],
            "ranks_per_node_in_group": mine["local"],
        }
        if case.moe.hierarchical:
            flat = run_parallel(replace(case, moe=replace(case.moe, hierarchical=False)), world)
            record["bitwise_vs_flat"] = bool(
                world.allreduce(int(bitwise_equal(mine, flat)), op=MPI.MIN)
            )
        parts = world.gather(mine, root=0)
        if world.rank == 0:
            assert parts is not None
            record.update(compare(merge(parts), run_reference(case)))
            print(json.dumps(record), flush=True)
    # bad input: experts not divisible by ep raises the same clear error on every rank
    try:
        ExpertGroup(world, world.size + 1 if world.size > 1 else 0)
    except ValueError as exc:
        if world.rank == 0:
            print(json.dumps({"case": "bad-experts", "error": str(exc)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
