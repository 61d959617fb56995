"""Plan -> `transformers.TrainingArguments` keyword arguments (a pure dict producer: no transformers import).

MindFormers YAML -> TrainingArguments:
- runner_config.batch_size x micro_batch_interleave_num -> per_device_train_batch_size (one dp replica's micro
  batch); runner_config.gradient_accumulation_steps (micro_batch_num when pipeline_stage > 1) ->
  gradient_accumulation_steps; runner_config.epochs -> num_train_epochs.
- optimizer (AdamW family): learning_rate (or lr_schedule.learning_rate), betas, eps, weight_decay ->
  optim="adamw_torch", learning_rate, adam_beta1, adam_beta2, adam_epsilon, weight_decay.
- lr_schedule.type -> lr_scheduler_type: Cosine... -> cosine (cosine_with_min_lr when lr_end > 0),
  ...Restarts... -> cosine_with_restarts, Linear / WarmUpDecay -> linear, Polynomial -> polynomial (lr_end),
  Constant... -> constant_with_warmup; warmup_steps / warmup_ratio -> warmup_steps (a float < 1 is a ratio in
  transformers 5); total_steps (> 0) -> max_steps.
- runner_wrapper.use_clip_grad + max_grad_norm -> max_grad_norm (0.0: no clipping).
- model.model_config.compute_dtype bfloat16 / float16 -> bf16 / fp16, only with gpu=True (CPU runs fp32, and
  dataloader_pin_memory=False).
- the plan's DeepSpeed config (ZeRO stage over dp x cp, buckets) -> deepspeed, with the batch, accumulation,
  clipping and precision entries "auto" (TrainingArguments fill them from the fields above).

The learning rate schedule is the Trainer's (its own warmup and decay over max_steps), not DeepSpeed's.
Anything in `overrides` wins (e.g. lr_scheduler_type for a schedule with no Trainer equivalent, logging_steps).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .deepspeed import deepspeed_batch, to_deepspeed

if TYPE_CHECKING:
    from ..plan import Plan

__all__ = ["lr_scheduler_kwargs", "training_arguments_kwargs"]


def lr_scheduler_kwargs(plan: Plan) -> dict[str, Any]:
    """lr_scheduler_type (+ lr_scheduler_kwargs), warmup_steps and max_steps for the YAML's lr_schedule. No
    lr_schedule: a constant learning rate, as in MindFormers and msp.initialize (not the Trainer's linear decay)."""
    s = plan.lr_schedule
    if not s:
        return {"lr_scheduler_type": "constant"}
    kind = s["type"].lower()
    lr_end = s.get("lr_end") or 0.0
    out: dict[str, Any] = {}
    if "restart" in kind:
        out["lr_scheduler_type"] = "cosine_with_restarts"
    elif "cosine" in kind:
        out["lr_scheduler_type"] = "cosine_with_min_lr" if lr_end > 0 else "cosine"
        if lr_end > 0:
            out["lr_scheduler_kwargs"] = {"min_lr": lr_end}
    elif "polynomial" in kind:
        out["lr_scheduler_type"] = "polynomial"
        if lr_end > 0:
            out["lr_scheduler_kwargs"] = {"lr_end": lr_end}
    elif "linear" in kind or "decay" in kind:
        out["lr_scheduler_type"] = "linear"
    elif "constant" in kind:
        out["lr_scheduler_type"] = "constant_with_warmup"
    else:
        raise ValueError(f"lr_schedule.type={s['type']!r} has no transformers scheduler equivalent here; pass "
                         "lr_scheduler_type=... (e.g. 'cosine_with_min_lr') explicitly")
    if s.get("warmup_steps"):
        out["warmup_steps"] = s["warmup_steps"]
    elif s.get("warmup_ratio"):
        out["warmup_steps"] = float(s["warmup_ratio"])  # transformers 5: a float below 1 is a ratio of the steps
    if s.get("total_steps"):
        out["max_steps"] = s["total_steps"]
    return out


def _deepspeed(plan: Plan, gpu: bool) -> dict[str, Any]:
    ds = to_deepspeed(plan, include_optimizer=False)  # the Trainer's torch optimizer and scheduler
    ds.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto", gradient_clipping="auto")
    for key in ("bf16", "fp16"):
        if key in ds:
            if gpu:
                ds[key]["enabled"] = "auto"
            else:
                del ds[key]
    return ds


def training_arguments_kwargs(plan: Plan, output_dir: str, *, gpu: bool = False, deepspeed: bool = True,
                              **overrides: Any) -> dict[str, Any]:
    """TrainingArguments(**training_arguments_kwargs(plan, "out")) runs the YAML's batch, accumulation, optimizer,
    schedule, clipping and precision. `gpu`: whether half precision may be enabled. `deepspeed=False` leaves the
    DeepSpeed config out (MindFormersTrainer builds its own from the YAML either way)."""
    micro, gas = deepspeed_batch(plan)
    kw: dict[str, Any] = {"output_dir": output_dir, "per_device_train_batch_size": micro,
                          "gradient_accumulation_steps": gas, "max_grad_norm": plan.gradient_clipping or 0.0}
    epochs = plan.config.runner_config.epochs
    if epochs:
        kw["num_train_epochs"] = epochs
    opt = plan.optimizer
    if opt:
        p = opt["params"]
        if opt.get("runs_as") == "torch.optim.AdamW":  # other types: MindFormersTrainer builds msp.build_optimizer
            kw["optim"] = "adamw_torch"
        if p.get("lr") is not None:
            kw["learning_rate"] = p["lr"]
        if p.get("betas"):
            kw["adam_beta1"], kw["adam_beta2"] = p["betas"]
        if p.get("eps") is not None:
            kw["adam_epsilon"] = p["eps"]
        if p.get("weight_decay") is not None:
            kw["weight_decay"] = p["weight_decay"]
    if "lr_scheduler_type" not in overrides:
        kw.update(lr_scheduler_kwargs(plan))
    if gpu and plan.compute_dtype in ("bf16", "fp16"):
        kw[plan.compute_dtype] = True
    if not gpu:
        kw["dataloader_pin_memory"] = False  # nothing to pin without an accelerator (torch warns)
    if deepspeed:
        kw["deepspeed"] = _deepspeed(plan, gpu)
    kw.update(overrides)
    return kw
