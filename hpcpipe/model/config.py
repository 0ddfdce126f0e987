"""[model]: which network is trained and its sizes."""

from __future__ import annotations

from dataclasses import dataclass

from hpcpipe.config import option

__all__ = ["ModelConfig"]


@dataclass(frozen=True)
class ModelConfig:
    """[model]: the network. Pipeline units = embedding, `layers` blocks, loss head."""

    kind: str = option(
        "gpt",
        "gpt: decoder-only transformer; mlp: per-token residual MLP (sees one token of context)",
        choices=("mlp", "gpt"),
    )
    layers: int = option(
        4,
        "residual blocks (the model has layers + 2 pipeline units)",
        minimum=1,
        maximum=4096,  # every rank builds every block's description: keep start-up bounded
    )
    d_model: int = option(64, "width of the residual stream", minimum=1)
    n_heads: int = option(4, "attention heads (gpt); must divide d_model", minimum=1)
    d_ff: int = option(256, "hidden width of each MLP", minimum=1)
    vocab: int = option(64, "token vocabulary (text data needs 256: byte-level)", minimum=2)
    seq_len: int = option(32, "tokens per sequence (context length)", minimum=1)

    def __post_init__(self) -> None:
        if self.kind == "gpt" and self.d_model % self.n_heads:
            raise ValueError(f"n_heads: = {self.n_heads} must divide d_model = {self.d_model}")
