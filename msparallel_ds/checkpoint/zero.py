"""engine.save / engine.load for engine.Engine (DeepSpeed ZeRO 0-2) in checkpoint.format's layout-independent file.

ZeRO partitions are gathered over dp x cp with DeepSpeed's own accessors (deepspeed.utils.safe_get_full_fp32_param /
safe_get_full_optimizer_state; the sharded save stages them locally and rebuilds them in its writer thread,
checkpoint.zero_stage) and tp parts over tp by engine.spec; loading cuts this rank's part with the same spec
and hands it to DeepSpeed's setters, which re-partition it for the new ZeRO group. `engine` is anything with ds,
layout, model, spec, lr_scheduler and global_steps (the HF Trainer passes such a view).
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch
from torch import Tensor

from .format import (FILE, agreed, check_model_config, check_names, read_for_layout, record_for, resume_progress,
                     verify_checksums, write_agreed)
from .optim_state import ensure_state, optimizer_keys, owners, state_view
from .reshard import fit, gather

__all__ = ["load_checkpoint", "save_checkpoint", "validated_parts"]


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


def _frozen(p, stage: int) -> Tensor:
    import deepspeed

    with deepspeed.zero.GatheredParameters([p], enabled=stage == 3):
        return p.detach().float().clone()


def _set_frozen(p, value: Tensor, stage: int) -> None:
    import deepspeed

    with deepspeed.zero.GatheredParameters([p], modifier_rank=0, enabled=stage == 3):
        p.copy_(value.to(p.dtype))


def _sharded_records(engine, stage, opt, keys, group):
    """(records, rebuild): (name, Shard, {key: tp-local tensor}) of the chunks this rank writes that need no
    collective (checkpoint.sharded.writes; under Muon's whole-parameter ZeRO (stage 0) the owner of a parameter's
    state writes it), and at ZeRO 1/2 the trainable parameters' records as a checkpoint.zero_stage.Rebuild: a
    local snapshot of this rank's flat-partition fragments now, rebuilt over a gloo clone of the dp group in the
    save's writer thread, so an async save returns after the local copy."""
    from .sharded import writes
    from .zero_stage import snapshot

    owner_of = owners(_inner_optimizer(engine)) if stage == 0 else {}
    records, deferred = [], []
    for i, (name, p) in enumerate(engine.model.named_parameters()):
        owner = owner_of.get(p, (None, None))[1]
        shard, mine = engine.spec.get(name), writes(engine.layout, engine.spec.get(name), i, owner)
        if stage > 0 and p.requires_grad:
            deferred.append((i, name, p, shard, mine))
        elif mine:
            records.append((name, shard, _param_record(p, stage, opt, keys)))
    return records, (snapshot(engine, deferred, keys if opt.state else (), group) if deferred else None)


def _param_record(p, stage: int, opt, keys) -> dict[str, Tensor]:
    """One parameter's tp-local fp32 weight and optimizer moments (ZeRO > 0: rebuilt over dp, a collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if not p.requires_grad:  # frozen (pet_config LoRA): no optimizer copy; the module weight is the value
        return {"fp32": _frozen(p, stage)}
    if stage == 0:  # `opt`: {parameter: state} (state_view: whole-parameter ZeRO keeps it on the owner only)
        state = opt.get(p, {})
        return {"fp32": p.detach().float(), **{k: state[k] for k in keys if k in state}}
    rec = {"fp32": safe_get_full_fp32_param(p)}
    for k in keys if opt.state else ():  # no Adam state before the first step
        value = safe_get_full_optimizer_state(p, k)
        if value is not None:
            rec[k] = value
    return rec


def _optimizer_step(engine, stage: int, opt) -> float:
    steps = [float(s["step"]) for s in (opt if stage == 0 else opt.state).values() if "step" in s]
    step = torch.tensor(max(steps) if steps else 0.0, device=engine.ds.device)
    if stage == 0 and owners(_inner_optimizer(engine)):  # whole-parameter ZeRO: a rank may own no AdamW parameter
        import torch.distributed as dist

        dist.all_reduce(step, op=dist.ReduceOp.MAX)
    return float(step.item())


def _optimizer(engine, stage: int):
    """(the optimizer, or at stage 0 this rank's {parameter: state}, and the saved keys)."""
    opt = _inner_optimizer(engine)
    if stage == 0:
        return state_view(opt)
    return opt, optimizer_keys(opt)


def _from_owner(engine, p, rec: dict, keys, owner) -> dict:
    """Whole-parameter ZeRO (single-file save): the owner broadcasts which state tensors it holds, then them."""
    import torch.distributed as dist

    layout, (group, rank) = engine.layout, owner
    src, g = layout.ranks(group)[rank], layout.group(group)
    have = torch.tensor([float(k in rec) for k in keys], device=engine.ds.device)
    dist.broadcast(have, src=src, group=g)
    out = {"fp32": rec["fp32"]}
    for k, flag in zip(keys, have.tolist()):
        if flag:
            t = rec[k].detach().clone() if k in rec else torch.empty_like(rec["fp32"], dtype=torch.float32)
            dist.broadcast(t, src=src, group=g)
            out[k] = t
    return out


def save_checkpoint(engine, save_dir: str, *, sharded: bool = True, async_save: bool = False,
                    replicas: int = 0) -> None:
    """Every rank calls; every rank writes its chunks (checkpoint.sharded), or (sharded=False) global rank 0 writes
    save_dir/FILE."""
    stage, layout, spec = _check_stage(engine), engine.layout, engine.spec
    if sharded or async_save or replicas:
        from .sharded import _group, save_sharded, wait_pending

        wait_pending()  # the snapshot's collectives run on the checkpoint group a save in flight may still use
        opt, keys = _optimizer(engine, stage)
        if stage > 0 and opt.state:
            _link_optimizer_state(engine)
        records, rebuild = _sharded_records(engine, stage, opt, keys, _group(layout))
        save_sharded(engine, save_dir, records, rebuild=rebuild, optimizer_step=_optimizer_step(engine, stage, opt),
                     model=engine.model, async_save=async_save, replicas=replicas)
        return
    opt, keys = _optimizer(engine, stage)
    owner_of = owners(_inner_optimizer(engine)) if stage == 0 else {}
    rank0 = layout.global_rank == 0
    if stage > 0 and opt.state:
        _link_optimizer_state(engine)
    params: dict[str, dict[str, Tensor]] = {}
    for name, p in engine.model.named_parameters():
        rec = _param_record(p, stage, opt, keys)
        if p in owner_of:
            rec = _from_owner(engine, p, rec, keys, owner_of[p])
        rec = {k: gather(v, spec.get(name), layout) for k, v in rec.items()}
        if rank0:
            params[name] = {k: v.detach().to("cpu", copy=True) for k, v in rec.items()}
    step = _optimizer_step(engine, stage, opt)
    record = record_for(engine, params, step, engine.model) if rank0 else None
    write_agreed(record, os.path.join(save_dir, FILE), engine.ds.device)  # every rank learns whether it was written


def validated_parts(ck: dict, view, hf_model, spec, layout, sliced: bool, source: str, *, subset: bool = False,
                    aliases: Optional[dict] = None):
    """This rank's part of every checkpoint tensor for `view`'s parameters, after checking EVERYTHING (names, the
    saved model config against `hf_model`'s, every shape under this layout, checksums) and before any tensor is
    touched: a failing load leaves the engine's weights and optimizer state as they were. `aliases`: a parameter
    name -> the checkpoint name it loads from (a pipeline's last-stage copy of the word embedding)."""
    aliases = aliases or {}
    named = list(view.named_parameters())
    check_names((aliases.get(n, n) for n, _ in named), ck["params"], source, subset=subset)
    check_model_config(ck.get("model_config"), hf_model, source)
    parts = {}
    for name, p in named:
        try:
            parts[name] = {k: fit(v, spec.get(name), layout, sliced, p.shape)
                           for k, v in ck["params"][aliases.get(name, name)].items()}
        except ValueError as e:
            raise ValueError(f"{source}: parameter {name}: {e}. Nothing was loaded") from None
    verify_checksums(ck, [aliases.get(n, n) for n in parts], source)
    return parts


def load_checkpoint(engine, load_dir: str) -> dict[str, Any]:
    """Resume from engine.save's file (any layout) or a convert-checkpoint folder for this layout; every rank
    calls. Returns the saved global_steps and optimizer_step."""
    from .folder import checkpoint_kind

    if agreed(lambda: checkpoint_kind(load_dir), f"engine.load({load_dir!r})") == "sharded":
        return _load_sharded(engine, load_dir)
    layout, what = engine.layout, f"engine.load({load_dir!r})"
    ck, sliced = agreed(lambda: read_for_layout(load_dir, layout), what)  # a bad folder: an error on every rank
    stage, spec = _check_stage(engine), engine.spec
    keys = _optimizer(engine, stage)[1]
    parts = agreed(lambda: validated_parts(ck, engine.model, engine.model, spec, layout, sliced, load_dir), what)
    ensure_state(_inner_optimizer(engine), keys, ck["optimizer_step"])
    opt = _optimizer(engine, stage)[0]  # at stage 0 the states just made
    if stage > 0:  # DeepSpeed would link each parameter to its slice of the flat Adam state at the first step; now
        _link_optimizer_state(engine)
    named = dict(engine.model.named_parameters())
    for name in named:
        _apply(engine, stage, opt, keys, named[name], parts[name])
    return resume_progress(engine, ck)


@torch.no_grad()
def _apply(engine, stage, opt, keys, p, rec) -> None:
    """Load one parameter's tp-local record into the module weight and the (ZeRO-partitioned) optimizer state."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    if not p.requires_grad:  # frozen (LoRA's base): only the module weight (ZeRO-3: gathered, set, partitioned again)
        _set_frozen(p, rec["fp32"], stage)
        return
    p.copy_(rec["fp32"].to(p.dtype))  # the module weight (ZeRO 1/2 keep it whole on every dp rank)
    if stage == 0:  # `opt`: {parameter: state}; whole-parameter ZeRO holds only the owner's, Muon a matrix's
        state = opt.get(p, {})  # momentum or another parameter's moments
        for k in keys:
            if k in rec and k in state:
                state[k].copy_(rec[k])
    else:
        safe_set_full_fp32_param(p, rec["fp32"].to(p.device))
        for k in keys:
            if k in rec:
                safe_set_full_optimizer_state(p, rec[k].to(p.device), k)


def _load_sharded(engine, load_dir: str) -> dict[str, Any]:
    """Resume from a sharded (DCP) save: checks on every rank, then this rank's chunks under this layout."""
    from .sharded import load_sharded, open_sharded

    stage = _check_stage(engine)
    keys = _optimizer(engine, stage)[1]
    named = dict(engine.model.named_parameters())
    held = owners(_inner_optimizer(engine)) if stage == 0 else {}  # whole-parameter ZeRO: the owner loads the state
    mine = {p for p, (group, rank) in held.items() if engine.layout.rank(group) == rank}
    wanted = [(n, tuple(p.shape), engine.spec.get(n), ("fp32",) + (keys if p not in held or p in mine else ()))
              for n, p in named.items()]
    plan = open_sharded(engine, load_dir, wanted, engine.model)
    ensure_state(_inner_optimizer(engine), keys, plan["progress"]["optimizer_step"])
    opt = _optimizer(engine, stage)[0]
    if stage > 0:
        _link_optimizer_state(engine)
    progress = load_sharded(engine, plan, lambda name, rec: _apply(engine, stage, opt, keys, named[name], rec))
    return resume_progress(engine, progress)
