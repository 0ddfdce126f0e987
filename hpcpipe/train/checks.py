"""The training workload's deck checks, run before any rank communicates (and by `--dry-run`
and `plan`): schedule, batch split, MoE, memory, stage partition, data. Pure: no MPI."""

from __future__ import annotations

from typing import Any

from hpcpipe.checks import check_paths, gib, keyed, memory_bytes
from hpcpipe.config import Config, ConfigError
from hpcpipe.topology import RankMap

__all__ = ["check", "check_memory", "deck_partition"]


def check(config: Config, rankmap: RankMap, files: bool) -> None:
    """The Trainer's checks, in its order: schedule, batch split, MoE, model size, stage
    partition, data."""
    from hpcpipe.model.models import build_model
    from hpcpipe.schedules.report import runnable_schedule
    from hpcpipe.train.data import build_dataset

    source = config.source
    check_paths(config)
    asynchronous = config.sections["async"]
    asynchronous.check(source)
    if asynchronous.mode in ("stash", "2bw"):
        from hpcpipe.train.flushfree_checks import check_flush_free

        check_flush_free(config, rankmap)
    elif asynchronous.mode == "local":
        from hpcpipe.train.localsgd_checks import check_local

        check_local(config, rankmap)
    schedule, lowered = runnable_schedule(config.pipeline, rankmap.pp, source)
    if config.train.sends == "blocking":
        _check_blocking(lowered, config)
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
    check_memory(config, rankmap, rows // (rankmap.dp * m))
    try:
        units = build_model(config.model, moe)
    except ValueError as exc:
        raise keyed(exc, "model", source) from None
    deck_partition(config, units, schedule.stages_of_rank)
    if files:
        build_dataset(config.data, config.model, config.run.seed, source=source)


def deck_partition(
    config: Config, units: Any, stages_of_rank: tuple[tuple[int, ...], ...]
) -> list[range]:
    """The deck's layer partition: `train.stage_units` as given, else balanced by
    `train.partition` over the ranks of the placement, each rank weighted by its
    `replan.speeds` when given (what the first plan, `plan` and the Trainer use)."""
    from hpcpipe.model.models import partition
    from hpcpipe.train.replan import initial_scale

    source = config.source
    n_stages = sum(len(row) for row in stages_of_rank)
    n_units = len(units)
    stage_units = config.train.stage_units
    if stage_units:
        if len(stage_units) != n_stages or sum(stage_units) != n_units:
            raise ConfigError(
                source,
                "train.stage_units",
                f"= {list(stage_units)} must list {n_stages} stage sizes "
                f"summing to the model's {n_units} units",
            )
        if config.replan.speeds:
            raise ConfigError(
                source,
                "replan.speeds",
                f"= {list(config.replan.speeds)} has no effect with train.stage_units (an "
                "explicit partition): drop one of them",
            )
    elif n_stages > n_units:
        raise ConfigError(
            source,
            "model.layers",
            f"= {config.model.layers} gives {n_units} pipeline units, fewer "
            f"than the schedule's {n_stages} stages; add layers or lower pp / v",
        )
    try:
        if stage_units:
            return partition(units, n_stages, by=list(stage_units))
        scale = initial_scale(config.replan, len(stages_of_rank), source)
        return partition(
            units,
            n_stages,
            by=config.train.partition,
            stages_of_rank=stages_of_rank,
            rank_scale=scale,
        )
    except ValueError as exc:
        key = "train.stage_units" if stage_units else "train.partition"
        raise ConfigError(source, key, f"cannot split the model: {exc}") from None


def _check_blocking(lowered: Any, config: Config) -> None:
    """Blocking sends need an order in which no send waits for a receive its peer has not
    posted yet: prove it for the deck's lookahead, or say which lookahead works."""
    from hpcpipe.schedules.errors import ScheduleError
    from hpcpipe.schedules.validate import validate

    lookahead = config.train.recv_lookahead
    try:
        validate(lowered, sends="blocking", lookahead=lookahead)
    except ScheduleError as exc:
        raise ConfigError(
            config.source,
            "train.sends",
            f"= 'blocking' deadlocks this schedule with train.recv_lookahead = {lookahead}: {exc}",
        ) from None


def check_memory(config: Config, rankmap: RankMap, rows_mb: int) -> None:
    """Reject models and batches that cannot fit one node's memory (they would fail at
    allocation, or thrash, on every rank): parameters with gradients and AdamW moments, the
    rank's token shard, and one microbatch's attention scores."""
    limit = memory_bytes()
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
            f"that is {gib(need)} per pipeline rank"
        ),
        "data.global_batch": (
            f"data.global_batch = {config.data.global_batch} sequences of model.seq_len = "
            f"{seq} tokens take {gib(need)} per data-parallel rank"
        ),
        "model.seq_len": (
            f"model.seq_len = {seq} makes attention scores of {gib(need)} per microbatch "
            f"({rows_mb} rows x {model.n_heads} heads x seq_len^2)"
        ),
    }[key]
    raise ConfigError(
        config.source, key, f"is too large: {what}, more than this node's {gib(limit)} of memory"
    )


# ---------------------------------------------------------------- sweep
