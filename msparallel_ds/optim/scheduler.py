"""msp.build_lr_scheduler: the YAML's `lr_schedule:` (and 2.x `grouped_lr_schedule:`) as a torch LRScheduler.

Each optimizer step k (from 0) runs at MindFormers' lr(k), the absolute value (not a factor of a base lr). The lr of
a group is looked up from the group's `lr_schedule_group` key at every step, so optimizer wrappers that re-split the
groups (DeepSpeed's MoE groups, ZeRO) keep each parameter on its schedule. DeepSpeed and the pipeline engine take the
object as a client lr_scheduler and step it once per optimizer step.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from torch.optim.lr_scheduler import LRScheduler

from .groups import SCHEDULE_KEY
from .lr import schedule_fn

__all__ = ["MindFormersLR", "build_lr_scheduler", "check_optim"]


class MindFormersLR(LRScheduler):
    def __init__(self, optimizer, default: Callable[[int], float], grouped: tuple = (), last_epoch: int = -1):
        self._default, self._grouped = default, tuple(grouped)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, group_index: Optional[int] = None) -> float:
        return (self._default if group_index is None else self._grouped[group_index])(step)

    def get_lr(self) -> list[float]:
        return [self.lr_at(self.last_epoch, g.get(SCHEDULE_KEY)) for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:  # the functions come from the YAML again (torch.load weights_only)
        return {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "_default", "_grouped")}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume: the step count, and the groups' lr set for it (the next update runs at lr(last_epoch))."""
        self.__dict__.update({k: v for k, v in state_dict.items() if k not in ("_default", "_grouped")})
        values = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, values):
            group["lr"] = lr
        self._last_lr = values


def _config(cfg):
    from ..config import ParallelConfig, load_config

    return cfg if isinstance(cfg, ParallelConfig) else load_config(cfg)


def build_lr_scheduler(optimizer, cfg, total_steps: Optional[int] = None) -> Optional[MindFormersLR]:
    """The YAML's lr schedule on `optimizer` (from msp.build_optimizer or any torch optimizer; groups without a
    `lr_schedule_group` key follow the default schedule). total_steps: the run's optimizer step count, used where the
    YAML writes total_steps: -1 (or none) as MindFormers fills it from epochs x dataset size. None when the YAML has
    neither `lr_schedule:` nor `grouped_lr_schedule:` (the optimizer keeps optimizer.learning_rate)."""
    cfg = _config(cfg)
    grouped_cfg = cfg.grouped_lr_schedule
    section = grouped_cfg.default if grouped_cfg is not None else cfg.lr_schedule
    if section is None:
        return None
    default = schedule_fn(section, total_steps)
    grouped = tuple(schedule_fn(g, total_steps) for g in grouped_cfg.grouped) if grouped_cfg is not None else ()
    return MindFormersLR(optimizer, default, grouped)


def check_optim(cfg, optimizer, lr_scheduler, total_steps: Optional[int]) -> None:
    """What msp.initialize will build from the YAML, checked before the model exists (one clear error early)."""
    from .build import optimizer_spec

    if optimizer is None:
        optimizer_spec(cfg)
    if lr_scheduler is None:
        for section in ([cfg.grouped_lr_schedule.default, *cfg.grouped_lr_schedule.grouped]
                        if cfg.grouped_lr_schedule is not None else [cfg.lr_schedule]):
            if section is not None:
                schedule_fn(section, total_steps)
