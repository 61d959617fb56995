"""Expert parallel applied to a model part (parallelize's step after tensor parallel).

Every MoE layer's routed experts become an ExpertParallelExperts over layout.group("ep") holding E/ep experts; their
parameters are marked for the gradient reduction over the expert-data-parallel group "edp" (the dp*cp*tp/ep ranks
holding the same experts): DeepSpeed's ZeRO reads `allreduce=False` / `group_name` (moe.deepspeed registers our
groups under that name), the pipeline engine and the global-norm clip read `expert_parallel`, and
`tensor_model_parallel` makes DeepSpeed's gradient norm count them on every tp rank (they differ across tp ranks
when ep folds tp; ZeRO partitions them over edp, so each expert element is counted once).
With ep = 1 the experts stay whole; under tp (sequence parallel) each tp rank feeds them its own sequence slice, so
their grads are summed over tp like the norms'.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from torch import nn

from .aux_loss import AuxLoss, install_aux_loss
from .dispatch import ExpertParallelExperts, expert_group_name

if TYPE_CHECKING:
    from ..distributed.layout import ParallelLayout
    from ..models.base import DecoderAdapter

__all__ = ["apply_ep", "expert_parameters", "is_expert_parameter"]


def is_expert_parameter(p: nn.Parameter) -> bool:
    return getattr(p, "expert_parallel", False)


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if is_expert_parameter(p)]


def _no_experts(part: nn.Module, ep: int) -> ValueError:
    config = getattr(part, "config", None)
    return ValueError(f"parallel_config.expert_parallel={ep} but {type(part).__name__} "
                      f"(model_type={getattr(config, 'model_type', None)!r}) has no mixture-of-experts layers: set "
                      "expert_parallel: 1, or train a MoE model (Qwen3-MoE, Qwen2-MoE, Mixtral)")


def apply_ep(part: nn.Module, layout: ParallelLayout, adapter: Optional[DecoderAdapter], capacity=None,
             aux: Optional[dict] = None) -> tuple[dict[str, str], Optional[AuxLoss]]:
    """Shard `part`'s experts over ep in place; returns the ep plan applied ({} when ep == 1) and the aux-loss state
    when `aux` ({"coeff", "scope", "z_coeff"}) asks for a load-balancing or z loss."""
    ep, tp = layout.size("ep"), layout.size("tp")
    plan = adapter.ep_plan(part.config) if adapter is not None and hasattr(adapter, "ep_plan") else {}
    if not plan:
        if ep > 1:
            raise _no_experts(part, ep)
        return {}, None
    name = expert_group_name(layout)
    for _, layer in adapter.layer_items(part):
        experts = adapter.experts_of(layer)
        if experts is None:
            continue
        if ep > 1 or capacity is not None:
            experts = ExpertParallelExperts(experts, layout, capacity)
            adapter.set_experts(layer, experts)
        if ep > 1:
            for p in experts.parameters(recurse=False):
                p.expert_parallel, p.allreduce, p.group_name = True, False, name
                # distinct on every tp rank when ep folds tp: DeepSpeed's norm then counts them on each tp rank
                p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1
        elif tp > 1:
            from ..tensor_parallel.replicated import mark

            mark(experts, layout.group("tp"))
    aux_loss = None
    if aux and (aux.get("coeff") or aux.get("z_coeff")):
        config = part.config
        aux_loss = AuxLoss(layout, adapter.num_experts(config), config.num_experts_per_tok,
                           score=getattr(adapter, "router_score", "softmax"), **getattr(adapter, "aux_rule", {}), **aux)
        install_aux_loss(part, adapter, aux_loss)
    return (plan if ep > 1 else {}), aux_loss

