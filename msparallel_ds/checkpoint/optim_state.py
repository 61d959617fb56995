"""The optimizer state a checkpoint carries: which per-parameter tensors, where they live, creating them on resume.

Adam/AdamW (exp_avg, exp_avg_sq) and Muon (momentum_buffer on its matrices, exp_avg / exp_avg_sq on its AdamW
parameters) are supported because their per-parameter tensors have the parameter's shape, so they reshard with the
same shard spec as the weight; other optimizers' state could not be sliced for another layout. With ZeRO-1 over whole
parameters (torch's ZeroRedundancyOptimizer; pipeline.zero.SplitZero's two parts: dense over dp x cp, experts over
edp) a parameter's state lives on one rank of its part's group (`owners`).
"""
from __future__ import annotations

import sys

import torch

__all__ = ["ensure_adam_state", "ensure_state", "optimizer_keys", "owners", "parts", "state_view"]


def parts(opt) -> list:
    """[(torch optimizer holding this rank's states, its ZeroRedundancyOptimizer or None, ZeRO group name)]: one part,
    or SplitZero's two (dense over dp x cp, experts over edp; duck-typed, no import of pipeline)."""
    # not imported here: torch.distributed.optim scripts its functional optimizers on import (~1.6 s on a loaded
    # CPU, which an async save would expose); without the module no ZeroRedundancyOptimizer exists
    zro = getattr(sys.modules.get("torch.distributed.optim"), "ZeroRedundancyOptimizer", None)
    out = []
    for i, part in enumerate(getattr(opt, "parts", None) or [opt]):
        z = part if zro is not None and isinstance(part, zro) else None
        out.append((z.optim if z is not None else part, z, "edp" if i == 1 else "dp_cp"))
    return out


def state_view(opt) -> tuple[dict, tuple[str, ...]]:
    """({parameter: state} of this rank's parts, built once) and the tensors saved per parameter."""
    ps = parts(opt)
    states: dict = {}
    for base, _, _ in ps:
        states.update(base.state)
    return states, optimizer_keys(ps[0][0])


def owners(opt) -> dict:
    """{parameter: (ZeRO group name, rank in it owning its optimizer state)} for the ZeRO-1 parts."""
    return {p: (name, r) for _, z, name in parts(opt) if z is not None for p, r in z._param_to_rank.items()}


def optimizer_keys(opt) -> tuple[str, ...]:
    """The per-parameter state tensors saved with each weight (error for anything but Adam/AdamW/Muon); a parameter
    saves those of them its state holds."""
    from ..optim.adam import AdamWeightDecay  # MindSpore's Adam without bias correction: the same two moments
    from ..optim.muon import Muon

    opt = parts(opt)[0][0]
    if isinstance(opt, Muon):
        return ("exp_avg", "exp_avg_sq", "momentum_buffer")
    if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW, AdamWeightDecay)):
        raise ValueError(f"engine.save/load support Adam, AdamW, AdamWeightDecay and Muon (their moments are "
                         f"resharded); got {type(opt).__name__}")
    amsgrad = any(g.get("amsgrad") for g in opt.param_groups)
    return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())


def ensure_state(opt, keys, step: float) -> None:
    """ensure_adam_state for every part's own (this rank's) parameters."""
    for base, _, _ in parts(opt):
        ensure_adam_state(base, keys, step)


def ensure_adam_state(opt, keys, step: float) -> None:
    """Adam creates its state at the first step; a resumed run needs it now, at the saved step. Muon: its matrices'
    momentum_buffer, its AdamW parameters' moments with an integer step (as Muon._adamw keeps it)."""
    from ..optim.muon import Muon

    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state[p]
            if isinstance(opt, Muon):
                if group["use_muon"]:
                    state.setdefault("momentum_buffer", torch.zeros_like(p, dtype=torch.float32))
                else:
                    for k in ("exp_avg", "exp_avg_sq"):
                        state.setdefault(k, torch.zeros_like(p, dtype=torch.float32))
                    state["step"] = int(step)
                continue
            for k in keys:
                state.setdefault(k, torch.zeros_like(p, memory_format=torch.preserve_format))
            state["step"] = torch.tensor(step, dtype=torch.float32) if not group.get("capturable") else \
                torch.tensor(step, dtype=torch.float32, device=p.device)
