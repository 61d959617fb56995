"""Expert-parallel dispatch: this rank's experts run the HF experts' own forward on the tokens routed to them.

    experts = ExpertParallelExperts(hf_experts, layout)     # in place of a HF experts module (parallelize)
    out = experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])   # HF's experts signature

Per MoE layer (Megatron-Core's alltoall dispatcher, dropless by default):
1. the (token, choice) pairs are sorted by expert, so each destination rank's pairs form one block;
2. the per-expert counts are exchanged once ([ep, E/ep] in one all-to-all): each rank then knows how many rows it
   receives from every source for every local expert, so expert ids need no exchange;
3. the token rows go to their experts' ranks (all-to-all-v, backward the reverse), the HF experts module (its
   parameters cut to this rank's E/ep experts, same names) runs on them with unit weights;
4. the results come back (all-to-all-v) and are scaled by the routing weights once, at the source, then summed per
   token: the same products HF's experts forward forms (`expert(x) * weight`, index_add over the choices).
A choice whose expert id is the sentinel E (a token dropped by the capacity rule, moe.capacity) is not sent.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ..distributed.collectives import exchange_counts
from ..tensor_parallel.mappings import exchange_rows
from ..tensor_parallel.spec import EXPERT_SHARD

if TYPE_CHECKING:
    from ..distributed.layout import ParallelLayout

__all__ = ["ExpertParallelExperts", "expert_group_name"]


def expert_group_name(layout: ParallelLayout) -> str:
    """The name expert parameters carry (DeepSpeed's `group_name`): one per layout, so layouts built one after another
    in a process (tests) never share DeepSpeed's group registry entries."""
    return f"msp_ep{layout.size('ep')}_edp{layout.size('edp')}_{id(layout):x}"


class ExpertParallelExperts(nn.Module):
    """A HF experts module (3-D expert tensors [E, ...], forward(hidden, top_k_index, top_k_weights)) run expert-
    parallel over layout.group("ep"): it holds this rank's E/ep experts under the HF parameter names (the fused
    expert tensors), cut by the shard spec's expert rule, and the HF module itself (unregistered, same Parameters) to
    run them. `capacity`: optional callable (top_k_index, top_k_weights) -> the same with dropped choices set to the
    sentinel E (moe.capacity); None = dropless."""

    def __init__(self, experts: nn.Module, layout: ParallelLayout, capacity=None):
        super().__init__()
        ep, rank = layout.size("ep"), layout.rank("ep")
        total = experts.num_experts
        if total % ep:
            raise ValueError(f"the model has {total} experts per MoE layer, which parallel_config.expert_parallel={ep} "
                             f"does not divide: pick an expert_parallel that divides {total}")
        self.num_experts, self.local_experts, self.ep = total, total // ep, ep
        self.first_expert = rank * self.local_experts
        self.group, self.capacity = layout.group("ep"), capacity
        for name, p in list(experts.named_parameters(recurse=False)):
            data = EXPERT_SHARD.local(p.detach(), ep, rank).clone()
            local = nn.Parameter(data, requires_grad=p.requires_grad)
            setattr(experts, name, local)
            self.register_parameter(name, local)  # the same Parameter: HF's forward and ours see one tensor
        experts.num_experts = self.local_experts  # HF's sentinel (skipped id) becomes E/ep
        self._inner = [experts]  # unregistered: its parameters are registered here under their own names

    @property
    def hf_experts(self) -> nn.Module:
        return self._inner[0]

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        for name, p in self._parameters.items():  # loaders (meta -> real) and .to() may have swapped Parameters
            if getattr(self.hf_experts, name) is not p:
                setattr(self.hf_experts, name, p)
        if self.capacity is not None:
            top_k_index, top_k_weights = self.capacity(top_k_index, top_k_weights, self.num_experts)
        tokens, hidden = hidden_states.shape
        k = top_k_index.shape[-1]
        expert = top_k_index.reshape(-1)
        weight = top_k_weights.reshape(-1, 1)
        token = torch.arange(tokens, device=hidden_states.device).repeat_interleave(k)
        kept = expert < self.num_experts
        if not bool(kept.all()):
            expert, weight, token = expert[kept], weight[kept], token[kept]
        order = torch.argsort(expert, stable=True)  # by expert, so by destination rank too
        expert, weight, token = expert[order], weight[order], token[order]
        counts = torch.bincount(expert, minlength=self.num_experts).view(self.ep, self.local_experts)
        got_counts = exchange_counts(counts, self.group) if self.ep > 1 else counts  # [source, local expert]
        send, recv = counts.sum(1).tolist(), got_counts.sum(1).tolist()
        rows = exchange_rows(hidden_states[token], send, recv, self.group)
        local_ids = torch.arange(self.local_experts, device=rows.device).repeat(self.ep)
        local_ids = local_ids.repeat_interleave(got_counts.reshape(-1))
        ones = rows.new_ones((rows.shape[0], 1))
        out = self.hf_experts(rows, local_ids[:, None], ones)
        if rows.shape[0] == 0:  # no token for any local expert: still give every parameter a (zero) grad
            out = out + sum(p.reshape(-1)[:1].sum() * 0 for p in self.parameters())
        back = exchange_rows(out, recv, send, self.group)
        combined = hidden_states.new_zeros((tokens, hidden))
        return combined.index_add(0, token, (back * weight.to(back.dtype)).to(combined.dtype))

    def extra_repr(self) -> str:
        return (f"experts {self.first_expert}..{self.first_expert + self.local_experts - 1} of {self.num_experts}, "
                f"ep={self.ep}, {'capacity' if self.capacity is not None else 'dropless'}")

