"""The YAML's `optimizer:` and `lr_schedule:` sections as plan entries (pure dicts; DeepSpeed / torch names)."""
from __future__ import annotations

from typing import Any, Optional

from .config.schema import ParallelConfig

__all__ = ["lr_schedule_entry", "optimizer_entry"]

_ADAMW = {"adamw", "fusedadamweightdecay", "adamweightdecay", "adamweightdecayx", "fp32adamweightdecay",
          "pmaadamw", "adam"}


def optimizer_entry(cfg: ParallelConfig) -> Optional[dict[str, Any]]:
    opt = cfg.optimizer
    if opt is None:
        return None
    lr = opt.learning_rate
    if lr is None and cfg.lr_schedule is not None:
        lr = cfg.lr_schedule.learning_rate
    kind = "AdamW" if opt.type.lower() in _ADAMW else opt.type
    params = {"lr": lr, "betas": list(opt.betas) if opt.betas else None, "eps": opt.eps,
              "weight_decay": opt.weight_decay}
    return {"type": kind, "mindformers_type": opt.type, "params": {k: v for k, v in params.items() if v is not None}}


def lr_schedule_entry(cfg: ParallelConfig) -> Optional[dict[str, Any]]:
    s = cfg.lr_schedule
    if s is None:
        return None
    warmup = s.warmup_steps
    total = s.total_steps if s.total_steps and s.total_steps > 0 else None
    if warmup is None and s.warmup_ratio is not None and total is not None:
        warmup = int(s.warmup_ratio * total)
    return {"type": s.type, "learning_rate": s.learning_rate, "lr_end": s.lr_end, "warmup_steps": warmup,
            "warmup_ratio": s.warmup_ratio, "total_steps": total}
