"""[machine]: what a rank can compute, hold and send, inside a node and across nodes.

The layout search predicts a step from these figures, so they should be measured, not guessed:
`calibration_intra` / `calibration_inter` name `hpcpipe bench p2p|alltoall ... --json` results
measured with the ranks inside one node / on two nodes, and each overrides the keys it
measures (latency and bandwidth from the ping-pong curve, all-to-all bandwidth from its largest
message). The defaults describe a generic 8-GPU node (NVLink-class links inside, one
InfiniBand-class rail per GPU across) and are there so that `plan --search` runs at all.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcpipe.config import ConfigError, option

__all__ = ["Link", "Machine", "MachineConfig", "machine_model"]


@dataclass(frozen=True)
class MachineConfig:
    """[machine]: the machine model of `hpcpipe plan --search` (units: us, GB/s, GiB, TFLOP/s)."""

    ranks_per_node: int = option(
        0, "ranks per node; 0 = topology.ranks_per_node, else 8", minimum=0, maximum=1 << 20
    )
    memory_gib: float = option(80.0, "device memory per rank, GiB", minimum=0.0)
    memory_reserve: float = option(
        0.1,
        "share of memory_gib a layout may not plan for (allocator slack, workspaces, buffers)",
        minimum=0.0,
        maximum=0.9,
    )
    compute_tflops: float = option(
        200.0, "achieved compute per rank on the model's matmuls, TFLOP/s", minimum=0.0
    )
    intra_latency_us: float = option(3.0, "point-to-point latency inside a node, us", minimum=0.0)
    intra_bandwidth_gbs: float = option(
        150.0, "point-to-point bandwidth inside a node, GB/s per rank and direction", minimum=0.0
    )
    inter_latency_us: float = option(8.0, "point-to-point latency across nodes, us", minimum=0.0)
    inter_bandwidth_gbs: float = option(
        25.0, "point-to-point bandwidth across nodes, GB/s per rank and direction", minimum=0.0
    )
    alltoall_intra_gbs: float | None = option(
        None, "all-to-all bandwidth per rank inside a node, GB/s; unset = intra_bandwidth_gbs"
    )
    alltoall_inter_gbs: float | None = option(
        None, "all-to-all bandwidth per rank across nodes, GB/s; unset = inter_bandwidth_gbs"
    )
    calibration_intra: tuple[str, ...] = option(
        (), "hpcpipe bench p2p/alltoall --json results measured inside one node"
    )
    calibration_inter: tuple[str, ...] = option(
        (), "the same, measured with the ranks on two nodes"
    )
    calibration_compute: tuple[str, ...] = option(
        (),
        "hpcpipe bench pipeline --json results (the real model): compute_tflops is set to "
        "the rate their F, B and W achieved",
    )

    def __post_init__(self) -> None:
        for key in ("memory_gib", "compute_tflops", "intra_bandwidth_gbs", "inter_bandwidth_gbs"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key}: = {getattr(self, key)} must be > 0")
        for key in ("alltoall_intra_gbs", "alltoall_inter_gbs"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ValueError(f"{key}: = {value} must be > 0 (or unset)")


@dataclass(frozen=True)
class Link:
    """One kind of connection: a message of n bytes takes latency + n / bandwidth seconds."""

    latency: float
    bandwidth: float
    alltoall_bandwidth: float

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth if nbytes else 0.0


@dataclass(frozen=True)
class Machine:
    """The resolved model in SI units (seconds, bytes/s, bytes, FLOP/s)."""

    ranks_per_node: int
    memory_bytes: float
    flops: float
    intra: Link
    inter: Link

    def link(self, crosses_nodes: bool) -> Link:
        return self.inter if crosses_nodes else self.intra


def _fit_p2p(rows: list[dict[str, Any]], path: str, source: str, key: str) -> tuple[float, float]:
    """(latency s, bandwidth B/s) of a ping-pong curve: the smallest message's time, and the
    slope between the two largest (what a large activation sees)."""
    column = "mailbox_us" if "mailbox_us" in rows[0] else "raw_us"
    pts = sorted((float(r["bytes"]), float(r[column]) * 1e-6) for r in rows)
    if len(pts) < 2 or pts[-1][0] <= pts[-2][0] or pts[-1][1] <= pts[-2][1]:
        raise ConfigError(source, key, f"{path}: a p2p result needs two or more growing sizes")
    latency = pts[0][1]
    bandwidth = (pts[-1][0] - pts[-2][0]) / (pts[-1][1] - pts[-2][1])
    return latency, bandwidth


def _result(path: str, kinds: tuple[str, ...], what: str, source: str, key: str) -> dict:
    """A `hpcpipe bench ... --json` result of one of `kinds`, or a ConfigError saying why not."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(source, key, f"{path} cannot be read: {exc.strerror}") from None
    except ValueError as exc:
        raise ConfigError(source, key, f"{path} is not JSON: {exc}") from None
    bench = data.get("benchmark") if isinstance(data, dict) else None
    if bench not in kinds:
        raise ConfigError(
            source, key, f"{path} is not a --json result of {what} (benchmark = {bench!r})"
        )
    return data


def _calibrate(paths: tuple[str, ...], source: str, key: str) -> dict[str, float]:
    """The link figures the named bench results measure."""
    found: dict[str, float] = {}
    for path in paths:
        data = _result(path, ("p2p", "alltoall"), "`hpcpipe bench p2p` or `alltoall`", source, key)
        bench, rows = data["benchmark"], data.get("rows")
        if not rows:
            raise ConfigError(source, key, f"{path} holds no rows (rerun the benchmark)")
        try:
            if bench == "p2p":
                found["latency"], found["bandwidth"] = _fit_p2p(rows, path, source, key)
            else:  # `bytes` is what each rank sends to each peer: (ranks - 1) x that leaves it
                big = max(rows, key=lambda r: float(r["bytes"]))
                column = "flat_us" if "flat_us" in big else "raw_us"
                peers = int(data.get("machine", {}).get("ranks", 2)) - 1
                seconds = float(big[column]) * 1e-6
                found["alltoall"] = peers * float(big["bytes"]) / seconds if seconds > 0 else 0.0
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            raise ConfigError(
                source, key, f"{path}: its rows lack the column {exc} (rerun the benchmark)"
            ) from None
        for what, value in found.items():
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(
                    source, key, f"{path}: gives a {what} of {value!r} (times must be finite, "
                    "growing with size and > 0; rerun the benchmark)",
                )  # fmt: skip
    return found


def machine_model(
    cfg: MachineConfig,
    topology_ranks_per_node: int,
    source: str,
    ranks_per_node: int | None = None,
) -> Machine:
    """The [machine] section resolved, calibration files applied (ConfigError naming the key).

    Ranks per node: `ranks_per_node` (the command line) wins, then the key, then the topology's,
    then 8."""
    links = []
    for where in ("intra", "inter"):
        latency = getattr(cfg, f"{where}_latency_us") * 1e-6
        bandwidth = getattr(cfg, f"{where}_bandwidth_gbs") * 1e9
        a2a = getattr(cfg, f"alltoall_{where}_gbs")
        alltoall = a2a * 1e9 if a2a is not None else bandwidth
        key = f"machine.calibration_{where}"
        measured = _calibrate(getattr(cfg, f"calibration_{where}"), source, key)
        latency = measured.get("latency", latency)
        bandwidth = measured.get("bandwidth", bandwidth)
        alltoall = measured.get("alltoall", alltoall if a2a is not None else bandwidth)
        links.append(Link(latency, bandwidth, alltoall))
    rpn = ranks_per_node or cfg.ranks_per_node or topology_ranks_per_node or 8
    usable = cfg.memory_gib * (1.0 - cfg.memory_reserve) * 2**30
    flops = cfg.compute_tflops * 1e12
    if cfg.calibration_compute:
        flops = _compute_rate(cfg.calibration_compute, source, "machine.calibration_compute")
    return Machine(rpn, usable, flops, links[0], links[1])


def _compute_rate(paths: tuple[str, ...], source: str, key: str) -> float:
    """FLOP/s that `hpcpipe bench pipeline` runs achieved, counted as the layout search counts
    them (F, B and W each the forward's FLOPs): the median over every schedule and step.

    Each result names its deck and overrides; that deck is read again (relative paths from
    where the benchmark ran, i.e. here) to count the FLOPs of one step."""
    from hpcpipe.config import load_config
    from hpcpipe.layout.shapes import unit_shapes

    rates = []
    for path in paths:
        data = _result(
            path, ("pipeline",), "`hpcpipe bench pipeline` (the real model)", source, key
        )
        params, ranks = data.get("params", {}), data.get("machine", {}).get("ranks")
        try:
            deck = load_config(
                params["deck"], [*params.get("overrides", []), f"topology.pp={ranks}"]
            )
        except (KeyError, OSError) as exc:
            raise ConfigError(source, key, f"{path}: its deck cannot be read: {exc}") from None
        except ConfigError as exc:
            raise ConfigError(source, key, f"{path}: its deck is not usable: {exc}") from None
        flops = sum(u.flops_per_token for u in unit_shapes(deck.model, deck.sections.get("moe"), 4))
        tokens = deck.data.global_batch * deck.model.seq_len  # pp = ranks, dp = 1
        for row in data.get("rows", []):
            for step in row.get("per_step", []) if isinstance(row, dict) else ():
                seconds = step.get("compute_s") if isinstance(step, dict) else None
                if isinstance(seconds, int | float) and math.isfinite(seconds) and seconds > 0:
                    rates.append(3 * flops * tokens / (ranks * seconds))  # mean F+B+W per rank
    if not rates:
        raise ConfigError(source, key, "the named results hold no measured step")
    return float(sorted(rates)[len(rates) // 2])
