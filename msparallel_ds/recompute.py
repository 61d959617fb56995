"""Activation recompute from MindFormers' `recompute_config` (through Plan.recompute) on a HF decoder.

| recompute_config                          | here                                                            |
|-------------------------------------------|-----------------------------------------------------------------|
| recompute: true                           | every decoder layer is checkpointed                             |
| recompute: [n0, n1, ...] (per stage)      | the first n_i layers of stage i (this rank's stage)             |
| select_recompute / select_comm_recompute  | only the submodules the patterns name, in every layer or in the |
|   (patterns, optionally per-stage counts) | first n_i layers                                                |

Patterns are MindFormers regexes over cell names (`feed_forward\\.mul`, `.*\\.norm`, `attention\\.wq`). MindSpore
recomputes single operators; PyTorch checkpoints modules, so a trailing operator name (mul, silu, reshape, ...) is
dropped and the pattern selects the module that runs it, matched against the HF name and MindFormers' name of each
submodule of a layer (the model-family adapter's `mindformers_names`, e.g. feed_forward and attention for the
Llama family's MLP and attention blocks).

Checkpointing wraps the module's `forward` (torch.utils.checkpoint, non-reentrant), so parameter names and HF
checkpoints are unchanged and pre-hooks (e.g. the sequence-parallel split) run outside the recomputed region.
"""
from __future__ import annotations

import re

from torch import nn
from torch.utils.checkpoint import checkpoint

from .training_wrap import wrap_training_forward

__all__ = ["apply_recompute", "checkpoint_module", "hf_gradient_checkpointing", "select_modules"]

# MindSpore primitive names that end a select pattern (an operator, not a cell)
_OPS = {"mul", "add", "silu", "gelu", "reshape", "cast", "matmul", "batchmatmul", "bmm", "transpose", "softmax",
        "merger_head_transpose", "activation", "activate", "tile", "concat", "split", "sum", "square", "rsqrt", "norm"}


def checkpoint_module(module: nn.Module) -> nn.Module:
    """Recompute `module`'s forward in backward instead of storing its activations (idempotent)."""
    return wrap_training_forward(module, "_msp_recompute",
                                 lambda inner, args, kwargs: checkpoint(inner, *args, use_reentrant=False, **kwargs))


def _module_regex(pattern: str) -> re.Pattern:
    parts = pattern.split(r"\.")
    if len(parts) > 1 and parts[-1] in _OPS and parts[-1] != "norm":
        parts = parts[:-1]  # `feed_forward\.mul`: the mul runs in feed_forward
    return re.compile(r"\.".join(parts))


def select_modules(layer: nn.Module, pattern: str, mindformers_names: dict[str, list[str]]) -> list[str]:
    """Names (relative to `layer`) of the submodules a MindFormers select pattern names; outermost only.
    mindformers_names: HF submodule name -> MindFormers cell names (the adapter's)."""
    rx = _module_regex(pattern)
    hits = []
    for name, _ in layer.named_modules():
        if not name:
            continue
        names = [name, *mindformers_names.get(name, [])]
        if any(rx.fullmatch(n) for n in names):
            hits.append(name)
    return [h for h in hits if not any(h.startswith(o + ".") for o in hits)]


def _count(value, stage: int, chunk: int = 0):
    """'all' -> None (every layer), [vpp][pp] counts -> this stage's count."""
    if value == "all":
        return None
    return value[chunk][stage] if value and isinstance(value[0], list) else value[stage]


def apply_recompute(part: nn.Module, recompute, *, stage: int = 0, chunk: int = 0) -> dict[str, list[str]]:
    """Checkpoint what `recompute` (a Plan.recompute) asks for in the decoder layers of `part` (a HF model or a
    pipeline stage), pipeline stage `stage`, virtual chunk `chunk`. Returns {global layer index: [recomputed
    submodule names]} ('' = the whole layer)."""
    if recompute is None or recompute.mode == "none":
        return {}
    from .models import adapter_for

    adapter = adapter_for(part)
    items = adapter.layer_items(part)
    layers = [layer for _, layer in items]
    done: dict[str, list[str]] = {}
    if recompute.mode in ("full", "layers"):
        n = len(layers) if recompute.mode == "full" else _count(recompute.layers, stage, chunk)
        for i, (index, layer) in enumerate(items):
            if i < n:
                checkpoint_module(layer)
                done[str(index)] = [""]
    for key, patterns in (("recompute_config.select_recompute", recompute.select),
                          ("recompute_config.select_comm_recompute", recompute.select_comm)):
        for pattern, value in patterns.items():
            n = _count(value, stage, chunk)
            n = len(layers) if n is None else n
            if n and not select_modules(layers[0], pattern, adapter.mindformers_names):
                names = ", ".join(name for name, _ in layers[0].named_modules() if name)
                raise ValueError(f"{key}: pattern {pattern!r} names no submodule of a "
                                 f"{type(layers[0]).__name__} (modules: {names}; MindFormers names such as "
                                 f"feed_forward, attention, w1/w2/w3 are understood); fix or drop the pattern")
            for i, (index, layer) in enumerate(items):
                if i >= n:
                    continue
                for name in select_modules(layer, pattern, adapter.mindformers_names):
                    have = done.setdefault(str(index), [])
                    if any(d == "" or name == d or name.startswith(d + ".") for d in have):
                        continue  # already inside a recomputed module
                    checkpoint_module(layer.get_submodule(name))
                    have.append(name)
    return done


def hf_gradient_checkpointing(model: nn.Module) -> dict[str, list[str]]:
    """`recompute: true` on a model without a family adapter: the model's own HF gradient checkpointing (every
    GradientCheckpointingLayer, non-reentrant). Returns {layer index: ['']} like apply_recompute."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    from .models import unsupported_advice

    if not getattr(model, "supports_gradient_checkpointing", False):
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise ValueError(f"recompute_config.recompute: true: {unsupported_advice(type(model).__name__, model_type)}; "
                         "it does not support HF gradient checkpointing either: set recompute: false")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    return {str(i): [""] for i in range(len(layers))}
