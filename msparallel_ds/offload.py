"""Activation offload (MindFormers swap_config / mcore cpu_offloading): the listed decoder layers keep the tensors
their forward saves for backward on the host, and backward brings each back when it needs it.

torch.autograd.graph.save_on_cpu does the moving (pinned host memory on an accelerator); on CPU it is a plain copy,
so the path still runs. Like recompute it wraps the layer's forward, so parameter names and checkpoints are
unchanged; the fine-grain interleave runs such layers whole.
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
from torch import nn

from .training_wrap import wrap_training_forward

__all__ = ["offload_activations", "offload_module"]


def offload_module(module: nn.Module) -> nn.Module:
    """Keep `module`'s saved activations on the host during training (idempotent)."""
    return wrap_training_forward(module, "_msp_offload", _on_host)


def _on_host(inner, args, kwargs):
    with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
        return inner(*args, **kwargs)


def offload_activations(part: nn.Module, which: Any, recomputed: Optional[dict] = None) -> list[str]:
    """Offload the decoder layers of `part` named by a Plan.activation_offload ("all" or global layer indices);
    returns the global indices done. A layer recomputed whole keeps no activations to move: recompute takes
    precedence there, with a warning, as in MindFormers (transformer/utils.py _check_swap_recompute_conflict)."""
    if not which:
        return []
    from .models import adapter_for

    done, skipped = [], []
    for index, layer in adapter_for(part).layer_items(part):
        if which == "all" or index in which:
            if "" in (recomputed or {}).get(str(index), ()):
                skipped.append(index)
                continue
            offload_module(layer)
            done.append(str(index))
    if skipped:
        warnings.warn(f"swap_config: layers {skipped} are recomputed whole, so their activations are not swapped "
                      "(recompute takes precedence, as in MindFormers)", stacklevel=3)
    return done
