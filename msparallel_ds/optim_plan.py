"""The YAML's `optimizer:`, `lr_schedule:` and `swap_config:` sections as plan entries (pure; DeepSpeed and torch
names)."""
from __future__ import annotations

from typing import Any, Optional

from .config.schema import ParallelConfig

__all__ = ["activation_offload_entry", "lr_schedule_entry", "optimizer_entry"]


def optimizer_entry(cfg: ParallelConfig) -> Optional[dict[str, Any]]:
    """The optimizer as data. `type` is DeepSpeed's name where one computes the same update ("AdamW": FusedAdam,
    with bias_correction false for the nn.AdamWeightDecay family), else the MindFormers type; `runs_as` says what
    msp.build_optimizer builds (optim/types.py)."""
    from .optim.types import family, yaml_betas

    opt = cfg.optimizer
    if opt is None:
        return None
    lr = opt.learning_rate
    if lr is None and cfg.lr_schedule is not None:
        lr = cfg.lr_schedule.learning_rate
    try:
        fam, betas = family(opt.type), yaml_betas(opt)
    except ValueError as exc:  # an unbuilt type plans fine; msp.initialize names it
        return {"type": opt.type, "mindformers_type": opt.type, "runs_as": None, "error": str(exc),
                "params": {k: v for k, v in {"lr": lr, "eps": opt.eps, "weight_decay": opt.weight_decay}.items()
                           if v is not None}}
    if fam.name == "muon":  # Muon's AdamW part reads adamw_betas / adamw_eps (optim/build.py)
        betas, eps = tuple(opt.adamw_betas or (0.95, 0.95)), opt.adamw_eps
        opt = opt.model_copy(update={"eps": eps})
    params: dict[str, Any] = {"lr": lr, "betas": list(betas), "eps": fam.eps if opt.eps is None else opt.eps,
                              "weight_decay": opt.weight_decay or 0.0}
    if fam.name == "muon":
        params.update(matched_adamw_rms=opt.matched_adamw_rms, momentum=opt.momentum, nesterov=opt.nesterov)
    kind, runs_as = opt.type, _RUNS_AS[fam.name]
    if fam.name in ("adamw", "no_bias"):
        kind = "AdamW"
        if fam.name == "no_bias":
            params["bias_correction"] = False
    return {"type": kind, "mindformers_type": opt.type, "runs_as": runs_as,
            "params": {k: v for k, v in params.items() if v is not None}}


_RUNS_AS = {"adamw": "torch.optim.AdamW", "no_bias": "AdamWeightDecay (no bias correction)",
            "adam_x": "AdamWeightDecay(bias_correction=True)", "pma": "PmaAdamW", "muon": "Muon (optim.muon)"}


def lr_schedule_entry(cfg: ParallelConfig) -> Optional[dict[str, Any]]:
    """The schedule as data (the engines run msp.build_lr_scheduler; DeepSpeed's schedulers compute other curves)."""
    s = cfg.lr_schedule
    if s is None:
        return None
    warmup = s.warmup_steps
    total = s.total_steps if s.total_steps and s.total_steps > 0 else None
    if s.warmup_ratio is not None:
        warmup = int(s.warmup_ratio * total) if total is not None else None
    out = {"type": s.type, "learning_rate": s.learning_rate, "lr_end": s.lr_end, "warmup_steps": warmup,
           "warmup_ratio": s.warmup_ratio, "total_steps": total}
    if cfg.grouped_lr_schedule is not None:
        out["grouped"] = [{"type": g.type, "params": list(g.params)} for g in cfg.grouped_lr_schedule.grouped]
    return out


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
