"""[moe]: Mixture-of-Experts blocks in the gpt model and how their tokens are routed."""

from __future__ import annotations

from dataclasses import dataclass

from hpcpipe.config import ConfigError, option

__all__ = ["MoEConfig", "check_moe"]


@dataclass(frozen=True)
class MoEConfig:
    """[moe]: which blocks are MoE, how many experts, routing, capacity and auxiliary losses."""

    experts: int = option(
        0,
        "experts per MoE block; 0 = no MoE (dense model)",
        minimum=0,
        maximum=4096,  # routing tables and per-expert bookkeeping grow with it on every rank
    )
    top_k: int = option(2, "experts each token is routed to", choices=(1, 2))
    capacity_factor: float = option(
        1.25,
        "per (microbatch, expert) capacity = ceil(tokens * top_k / experts * capacity_factor); "
        "assignments beyond it are dropped, lowest router probability first",
    )
    dropless: bool = option(False, "never drop: every expert takes every token routed to it")
    aux_loss_coef: float = option(
        0.01, "weight of the load-balancing loss experts * sum_i f_i * P_i", minimum=0.0
    )
    z_loss_coef: float = option(
        0.001, "weight of the router z-loss mean(logsumexp(logits)^2)", minimum=0.0
    )
    every: int = option(
        2, "every N-th transformer block is MoE (blocks N, 2N, ...; 1 = all)", minimum=1
    )
    d_ff_expert: int = option(0, "hidden width of each expert MLP; 0 = model.d_ff", minimum=0)
    hierarchical: bool = option(
        False,
        "two-phase all-to-all (intra-node, then inter-node between equal local ranks) "
        "instead of one flat Alltoallv; results are bitwise identical",
    )

    def __post_init__(self) -> None:
        if self.experts and self.top_k > self.experts:
            raise ValueError(f"top_k: = {self.top_k} must be <= experts = {self.experts}")
        if self.experts and not self.dropless and self.capacity_factor <= 0:
            raise ValueError(
                f"capacity_factor: = {self.capacity_factor} must be > 0 when dropless = false "
                "(it sets how many tokens each expert takes)"
            )

    @property
    def enabled(self) -> bool:
        return self.experts > 0

    def is_moe_block(self, block: int) -> bool:
        """Whether transformer block `block` (0-based among the blocks) is an MoE block."""
        return self.enabled and (block + 1) % self.every == 0


def check_moe(moe: MoEConfig, *, ep: int, layers: int, kind: str, source: str) -> None:
    """Checks that need other sections ([topology].ep, [model]); run once the world is known."""
    if not moe.enabled:
        return
    if kind != "gpt":
        raise ConfigError(source, "moe.experts", f"= {moe.experts} needs model.kind = 'gpt'")
    if moe.experts % ep:
        raise ConfigError(
            source,
            "moe.experts",
            f"= {moe.experts} must be divisible by topology.ep = {ep} "
            "(each expert-parallel rank holds experts / ep experts)",
        )
    if moe.every > layers:
        raise ConfigError(
            source,
            "moe.every",
            f"= {moe.every} exceeds model.layers = {layers}: no block would be MoE",
        )
