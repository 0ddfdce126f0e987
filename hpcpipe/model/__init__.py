"""Models as lists of pipeline units with forward (F), backward-input (B) and backward-weight (W).

`build_model` gives the units, `partition` splits them into contiguous stages, and `Stage` runs
F, B and W of one microbatch on a stage with explicit parameters and contexts (see
`hpcpipe.model.stage`).
"""

from hpcpipe.model.blocks import (
    CausalSelfAttention,
    Chain,
    LossHead,
    Residual,
    ResidualMLP,
    TransformerBlock,
)
from hpcpipe.model.config import ModelConfig
from hpcpipe.model.layers import (
    CausalSelfAttentionCore,
    Embedding,
    Gelu,
    Layer,
    LayerNorm,
    Linear,
    Module,
    SoftmaxCrossEntropy,
    activation_bytes,
)
from hpcpipe.model.models import (
    Params,
    UnitCost,
    balance,
    boundary_shape,
    build_model,
    describe,
    init_params,
    partition,
    unit_costs,
)
from hpcpipe.model.stage import Stage, accumulate, zeros_like

__all__ = [
    "CausalSelfAttention",
    "CausalSelfAttentionCore",
    "Chain",
    "Embedding",
    "Gelu",
    "Layer",
    "LayerNorm",
    "Linear",
    "LossHead",
    "ModelConfig",
    "Module",
    "Params",
    "Residual",
    "ResidualMLP",
    "SoftmaxCrossEntropy",
    "Stage",
    "TransformerBlock",
    "UnitCost",
    "accumulate",
    "activation_bytes",
    "balance",
    "boundary_shape",
    "build_model",
    "describe",
    "init_params",
    "partition",
    "unit_costs",
    "zeros_like",
]
