"""The YAML's routing weights on the HF routers: norm_topk_prob and routed_scaling_factor as MindFormers computes
them (mcore parallel_core/training_graph/transformer/moe/router.py:290-295; legacy modules/transformer/moe.py:
1192-1195):

    weights = the chosen experts' scores; / (sum + 1e-20) when norm_topk_prob and top_k > 1; x routed_scaling_factor

YAML against the HF model's config: the YAML wins, with a ConfigWarning naming both values. MindFormers trains with
the YAML's values, the aim is its loss curve, and an HF config cannot always say them: Qwen3-MoE has no scaling
factor at all, yet the real Qwen3-MoE pretrain YAML sets routed_scaling_factor 1.5 and norm_topk_prob false (the
hub model: true), so refusing a mismatch would refuse MindFormers' own configs. The HF config is updated where it has
the field (save_pretrained then writes what was trained); a factor the HF family cannot hold is named in the warning.
Keys the YAML leaves out keep the HF model's behaviour.
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

from torch import nn

from ..config.errors import ConfigError, ConfigIssue, ConfigWarning

__all__ = ["apply_routing"]


def _scale_output(factor: float):
    def hook(router: nn.Module, args, output):
        logits, weights, index = output
        return logits, weights * factor, index
    return hook


def _warn(text: str) -> None:
    warnings.warn(text, ConfigWarning, stacklevel=4)


def apply_routing(part: nn.Module, adapter: Any, settings: Any) -> dict[str, Any]:
    """Give every router of `part` the YAML's norm_topk_prob / routed_scaling_factor; returns what was set."""
    norm, scale = settings.norm_topk_prob, settings.routed_scaling_factor
    if norm is None and scale is None:
        return {}
    config, kind = part.config, type(part.config).__name__
    routers = [r for _, layer in adapter.layer_items(part) for r in [adapter.router_of(layer)] if r is not None]
    applied: dict[str, Any] = {}
    if norm is not None:
        top_k = getattr(config, "num_experts_per_tok", 1) or 1
        effective = bool(norm) and top_k > 1  # MindFormers normalises only when more than one expert is chosen
        theirs = getattr(config, "norm_topk_prob", None)
        fixed = [r for r in routers if not hasattr(r, "norm_topk_prob")]
        if fixed and not effective and top_k > 1:  # Mixtral's router always normalises
            raise ConfigError([ConfigIssue(settings.key("norm_topk_prob"), norm, f"cannot be applied to {kind}: its "
                                           f"router ({type(fixed[0]).__name__}) always normalises the top-k weights",
                                           "write norm_topk_prob: true (or leave it out) for this model")])
        if theirs is not None and bool(theirs) != bool(norm):
            _warn(f"{settings.key('norm_topk_prob')}={norm} differs from the HF model's {kind}.norm_topk_prob="
                  f"{theirs}: the YAML's value is used, as MindFormers uses it (router.py:290-293)")
        for r in routers:
            if hasattr(r, "norm_topk_prob"):
                r.norm_topk_prob = effective
        if theirs is not None:
            config.norm_topk_prob = bool(norm)
        applied["norm_topk_prob"] = effective
    if scale is not None:
        theirs = getattr(config, "routed_scaling_factor", None)
        held = all(hasattr(r, "routed_scaling_factor") for r in routers)
        if float(scale) != float(theirs if theirs is not None else 1.0):
            _warn(f"{settings.key('routed_scaling_factor')}={scale:g} differs from the HF model's "
                  + (f"{kind}.routed_scaling_factor={theirs:g}" if theirs is not None else f"(a {kind} has none: 1)")
                  + ": the YAML's value multiplies the routing weights, as MindFormers does (router.py:295)"
                  + ("" if held else "; a HF checkpoint saved from this run loads without that factor"))
        for r in routers:
            if hasattr(r, "routed_scaling_factor"):
                r.routed_scaling_factor = float(scale)
            elif float(scale) != 1.0:
                r.register_forward_hook(_scale_output(float(scale)))
        if theirs is not None:
            config.routed_scaling_factor = float(scale)
        applied["routed_scaling_factor"] = float(scale)
    return applied


def routing_of(settings: Optional[Any]) -> bool:
    """Whether the YAML sets anything apply_routing acts on."""
    return settings is not None and (settings.norm_topk_prob is not None or settings.routed_scaling_factor is not None)
