"""`model.model_config.pet_config` (MindFormers parameter-efficient tuning) -> LoraSettings, with its rules.

MindFormers 2.1.0 pet/pet_config.py LoraConfig: lora_rank 8, lora_alpha 16, lora_dropout 0.01, lora_a_init 'normal',
lora_b_init 'zero', target_modules (a regex `re.match`ed against each cell's own name, pet/tuners/lora_adapter.py:67),
exclude_layers (regexes, skipped first, :65), freeze_include / freeze_exclude (mindpet's freeze lists). Only LoRA is
built here; prefix tuning, p-tuning v2, S-LoRA, adapter and AdaLoRA are one error each.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .errors import ConfigIssue

__all__ = ["LoraSettings", "read_pet"]

KEY = "model.model_config.pet_config"
_KNOWN = {"pet_type", "lora_rank", "lora_alpha", "lora_dropout", "lora_a_init", "lora_b_init", "target_modules",
          "exclude_layers", "freeze_include", "freeze_exclude", "param_init_type", "compute_dtype"}


@dataclass(frozen=True)
class LoraSettings:
    rank: int = 8
    alpha: float = 16
    dropout: float = 0.01
    target_modules: str = ""
    exclude_layers: tuple[str, ...] = ()

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank  # MindFormers' (lora_layers.py:149) and peft's (without rslora)


def read_pet(raw: Mapping, cfg: Any) -> tuple[Optional[LoraSettings], list[ConfigIssue]]:
    model = raw.get("model")
    mc = model.get("model_config") if isinstance(model, Mapping) else None
    pet = mc.get("pet_config") if isinstance(mc, Mapping) else None
    if pet is None:
        return None, []
    if not isinstance(pet, Mapping):
        return None, [ConfigIssue(KEY, pet, "must be a mapping", "write pet_type: lora with its lora_* keys")]
    kind = str(pet.get("pet_type", "")).lower()
    if kind != "lora":
        return None, [ConfigIssue(f"{KEY}.pet_type", pet.get("pet_type"), "is not built here (only lora is: prefix "
                                  "tuning, p-tuning v2, S-LoRA and adapters are not)", "use pet_type: lora, or drop "
                                  "pet_config to train every weight")]
    issues: list[ConfigIssue] = []
    for key in sorted(set(pet) - _KNOWN):
        issues.append(ConfigIssue(f"{KEY}.{key}", pet[key], "is not a MindFormers LoraConfig key", "remove it"))
    for key in ("freeze_include", "freeze_exclude"):
        if pet.get(key):
            issues.append(ConfigIssue(f"{KEY}.{key}", pet[key], "(mindpet's freeze lists) is not built here: only "
                                      "the LoRA weights train", f"remove {key}"))
    for key, default in (("lora_a_init", "normal"), ("lora_b_init", "zero")):
        if str(pet.get(key, default)).lower() not in (default, "zeros" if default == "zero" else default):
            issues.append(ConfigIssue(f"{KEY}.{key}", pet[key], f"is not built here (only {default!r}, the default)",
                                      f"use {default!r}"))
    rank, alpha, dropout = pet.get("lora_rank", 8), pet.get("lora_alpha", 16), pet.get("lora_dropout", 0.01)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        issues.append(ConfigIssue(f"{KEY}.lora_rank", rank, "must be a positive integer", "e.g. lora_rank: 8"))
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        issues.append(ConfigIssue(f"{KEY}.lora_alpha", alpha, "must be a positive number", "e.g. lora_alpha: 16"))
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        issues.append(ConfigIssue(f"{KEY}.lora_dropout", dropout, "must be in [0, 1)", "e.g. lora_dropout: 0.05"))
    target = pet.get("target_modules")
    exclude = pet.get("exclude_layers") or []
    exclude = [exclude] if isinstance(exclude, str) else exclude
    if not isinstance(target, str) or not target:
        issues.append(ConfigIssue(f"{KEY}.target_modules", target, "must be a regex of MindFormers cell names",
                                  "e.g. target_modules: '.*wq|.*wk|.*wv|.*wo'"))
    for key, pattern in [("target_modules", target), *(("exclude_layers", p) for p in exclude)]:
        try:
            re.compile(pattern) if isinstance(pattern, str) else None
        except re.error as e:
            issues.append(ConfigIssue(f"{KEY}.{key}", pattern, f"is not a regular expression ({e})", "fix the regex"))
    if not all(isinstance(p, str) for p in exclude):
        issues.append(ConfigIssue(f"{KEY}.exclude_layers", exclude, "must be a list of regexes", "list strings"))
    if cfg.tp > 1:
        issues.append(ConfigIssue(f"{KEY}.pet_type", "lora", f"with parallel_config.model_parallel={cfg.tp} is not "
                                  "built (LoRA A/B of tensor-parallel linears are not sharded here)",
                                  "train LoRA with model_parallel: 1 (data / context / pipeline parallel and ZeRO "
                                  "work)"))
    if issues:
        return None, issues
    return LoraSettings(int(rank), float(alpha), float(dropout), target, tuple(exclude)), []
