"""`hpcpipe plan --search`: the deck's model and machine in, the ranked layouts out (a table,
why the others were left out, and the chosen deck)."""

from __future__ import annotations

import dataclasses
import time
import types
from pathlib import Path

from hpcpipe.config import Config, ConfigError, dump_toml
from hpcpipe.layout.cost import Layout, LayoutCost, Prediction, Workload
from hpcpipe.layout.machine import MachineConfig, machine_model
from hpcpipe.layout.search import SearchResult, search_layouts
from hpcpipe.layout.shapes import unit_shapes
from hpcpipe.schedules import simulate
from hpcpipe.schedules.ir import to_csv

__all__ = ["MAX_WORLD", "chosen_config", "layout_search_report", "run_search"]

MAX_WORLD = 1 << 20
"""Beyond a million ranks the per-rank arrays of the node-crossing check cost minutes."""


def _workload(config: Config) -> tuple[Workload, int]:
    model, moe = config.model, config.sections.get("moe")
    if moe is not None and moe.enabled:
        from hpcpipe.moe.config import check_moe

        check_moe(moe, ep=1, layers=model.layers, kind=model.kind, source=config.source)
    size = 8 if config.device.dtype == "float64" else 4
    optim = config.optim
    states = 2 if optim.kind == "adamw" else (1 if optim.momentum > 0 else 0)
    work = Workload(
        units=tuple(unit_shapes(model, moe, size)),
        global_batch=config.data.global_batch,
        seq_len=model.seq_len,
        d_model=model.d_model,
        dtype_bytes=size,
        optimizer_states=states,
        top_k=moe.top_k if moe is not None and moe.enabled else 0,
    )
    return work, (moe.experts if moe is not None and moe.enabled else 0)


def run_search(
    config: Config,
    world: int,
    *,
    ranks_per_node: int | None = None,
    top: int = 10,
    auto: int = 0,
) -> SearchResult:
    """Rank the deck's layouts on `world` ranks (a deck without [model] is bad input)."""
    if world > MAX_WORLD:
        raise ConfigError(
            "--world", "", f"= {world}: the layout search lays out at most {MAX_WORLD} ranks"
        )
    if config.run.workload != "train":
        raise ConfigError(
            config.source, "run.workload", f"= {config.run.workload!r}: --search lays out training"
        )
    from hpcpipe.model.models import build_model, partition

    work, experts = _workload(config)
    mcfg = config.sections.get("machine") or MachineConfig()
    machine = machine_model(mcfg, config.topology.ranks_per_node, config.source, ranks_per_node)
    moe = config.sections.get("moe")
    units = build_model(config.model, moe if moe is not None and moe.enabled else None)
    by = config.train.partition

    def split(n_stages: int, placement: tuple[tuple[int, ...], ...]) -> list[range]:
        return partition(units, n_stages, by=by, stages_of_rank=placement)

    topo = config.topology
    keep = tuple(topo.intra_node) if topo.cross_node == "error" else ()
    return search_layouts(
        work, machine, world, experts=experts, top=top, partition=split, auto=auto,
        keep_inside=keep,
    )  # fmt: skip


def chosen_config(
    config: Config, result: SearchResult, world: int, schedule_csv: str | None = None
) -> Config:
    """The deck with the best layout written into [topology] and [pipeline]; a searched
    schedule (`auto`) is run from `schedule_csv`, which the caller writes."""
    best = result.ranked[0][1].layout
    topo = dataclasses.replace(
        config.topology, pp=best.pp, dp=best.dp, ep=best.ep, order=",".join(best.order)
    )
    searched = best.schedule == "auto"
    pipe = dataclasses.replace(
        config.pipeline,
        schedule="csv" if searched else best.schedule,
        microbatches=best.m,
        virtual_stages=best.v,
        memory_budget=None,
        schedule_csv=schedule_csv if searched else None,
        overlap_pairs=False,
    )
    sections = dict(config.sections)
    sections["topology"], sections["pipeline"] = topo, pipe
    return Config(
        source=f"{config.source} (hpcpipe plan --search, world {world})",
        sections=types.MappingProxyType(sections),
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def layout_search_report(
    config: Config,
    world: int,
    *,
    ranks_per_node: int | None = None,
    top: int = 10,
    auto: int = 0,
    write_deck: str | None = None,
) -> tuple[str, bool]:
    """The search's table, and whether any layout fits; with `write_deck`, the chosen deck
    is written there."""
    t0 = time.process_time()
    result = run_search(config, world, ranks_per_node=ranks_per_node, top=top, auto=auto)
    spent = time.process_time() - t0
    mcfg = config.sections.get("machine") or MachineConfig()
    machine = machine_model(mcfg, config.topology.ranks_per_node, config.source, ranks_per_node)
    rpn = min(machine.ranks_per_node, world)
    model = config.model
    lines = [
        f"layout search: world {world} ({-(-world // rpn)} node(s) of {rpn} ranks), "
        f"{model.kind} {model.layers} layers d_model {model.d_model}, global batch "
        f"{config.data.global_batch} x {model.seq_len} tokens",
        f"machine: {machine.flops / 1e12:g} TFLOP/s, {machine.memory_bytes / 2**30:.1f} GiB "
        f"usable per rank; inside a node {machine.intra.latency * 1e6:.3g} us, "
        f"{machine.intra.bandwidth / 1e9:.3g} GB/s; across nodes "
        f"{machine.inter.latency * 1e6:.3g} us, {machine.inter.bandwidth / 1e9:.3g} GB/s",
        f"{result.candidates} candidates, {result.fit} fit, {result.simulated} simulated (the "
        f"rest ruled out by their work bound), {spent:.1f} s CPU",
    ]
    if result.rejected:
        lines.append("left out:")
        for reason, entry in sorted(result.rejected.items()):
            lines.append(f"  {reason:<9}{entry.count:>7}  e.g. {entry.example}")
    if not result.ranked:
        lines.append("no layout fits: see what was left out above")
        return "\n".join(lines), False
    head = (
        f"{'#':>3} {'pp':>4} {'dp':>5} {'ep':>3} {'order':<9} {'schedule':<20} {'m':>4} "
        f"{'step ms':>9} {'compute':>8} {'a2a':>7} {'bubble':>7} {'p2p':>7} {'reduce':>7} "
        f"{'GiB':>6}  "
        "across nodes"
    )
    lines += ["", "predicted step and its parts on the rank that finishes last (ms)", head]
    for i, (pred, cost) in enumerate(result.ranked, 1):
        lay = cost.layout
        sched = lay.schedule + (f" v={lay.v}" if lay.v else "")
        crossing = [d for d, c in cost.crosses.items() if c and _degree(lay, d) > 1]
        p2p = min(_message_wait(cost, pred), pred.idle)
        lines.append(
            f"{i:>3} {lay.pp:>4} {lay.dp:>5} {lay.ep:>3} {','.join(lay.order):<9} {sched:<20} "
            f"{lay.m:>4} {_ms(pred.step):>9} {_ms(pred.compute):>8} {_ms(pred.alltoall):>7} "
            f"{_ms(pred.idle - p2p):>7} {_ms(p2p):>7} {_ms(pred.reduce_exposed):>7} "
            f"{pred.memory / 2**30:>6.3g}  " + (",".join(crossing) or "-")
        )
    best_cost = result.ranked[0][1]
    best = best_cost.layout
    lines.append("")
    if best.schedule == "auto":
        how = "and the searched schedule, which --write-deck writes as CSV beside the deck"
    else:
        how = f"--set pipeline.schedule={best.schedule} --set pipeline.microbatches={best.m}" + (
            f" --set pipeline.virtual_stages={best.v}" if best.v else ""
        )
    lines.append(
        f"chosen: {best.label}; run it with --set topology.pp={best.pp} "
        f"--set topology.ep={best.ep} --set topology.order={','.join(best.order)} {how}"
    )
    if write_deck:
        csv = None
        if best.schedule == "auto":
            csv = str(Path(write_deck).with_suffix(".schedule.csv"))
            Path(csv).write_text(to_csv(best_cost.schedule))
        Path(write_deck).write_text(dump_toml(chosen_config(config, result, world, csv)))
        lines.append(f"wrote {write_deck}" + (f" and {csv}" if csv else ""))
    return "\n".join(lines), True


def _message_wait(cost: LayoutCost, pred: Prediction) -> float:
    """What the messages between stages add to the pipeline: its makespan minus the same
    schedule's with free messages (the rest of the idle time is fill and drain)."""
    free = dataclasses.replace(cost.costs, comm_latency=0.0, comm_bandwidth=None)
    return max(pred.makespan - simulate(cost.schedule, free).makespan, 0.0)


def _degree(layout: Layout, dim: str) -> int:
    return {"pp": layout.pp, "dp": layout.dp, "ep": layout.ep, "edp": layout.dp // layout.ep}[dim]
