"""MindFormers' learning-rate schedules (core/lr/lr_schedule.py, 1.3.2 and 2.1.0) as plain functions of the step.

`schedule_fn(section, total_steps)` -> f(step) -> lr, where step counts optimizer steps from 0 (MindSpore's
`global_step` before its increment: the first update uses f(0)). Every branch follows the MindSpore `construct`
line by line; tests/fixtures/mindspore_optim holds MindSpore's own values. Where MindFormers would raise (a missing
total_steps, lr_end >= learning_rate) the error names the YAML key and the fix.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

__all__ = ["LR_TYPES", "schedule_fn", "needs_total_steps"]

# MindFormers' registry names and the aliases build_lr.py registers
_ALIASES = {"constant_with_warmup": "ConstantWarmUpLR", "linear": "LinearWithWarmUpLR", "cosine": "CosineWithWarmUpLR",
            "cosine_with_restarts": "CosineWithRestartsAndWarmUpLR", "polynomial": "PolynomialWithWarmUpLR",
            "cosine_annealing": "CosineAnnealingLR", "cosine_annealing_warm_restarts": "CosineAnnealingWarmRestarts"}
_NOT_BUILT = {"MegatronLR": "a research class loaded through `auto_register` (yizhao_scheduler.MegatronLR), outside "
                            "MindFormers' core; its YAML comment names CosineWithWarmUpLR, which is built"}


def _get(section, key, default=None):
    value = getattr(section, key, None)
    return default if value is None else value


def _steps(section, name: str, steps: Optional[int], ratio: Optional[float], total: Optional[int], kind: str) -> int:
    """_get_lr_steps: a ratio (when set) wins over the step count and needs total_steps."""
    if ratio is None:
        return int(steps or 0)
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"lr_schedule.{name}_ratio={ratio}: must be in [0, 1] (MindFormers' rule); fix the ratio")
    _need_total(total, kind, f"{name}_ratio")
    return int(total * ratio)


def _need_total(total: Optional[int], kind: str, why: str) -> None:
    if total is None:
        raise ValueError(
            f"lr_schedule.total_steps is -1 / unset and {kind} needs it ({why}); MindFormers fills it from epochs x "
            "the dataset's steps. Pass the run's step count: msp.initialize(model, cfg, total_steps=N) or "
            "msp.build_lr_scheduler(optimizer, cfg, total_steps=N), or set lr_schedule.total_steps in the YAML")


def _warmup(step: float, warmup: float, lr: float, init: float) -> Optional[float]:
    if warmup != 0 and warmup > step:
        return init + (lr - init) * (step / warmup)
    return None


def _lr(section, kind: str) -> float:
    lr = getattr(section, "learning_rate", None)
    if lr is None:
        raise ValueError(f"lr_schedule.type={kind} has no lr_schedule.learning_rate; set it (the peak learning rate)")
    return float(lr)


def _constant(s, total):
    lr, init = _lr(s, "ConstantWarmUpLR"), _get(s, "warmup_lr_init", 0.0)
    w = _steps(s, "warmup", s.warmup_steps, s.warmup_ratio, total, "ConstantWarmUpLR")
    return lambda t: _or(_warmup(t, w, lr, init), lr)


def _linear(s, total):
    kind = "LinearWithWarmUpLR"
    _need_total(total, kind, "the linear decay ends at total_steps")
    lr, init = _lr(s, kind), _get(s, "warmup_lr_init", 0.0)
    w = _steps(s, "warmup", s.warmup_steps, s.warmup_ratio, total, kind)
    linear = max(1, total - w)
    return lambda t: _or(_warmup(t, w, lr, init), lr * max(0.0, (total - t) / linear))


def _cosine(s, total):
    kind = "CosineWithWarmUpLR"
    _need_total(total, kind, "the cosine spans total_steps - warmup")
    lr, init, end = _lr(s, kind), _get(s, "warmup_lr_init", 0.0), _get(s, "lr_end", 0.0)
    cycles = _get(s, "num_cycles", 0.5)
    w = _steps(s, "warmup", s.warmup_steps, s.warmup_ratio, total, kind)
    cosine = max(1, total - w)
    decay = max(1, s.decay_steps) if s.decay_steps is not None else max(1, total)
    decay = _steps(s, "decay", decay, s.decay_ratio, total, kind)

    def f(t):
        if t >= decay:
            return end
        up = _warmup(t, w, lr, init)
        if up is not None:
            return up
        pct = max(0.0, 0.5 * (1.0 + math.cos(math.pi * cycles * 2.0 * ((t - w) / cosine))))
        return end + (lr - end) * pct
    return f


def _restarts(s, total):
    kind = "CosineWithRestartsAndWarmUpLR"
    _need_total(total, kind, "the cosine spans total_steps - warmup")
    lr, init, end = _lr(s, kind), _get(s, "warmup_lr_init", 0.0), _get(s, "lr_end", 0.0)
    cycles = _get(s, "num_cycles", 1.0)
    w = _steps(s, "warmup", s.warmup_steps, s.warmup_ratio, total, kind)
    cosine = max(1, total - w)
    decay = max(1, s.decay_steps) if s.decay_steps is not None else max(1, total)

    def f(t):
        if t >= decay:
            return end
        up = _warmup(t, w, lr, init)
        if up is not None:
            return up
        progress = (t - w) / cosine
        if progress >= 1.0:
            return 0.0
        return end + (lr - end) * max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((cycles * progress) % 1.0))))
    return f


def _polynomial(s, total):
    kind = "PolynomialWithWarmUpLR"
    _need_total(total, kind, "the decay ends at total_steps")
    lr, init, end = _lr(s, kind), _get(s, "warmup_lr_init", 0.0), _get(s, "lr_end", 1e-7)
    power = _get(s, "power", 1.0)
    w = _steps(s, "warmup", s.warmup_steps, s.warmup_ratio, total, kind)
    decay = max(1, s.decay_steps) if s.decay_steps is not None else max(1, total - w)
    if not lr > end:
        raise ValueError(f"lr_schedule.lr_end={end} must be smaller than lr_schedule.learning_rate={lr} "
                         "(PolynomialWithWarmUpLR's rule); lower lr_end")

    def f(t):
        up = _warmup(t, w, lr, init)
        if up is not None:
            return up
        if t > total:
            return end
        remaining = 1 - (t - w) / decay
        if remaining < 0 and not float(power).is_integer():
            return math.nan  # MindSpore's float pow of a negative base (decay_steps < total - warmup)
        return (lr - end) * remaining ** power + end
    return f


def _wsd(s, total):
    kind = "WarmUpStableDecayLR"
    _need_total(total, kind, "the decay ends at total_steps")
    lr, init, end = _lr(s, kind), _get(s, "warmup_lr_init", 0.0), _get(s, "lr_end", 1e-7)
    w = _steps(s, "warmup", s.warmup_steps, s.warmup_ratio, total, kind)
    start = _steps(s, "decay_start", s.decay_start_steps, s.decay_start_ratio, total, kind)
    if not lr > end:
        raise ValueError(f"lr_schedule.lr_end={end} must be smaller than lr_schedule.learning_rate={lr} "
                         "(WarmUpStableDecayLR's rule); lower lr_end")
    decay = total - start

    def f(t):
        up = _warmup(t, w, lr, init)
        if up is not None:
            return up
        if start > t:
            return lr  # MindFormers writes lr * step / step here: NaN at step 0 without warmup (we keep lr)
        return lr - (lr - end) * ((t - start) / decay)
    return f


def _cooldown(s, total):
    kind = "ConstantWithCoolDownLR"
    lr, init = _lr(s, kind), _get(s, "warmup_lr_init", 0.0)
    end1 = _get(s, "lr_end1", 0.0)
    end2 = s.lr_end2 or end1
    cycles = _get(s, "num_cycles", 0.5)
    w = _steps(s, "warmup", s.warmup_steps, s.warmup_ratio, total, kind)
    if s.decay_steps is None:
        _need_total(total, kind, "decay_steps is unset")
    decay = max(1, s.decay_steps) if s.decay_steps is not None else max(1, total)
    decay = _steps(s, "decay", decay, s.decay_ratio, total, kind)
    keep, final = _get(s, "keep_steps", 0), _get(s, "final_steps", 0)

    def f(t):
        up = _warmup(t, w, lr, init)
        if up is not None:
            return up
        if w + keep > t:
            return lr
        if w + keep + decay > t:
            pct = max(0.0, 0.5 * (1.0 + math.cos(math.pi * cycles * 2.0 * ((t - keep - w) / decay))))
            return end1 + (lr - end1) * pct
        return end1 if w + keep + decay + final > t else end2
    return f


def _annealing(s, total):
    base = s.base_lr if s.base_lr is not None else _lr(s, "CosineAnnealingLR")
    if s.t_max is None:
        raise ValueError("lr_schedule.type=CosineAnnealingLR needs lr_schedule.t_max (a positive step count)")
    eta = _get(s, "eta_min", 0.0)
    return lambda t: eta + (base - eta) * max(0.0, 0.5 * (1.0 + math.cos(math.pi * t / s.t_max)))


def _warm_restarts(s, total):
    base = s.base_lr if s.base_lr is not None else _lr(s, "CosineAnnealingWarmRestarts")
    if s.t_0 is None:
        raise ValueError("lr_schedule.type=CosineAnnealingWarmRestarts needs lr_schedule.t_0 (a positive step count)")
    t0, mult, eta = s.t_0, _get(s, "t_mult", 1), _get(s, "eta_min", 0.0)

    def f(t):
        if t < t0:
            cur, span = t, t0
        elif mult == 1:
            cur, span = t - (t // t0) * t0, t0
        else:
            n = math.floor(math.log(t / t0 * (mult - 1.0) + 1.0) / math.log(mult))
            q = mult ** n
            cur, span = t - t0 * (1.0 - q) / (1.0 - mult), t0 * q
        return eta + (base - eta) * max(0.0, 0.5 * (1.0 + math.cos(math.pi * cur / span)))
    return f


_BUILDERS: dict[str, Callable[[Any, Optional[int]], Callable[[int], float]]] = {
    "ConstantWarmUpLR": _constant, "LinearWithWarmUpLR": _linear, "CosineWithWarmUpLR": _cosine,
    "CosineWithRestartsAndWarmUpLR": _restarts, "PolynomialWithWarmUpLR": _polynomial,
    "WarmUpStableDecayLR": _wsd, "ConstantWithCoolDownLR": _cooldown, "CosineAnnealingLR": _annealing,
    "CosineAnnealingWarmRestarts": _warm_restarts}
LR_TYPES = tuple(_BUILDERS) + tuple(_ALIASES)


def _or(value: Optional[float], default: float) -> float:
    return default if value is None else value


def canonical(kind: str) -> str:
    name = _ALIASES.get(kind, kind)
    if name in _NOT_BUILT:
        raise ValueError(f"lr_schedule.type={kind!r} is {_NOT_BUILT[name]}; it is not built here. Use one of "
                         f"{', '.join(_BUILDERS)}")
    if name not in _BUILDERS:
        raise ValueError(f"lr_schedule.type={kind!r} is not a MindFormers schedule built here; use one of "
                         f"{', '.join(LR_TYPES)}")
    return name


def resolved_total(section, total_steps: Optional[int]) -> Optional[int]:
    """The YAML's total_steps when positive (MindFormers keeps it), else the caller's; None when neither has one."""
    yaml_total = getattr(section, "total_steps", None)
    if yaml_total is not None and yaml_total >= 0:
        return int(yaml_total)
    if total_steps is not None:
        if int(total_steps) < 1:
            raise ValueError(f"total_steps={total_steps}: the run's optimizer step count must be >= 1")
        return int(total_steps)
    return None


def needs_total_steps(section) -> bool:
    try:
        schedule_fn(section, None)
    except ValueError as exc:
        return "lr_schedule.total_steps" in str(exc)
    return False


def schedule_fn(section, total_steps: Optional[int] = None) -> Callable[[int], float]:
    """section: the config's LrSchedule (or GroupedLr); total_steps: the caller's count for total_steps -1/None."""
    return _BUILDERS[canonical(section.type)](section, resolved_total(section, total_steps))
