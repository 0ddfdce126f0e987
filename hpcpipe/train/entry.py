"""The training workload's entry: a synchronous run, or with `[async] mode` set a pipeline
without a flush (docs/async.md)."""

from __future__ import annotations

from hpcpipe.runtime import RunContext

__all__ = ["run"]


def run(ctx: RunContext) -> None:
    if ctx.config.sections["async"].mode == "sync":
        from hpcpipe.train.workload import run as run_synchronous

        run_synchronous(ctx)
    else:
        from hpcpipe.train.flushfree_run import run_flush_free

        run_flush_free(ctx)
