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

The file is written under a temporary name and renamed into place, so a run killed while saving leaves the
previous checkpoint intact; a missing, truncated or foreign file is one clear error. `msparallel-ds
convert-checkpoint SRC DST --to-config NEW.yaml` (msparallel_ds.convert) pre-slices a checkpoint for another
layout offline: DST holds one file per (pp, tp) coordinate and engine.load reads only its own.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["load_checkpoint", "save_checkpoint", "tp_slice"]

FILE = "msp_universal.pt"
FORMAT = "msparallel_ds.universal/1"
SHARDED_INDEX = "msp_sharded.json"
SHARDED_FORMAT = "msparallel_ds.sharded/1"


def shard_file(pp_rank: int, tp_rank: int) -> str:
    return f"msp_shard_pp{pp_rank:03d}_tp{tp_rank:03d}.pt"


def atomic_save(obj: Any, path: str) -> None:
    """torch.save to a temporary name in the same folder, then rename: readers see the old file or the new one."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def read_checkpoint_file(path: str, expected_format: str) -> dict[str, Any]:
    """torch.load with one clear error for a missing, truncated or foreign file."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no msparallel_ds checkpoint at {path} (write one with engine.save(dir))")
    try:
        ck = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # a truncated zip, a pickle of something else, a text file...
        raise ValueError(f"{path} is not a readable msparallel_ds checkpoint ({type(e).__name__}: {e}); it may be "
                         "truncated or from another tool: load an earlier checkpoint or save again") from None
    if not isinstance(ck, dict) or ck.get("format") != expected_format:
        found = ck.get("format") if isinstance(ck, dict) else type(ck).__name__
        raise ValueError(f"{path}: unknown checkpoint format {found!r} (expected {expected_format})")
    return ck


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


def _link_optimizer_state(engine) -> None:
    """Point each parameter's ZeRO fragment at its slice of the flat Adam state. DeepSpeed (0.19.8) links them once,
    right after the FIRST param group's step, so with several groups (the Trainer's decay / no-decay split) the later
    groups stay linked to nothing; link again now that all the state exists."""
    ds_opt = engine.ds.optimizer
    if hasattr(ds_opt, "_hp_optimizer_states_linked"):
        ds_opt._hp_optimizer_states_linked = False
        ds_opt._lazy_init_hp_params_optimizer_state()


def tp_slice(t: Tensor, p, layout) -> Tensor:
    """This tp rank's slice of the full tensor `t` for parameter `p`, shape-checked."""
    if getattr(p, "tensor_model_parallel", False) and layout.size("tp") > 1:
        t = t.chunk(layout.size("tp"), p.partition_dim)[layout.rank("tp")]
    return _check_shape(t, p)



def _check_shape(t: Tensor, p) -> Tensor:
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
    if stage > 0 and opt.state:
        _link_optimizer_state(engine)
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
        config = getattr(engine.model, "config", None)
        atomic_save({"format": FORMAT, "params": params, "optimizer_step": float(max(steps)) if steps else 0.0,
                     "global_steps": engine.global_steps,
                     "lr_scheduler": sched.state_dict() if sched is not None else None,
                     "model_config": config.to_dict() if hasattr(config, "to_dict") else None},
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


def check_names(names, saved, source: str, *, subset: bool = False) -> None:
    """The model's parameter names must all be in the checkpoint and, unless this rank holds a `subset` of the model
    (one pipeline stage), the checkpoint must hold no others."""
    names, saved = set(names), set(saved)
    missing, unexpected = sorted(names - saved), [] if subset else sorted(saved - names)
    if missing or unexpected:
        raise ValueError(f"{source} does not match this model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def _read_for_layout(load_dir: str, layout) -> tuple[dict[str, Any], bool]:
    """The checkpoint's content for this rank and whether its tensors are already sliced for this layout (a folder
    written by convert-checkpoint) or full size (engine.save)."""
    index = os.path.join(load_dir, SHARDED_INDEX)
    if not os.path.exists(index):
        return read_checkpoint_file(os.path.join(load_dir, FILE), FORMAT), False
    with open(index) as f:
        meta = json.load(f)
    want = {"pp": layout.size("pp"), "tp": layout.size("tp")}
    if meta.get("format") != SHARDED_FORMAT or meta.get("mesh", {}) != want:
        raise ValueError(f"{load_dir} was converted for pipeline_stage={meta.get('mesh', {}).get('pp')}, "
                         f"model_parallel={meta.get('mesh', {}).get('tp')} ({meta.get('config')}); this run has "
                         f"pipeline_stage={want['pp']}, model_parallel={want['tp']}: convert the original checkpoint "
                         "again with msparallel-ds convert-checkpoint SRC DST --to-config THIS.yaml, or load the "
                         "original (layout-independent) one")
    return read_checkpoint_file(os.path.join(load_dir, shard_file(layout.rank("pp"), layout.rank("tp"))),
                                SHARDED_FORMAT), True


def _fit(t: Tensor, p, layout, sliced: bool) -> Tensor:
    return _check_shape(t, p) if sliced else tp_slice(t, p, layout)


def load_checkpoint(engine, load_dir: str) -> dict[str, Any]:
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    layout = engine.layout
    ck, sliced = _read_for_layout(load_dir, layout)
    stage = _check_stage(engine)
    opt = _inner_optimizer(engine)
    keys = _optimizer_keys(opt)
    check_names((n for n, _ in engine.model.named_parameters()), ck["params"], load_dir)
    _ensure_adam_state(opt, keys, ck["optimizer_step"])
    if stage > 0:  # DeepSpeed would link each parameter to its slice of the flat Adam state at the first step; now
        _link_optimizer_state(engine)
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            rec = {k: _fit(v, p, layout, sliced) for k, v in ck["params"][name].items()}
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
