"""Training: data, optimizers and the single-process reference trainer (the test oracle).

The pipeline runtime builds on these: it shards `Dataset.global_batch` with `Dataset.shard`, runs
`hpcpipe.model.Stage` F/B/W per microbatch, and updates with `apply_update`; the reference trainer
does the same arithmetic in one process.
"""

from hpcpipe.train.data import DataConfig, Dataset, MarkovChain, build_dataset
from hpcpipe.train.optim import (
    OptimConfig,
    OptimState,
    adamw_update,
    apply_update,
    clip_scale,
    grad_sq_norm,
    init_state,
    learning_rate,
    sgd_update,
)
from hpcpipe.train.reference import ReferenceResult, loss_and_grads, to_host, train_reference

__all__ = [
    "DataConfig",
    "Dataset",
    "MarkovChain",
    "OptimConfig",
    "OptimState",
    "ReferenceResult",
    "adamw_update",
    "apply_update",
    "build_dataset",
    "clip_scale",
    "grad_sq_norm",
    "init_state",
    "learning_rate",
    "loss_and_grads",
    "sgd_update",
    "to_host",
    "train_reference",
]
