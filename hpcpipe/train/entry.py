"""The training workload's entry: a synchronous run, or with `[async] mode` set a pipeline
without a flush or replicas that average every few steps (docs/async.md)."""

from __future__ import annotations

from hpcpipe.runtime import RunContext

__all__ = ["run"]


def run(ctx: RunContext) -> None:
    mode = ctx.config.sections["async"].mode
    if mode == "sync":
        from hpcpipe.train.workload import run as run_synchronous

        run_synchronous(ctx)
    elif mode == "local":
        from hpcpipe.train.localsgd import run_local

        run_local(ctx)
    else:
        from hpcpipe.train.flushfree_run import run_flush_free

        run_flush_free(ctx)
