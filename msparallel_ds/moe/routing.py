"""The YAML's routing weights on the HF routers: norm_topk_prob and routed_scaling_factor as MindFormers computes
them (mcore parallel_core/training_graph/transformer/moe/router.py:290-295; legacy modules/transformer/moe.py:
1192-1195):

    weights = the chosen experts' scores; / (sum + 1e-20) when norm_topk_prob and top_k > 1; x routed_scaling_factor

The router's compute dtype (mcore `moe_router_dtype`, default float32: parallel_core/transformer_config.py:1927;
legacy moe_config `router_dense_type`, default float32: 1.3.2 modules/transformer/moe.py:126): MindFormers casts the
router's input and weight to it for the logits matmul (training_graph/transformer/moe/router.py:117-118, pynative
router.py:356-360, whose weight is held in it), takes scores, the bias-added choice and the top-k weights in it, and
casts the routing weights to the experts' dtype where they multiply the expert outputs (pynative moe/experts.py:160,
:170). `RoutedIn` does that around the HF router's own forward: a no-op on a float32 model, under bf16 the routing
no longer rounds the logits to bf16 (HF's V4 and Qwen-MoE routers run in the model dtype; V3's casts to fp32 already).
The weight stays the model's parameter (bf16 under DeepSpeed bf16; MindFormers' pynative router keeps it in fp32).

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

import torch
from torch import nn

from ..config.errors import ConfigError, ConfigIssue, ConfigWarning

__all__ = ["apply_routing", "route_in"]


def _scale_output(factor: float):
    def hook(router: nn.Module, args, output):
        logits, weights, index = output
        return logits, weights * factor, index
    return hook


class RoutedIn:
    """A router class's stand-in subclass computing its forward in `router.router_dtype` (module docstring)."""

    _made: dict[type, type] = {}

    @classmethod
    def subclass(cls, base: type) -> type:
        if base not in cls._made:
            def forward(self, hidden_states, *args, **kwargs):
                weight = self._parameters["weight"]
                self._parameters["weight"] = weight.to(self.router_dtype)  # autograd reaches the parameter
                try:
                    return base.forward(self, hidden_states.to(self.router_dtype), *args, **kwargs)
                finally:
                    self._parameters["weight"] = weight
            cls._made[base] = type(f"{base.__name__}RoutedIn", (base,), {"forward": forward,
                                                                         "__module__": base.__module__})
        return cls._made[base]


def _weights_in_input_dtype(router: nn.Module, args, output):
    """The routing weights in the experts' dtype (the hidden states'), as MindFormers casts its probs."""
    logits, weights, index = output
    return logits, weights.to(args[0].dtype), index


def route_in(routers: list, dtype: str) -> None:
    """Every router computes in `dtype` (moe_router_dtype); registered after the other weight hooks of apply_routing,
    so a routed_scaling_factor hook multiplies in that dtype too."""
    for r in routers:
        if not isinstance(getattr(r, "weight", None), nn.Parameter):
            continue
        r.router_dtype = getattr(torch, dtype)
        if not isinstance(r, tuple(RoutedIn._made.values())):
            r.__class__ = RoutedIn.subclass(type(r))
            r.register_forward_hook(_weights_in_input_dtype)


def _warn(text: str) -> None:
    warnings.warn(text, ConfigWarning, stacklevel=4)


def apply_routing(part: nn.Module, adapter: Any, settings: Any) -> dict[str, Any]:
    """Give every router of `part` the YAML's norm_topk_prob / routed_scaling_factor; returns what was set."""
    norm, scale = settings.norm_topk_prob, settings.routed_scaling_factor
    dtype = getattr(settings, "router_dtype", None)
    if norm is None and scale is None and dtype is None:
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
    if dtype is not None:
        route_in(routers, dtype)
        applied["router_dtype"] = dtype
    return applied


def routing_of(settings: Optional[Any]) -> bool:
    """Whether the YAML sets anything apply_routing acts on."""
    return settings is not None and (settings.norm_topk_prob is not None or settings.routed_scaling_factor is not None
                                     or getattr(settings, "router_dtype", None) is not None)
