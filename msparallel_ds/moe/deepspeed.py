"""Hand expert-parallel parameters to DeepSpeed's ZeRO 0-2 (engine.py calls `prepare` before deepspeed.initialize).

DeepSpeed 0.19.8 reduces a parameter with `allreduce=False` over the expert-data-parallel group registered under its
`group_name` (utils/groups.py registry), ZeRO-1/2 partition the optimizer state of a param group marked
{"moe": True, "name": group_name} over that group (stage_1_and_2.py `_configure_moe_settings`), and its engine turns
that path on only when the module tree holds a `deepspeed.moe.layer.MoE`. So: our edp / ep groups are registered
under the layout's name (moe.dispatch.expert_group_name), a parameter-free MoE marker sits on the model while
deepspeed.initialize runs, and the optimizer's param groups are split into dense and expert groups. Gradients: both
paths divide the sum over edp by the data-parallel size dp, as for dense parameters (the engine's loss carries
x dp / N), so the expert update is d(sum of token losses) / N as well.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .apply import expert_parameters, is_expert_parameter
from .dispatch import expert_group_name

if TYPE_CHECKING:
    from ..distributed.layout import ParallelLayout

__all__ = ["deepspeed_moe", "split_param_groups"]

_MARKER = "msp_deepspeed_moe_marker"


def _register_groups(layout: ParallelLayout, name: str) -> None:
    from deepspeed.utils import groups

    groups._EXPERT_PARALLEL_GROUP[name] = layout.group("ep")
    groups._EXPERT_PARALLEL_GROUP_RANKS[name] = list(layout.ranks("ep"))
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = layout.group("edp")
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = list(layout.ranks("edp"))


def _marker(num_experts: int, name: str) -> nn.Module:
    from deepspeed.moe.layer import MoE

    class ExpertGroupsMarker(MoE):
        """No parameters, no forward: tells DeepSpeed's engine the model has MoE layers (groups are ours)."""

        def __init__(self):
            nn.Module.__init__(self)
            self.num_experts, self.expert_group_name = num_experts, name

        def set_deepspeed_parallelism(self, *args, **kwargs) -> None:
            return None

    return ExpertGroupsMarker()


def split_param_groups(groups_or_params: Any, name: str) -> list[dict]:
    """Optimizer param groups with expert parameters in their own groups ({"moe": True, "name": name}, same
    hyper-parameters), as ZeRO needs them."""
    items = list(groups_or_params)
    groups = items if items and isinstance(items[0], dict) else [{"params": items}]
    out = []
    for group in groups:
        params = list(group["params"])
        dense = [p for p in params if not is_expert_parameter(p)]
        experts = [p for p in params if is_expert_parameter(p)]
        if dense:
            out.append({**group, "params": dense})
        if experts:
            out.append({**group, "params": experts, "moe": True, "name": name})
    return out


@contextmanager
def deepspeed_moe(model: nn.Module, layout: ParallelLayout, optimizer: torch.optim.Optimizer):
    """While deepspeed.initialize runs: our groups registered, the marker on the model, the optimizer's groups split.
    A no-op for a model without expert-parallel parameters."""
    experts = expert_parameters(model)
    if not experts:
        yield
        return
    name = expert_group_name(layout)
    _register_groups(layout, name)
    if not any(g.get("moe") for g in optimizer.param_groups):
        optimizer.param_groups = split_param_groups(optimizer.param_groups, name)
    model.add_module(_MARKER, _marker(len(experts), name))
    try:
        yield
    finally:
        del model._modules[_MARKER]
