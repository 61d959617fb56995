"""Full state dicts and layout-independent checkpoints of a pipeline engine (msparallel_ds.checkpoint's format).

Each stage's records (weights, and for checkpoints the Adam moments) are gathered over tp (gather_tp_shard) and,
with ZeRO-1, broadcast over dp x cp from the rank that owns the optimizer state; then the ranks on global rank 0's
pipeline path (dp = cp = tp coordinate 0) send their stage's records to rank 0 over the pp group. The file is the
one engine.Engine writes (same keys, HF names), so a pp run resumes under dp/tp/cp or one process and back.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..checkpoint import (
    FILE,
    FORMAT,
    _ensure_adam_state,
    _fit,
    _optimizer_keys,
    _read_for_layout,
    atomic_save,
    check_names,
)

__all__ = ["gather_pipeline_state_dict", "load_pipeline_checkpoint", "save_pipeline_checkpoint"]


def _merge_over_pp(local: Optional[dict], layout, rank0_only: bool) -> Optional[dict]:
    group = layout.group("pp")
    if rank0_only:
        if not (layout.rank("dp_cp") == 0 and layout.rank("tp") == 0):
            return None
        parts = [None] * layout.size("pp") if layout.global_rank == 0 else None
        dist.gather_object(local, parts, dst=0, group=group)
    else:
        parts = [None] * layout.size("pp")
        dist.all_gather_object(parts, local, group=group)
    if parts is None:
        return None
    out: dict = {}
    for part in parts:
        out.update(part)
    return out


def gather_pipeline_state_dict(view, layout, *, rank0_only: bool = True) -> Optional[dict[str, Tensor]]:
    """HF-keyed full state dict from every rank's stage view; None off global rank 0 when rank0_only."""
    from ..weights import _gather_tp

    on_path = layout.rank("dp_cp") == 0
    if rank0_only and not on_path:
        return None
    local = _gather_tp(view, layout, keep=True)
    return _merge_over_pp(local, layout, rank0_only)


def _zero(opt):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return opt if isinstance(opt, ZeroRedundancyOptimizer) else None


def _base(opt):
    z = _zero(opt)
    return z.optim if z is not None else opt


def _has_state(engine) -> bool:
    flag = torch.tensor(float(bool(_base(engine.optimizer).state)), device=engine.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def save_pipeline_checkpoint(engine, save_dir: str) -> None:
    from ..weights import gather_tp_shard

    layout, opt = engine.layout, engine.optimizer
    base, zero = _base(opt), _zero(opt)
    keys = _optimizer_keys(base)
    stateful = _has_state(engine)
    dp_cp = layout.ranks("dp_cp")
    records: dict[str, dict[str, Tensor]] = {}
    steps = []
    for name, p in engine.model.named_parameters():
        rec = {"fp32": p.detach().float()}
        if stateful:
            state = base.state.get(p, {})
            for k in keys:
                t = state[k].detach().clone() if k in state else torch.zeros_like(p)
                if zero is not None:  # the owner broadcasts its shard's state over dp x cp
                    dist.broadcast(t, src=dp_cp[zero._param_to_rank[p]], group=layout.group("dp_cp"))
                rec[k] = t
            if "step" in state:
                steps.append(float(state["step"]))
        rec = {k: gather_tp_shard(v, p, layout) for k, v in rec.items()}
        records[name] = {k: v.detach().to("cpu", copy=True) for k, v in rec.items()}
    step = torch.tensor(max(steps) if steps else 0.0, device=engine.device)
    dist.all_reduce(step, op=dist.ReduceOp.MAX)
    full = _merge_over_pp(records if layout.rank("dp_cp") == 0 else None, layout, rank0_only=True)
    if layout.global_rank == 0:
        sched = engine.lr_scheduler
        config = getattr(engine._hf, "config", None)
        record = {"format": FORMAT, "params": full, "optimizer_step": float(step.item()),
                  "global_steps": engine.global_steps,
                  "lr_scheduler": sched.state_dict() if sched is not None else None,
                  "model_config": config.to_dict() if hasattr(config, "to_dict") else None}
        atomic_save(record, os.path.join(save_dir, FILE))
    dist.barrier()


def load_pipeline_checkpoint(engine, load_dir: str) -> dict[str, Any]:
    layout, base = engine.layout, _base(engine.optimizer)
    ck, sliced = _read_for_layout(load_dir, layout)  # engine.save's file, or convert-checkpoint's per-(pp, tp) one
    keys = _optimizer_keys(base)
    check_names((n for n, _ in engine.model.named_parameters()), ck["params"], load_dir, subset=True)
    _ensure_adam_state(base, keys, ck["optimizer_step"])
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            rec = {k: _fit(v, p, layout, sliced) for k, v in ck["params"][name].items()}
            p.copy_(rec["fp32"].to(p.dtype))
            if p in base.state:  # ZeRO-1: only this rank's shard of the optimizer state lives here
                for k in keys:
                    if k in rec:
                        base.state[p][k].copy_(rec[k])
    if ck["lr_scheduler"] is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(ck["lr_scheduler"])
    engine.global_steps = ck["global_steps"]
    dist.barrier()
    return {"global_steps": ck["global_steps"], "optimizer_step": ck["optimizer_step"]}
