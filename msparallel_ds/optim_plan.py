"""The YAML's `optimizer:`, `lr_schedule:` and `swap_config:` sections as plan entries (pure; DeepSpeed and torch
names)."""
from __future__ import annotations

from typing import Any, Optional

from .config.schema import ParallelConfig

__all__ = ["activation_offload_entry", "lr_schedule_entry", "optimizer_entry"]

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


def activation_offload_entry(cfg: ParallelConfig, notes: list[str]) -> Any:
    """swap_config (or mcore cpu_offloading): "all", or the sorted decoder layer indices whose activations go to the
    host; None when off. Per-operator op_swap is not built (noted); prefetch distances do not apply to torch's
    save_on_cpu, which brings each tensor back when backward needs it."""
    sc = cfg.swap_config
    if not sc.swap:
        return None
    if sc.op_swap:
        notes.append("swap_config.op_swap (per-operator activation swap) is not built; the layer_swap layers are")
    layers: set[int] = set()
    for entry in sc.layer_swap or ():
        if entry.layers is True:
            return "all"
        if entry.layers is not False:  # a list of layer ids, or of lists of them
            layers.update(i for x in entry.layers for i in (x if isinstance(x, list) else [x]))
    return tuple(sorted(layers)) or None
