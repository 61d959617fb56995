"""Expert capacity and token dropping, when the YAML sets a capacity factor (otherwise every run is dropless).

MindFormers (mcore `moe_expert_capacity_factor`, legacy `capacity_factor`) and Megatron-Core drop per expert the
routed choices beyond its capacity, computed over the tokens this rank's MoE layer sees in one micro-batch:

    capacity = ceil(top_k * tokens * capacity_factor / num_experts), at most `tokens`, rounded up to a multiple of
               `round_to` (legacy MindFormers pads it to model_parallel)

which choices stay (moe_token_drop_policy):
- "probs": per expert the `capacity` choices with the highest routing weight (ties: the earlier token);
- "position": per expert the first `capacity` choices in token order (a token's k choices in choice order).
A dropped choice contributes nothing (its expert id becomes the sentinel E, its weight 0); the kept weights are not
renormalized (Megatron-Core's rule). The rule depends on how many tokens a rank holds, so it is per micro-batch and
per dp / cp / sequence-parallel shard, as in MindFormers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Capacity", "expert_capacity"]

DROP_POLICIES = ("probs", "position")


def expert_capacity(tokens: int, top_k: int, num_experts: int, factor: float, round_to: int = 1) -> int:
    cap = min(math.ceil(top_k * tokens * factor / num_experts), tokens)
    return math.ceil(cap / round_to) * round_to if round_to > 1 else cap


@dataclass(frozen=True)
class Capacity:
    """The drop rule: called as rule(top_k_index [T, k], top_k_weights [T, k], num_experts) -> the same two with
    the dropped choices set to (num_experts, 0)."""

    factor: float
    policy: str = "probs"
    round_to: int = 1

    def __post_init__(self):
        if self.policy not in DROP_POLICIES:
            raise ValueError(f"moe_token_drop_policy={self.policy!r}: must be one of {', '.join(DROP_POLICIES)}")
        if not self.factor > 0:
            raise ValueError(f"capacity factor {self.factor!r} must be > 0 (leave it unset for dropless routing)")

    def __call__(self, top_k_index: Tensor, top_k_weights: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
        tokens, k = top_k_index.shape
        cap = expert_capacity(tokens, k, num_experts, self.factor, self.round_to)
        expert = top_k_index.reshape(-1)
        if self.policy == "probs":  # per expert, highest weight first; stable sorts keep token order on ties
            by_weight = torch.argsort(top_k_weights.reshape(-1).detach(), descending=True, stable=True)
            order = by_weight[torch.argsort(expert[by_weight], stable=True)]
        else:  # token order; a token's choices in choice order
            order = torch.argsort(expert, stable=True)
        sorted_expert = expert[order]
        counts = torch.bincount(sorted_expert, minlength=num_experts)
        starts = torch.cumsum(counts, 0) - counts
        rank_in_expert = torch.arange(expert.numel(), device=expert.device) - starts[sorted_expert]
        keep = torch.empty_like(expert, dtype=torch.bool)
        keep[order] = rank_in_expert < cap
        keep = keep.view(tokens, k)
        index = torch.where(keep, top_k_index, torch.full_like(top_k_index, num_experts))
        return index, top_k_weights * keep.to(top_k_weights.dtype)
