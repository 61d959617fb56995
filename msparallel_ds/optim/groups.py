"""MindFormers' optimizer parameter groups (2.1 trainer/optimizer_grouped_parameters.py, 1.3.2 the same rule).

No weight decay for 1-D parameters, names ending `.bias`, names in the model's `no_weight_decay()` set and names
containing one of its `no_weight_decay_keywords()`; every other trainable parameter decays. With a YAML
`grouped_lr_schedule`, a parameter whose name contains (or fnmatches) one of a group's `params` patterns follows that
group's schedule (first matching group in YAML order); each (schedule group, decay) pair is one optimizer group, in
the order the parameters first appear, as MindFormers builds them.
"""
from __future__ import annotations

from fnmatch import fnmatch
from typing import Optional

import torch.nn as nn

__all__ = ["param_groups", "no_decay"]

# Extra keys our groups carry: torch optimizers keep unknown group keys, ZeRO (DeepSpeed and torch) copies them.
SCHEDULE_KEY = "lr_schedule_group"  # None: the default lr_schedule; i: grouped_lr_schedule.grouped[i]
NAME_KEY = "group_name"


def _model_set(model: nn.Module, attr: str) -> set:
    fn = getattr(model, attr, None)
    return set(fn()) if callable(fn) else set()


def no_decay(name: str, p, skip: set, keywords: set) -> bool:
    return p.dim() == 1 or name.endswith(".bias") or name in skip or any(k in name for k in keywords)


def _schedule_index(name: str, patterns: list[list[str]]) -> Optional[int]:
    for i, group in enumerate(patterns):
        if any(pat in name or fnmatch(name, pat) for pat in group):
            return i
    return None


def param_groups(model: nn.Module, weight_decay: float, grouped_patterns: Optional[list[list[str]]] = None
                 ) -> list[dict]:
    """[{'params', 'weight_decay', 'group_name', 'lr_schedule_group'}, ...] for the trainable parameters."""
    skip, keywords = _model_set(model, "no_weight_decay"), _model_set(model, "no_weight_decay_keywords")
    patterns = grouped_patterns or []
    groups: dict[str, dict] = {}
    matched = [False] * len(patterns)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = not no_decay(name, p, skip, keywords)
        base = "weight_decay" if decay else "no_weight_decay"
        index = _schedule_index(name, patterns)
        key = base if index is None else f"group_{index}_{base}"
        if index is not None:
            matched[index] = True
        if key not in groups:
            groups[key] = {"params": [], "weight_decay": float(weight_decay or 0.0) if decay else 0.0,
                           NAME_KEY: key, SCHEDULE_KEY: index}
        groups[key]["params"].append(p)
    for i, hit in enumerate(matched):
        if not hit:
            raise ValueError(f"grouped_lr_schedule.grouped[{i}].params={patterns[i]!r} matches no trainable parameter "
                             "name (MindFormers' rule: substring or fnmatch); fix the patterns")
    if not groups:
        raise ValueError("the model has no trainable parameters to optimize")
    return list(groups.values())
