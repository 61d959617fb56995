"""Aux-loss-free load balancing (DeepSeek-V3; MindFormers balance_via_topk_bias / moe_router_enable_expert_bias
with topk_bias_update_rate / moe_router_bias_update_rate; Megatron-Core's router expert bias).

The router chooses experts by score + bias (HF DeepSeek-V3: `e_score_correction_bias`; the routing weights use the
score alone). After every optimizer step each MoE layer's bias moves by

    bias += rate * sign(mean_e load - load_e)

where load_e is the number of top-k choices of expert e in the step's forwards (every micro-batch) summed over
every rank of the pipeline stage that routes different tokens (dp x cp x tp: tp ranks route their own sequence
slice under sequence parallel), i.e. the global load; every rank then applies the same update. Counts are
recorded in the backward of the routing weights, so a forward that is not back-propagated (the pipeline
schedule's shape inference, a recompute) does not count, as in moe.aux_loss.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor, nn

from ..distributed.collectives import sum_over
from .aux_loss import trained_forward

if TYPE_CHECKING:
    from ..distributed.layout import ParallelLayout

__all__ = ["ExpertBias", "install_expert_bias"]


class _CountOnBackward(torch.autograd.Function):
    """Forward: the routing weights unchanged. Backward: grad passes through; the choices' counts go to `sink`."""

    @staticmethod
    def forward(ctx, weights: Tensor, counts: Tensor, sink: list) -> Tensor:
        ctx.counts, ctx.sink = counts, sink
        return weights.view_as(weights)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.sink.append(ctx.counts)
        return grad, None, None


class ExpertBias:
    """One model part's routers with an expert bias: their counts since the last update, and the update rule."""

    def __init__(self, layout: ParallelLayout, rate: float):
        self.layout, self.rate = layout, float(rate)
        self.routers: list[tuple[nn.Module, Tensor, list]] = []  # (router, its bias buffer, recorded counts)

    def add(self, router: nn.Module, bias: Tensor, num_experts: int) -> None:
        sink: list = []
        self.routers.append((router, bias, sink))

        def hook(mod, args, output):
            if not trained_forward(mod, output):
                return output
            logits, weights, index = output
            counts = torch.bincount(index.reshape(-1), minlength=num_experts)[:num_experts]
            return logits, _CountOnBackward.apply(weights, counts, sink), index

        router.register_forward_hook(hook)

    def loads(self, last: Optional[int] = None) -> Optional[Tensor]:
        """[routers, E] global expert loads of the forwards back-propagated since the last call (the `last` ones of
        each router only, when given), then cleared; None when this part has no routers."""
        if not self.routers:
            return None
        rows = []
        for _, bias, sink in self.routers:
            kept = sink[-last:] if last else sink
            rows.append(torch.stack(kept).sum(0) if kept else torch.zeros(bias.numel(), dtype=torch.long))
            sink.clear()
        t = torch.stack(rows).to(device=self.routers[0][1].device, dtype=torch.float64)
        sum_over(self.layout, "dp_cp", t)
        return sum_over(self.layout, "tp", t)

    @torch.no_grad()
    def update(self, last: Optional[int] = None) -> Optional[Tensor]:
        """Apply the step's bias update to every router; returns the loads it used."""
        load = self.loads(last)
        if load is None:
            return None
        step = torch.sign(load.mean(-1, keepdim=True) - load) * self.rate
        for (_, bias, _), delta in zip(self.routers, step):
            bias.add_(delta.to(bias.dtype))
        return load


def install_expert_bias(part: nn.Module, adapter, layout: ParallelLayout, rate: float) -> ExpertBias:
    """Hook every MoE router of `part` that has an expert bias; a clear error when the model has none."""
    state = ExpertBias(layout, rate)
    for _, layer in adapter.layer_items(part):
        router = adapter.router_of(layer)
        if router is None:
            continue
        bias = adapter.expert_bias_of(router)
        if bias is None and getattr(adapter, "fixed_routing", lambda r: False)(router):
            continue  # a hash router (DeepSeek-V4): its experts are fixed, a bias would choose nothing
        if bias is None:
            raise ValueError(f"the YAML enables the router expert bias (moe_router_enable_expert_bias / "
                             f"balance_via_topk_bias) but {type(part).__name__}'s router ({type(router).__name__}) "
                             "has none: aux-loss-free balancing needs a DeepSeek-V3-style router "
                             "(e_score_correction_bias); turn the key off for this model")
        state.add(router, bias, adapter.num_experts(part.config))
    return state
