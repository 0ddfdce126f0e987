"""What can be checked before a job does any MPI work: the deck against the world size and the
workload's own constraints, the Slurm allocation, and the run directory.

The deck checks are pure (no MPI, no writes) and run identically on every rank, and by
`hpcpipe run --dry-run`, so a deck that cannot run stops the whole job with exit 2 and one
message naming the key, before any rank allocates, communicates or writes; tests call them
in-process. The Slurm helpers are pure as well, and the run-directory helpers touch only the
file system: the runtime gathers their answers from every rank and raises the same error
everywhere.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import os
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcpipe.config import Config, ConfigError, dump_toml
from hpcpipe.topology import RankMap

__all__ = [
    "SlurmLayout",
    "check_deck",
    "check_output",
    "check_paths",
    "check_slurm",
    "planning_world",
    "prepare_output",
    "slurm_layout",
]

# Sizes past which a deck cannot be a real job on one node: rejected up front rather than
# discovered as an allocation failure (or minutes of plan building) on every rank.
MAX_SWEEP_DIRECTIONS = 100_000
"""Directions per octant of a sweep quadrature."""
MAX_PRODUCT_POLAR = 512
"""Polar points of a product quadrature (Gauss-Legendre nodes of larger sets take minutes)."""
MAX_SWEEP_TASKS = 1_000_000
"""KBA tasks per rank and sweep (octants x angle blocks x z blocks)."""


def check_deck(config: Config, world: int, ranks_per_node: int, *, files: bool = True) -> RankMap:
    """The rank layout of `config` on `world` ranks, after every check its workload makes before
    communicating; raises ConfigError naming the key otherwise.

    `files` also opens the data and mesh files the deck names (token ranges, mesh ids) and
    builds the synthetic data chain, as `--dry-run` does; a real run leaves that to its
    workload, which does it first thing anyway, rather than reading them twice on every rank.
    """
    from hpcpipe.runtime import build_rankmap

    rankmap = build_rankmap(config, world, ranks_per_node)
    check_written_paths(config)
    check = _WORKLOAD_CHECKS.get(config.run.workload)
    if check is not None:
        check(config, rankmap, files)
    return rankmap


def planning_world(config: Config, world: int | None) -> tuple[int, str | None]:
    """The world size to plan `config` for without MPI, and a note when it was chosen here.

    `world` (from --world) wins; else the deck fixes it (pp * dp, or px * py for a sweep);
    else (topology.dp = 0, the rest of the world) the smallest world that fits, pp * ep,
    with a note saying so, rather than an error for a deck that runs on any multiple of it.
    """
    if world is not None:
        if world < 1:
            raise ConfigError("--world", "", f"must be >= 1, got {world}")
        return world, None
    if config.run.workload == "sweep":
        return config.sweep.px * config.sweep.py, None
    topo = config.topology
    if topo.dp:
        return topo.pp * topo.dp, None
    n = topo.pp * topo.ep
    return n, (
        f"topology.dp = 0 gives data parallelism the rest of the world, so the deck runs on any "
        f"multiple of pp * ep = {topo.pp} * {topo.ep}; planning for world {n}, the smallest "
        "(pass --world N for another)"
    )


def check_paths(config: Config) -> None:
    """Files the deck names that are read as soon as the deck is used must be regular files: a
    FIFO would block the read forever (and a time-limit signal is held during start-up), a
    directory or device gives a confusing error deep inside a reader."""
    pipeline = config.sections.get("pipeline")
    if pipeline is not None and pipeline.schedule == "csv" and pipeline.schedule_csv:
        path = Path(pipeline.schedule_csv)
        try:
            regular = stat.S_ISREG(path.stat().st_mode)
        except (OSError, ValueError) as exc:
            raise ConfigError(
                config.source,
                "pipeline.schedule_csv",
                f"= {str(path)!r} cannot be read: {_os_reason(exc)}",
            ) from None
        if not regular:
            raise ConfigError(
                config.source,
                "pipeline.schedule_csv",
                f"= {str(path)!r} is not a regular file (a directory, FIFO or device)",
            )


def _keyed(exc: ValueError, section: str, source: str) -> ConfigError:
    """A component's ValueError("key: why") as the ConfigError that names section.key."""
    key, sep, why = str(exc).partition(": ")
    if sep and re.fullmatch(r"[a-z_]+", key):
        return ConfigError(source, f"{section}.{key}", why)
    return ConfigError(source, section, f"is not usable: {exc}")


def _memory_bytes() -> int:
    """Physical memory of this node (0 when the platform cannot tell)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


# ---------------------------------------------------------------- train


def _check_train(config: Config, rankmap: RankMap, files: bool) -> None:
    """The Trainer's checks, in its order: schedule, batch split, MoE, model size, stage
    partition, data."""
    from hpcpipe.model.models import build_model, partition
    from hpcpipe.schedules.report import runnable_schedule
    from hpcpipe.train.data import build_dataset

    source = config.source
    check_paths(config)
    schedule, _ = runnable_schedule(config.pipeline, rankmap.pp, source)
    m = schedule.num_microbatches
    rows = config.data.global_batch
    if rows % (rankmap.dp * m):
        raise ConfigError(
            source,
            "data.global_batch",
            f"= {rows} must be divisible by dp * pipeline.microbatches = {rankmap.dp} * {m} = "
            f"{rankmap.dp * m}",
        )
    moe = config.moe
    if moe.enabled:
        from hpcpipe.moe.config import check_moe

        check_moe(
            moe, ep=rankmap.ep, layers=config.model.layers, kind=config.model.kind, source=source
        )
    _check_train_memory(config, rankmap, rows // (rankmap.dp * m))
    try:
        units = build_model(config.model, moe)
    except ValueError as exc:
        raise _keyed(exc, "model", source) from None
    n_stages, n_units = schedule.num_stages, len(units)
    stage_units = config.train.stage_units
    if stage_units:
        if len(stage_units) != n_stages or sum(stage_units) != n_units:
            raise ConfigError(
                source,
                "train.stage_units",
                f"= {list(stage_units)} must list {n_stages} stage sizes "
                f"summing to the model's {n_units} units",
            )
    elif n_stages > n_units:
        raise ConfigError(
            source,
            "model.layers",
            f"= {config.model.layers} gives {n_units} pipeline units, fewer "
            f"than the schedule's {n_stages} stages; add layers or lower pp / v",
        )
    try:
        partition(
            units,
            n_stages,
            by=list(stage_units) if stage_units else config.train.partition,
            stages_of_rank=None if stage_units else schedule.stages_of_rank,
        )
    except ValueError as exc:
        key = "train.stage_units" if stage_units else "train.partition"
        raise ConfigError(source, key, f"cannot split the model: {exc}") from None
    if files:
        build_dataset(config.data, config.model, config.run.seed, source=source)


def _check_train_memory(config: Config, rankmap: RankMap, rows_mb: int) -> None:
    """Reject models and batches that cannot fit one node's memory (they would fail at
    allocation, or thrash, on every rank): parameters with gradients and AdamW moments, the
    rank's token shard, and one microbatch's attention scores."""
    limit = _memory_bytes()
    if not limit:
        return
    model, moe = config.model, config.moe
    d, f, vocab, seq, layers = model.d_model, model.d_ff, model.vocab, model.seq_len, model.layers
    size = 8 if config.device.dtype == "float64" else 4
    dense = 4 * d * d + 2 * d * f if model.kind == "gpt" else 2 * d * f
    n_moe = layers // moe.every if moe.enabled and model.kind == "gpt" else 0
    per_expert = 2 * d * (moe.d_ff_expert or f)
    moe_block = 4 * d * d + d * moe.experts + -(-moe.experts // rankmap.ep) * per_expert
    params = (
        vocab * d * 2
        + (seq * d if model.kind == "gpt" else 0)
        + (layers - n_moe) * dense
        + n_moe * moe_block
    )
    terms = {
        "model.d_model": params * size * 4 // rankmap.pp,
        "data.global_batch": (config.data.global_batch // rankmap.dp) * (seq + 1) * 8 * 2,
        "model.seq_len": rows_mb * model.n_heads * seq * seq * size if model.kind == "gpt" else 0,
    }
    key, need = max(terms.items(), key=lambda kv: kv[1])
    if need <= limit:
        return
    what = {
        "model.d_model": (
            f"model.d_model = {d}, model.d_ff = {f}, model.vocab = {vocab}, model.layers = "
            f"{layers}"
            + (f", moe.experts = {moe.experts}" if n_moe else "")
            + f" give about {params:.3g} parameters; with gradients and optimizer moments "
            f"that is {_gib(need)} per pipeline rank"
        ),
        "data.global_batch": (
            f"data.global_batch = {config.data.global_batch} sequences of model.seq_len = "
            f"{seq} tokens take {_gib(need)} per data-parallel rank"
        ),
        "model.seq_len": (
            f"model.seq_len = {seq} makes attention scores of {_gib(need)} per microbatch "
            f"({rows_mb} rows x {model.n_heads} heads x seq_len^2)"
        ),
    }[key]
    raise ConfigError(
        config.source, key, f"is too large: {what}, more than this node's {_gib(limit)} of memory"
    )


# ---------------------------------------------------------------- sweep


def _check_sweep_physics(cfg: Any, source: str) -> None:
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


def _check_sweep(config: Config, rankmap: RankMap, files: bool) -> None:
    """The sweep workload's checks: rank grid, problem size, quadrature and KBA plan."""
    from hpcpipe.sweep.mesh import build_problem
    from hpcpipe.sweep.plan import PlanError, plan_for, validate

    cfg, source = config.sweep, config.source
    _check_sweep_physics(cfg, source)
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
    limit = _memory_bytes()
    cells = (cfg.nx // cfg.px) * (cfg.ny // cfg.py) * cfg.nz
    need = cells * (cfg.groups * 8 * 6 + 8)
    if limit and need > limit:
        sizes = {"sweep.nx": cfg.nx, "sweep.ny": cfg.ny, "sweep.nz": cfg.nz}
        key = max(sizes, key=lambda k: sizes[k])
        raise ConfigError(
            source,
            key,
            f"is too large: sweep.nx * sweep.ny * sweep.nz = {cfg.nx} * {cfg.ny} * {cfg.nz} "
            f"cells x {cfg.groups} group(s) need about {_gib(need)} per rank, more than this "
            f"node's {_gib(limit)} of memory",
        )
    try:
        unread = not files and getattr(cfg, "mesh_file", "")  # the workload reads it anyway
        problem = build_problem(dataclasses.replace(cfg, mesh_file="") if unread else cfg)
    except ValueError as exc:
        raise _keyed(exc, "sweep", source) from None
    try:
        validate(plan_for(cfg, problem))
    except PlanError as exc:
        word = re.match(r"[a-z_]+", str(exc))
        known = word is not None and hasattr(cfg, word.group(0))
        key = f"sweep.{word.group(0)}" if known and word else "sweep"
        raise ConfigError(source, key, f"cannot be planned: {exc}") from None


_WORKLOAD_CHECKS: dict[str, Callable[[Config, RankMap, bool], None]] = {
    "train": _check_train,
    "sweep": _check_sweep,
}


# ---------------------------------------------------------------- Slurm


@dataclass(frozen=True)
class SlurmLayout:
    """What Slurm says about this launch: how many tasks, and how many on each node."""

    tasks: int | None
    tasks_var: str
    per_node: tuple[int, ...] | None
    per_node_var: str
    per_node_text: str


def _tasks_per_node(text: str) -> tuple[int, ...] | None:
    """`SLURM_TASKS_PER_NODE` syntax, e.g. "4(x2),3" -> (4, 4, 3); None when unparsable."""
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            return None
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return tuple(out) or None


def _int(env: Mapping[str, str], var: str) -> int | None:
    value = env.get(var, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def slurm_layout(env: Mapping[str, str], *, srun_launched: bool) -> SlurmLayout | None:
    """Slurm's view of this job's tasks, when it describes the MPI world we are in.

    `srun_launched`: every rank's SLURM_PROCID equals its world rank, so srun started the
    ranks and the step's variables describe them. Otherwise the ranks came from mpiexec: the
    allocation's SLURM_NTASKS describes them only when we are not inside some other job step
    (mpiexec run from the batch script or an salloc shell); inside a step (mpiexec bootstrapping
    through srun, srun --pty) nothing can be concluded.
    """
    if srun_launched and "SLURM_STEP_NUM_TASKS" in env:
        tasks_var = "SLURM_STEP_NUM_TASKS"
        per_node_vars = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    elif not srun_launched and "SLURM_STEP_NUM_TASKS" not in env:
        tasks_var = "SLURM_NTASKS" if "SLURM_NTASKS" in env else "SLURM_NPROCS"
        per_node_vars = ("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    else:
        return None
    tasks = _int(env, tasks_var)
    per_node, per_node_var, text = None, "", ""
    for var in per_node_vars:
        if var not in env:
            continue
        text = env[var]
        if var == "SLURM_NTASKS_PER_NODE":
            n = _int(env, var)
            nodes = _int(env, "SLURM_NNODES") or _int(env, "SLURM_JOB_NUM_NODES")
            if n is None or nodes is None:
                continue
            per_node = (n,) * nodes
        else:
            per_node = _tasks_per_node(text)
        if per_node is not None:
            per_node_var = var
            break
    if tasks is None and per_node is None:
        return None
    return SlurmLayout(tasks, tasks_var, per_node, per_node_var, text)


def check_slurm(
    layout: SlurmLayout | None, world: int, ranks_per_node: int, source: str
) -> list[str]:
    """Raise ConfigError when the MPI world or topology.ranks_per_node contradicts Slurm's
    allocation; returns warnings (virtual nodes that subdivide Slurm's) for rank 0 to print.

    A world of another size than the tasks Slurm started or allocated is almost always a
    wrong `-n` under an allocation; virtual nodes that straddle two real nodes make every
    node-aware choice (intra-node groups, the two-phase all-to-all) wrong.
    """
    if layout is None:
        return []
    if layout.tasks is not None and layout.tasks != world:
        raise ConfigError(
            "launcher",
            layout.tasks_var,
            f"= {layout.tasks} tasks in the Slurm allocation, but the MPI world has {world} "
            f"rank(s): launch with srun (or mpiexec -n {layout.tasks}) inside the allocation, or "
            "allocate as many tasks as the job needs",
        )
    if not ranks_per_node or layout.per_node is None or sum(layout.per_node) != world:
        return []
    # Slurm's node boundaries (block placement) must be virtual-node boundaries too
    ends = itertools.accumulate(layout.per_node)
    straddles = any(end % ranks_per_node and end != world for end in ends)
    slurm = f"{layout.per_node_var}={layout.per_node_text}"
    if straddles:
        counts = sorted(set(layout.per_node))
        fit = counts[0] if len(counts) == 1 else 0
        raise ConfigError(
            source,
            "topology.ranks_per_node",
            f"= {ranks_per_node} but Slurm placed {','.join(map(str, layout.per_node))} "
            f"task(s) per node ({slurm}): virtual nodes would straddle real ones; set "
            f"topology.ranks_per_node = 0 (discover nodes)" + (f" or {fit}" if fit else ""),
        )
    if any(n != ranks_per_node for n in layout.per_node):
        return [
            f"topology.ranks_per_node = {ranks_per_node} splits Slurm's nodes ({slurm}) into "
            "smaller virtual nodes; traffic between them is treated as inter-node"
        ]
    return []


def slurm_nodes_warning(layout: SlurmLayout | None, nodes: int) -> str | None:
    """A warning when MPI found fewer or more nodes than Slurm allocated (ranks discovered on
    the nodes, topology.ranks_per_node = 0): mpiexec without Slurm support starts every rank
    on the first node."""
    if layout is None or layout.per_node is None or len(layout.per_node) == nodes:
        return None
    return (
        f"MPI finds the ranks on {nodes} node(s) but Slurm allocated {len(layout.per_node)} "
        f"({layout.per_node_var}={layout.per_node_text}): the launcher did not place ranks "
        "where Slurm expects them (use srun, or an mpiexec built with Slurm support)"
    )


# ---------------------------------------------------------------- output directory


def _os_reason(exc: OSError | ValueError) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        name = errno.errorcode.get(exc.errno, str(exc.errno))
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{exc.strerror or os.strerror(exc.errno)} [{name}]{where}"
    return str(exc)


def _output_dirs(config: Config) -> list[tuple[str, Path]]:
    """(key, directory) of everything the run writes: run.output, and checkpoint.dir and the
    directory of trace.path when they are set apart from it."""
    dirs = [("run.output", Path(config.run.output))]
    ckpt = config.sections.get("checkpoint")
    if ckpt is not None and ckpt.dir:
        dirs.append(("checkpoint.dir", Path(ckpt.dir)))
    trace = config.sections.get("trace")
    if trace is not None and trace.enabled and trace.path:
        dirs.append(("trace.path", Path(trace.path).parent))
    return dirs


def prepare_output(
    config: Config, *, resume: bool = False, overwrite: bool = False
) -> tuple[str, str] | None:
    """Rank 0: apply the run-directory policy (hpcpipe.rundir), create the run directories and
    write config.toml into run.output; returns (key, reason) when that fails (an earlier run
    there, missing permission, read-only or full file system, a file in the way), None when
    done."""
    problem = _earlier_run(config, resume=resume, overwrite=overwrite)
    if problem is not None:
        return problem
    for key, path in _output_dirs(config):
        try:
            path.mkdir(parents=True, exist_ok=True)
            if key == "run.output":
                tmp = path / ".config.toml.tmp"
                tmp.write_text(dump_toml(config), encoding="utf-8")
                os.replace(tmp, path / "config.toml")
        except (OSError, ValueError) as exc:
            return key, f"= {str(path)!r}: cannot write there: {_os_reason(exc)}"
    return check_output(config)


def _written_paths(config: Config) -> tuple[Path, Path, Path]:
    """run.output, the checkpoints directory and the trace file of this deck."""
    output = Path(config.run.output)
    ckpt = config.sections.get("checkpoint")
    trace = config.sections.get("trace")
    checkpoints = ckpt.directory(output) if ckpt is not None else output / "checkpoints"
    trace_file = trace.resolve_path(output) if trace is not None else output / "trace.h5"
    return output, checkpoints, trace_file


def _earlier_run(config: Config, *, resume: bool, overwrite: bool) -> tuple[str, str] | None:
    from hpcpipe.rundir import clear_run, describe, previous_run

    output, checkpoints, trace_file = _written_paths(config)
    try:
        found = previous_run(output, checkpoints, trace_file)
        if not found or resume:
            return None
        if overwrite:
            clear_run(found)
            return None
    except OSError as exc:
        return "run.output", f"= {str(output)!r}: cannot clear the earlier run: {_os_reason(exc)}"
    return "run.output", (
        f"= {str(output)!r} already holds an earlier run ({describe(found, output)}): continue "
        "it with --resume, start afresh with --overwrite (deletes those files only), or set "
        "run.output to another directory"
    )


def check_written_paths(config: Config) -> None:
    """Pure checks of where the run will write, before any work: an empty run.output would
    scatter the run's files into the working directory; a trace.path that is a directory
    would only fail when the trace is written, at the end of the run."""
    source = config.source
    if not config.run.output.strip():
        raise ConfigError(
            source,
            "run.output",
            '= "" would write the run\'s files into the working directory: name a run '
            'directory (e.g. "runs/my_run")',
        )
    trace = config.sections.get("trace")
    if trace is not None and trace.enabled and trace.path and Path(trace.path).is_dir():
        raise ConfigError(
            source,
            "trace.path",
            f"= {trace.path!r} is a directory: name the trace file (e.g. "
            f"{str(Path(trace.path) / 'trace.h5')!r}), or leave it empty for "
            "<run.output>/trace.h5",
        )


def check_output(config: Config) -> tuple[str, str] | None:
    """Any rank, after rank 0 prepared the directories: are they there and writable from this
    node (a run directory on a file system that other nodes do not share, or mount read-only,
    shows up here)? Returns (key, reason) or None."""
    for key, path in _output_dirs(config):
        try:
            if not path.is_dir():
                return key, f"= {str(path)!r}: not a directory on this node"
        except (OSError, ValueError) as exc:
            return key, f"= {str(path)!r}: {_os_reason(exc)}"
        if not os.access(path, os.W_OK | os.X_OK):
            reason = "read-only file system" if _read_only(path) else "permission denied"
            return key, f"= {str(path)!r}: cannot write there ({reason})"
    return None


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False
