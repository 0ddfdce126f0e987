"""`hpcpipe ckpt inspect | verify | convert PATH`: look at, check and export checkpoints.

PATH is a step directory, a checkpoints directory or a run directory (the latter two mean the
latest complete checkpoint). Exit codes: 0 ok, 1 the checkpoint is damaged (verify names the
bad tensor), 2 bad input (no checkpoint there, unreadable index, refusing to overwrite).

Imports of h5py and the checkpoint library happen inside the verbs: building the CLI parser
must stay cheap and must never start MPI.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hpcpipe.cli import register_command
from hpcpipe.console import say
from hpcpipe.mpi.guard import EXIT_BAD_INPUT, EXIT_RUNTIME

__all__: list[str] = []


def _configure(p: argparse.ArgumentParser) -> None:
    verbs = p.add_subparsers(dest="ckpt_verb", metavar="VERB", required=True)
    inspect = verbs.add_parser(
        "inspect", help="step, layout, sizes, attributes and the tensor table of a checkpoint"
    )
    inspect.add_argument("path", help="step, checkpoints or run directory")
    inspect.add_argument(
        "--slices", action="store_true", help="also list every stored slice and its CRC32"
    )
    verify = verbs.add_parser(
        "verify", help="recompute every checksum; exit 1 naming each damaged tensor"
    )
    verify.add_argument("path", help="step, checkpoints or run directory")
    convert = verbs.add_parser(
        "convert", help="export one HDF5 file with one dataset per global tensor"
    )
    convert.add_argument("path", help="step, checkpoints or run directory")
    convert.add_argument("out", help="the consolidated HDF5 file to write")
    convert.add_argument("--force", action="store_true", help="overwrite OUT if it exists")


def _error(message: object) -> None:
    from hpcpipe.textsafe import printable

    say(printable(f"ERROR: {message}"), err=True)


def _execute(args: argparse.Namespace) -> int:
    from hpcpipe.io.checkpoint import (
        CheckpointError,
        convert_checkpoint,
        inspect_checkpoint,
        resolve_checkpoint,
        verify_checkpoint,
    )
    from hpcpipe.io.ckpt_read import describe_totals
    from hpcpipe.textsafe import printable

    notes: list[str] = []
    try:  # what cannot be opened at all is bad input (exit 2)
        step_dir = resolve_checkpoint(args.path, notes)
        for note in notes:
            say(printable(f"WARNING: {note}"), err=True)
        if args.ckpt_verb == "inspect":
            print(printable(inspect_checkpoint(step_dir, slices=args.slices)))
            return 0
        step, ntensors, nslices, nbytes = describe_totals(step_dir)
        if args.ckpt_verb == "convert" and Path(args.out).exists() and not args.force:
            raise CheckpointError("already exists (pass --force to overwrite)", path=args.out)
    except CheckpointError as exc:
        _error(exc)
        return EXIT_BAD_INPUT

    if args.ckpt_verb == "verify":
        problems = verify_checkpoint(step_dir)
        if problems:
            print(printable(f"FAILED: {step_dir} (step {step}): {len(problems)} problem(s)"))
            for problem in problems:
                print(printable(f"  {problem}"))
            return EXIT_RUNTIME
        print(
            f"OK: {step_dir} (step {step}): {ntensors} tensors, {nslices} slices, "
            f"{nbytes} bytes, every CRC32 matches"
        )
        return 0

    try:
        out = convert_checkpoint(step_dir, args.out, overwrite=args.force)
    except CheckpointError as exc:
        _error(exc)
        return EXIT_RUNTIME
    print(f"wrote {out}: {ntensors} tensors from {step_dir} (step {step})")
    return 0


register_command("ckpt", "inspect, verify or export checkpoints (no MPI)")(_configure)(_execute)
