"""`hpcpipe bench NAME`: run one registered benchmark under MPI; rank 0 prints, --json writes.

    mpiexec -n 2 hpcpipe bench p2p --json p2p.json
    mpiexec -n 2 hpcpipe bench pipeline inputs/gpt_pp4.toml
    mpiexec -n 8 hpcpipe bench pipeline --synthetic

The options of every benchmark are declared here with the `benchmark` decorator; the runners
live in their own modules and are imported (with mpi4py) only when run, so building the CLI
parser never starts MPI.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from hpcpipe.bench.registry import BENCHMARKS, benchmark
from hpcpipe.bench.sizes import parse_bytes
from hpcpipe.cli import register_command
from hpcpipe.config import ConfigError
from hpcpipe.console import say
from hpcpipe.schedules.registry import SCHEDULE_NAMES

__all__: list[str] = []


def _sizes(p: argparse.ArgumentParser, lo: str, hi: str, factor: int, budget: int) -> None:
    p.add_argument(
        "--min-bytes", type=parse_bytes, default=parse_bytes(lo), help=f"smallest (default {lo})"
    )
    p.add_argument(
        "--max-bytes", type=parse_bytes, default=parse_bytes(hi), help=f"largest (default {hi})"
    )
    p.add_argument(
        "--factor", type=int, default=factor, help=f"size step factor (default {factor})"
    )
    p.add_argument(
        "--budget-mib",
        type=int,
        default=budget,
        help=f"bytes moved per timed loop, in MiB: sets the calls per size (default {budget})",
    )


def _deck(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("deck", nargs="?", default=default, help=f"input deck (default {default})")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a deck key (repeatable); topology.pp is the world size, dp is 1",
    )
    p.add_argument(
        "--schedules",
        default=",".join(SCHEDULE_NAMES),
        help="comma-separated schedules (default: all; those that cannot run are skipped)",
    )


@benchmark(
    "p2p",
    "ping-pong latency/bandwidth, 1 B .. 64 MiB: pipeline Mailbox vs raw Send/Recv (2 ranks)",
    "hpcpipe.bench.p2p:run",
)
def _p2p(p: argparse.ArgumentParser) -> None:
    _sizes(p, "1", "64Mi", 2, 256)
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: device buffers, direct (CUDA-aware MPI) vs staged through pinned host memory",
    )
    p.add_argument(
        "--cuda-aware",
        choices=("auto", "on", "off"),
        default="auto",
        help="with --device cuda: whether the direct path may hand device buffers to MPI",
    )


@benchmark(
    "allreduce",
    "gradient reduction: BucketedAllreduce vs raw Allreduce",
    "hpcpipe.bench.allreduce:run",
)
def _allreduce(p: argparse.ArgumentParser) -> None:
    _sizes(p, "1Ki", "64Mi", 4, 256)
    p.add_argument(
        "--bucket-mb", type=float, default=4.0, help="bucket size in MiB (default 4, as train)"
    )


@benchmark(
    "alltoall",
    "MoE dispatch all-to-all, flat and two-phase, vs raw Alltoallv",
    "hpcpipe.bench.alltoall:run",
)
def _alltoall(p: argparse.ArgumentParser) -> None:
    _sizes(p, "1Ki", "4Mi", 2, 64)


@benchmark(
    "pipeline",
    "per schedule: measured step time and bubble vs the simulator (real model, or --synthetic)",
    "hpcpipe.bench.pipeline:run",
)
def _pipeline(p: argparse.ArgumentParser) -> None:
    _deck(p, "inputs/gpt_pp4.toml")
    p.add_argument(
        "--steps",
        type=int,
        default=2,
        help="steps per schedule per repetition (each schedule's first step is a warm-up)",
    )
    p.add_argument(
        "--synthetic",
        action="store_true",
        help="stub stages that sleep for the deck's [pipeline] costs instead of computing",
    )
    _sleeping_stages(p, "--synthetic: ")
    p.add_argument(
        "--overlap-pairs",
        action="store_true",
        help="--synthetic: also run dualpipe-v as overlapped F&B pairs (row 'dualpipe-v F&B'); "
        "give the deck's [pipeline] t_alltoall a share so there is communication to hide",
    )


def _sleeping_stages(p: argparse.ArgumentParser, when: str = "") -> None:
    """The options of stages that sleep for their modelled costs (hpcpipe.bench.synthetic)."""
    p.add_argument(
        "--unit-ms",
        type=float,
        default=20.0,
        help=f"{when}milliseconds per cost unit of [pipeline] t_f/t_b/t_w (default 20: "
        "long against the ~0.1-0.3 ms a sleep overshoots on a busy node)",
    )
    p.add_argument(
        "--act-bytes",
        type=parse_bytes,
        default=parse_bytes("4Ki"),
        help=f"{when}bytes of each activation message (default 4Ki)",
    )
    p.add_argument(
        "--poll-us",
        type=float,
        default=20.0,
        help=f"{when}sleep between two tests of a message when polling (default 20)",
    )
    p.add_argument(
        "--wait",
        choices=("auto", "mpi", "poll"),
        default="auto",
        help=f"{when}wait for messages in MPI Wait, or poll with sleeps (auto: poll "
        "when a node holds more ranks than cores)",
    )


@benchmark(
    "stream",
    "a pipeline without a flush (2bw, stash) against every flushed schedule, stages sleeping "
    "for the deck's costs: steady state vs the no-bubble bound",
    "hpcpipe.bench.stream:run",
)
def _stream(p: argparse.ArgumentParser) -> None:
    _deck(p, "inputs/gpt_pp4.toml")
    p.add_argument("--mode", default="2bw", help="2bw (an update per global batch) or stash")
    p.add_argument(
        "--base", default="1f1b", help="the schedule streamed without a flush (default 1f1b)"
    )
    p.add_argument(
        "--microbatches", type=int, default=0, help="per global batch (default 0: 2 x ranks)"
    )
    p.add_argument(
        "--updates",
        type=int,
        default=8,
        help="global batches in the stream (default 8: fill and drain outside its middle half)",
    )
    _sleeping_stages(p)


@benchmark(
    "layout",
    "every layout of this world that fits a deck, run on emulated nodes with its modelled "
    "costs: measured step vs the layout search's prediction, and their rank correlation",
    "hpcpipe.bench.layout:run",
)
def _layout(p: argparse.ArgumentParser) -> None:
    default = "inputs/layout_tiny.toml"
    p.add_argument("deck", nargs="?", default=default, help=f"input deck (default {default})")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a deck key (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=4,
        help="ranks per virtual node (messages between them use the [machine] inter-node link)",
    )
    p.add_argument(
        "--target-ms",
        type=float,
        default=400.0,
        help="the predicted best step in ms: every modelled cost is scaled by the same factor "
        "(default 400: sleep wake-ups small beside the actions on an oversubscribed node)",
    )
    p.add_argument(
        "--poll-us",
        type=float,
        default=20.0,
        help="with more ranks than cores, a waiting rank polls Test and sleeps this long",
    )


@benchmark(
    "sweep",
    "sweep grind time, kernel, fix-up and KBA efficiency on Kripke's problem, vs the KBA "
    "model (and Kripke itself with --kripke)",
    "hpcpipe.bench.sweep:run",
)
def _sweep(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", type=int, default=32, help="zones per side (default 32)")
    p.add_argument("--iterations", type=int, default=5, help="source iterations (default 5)")
    p.add_argument(
        "--blockings",
        default="auto,16x10,8x10,4x10,8x5",
        help="z_block x angle_block per parallel case, auto = the plan's choice; "
        "default auto,16x10,8x10,4x10,8x5",
    )
    p.add_argument(
        "--kernel", default="auto", choices=("auto", "numba", "numpy"), help="sweep.kernel"
    )
    p.add_argument(
        "--kripke",
        default=os.environ.get("KRIPKE_EXE", ""),
        metavar="EXE",
        help="also run this Kripke (v1.2.x kripke.exe) on the same problem, interleaved "
        "(default: $KRIPKE_EXE, if set)",
    )
    p.add_argument(
        "--kripke-layouts",
        default="DGZ,DZG,GDZ,GZD,ZDG,ZGD",
        help="Kripke data layouts to run (default all six)",
    )
    p.add_argument(
        "--kripke-mpiexec",
        default="",
        help="launcher for multi-rank Kripke runs (default: the mpiexec beside this Python)",
    )


@benchmark(
    "ckpt",
    "checkpoint write/read bandwidth vs plain h5py and the raw disk",
    "hpcpipe.bench.ckpt:run",
)
def _ckpt(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mib", type=int, default=1024, help="state size in all (default 1024)")
    p.add_argument("--tensors", type=int, default=8, help="tensors per rank (default 8)")
    p.add_argument("--dir", default=None, help="scratch directory (default: the temp dir)")


@benchmark(
    "overlap",
    "per schedule, pp x dp: data-parallel gradient reductions hidden behind the pipeline",
    "hpcpipe.bench.overlap:run",
)
def _overlap(p: argparse.ArgumentParser) -> None:
    _deck(p, "inputs/gpt_pp4.toml")
    p.add_argument(
        "--pp", type=int, default=2, help="pipeline ranks per replica; dp = world / pp (default 2)"
    )


@benchmark(
    "memory",
    "per schedule and rank: peak RSS and peak activation memory vs the model",
    "hpcpipe.bench.memory:run",
)
def _memory(p: argparse.ArgumentParser) -> None:
    _deck(p, "inputs/gpt_pp4.toml")
    p.add_argument("--steps", type=int, default=3, help="steps per schedule (default 3)")


def _configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench_name", metavar="BENCHMARK", required=True)
    for bench in BENCHMARKS.values():
        q = sub.add_parser(bench.name, help=bench.help, description=bench.help)
        bench.configure(q)
        q.add_argument(
            "--repeats",
            type=int,
            default=5,
            help="repetitions; every figure is their median (default 5)",
        )
        q.add_argument("--json", default=None, metavar="PATH", help="also write the results here")


def _command(comm_size: int) -> str:
    """How this run was started, for the JSON (the launcher's own options are not known)."""
    return f"mpiexec -n {comm_size} hpcpipe " + shlex.join(sys.argv[1:])


def _execute(args: argparse.Namespace) -> int:
    from hpcpipe.mpi.guard import abort_on_error

    bench = BENCHMARKS[args.bench_name]
    if args.repeats < 1:
        raise ConfigError("--repeats", "", f"must be >= 1, got {args.repeats}")

    def job() -> int:
        from mpi4py import MPI

        from hpcpipe.bench.harness import machine
        from hpcpipe.mpi.guard import prepare

        prepare()
        comm = MPI.COMM_WORLD
        info = machine(comm)
        report = bench.runner()(comm, args)
        comm.Barrier()
        if comm.rank == 0:
            if report.stream:
                report.finish()
            else:
                say(report.render())
            if args.json:
                info["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
                path = report.write(args.json, command=_command(comm.size), machine=info)
                say(f"# wrote {path}")
        return 0

    return abort_on_error(job, bad_input=(ConfigError,))


register_command(
    "bench",
    "benchmarks against raw MPI, the simulator and the disk (mpiexec -n 2 hpcpipe bench p2p)",
)(_configure)(_execute)
