"""`hpcpipe run | plan | ...`: parse arguments, load the deck, call one function.

Exit codes: 0 ok, 2 bad input (deck, arguments, files), 1 runtime failure. `plan` never starts
MPI; `run` starts it only after the deck has been read and checked.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from hpcpipe import __version__
from hpcpipe.config import Config, ConfigError, dump_toml, load_config
from hpcpipe.console import say
from hpcpipe.mpi.guard import (
    EXIT_BAD_INPUT,
    abort_on_error,
    launcher_rank,
    rank_zero_exits_first,
    under_launcher,
)

if TYPE_CHECKING:  # NumPy must not load before `run` blocks the stop signals (its BLAS
    from hpcpipe.topology import RankMap  # threads would inherit an unblocked mask)

__all__ = ["main", "register_command"]

_COMMANDS: dict[
    str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int], str]
] = {}


def register_command(name: str, help_text: str):
    """Decorator pair for a verb: `configure(parser)` then `execute(args) -> exit code`."""

    def wrap(configure: Callable[[argparse.ArgumentParser], None]):
        def bind(execute: Callable[[argparse.Namespace], int]):
            _COMMANDS[name] = (configure, execute, help_text)
            return execute

        return bind

    return wrap


def _deck_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "deck",
        nargs="?",
        default=None,
        help="input deck (TOML, see inputs/); default: the built-in quick-start deck",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a deck key, e.g. --set topology.pp=4 (repeatable; TOML values)",
    )


def _load(args: argparse.Namespace) -> Config:
    return load_config(args.deck, args.overrides)


# ---------------------------------------------------------------- run


def _configure_run(p: argparse.ArgumentParser) -> None:
    _deck_arguments(p)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved deck and the rank layout, then exit",
    )
    p.add_argument(
        "--world",
        type=int,
        default=None,
        metavar="N",
        help="with --dry-run: check the deck for N ranks without starting MPI (default "
        "outside a launcher: the world the deck implies, as `hpcpipe plan` picks it)",
    )
    p.add_argument("--verbose", action="store_true", help="let every rank log, not just rank 0")
    p.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="PATH",
        help="continue from the latest complete checkpoint of run.output (or PATH)",
    )
    p.add_argument(
        "--allow-change",
        action="append",
        default=[],
        metavar="KEY",
        help="with --resume: accept a checkpoint written with another value of KEY (e.g. "
        "optim.lr, or a whole section: optim); without it a change of the model, data, "
        "optimizer, seed or precision is refused",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh where an earlier run wrote: delete its files in run.output and its "
        "checkpoints (only those; without this flag such a run directory is refused)",
    )


def _execute_run(args: argparse.Namespace) -> int:
    config = _load(args)  # before MPI starts: every rank reads the same deck
    if args.overwrite and args.resume:
        raise ConfigError(
            "command line",
            "--overwrite",
            "and --resume contradict each other: continue a run or replace it",
        )
    if args.allow_change:
        from hpcpipe.train.checkpointing import check_allowed

        if not args.resume:
            raise ConfigError("command line", "--allow-change", "is for --resume")
        check_allowed(tuple(args.allow_change), config)
    if args.world is not None and not args.dry_run:
        raise ConfigError(
            "command line",
            "--world",
            "is for --dry-run: a real run's world is what the launcher started",
        )
    if args.dry_run and (args.world is not None or not under_launcher()):
        return _dry_run(config, args.world)
    from hpcpipe.runtime import RunOptions, run_job

    return abort_on_error(
        lambda: run_job(
            config,
            RunOptions(
                dry_run=args.dry_run,
                verbose=args.verbose,
                resume=args.resume,
                overwrite=args.overwrite,
                allow_changes=tuple(args.allow_change),
            ),
        ),
        bad_input=(ConfigError,),
    )


def _dry_run(config: Config, world: int | None) -> int:
    """`run --dry-run` outside a launcher (or with --world): every deck and workload check a
    job makes before communicating, for a world given or implied, without starting MPI."""
    from hpcpipe.preflight import check_deck, planning_world
    from hpcpipe.runtime import layout_text

    n, note = planning_world(config, world)
    if note:
        print(f"note: {note}", file=sys.stderr)
    rpn = config.topology.ranks_per_node or min(n, 8)
    rankmap = check_deck(config, n, rpn, files=True)
    print(dump_toml(config), end="")
    print(layout_text(config, rankmap))
    if not config.topology.ranks_per_node and config.run.workload != "sweep":
        print(f"(nodes: {rpn} rank(s) per node assumed; a launched job discovers them)")
    return 0


register_command(
    "run", "run the deck's workload on the current MPI world (mpiexec -n N hpcpipe run DECK)"
)(_configure_run)(_execute_run)


# ---------------------------------------------------------------- plan


def _configure_plan(p: argparse.ArgumentParser) -> None:
    _deck_arguments(p)
    p.add_argument(
        "--world",
        type=int,
        default=None,
        help="world size to plan for (default: pp * dp, or px * py for a sweep; with "
        "topology.dp = 0, the smallest world that fits, said so)",
    )
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="ranks per node (default: topology.ranks_per_node, else 8)",
    )
    p.add_argument("--rows", type=int, default=16, help="ranks listed in the layout table")
    p.add_argument(
        "--png",
        default=None,
        help="write a picture of the plan to this PNG (the schedule timeline; for a sweep "
        "the KBA stage chart and wavefront)",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="table of every pipeline schedule for the deck's p, m and costs",
    )
    p.add_argument(
        "--csv",
        default=None,
        metavar="FILE",
        help="write the schedule the deck resolves to (the search's choice for 'auto') as CSV, "
        "to inspect, edit and run with pipeline.schedule = 'csv'",
    )
    p.add_argument(
        "--flush-free",
        default=None,
        choices=("stash", "2bw"),
        help="the deck's schedule run as a stream without a flush: weight versions, gradient "
        "delay and steady state against the flushed step (stash: an update per microbatch; "
        "2bw: per global batch, two weight versions); --png draws the stream",
    )
    p.add_argument("--show-config", action="store_true", help="print the resolved deck too")
    # schedule search (issue 14): the makespan vs peak-memory front
    p.add_argument(
        "--pareto",
        action="store_true",
        help="table of the schedule search's makespan vs peak-memory front next to every "
        "fixed schedule, for the deck's p, m and costs",
    )
    p.add_argument(
        "--pareto-png", default=None, help="also draw that front to this PNG (implies --pareto)"
    )
    p.add_argument(
        "--search",
        action="store_true",
        help="rank every pp x dp x ep x order x schedule x microbatches layout of --world "
        "ranks by predicted step under the [machine] model, and say why the rest do not fit",
    )
    p.add_argument("--top", type=int, default=10, help="--search: layouts listed (default 10)")
    p.add_argument(
        "--auto",
        type=int,
        default=0,
        metavar="N",
        help="--search: also run the schedule search (schedule = 'auto', seconds each) for the "
        "degrees, order and microbatches of the N best layouts (default 0)",
    )
    p.add_argument(
        "--write-deck",
        default=None,
        metavar="FILE",
        help="--search: write the deck with the chosen layout to FILE",
    )


def _execute_plan(args: argparse.Namespace) -> int:
    from hpcpipe.checks import check_paths
    from hpcpipe.preflight import planning_world

    config = _load(args)
    check_paths(config)  # a FIFO as schedule_csv would block the read below forever
    for flag, value in (("--png", args.png), ("--pareto-png", args.pareto_png)):
        if value:  # before any work: a missing matplotlib is bad input, said once
            from hpcpipe.plotting import require_matplotlib

            require_matplotlib("plan", flag)
    if args.search or args.write_deck:
        return _layout_search(config, args)
    world, note = planning_world(config, args.world)
    if note:
        print(f"note: {note}\n")
    if args.show_config:
        print(dump_toml(config))
    if config.run.workload == "sweep":
        for flag, used in (
            ("--compare", args.compare),
            ("--pareto", args.pareto),
            ("--csv", args.csv),
            ("--flush-free", args.flush_free),
        ):
            if used or (flag == "--pareto" and args.pareto_png):
                raise ConfigError(
                    flag, "", "compares pipeline schedules; a sweep deck has none (drop the flag)"
                )
        print(_sweep_plan(config, world, args.png))
        return 0
    rankmap = _plan_rankmap(config, world, args.ranks_per_node)
    print(rankmap.describe(max_rows=args.rows))
    for problem in rankmap.check_intra_node(config.topology.intra_node):
        print(f"WARNING: {problem}")
    pipeline = config.sections.get("pipeline")
    pareto = args.pareto or args.pareto_png is not None  # schedule search (issue 14)
    if args.csv and pipeline is None:
        raise ConfigError("--csv", "", "writes the pipeline schedule; this deck has no [pipeline]")
    deck_mode = config.sections["async"].mode  # a deck that trains without a flush shows it
    mode = args.flush_free or (deck_mode if deck_mode in ("stash", "2bw") else None)
    if mode:
        return _flush_free_plan(config, rankmap.pp, mode, args)
    if pipeline is not None and (
        config.run.workload == "train" or args.png or args.compare or pareto or args.csv
    ):
        from hpcpipe.schedules.report import plan_report

        print()
        print(
            plan_report(
                pipeline,
                rankmap.pp,
                png=args.png,
                compare=args.compare,
                pareto=pareto,
                pareto_png=args.pareto_png,
                csv=args.csv,
                source=config.source,
            )
        )
        if config.run.workload == "train" and not (args.compare or pareto or args.csv):
            print()
            print(_partition_text(config, rankmap.pp))
    return 0


def _flush_free_plan(config: Config, pp: int, mode: str, args: argparse.Namespace) -> int:
    """`plan --flush-free MODE` (or a deck's `async.mode`): the deck's schedule without a
    flush, instead of its step."""
    from hpcpipe.schedules.flushfree_report import flush_free_report

    pipeline = config.sections.get("pipeline")
    if pipeline is None:
        raise ConfigError("--flush-free", "", "plans a pipeline; this deck has no [pipeline]")
    for flag, used in (("--compare", args.compare), ("--pareto", args.pareto or args.pareto_png)):
        if used:
            raise ConfigError(flag, "", "compares flushed steps; drop it or --flush-free")
    if args.csv:
        raise ConfigError("--csv", "", "writes a flushed step's schedule; drop it or --flush-free")
    print()
    print(flush_free_report(pipeline, pp, mode, png=args.png, source=config.source))
    return 0


def _layout_search(config: Config, args: argparse.Namespace) -> int:
    """`plan --search`: the world is the user's (the deck's degrees are what is searched)."""
    from hpcpipe.layout.report import layout_search_report

    if not args.search:
        raise ConfigError("--write-deck", "", "writes the layout --search chooses: add --search")
    if args.world is None or args.world < 1:
        raise ConfigError("--world", "", "--search needs the world size to lay out (--world N)")
    if args.top < 1:
        raise ConfigError("--top", "", f"= {args.top} must be >= 1")
    if args.auto < 0:
        raise ConfigError("--auto", "", f"= {args.auto} must be >= 0")
    text, found = layout_search_report(
        config, args.world, ranks_per_node=args.ranks_per_node, top=args.top, auto=args.auto,
        write_deck=args.write_deck,
    )  # fmt: skip
    print(text)
    return 0 if found else 1


def _partition_text(config: Config, pp: int) -> str:
    """The layer partition the run will start with (by FLOPs or params, rank speeds)."""
    from hpcpipe.model.models import build_model
    from hpcpipe.schedules.report import runnable_schedule
    from hpcpipe.train.checks import deck_partition

    schedule, _ = runnable_schedule(config.pipeline, pp, config.source)
    units = build_model(config.model, config.moe)
    try:
        ranges = deck_partition(config, units, schedule.stages_of_rank)
    except ConfigError as exc:  # the schedule is still worth seeing; the run would refuse
        return f"layer partition: none fits ({exc}); a run of this deck exits 2"
    train, speeds = config.train, config.replan.speeds
    how = (
        "as train.stage_units gives it"
        if train.stage_units
        else f"balanced by {train.partition}"
        + (f" for rank speeds {list(speeds)} (replan.speeds)" if speeds else "")
    )
    lines = [f"layer partition {how}: stage_units {[len(r) for r in ranges]}"]
    for rank, row in enumerate(schedule.stages_of_rank):
        held = ", ".join(f"stage {s}: units {ranges[s].start}..{ranges[s].stop - 1}" for s in row)
        flops = sum(units[i].flops_per_token() for s in row for i in ranges[s])
        lines.append(f"  rank {rank}: {held} ({flops} FLOPs/token)")
    if config.replan.enabled:
        r = config.replan
        lines.append(
            f"re-planned while training from measured costs: every {r.check_every} steps, "
            f"when the predicted gain is >= {r.min_gain:.0%}"
            + (" at two checks in a row" if r.confirm else "")
            + f" (cooldown {r.cooldown} checks)"
        )
    return "\n".join(lines)


def _plan_rankmap(config: Config, world: int, ranks_per_node: int | None) -> RankMap:
    from hpcpipe.topology import RankMap, TopologyError

    topo = config.topology
    rpn = ranks_per_node or topo.ranks_per_node or 8
    if rpn < 1:
        raise ConfigError("--ranks-per-node", "", f"must be >= 1, got {rpn}")
    try:
        return RankMap.build(world, rpn, pp=topo.pp, dp=topo.dp, ep=topo.ep, order=topo.order)
    except TopologyError as exc:
        raise ConfigError(
            config.source,
            f"topology.{exc.dim}" if exc.dim else "topology",
            f"{exc.detail} (planning for --world {world}; --set topology.dp=0 "
            "gives dp the rest of the world)",
        ) from None


def _sweep_plan(config: Config, world: int, png: str | None) -> str:
    """The KBA decomposition, its predicted stages and efficiency, the wavefront over the
    rank grid and a stage chart (no MPI); `png` also draws them."""
    from hpcpipe.sweep.blocking import describe_blocking
    from hpcpipe.sweep.checks import check_kernel
    from hpcpipe.sweep.mesh import build_problem
    from hpcpipe.sweep.plan import PlanError, blocking_for, plan_for, simulate
    from hpcpipe.sweep.plan_view import plan_text, plot_plan

    cfg = config.sweep
    if cfg.px * cfg.py != world:
        raise ConfigError(
            config.source,
            "sweep.px",
            f"* sweep.py = {cfg.px} * {cfg.py} = {cfg.px * cfg.py} ranks, but --world is "
            f"{world}; drop --world (a sweep's world is px * py) or change sweep.px / sweep.py",
        )
    check_kernel(cfg, config.device.kind, config.source)
    problem = build_problem(cfg)
    blocking = blocking_for(cfg, problem, device=config.device.kind)
    try:
        plan = plan_for(cfg, problem, blocking)
        sim = simulate(plan)
    except PlanError as exc:
        raise ConfigError(config.source, "sweep", str(exc)) from None
    line = describe_blocking(blocking)
    text = plan_text(plan, sim, blocking=line)
    if png:
        text += f"\nplan picture written to {plot_plan(sim, png)}"
    return text


register_command("plan", "show the rank layout and pipeline schedule for a deck (no MPI)")(
    _configure_plan
)(_execute_plan)


# ---------------------------------------------------------------- main

# Modules that register more verbs with `register_command` (imported when the parser is built;
# they must not import MPI at module level, so that `plan` and friends never start it).
PLUGINS = ("hpcpipe.io.ckpt_cli", "hpcpipe.analysis.cli", "hpcpipe.bench.cli")


def _load_plugins() -> None:
    import importlib

    for module in PLUGINS:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:  # a component not present in this build
            if exc.name is None or not module.startswith(exc.name):
                raise


def build_parser() -> argparse.ArgumentParser:
    _load_plugins()
    parser = argparse.ArgumentParser(
        prog="hpcpipe",
        description="MPI-native pipeline, data and expert parallelism, and pipelined sweeps.",
        epilog="Examples:\n  mpiexec -n 8 hpcpipe run inputs/topology_tiny.toml\n"
        "  hpcpipe plan inputs/topology_tiny.toml --world 4096 --ranks-per-node 8",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"hpcpipe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (configure, execute, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        configure(p)
        p.set_defaults(execute=execute)
    return parser


def _limit_blas_threads() -> None:
    """Under an MPI launcher, give each rank its share of the node's cores for BLAS threads.

    Several ranks per node each starting one BLAS thread per core oversubscribe the node and
    slow everything down; this must happen before NumPy is imported. Explicit settings win.
    """
    import os

    local = next(
        (
            os.environ[v]
            for v in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")
            if v in os.environ
        ),
        None,
    )
    if local is None or not local.isdigit() or int(local) < 1:
        return
    share = str(max(1, (os.cpu_count() or 1) // int(local)))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, share)


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["run"]:
        # first of all: stop signals blocked before any thread (BLAS, MPI) exists, so a
        # time-limit warning or Ctrl-C during start-up is kept for the run, never lost
        from hpcpipe.signals import catch_stop_signals

        catch_stop_signals()
    _limit_blas_threads()
    args = build_parser().parse_args(argv)
    try:
        return args.execute(args)
    except ConfigError as exc:
        if launcher_rank() == 0:
            from hpcpipe.textsafe import printable

            say(printable(f"ERROR: {exc}"), err=True)
        rank_zero_exits_first()  # the first non-zero exit may end the job: rank 0's, reported
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into `head` and friends
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
