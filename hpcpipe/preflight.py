"""What can be checked before a job does any MPI work: the deck against the world size and the
workload's own constraints (each workload's `check`, found through hpcpipe.workloads), the
Slurm allocation, and the run directory.

The deck checks are pure (no MPI, no writes) and run identically on every rank, and by
`hpcpipe run --dry-run`, so a deck that cannot run stops the whole job with exit 2 and one
message naming the key, before any rank allocates, communicates or writes; tests call them
in-process. The Slurm helpers are pure as well, and the run-directory helpers touch only the
file system: the runtime gathers their answers from every rank and raises the same error
everywhere.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hpcpipe.checks import os_reason
from hpcpipe.config import Config, ConfigError, dump_toml
from hpcpipe.topology import RankMap

__all__ = [
    "SlurmLayout",
    "build_rankmap",
    "check_deck",
    "check_output",
    "check_slurm",
    "planning_world",
    "prepare_output",
    "slurm_layout",
]


def check_deck(config: Config, world: int, ranks_per_node: int, *, files: bool = True) -> RankMap:
    """The rank layout of `config` on `world` ranks, after every check its workload makes before
    communicating; raises ConfigError naming the key otherwise.

    `files` also opens the data and mesh files the deck names (token ranges, mesh ids) and
    builds the synthetic data chain, as `--dry-run` does; a real run leaves that to its
    workload, which does it first thing anyway, rather than reading them twice on every rank.
    The workload's own checks come from its entry in `hpcpipe.workloads`.
    """
    from hpcpipe.workloads import workload_check

    rankmap = build_rankmap(config, world, ranks_per_node)
    check_written_paths(config)
    check = workload_check(config.run.workload)
    if check is not None:
        check(config, rankmap, files)
    return rankmap


def build_rankmap(config: Config, world: int, ranks_per_node: int) -> RankMap:
    """The deck's degrees on this world; errors name the deck key to change."""
    from hpcpipe.topology import TopologyError

    topo = config.topology
    try:
        rankmap = RankMap.build(
            world, ranks_per_node, pp=topo.pp, dp=topo.dp, ep=topo.ep, order=topo.order
        )
    except TopologyError as exc:
        raise ConfigError(
            config.source,
            f"topology.{exc.dim}" if exc.dim else "topology",
            f"{exc.detail} ({_fitting_worlds(config, world)})",
        ) from None
    problems = rankmap.check_intra_node(topo.intra_node)
    if problems and topo.cross_node == "error":
        raise ConfigError(config.source, "topology.intra_node", "; ".join(problems))
    return rankmap


def _fitting_worlds(config: Config, world: int) -> str:
    """The hint of a world-size error: which launch sizes fit the deck's [topology]."""
    topo = config.topology
    if topo.dp:
        n = topo.pp * topo.dp
        return (
            f"the deck needs topology.pp * topology.dp = {n} ranks: launch mpiexec -n {n}, "
            "or set topology.dp = 0 to give data parallelism the rest of the world"
        )
    unit = topo.pp * topo.ep
    low, high = world // unit * unit, (world // unit + 1) * unit
    sizes = f"{low} or {high}" if low else f"{high}"
    return (
        f"topology.pp * topology.ep = {topo.pp} * {topo.ep} = {unit} must divide the world size: "
        f"launch mpiexec -n {sizes} (any multiple of {unit}), or change [topology]"
    )


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
            return key, f"= {str(path)!r}: cannot write there: {os_reason(exc)}"
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
        return "run.output", f"= {str(output)!r}: cannot clear the earlier run: {os_reason(exc)}"
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
            return key, f"= {str(path)!r}: {os_reason(exc)}"
        if not os.access(path, os.W_OK | os.X_OK):
            reason = "read-only file system" if _read_only(path) else "permission denied"
            return key, f"= {str(path)!r}: cannot write there ({reason})"
    return None


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False
