"""Layout-independent training checkpoints: save under one layout, resume under any other (or one process).

    engine.save("ckpt/")      # every rank calls; global rank 0 writes ckpt/msp_universal.pt
    engine.load("ckpt/")      # in a new run, after msp.initialize, under the same or another YAML

What is stored, per parameter under its HF name: the fp32 master weight and the Adam moments (exp_avg,
exp_avg_sq), FULL size: ZeRO partitions are gathered over dp x cp with DeepSpeed's own accessors
(deepspeed.utils.safe_get_full_fp32_param / safe_get_full_optimizer_state) and tensor-parallel shards over tp
along their partition_dim. Plus the optimizer step, the engine's step count and the lr scheduler state. Loading
slices the same tensors for the new layout's tp rank and hands them to DeepSpeed's setters, so the continued run
takes exactly the steps the uninterrupted one would have. Rank 0 holds the full state while saving; meant for
models that fit in one host's memory (resharding a 70B run would stream per parameter instead).
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["load_checkpoint", "save_checkpoint"]

FILE = "msp_universal.pt"
FORMAT = "msparallel_ds.universal/1"


def _optimizer_keys(opt) -> tuple[str, ...]:
    if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        raise ValueError(f"engine.save/load support Adam and AdamW (their moments are resharded); got "
                         f"{type(opt).__name__}")
    amsgrad = any(g.get("amsgrad") for g in opt.param_groups)
    return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())


def _inner_optimizer(engine):
    """The torch optimizer: over module parameters at ZeRO-0, over DeepSpeed's flat fp32 partitions at 1/2."""
    opt = engine.ds.optimizer
    return getattr(opt, "optimizer", opt) if engine.ds.zero_optimization_stage() > 0 else opt


def _check_stage(engine) -> int:
    stage = engine.ds.zero_optimization_stage()
    if stage > 2:
        raise ValueError("engine.save/load: ZeRO-3 (optimizer_level: level3) checkpoints are not supported yet; "
                         "use level1/level2, or engine.save_pretrained for the weights")
    return stage


def _tp_slice(t: Tensor, p, layout) -> Tensor:
    if getattr(p, "tensor_model_parallel", False) and layout.size("tp") > 1:
        t = t.chunk(layout.size("tp"), p.partition_dim)[layout.rank("tp")]
    if tuple(t.shape) != tuple(p.shape):
        raise ValueError(f"checkpoint tensor of shape {tuple(t.shape)} does not fit parameter of shape "
                         f"{tuple(p.shape)} under this layout (was it saved from another model?)")
    return t


def save_checkpoint(engine, save_dir: str) -> None:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from .weights import gather_tp_shard

    stage, layout = _check_stage(engine), engine.layout
    opt = _inner_optimizer(engine)
    keys = _optimizer_keys(opt)
    rank0 = layout.global_rank == 0
    params: dict[str, dict[str, Tensor]] = {}
    for name, p in engine.model.named_parameters():
        if stage == 0:
            state = opt.state.get(p, {})
            rec = {"fp32": p.detach().float(), **{k: state[k] for k in keys if k in state}}
        else:
            rec = {"fp32": safe_get_full_fp32_param(p)}
            for k in keys if opt.state else ():  # no Adam state before the first step
                value = safe_get_full_optimizer_state(p, k)
                if value is not None:
                    rec[k] = value
        rec = {k: gather_tp_shard(v, p, layout) for k, v in rec.items()}
        if rank0:
            params[name] = {k: v.detach().to("cpu", copy=True) for k, v in rec.items()}
    if rank0:
        steps = [s["step"] for s in opt.state.values() if "step" in s]
        sched = engine.lr_scheduler
        os.makedirs(save_dir, exist_ok=True)
        torch.save({"format": FORMAT, "params": params, "optimizer_step": float(max(steps)) if steps else 0.0,
                    "global_steps": engine.global_steps,
                    "lr_scheduler": sched.state_dict() if sched is not None else None},
                   os.path.join(save_dir, FILE))
    dist.barrier()


def _ensure_adam_state(opt, keys, step: float) -> None:
    """Adam creates its state at the first step; a resumed run needs it now, at the saved step."""
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state[p]
            for k in keys:
                state.setdefault(k, torch.zeros_like(p, memory_format=torch.preserve_format))
            state["step"] = torch.tensor(step, dtype=torch.float32) if not group.get("capturable") else \
                torch.tensor(step, dtype=torch.float32, device=p.device)


def load_checkpoint(engine, load_dir: str) -> dict[str, Any]:
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    path = os.path.join(load_dir, FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no msparallel_ds checkpoint at {path} (write one with engine.save(dir))")
    ck = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if ck.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown checkpoint format {ck.get('format')!r} (expected {FORMAT})")
    stage, layout = _check_stage(engine), engine.layout
    opt = _inner_optimizer(engine)
    keys = _optimizer_keys(opt)
    names = [n for n, _ in engine.model.named_parameters()]
    missing, unexpected = sorted(set(names) - set(ck["params"])), sorted(set(ck["params"]) - set(names))
    if missing or unexpected:
        raise ValueError(f"{path} does not match this model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    _ensure_adam_state(opt, keys, ck["optimizer_step"])
    if stage > 0:  # DeepSpeed links each parameter to its slice of the flat Adam state after the first step; now
        engine.ds.optimizer._lazy_init_hp_params_optimizer_state()
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            rec = {k: _tp_slice(v, p, layout) for k, v in ck["params"][name].items()}
            p.copy_(rec["fp32"].to(p.dtype))  # the module weight (ZeRO 1/2 keep it whole on every dp rank)
            if stage == 0:
                for k in keys:
                    if k in rec:
                        opt.state[p][k].copy_(rec[k])
            else:
                safe_set_full_fp32_param(p, rec["fp32"].to(p.device))
                for k in keys:
                    if k in rec:
                        safe_set_full_optimizer_state(p, rec[k].to(p.device), k)
    if ck["lr_scheduler"] is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(ck["lr_scheduler"])
    engine.global_steps = ck["global_steps"]
    dist.barrier()
    return {"global_steps": ck["global_steps"], "optimizer_step": ck["optimizer_step"]}
