"""The optimizer types of MindFormers' YAMLs and the maths each one computes (pure: plan/export read it too).

| optimizer.type | MindFormers / MindSpore class | runs as |
|---|---|---|
| AdamW (2.x, 1.3.2; `use_fused` too) | core/optim/adamw.py: bias correction, decoupled decay | torch.optim.AdamW |
| PmaAdamW, FusedPmaAdamW (2.x) | pma_adamw.py: AdamW + EMA/SMA weight fusion | optim.adam.PmaAdamW |
| FP32StateAdamWeightDecay, FusedAdamWeightDecay, AdamWeightDecay, 1.x `adamw`, `fp32_adamw`, `fused_adamw` | nn.AdamWeightDecay maths: no bias correction | optim.adam.AdamWeightDecay |
| AdamWeightDecayX (research/qwen) | bias correction, eps outside it; decay on every parameter | AdamWeightDecay(bias_correction=True) |
| Muon (2.1, deepseek4) | muon.py: Newton-Schulz on hidden matrices, AdamW(adamw_betas) on the rest | optim.muon.Muon |
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OPTIMIZER_TYPES", "Family", "family", "yaml_betas"]


@dataclass(frozen=True)
class Family:
    name: str  # "adamw" (torch AdamW maths), "no_bias" (nn.AdamWeightDecay), "adam_x", "pma", "muon"
    eps: float  # MindFormers' default eps for the type
    decay_all: bool = False  # the class overwrites the groups' weight decay with its own (every parameter decays)


# AdamWeightDecayX's __init__ sets self.weight_decay = weight_decay after the groups: MindSpore decays every parameter
ADAMW, NO_BIAS, ADAM_X, PMA = Family("adamw", 1e-8), Family("no_bias", 1e-6), Family("adam_x", 1e-8, True), \
    Family("pma", 1e-8)
MUON = Family("muon", 1e-8)  # adamw_eps
_TYPES = {
    "AdamW": ADAMW, "PmaAdamW": PMA, "FusedPmaAdamW": PMA,
    "FP32StateAdamWeightDecay": NO_BIAS, "fp32_adamw": NO_BIAS, "FusedAdamWeightDecay": NO_BIAS,
    "fused_adamw": NO_BIAS, "AdamWeightDecay": NO_BIAS, "adamw": NO_BIAS, "AdamWeightDecayX": ADAM_X, "Muon": MUON,
}
OPTIMIZER_TYPES = tuple(_TYPES)
_LATER = {"Came": "MindFormers' Came (core/optim/came.py) is not yet built here"}


def family(kind: str) -> Family:
    if kind in _LATER:
        raise ValueError(f"optimizer.type={kind!r}: {_LATER[kind]}; use one of {', '.join(OPTIMIZER_TYPES)} or pass "
                         "msp.initialize(..., optimizer=lambda params: ...)")
    if kind not in _TYPES:
        raise ValueError(f"optimizer.type={kind!r} is not an optimizer built here (MindFormers' registry names are "
                         f"case-sensitive); use one of {', '.join(OPTIMIZER_TYPES)}")
    return _TYPES[kind]


def yaml_betas(opt) -> tuple[float, float]:
    """`betas: [b1, b2]` (2.x) or `beta1`/`beta2` (1.x); MindFormers' default (0.9, 0.999)."""
    one = (opt.beta1, opt.beta2)
    if opt.betas is not None:
        if any(b is not None and b != a for a, b in zip(opt.betas, one)):
            raise ValueError(f"optimizer.betas={list(opt.betas)} disagrees with optimizer.beta1/beta2={list(one)}; "
                             "write one spelling (2.x: betas, 1.x: beta1/beta2)")
        return float(opt.betas[0]), float(opt.betas[1])
    return float(0.9 if one[0] is None else one[0]), float(0.999 if one[1] is None else one[1])
