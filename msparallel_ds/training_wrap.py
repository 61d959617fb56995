"""Route a module's forward through a wrapper while it trains (recompute, activation offload), keeping its
parameters, names and hooks: the module object stays, only its `forward` attribute is wrapped, once per marker."""
from __future__ import annotations

import functools
from typing import Any, Callable

from torch import nn

__all__ = ["wrap_training_forward"]


def wrap_training_forward(module: nn.Module, marker: str, run: Callable[[Callable, tuple, dict], Any]) -> nn.Module:
    """While module.training, forward(*a, **k) becomes run(inner_forward, a, k); sets `module.<marker>` (idempotent:
    a module already marked is returned as it is). Eval runs the plain forward."""
    if getattr(module, marker, False):
        return module
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not module.training:
            return inner(*args, **kwargs)
        return run(inner, args, kwargs)

    module.forward = forward
    setattr(module, marker, True)
    return module
