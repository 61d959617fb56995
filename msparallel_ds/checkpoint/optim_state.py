"""The Adam state a checkpoint carries: which moments, and creating them before the first step on resume.

Only Adam/AdamW are supported because their per-parameter moments have the parameter's shape, so they reshard
with the same shard spec as the weight; other optimizers' state could not be sliced for another layout.
"""
from __future__ import annotations

import torch

__all__ = ["ensure_adam_state", "optimizer_keys"]


def optimizer_keys(opt) -> tuple[str, ...]:
    """The per-parameter state tensors saved with each weight (error for anything but Adam/AdamW)."""
    from ..optim.adam import AdamWeightDecay  # MindSpore's Adam without bias correction: the same two moments

    if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW, AdamWeightDecay)):
        raise ValueError(f"engine.save/load support Adam, AdamW and AdamWeightDecay (their moments are resharded); got "
                         f"{type(opt).__name__}")
    amsgrad = any(g.get("amsgrad") for g in opt.param_groups)
    return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())


def ensure_adam_state(opt, keys, step: float) -> None:
    """Adam creates its state at the first step; a resumed run needs it now, at the saved step."""
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state[p]
            for k in keys:
                state.setdefault(k, torch.zeros_like(p, memory_format=torch.preserve_format))
            state["step"] = torch.tensor(step, dtype=torch.float32) if not group.get("capturable") else \
                torch.tensor(step, dtype=torch.float32, device=p.device)
