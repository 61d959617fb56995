"""msp.build_optimizer: the YAML's `optimizer:` as MindSpore/MindFormers compute it, on MindFormers' parameter groups
(types.py says what each type runs as).

The torch classes run on every device (foreach kernels on CUDA); DeepSpeed's FusedAdam(bias_correction=False)
computes the same update as AdamWeightDecay and is what `msparallel-ds export --to deepspeed` names.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from .adam import AdamWeightDecay, PmaAdamW
from .groups import param_groups
from .types import family, yaml_betas

__all__ = ["build_optimizer", "optimizer_groups", "optimizer_spec"]

_CLASSES: dict[str, tuple[Callable[..., torch.optim.Optimizer], dict]] = {
    "adamw": (torch.optim.AdamW, {}), "no_bias": (AdamWeightDecay, {"bias_correction": False}),
    "adam_x": (AdamWeightDecay, {"bias_correction": True}), "pma": (PmaAdamW, {})}


def _learning_rate(cfg) -> float:
    section = cfg.grouped_lr_schedule.default if cfg.grouped_lr_schedule is not None else cfg.lr_schedule
    lr = section.learning_rate if section is not None else None
    if section is not None and lr is None:
        lr = section.base_lr
    if lr is None:
        lr = cfg.optimizer.learning_rate
    if lr is None:
        raise ValueError("optimizer.learning_rate is unset and the YAML has no lr_schedule.learning_rate; set one "
                         "(MindFormers' rule: 'No learning rate specified')")
    return float(lr)


def optimizer_spec(cfg) -> tuple[Callable[..., torch.optim.Optimizer], dict[str, Any]]:
    """(optimizer class, its keyword arguments) for the YAML's optimizer; groups come from optim.groups."""
    opt = cfg.optimizer
    if opt is None:
        raise ValueError("the YAML has no `optimizer:` section (MindFormers cannot train it either: 1.3.2 "
                         "trainer/base_trainer.py:487 reads config.optimizer.weight_decay); add one (e.g. type: "
                         "AdamW) or pass msp.initialize(..., optimizer=lambda params: torch.optim.AdamW(params, "
                         "lr=...))")
    fam = family(opt.type)
    if fam.name == "muon":
        return _muon_spec(cfg)
    cls, extra = _CLASSES[fam.name]
    kwargs: dict[str, Any] = dict(lr=_learning_rate(cfg), betas=yaml_betas(opt),
                                  eps=float(fam.eps if opt.eps is None else opt.eps),
                                  weight_decay=float(opt.weight_decay or 0.0), **extra)
    if fam.name == "pma":
        kwargs.update({k: getattr(opt, k) for k in ("fused_num", "interleave_step", "fused_algo", "ema_alpha")
                       if getattr(opt, k) is not None})
    return cls, kwargs


def _pynative(cfg) -> bool:
    """A MindFormers 2.1 pynative-schema YAML (`parallelism:` / `training:`): it runs pynative/optimizer/muon.py."""
    return cfg.parallelism is not None or cfg.training is not None


def _muon_spec(cfg):
    from .muon import Muon, check_muon_layout
    from .muon_pynative import PynativeMuon, check_pynative_keys

    opt = cfg.optimizer
    pynative = _pynative(cfg)
    check_muon_layout(cfg, pynative)

    def pick(value, default):  # muon.py's defaults where the YAML is silent
        return default if value is None else value

    kwargs = dict(lr=_learning_rate(cfg), weight_decay=float(opt.weight_decay or 0.0),
                  matched_adamw_rms=float(pick(opt.matched_adamw_rms, 0.2)),
                  momentum=float(pick(opt.momentum, 0.95)), nesterov=pick(opt.nesterov, True),
                  adamw_betas=tuple(float(b) for b in pick(opt.adamw_betas, (0.95, 0.95))),
                  adamw_eps=float(pick(opt.adamw_eps, 1e-8)))
    if not pynative:
        return Muon, kwargs
    check_pynative_keys(opt)
    return PynativeMuon, dict(kwargs, ns_coefficients=opt.ns_coefficients, ns_steps=opt.ns_steps,
                              eps=float(pick(opt.eps, 1e-7)))


def optimizer_groups(model: nn.Module, cfg, cls, kwargs) -> list[dict]:
    """MindFormers' groups for `cls` as the YAML's type applies them (AdamWeightDecayX: one decay for all; Muon: each
    split into its Newton-Schulz and AdamW parts)."""
    groups = param_groups(model, kwargs["weight_decay"], grouped_patterns(cfg))
    if family(cfg.optimizer.type).decay_all:
        for group in groups:
            group["weight_decay"] = kwargs["weight_decay"]
    from .muon import Muon, muon_groups

    if isinstance(cls, type) and issubclass(cls, Muon):
        if _pynative(cfg):
            from .muon_pynative import pynative_muon_groups, warn_qk_clip

            warn_qk_clip(model, cfg.optimizer)
            return pynative_muon_groups(model, groups, cfg.optimizer.adamw_include)
        groups = muon_groups(model, groups)
    return groups


def grouped_patterns(cfg) -> Optional[list[list[str]]]:
    g = cfg.grouped_lr_schedule
    if g is None:
        return None
    for i, item in enumerate(g.grouped):
        if not item.params:
            raise ValueError(f"grouped_lr_schedule.grouped[{i}].params is empty; each item needs a non-empty list "
                             "of parameter name patterns (MindFormers' rule)")
    return [list(item.params) for item in g.grouped]


def build_optimizer(model: nn.Module, cfg) -> torch.optim.Optimizer:
    """The YAML's optimizer (`cfg`: path, dict, YAML text or ParallelConfig) over `model`'s trainable parameters in
    MindFormers' groups (no decay for 1-D / `.bias` / the model's no_weight_decay names; grouped_lr_schedule
    groups). Its lr is the schedule's peak; msp.build_lr_scheduler drives it per step."""
    from ..config import ParallelConfig, load_config

    cfg = cfg if isinstance(cfg, ParallelConfig) else load_config(cfg)
    cls, kwargs = optimizer_spec(cfg)
    optimizer = cls(optimizer_groups(model, cfg, cls, kwargs), **kwargs)
    optimizer.mindformers_type = cfg.optimizer.type
    return optimizer
