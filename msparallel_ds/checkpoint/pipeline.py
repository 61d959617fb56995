"""engine.save / engine.load for the pipeline engine, in the same file engine.Engine writes (checkpoint.format).

Each stage's records (fp32 weights and Adam moments) are gathered over tp by engine.spec and, with ZeRO-1 (torch's
ZeroRedundancyOptimizer), broadcast over its group from the rank that owns the optimizer state (dp x cp; with ep the
experts' over edp, pipeline.zero.SplitZero's two parts, each parameter in exactly one); then the ranks on
global rank 0's pipeline path (dp = cp = tp coordinate 0) send their stage's records to rank 0 over the pp group.
Same keys (HF names), so a pp run resumes under dp/tp/cp or one process and back.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .format import FILE, agreed, read_for_layout, record_for, resume_progress, write_agreed
from .optim_state import ensure_state, owners, parts, state_view
from .reshard import gather, gather_pipeline_state_dict, merge_over_pp
from .zero import validated_parts

__all__ = ["gather_pipeline_state_dict", "load_pipeline_checkpoint", "save_pipeline_checkpoint"]


def _has_state(engine) -> bool:
    """Whether any rank has taken a step (ZeRO-1: a rank may own no parameter of its stage)."""
    flag = torch.tensor(float(bool(state_view(engine.optimizer)[0])), device=engine.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _sharded_records(engine, states, owner_of, keys):
    """(name, Shard, {key: tp-local tensor}) of the chunks this rank writes: with ZeRO-1 the owner of a parameter's
    optimizer state writes it (checkpoint.sharded.writes: an expert split over ep by its edp rank, others by their
    dp x cp rank), no collective needed."""
    from .sharded import writes

    for i, (name, p) in enumerate(engine.model.named_parameters()):
        if getattr(p, "shared_embedding", False):  # written once, by the first stage (pipeline.shared)
            continue
        shard = engine.spec.get(name)
        if writes(engine.layout, shard, i, owner_of.get(p, (None, None))[1]):
            state = states.get(p, {})
            yield name, shard, {"fp32": p.detach().float(), **{k: state[k] for k in keys if k in state}}


def save_pipeline_checkpoint(engine, save_dir: str, *, sharded: bool = True, async_save: bool = False,
                             replicas: int = 0) -> None:
    """Every rank calls; every rank writes its chunks (checkpoint.sharded), or (sharded=False) global rank 0 writes
    save_dir/FILE."""
    layout, opt, spec = engine.layout, engine.optimizer, engine.spec
    if sharded or async_save or replicas:
        from .sharded import save_sharded

        states, keys = state_view(opt)
        steps = [float(s["step"]) for s in states.values() if "step" in s]
        step = torch.tensor(max(steps) if steps else 0.0, device=engine.device)
        dist.all_reduce(step, op=dist.ReduceOp.MAX)  # a ZeRO-1 rank may own no parameter of its stage
        save_sharded(engine, save_dir, _sharded_records(engine, states, owners(opt), keys),
                     optimizer_step=float(step.item()), model=engine._hf, async_save=async_save,
                     replicas=replicas)
        return
    (states, keys), owner_of = state_view(opt), owners(opt)
    stateful = _has_state(engine)
    records: dict[str, dict[str, Tensor]] = {}
    steps = []
    for name, p in engine.model.named_parameters():
        if getattr(p, "shared_embedding", False):  # written once, by the first stage (pipeline.shared)
            continue
        rec = {"fp32": p.detach().float()}
        if stateful:
            state = states.get(p, {})
            for k in keys:
                t = state[k].detach().clone() if k in state else torch.zeros_like(p)
                if p in owner_of:  # the owner broadcasts its shard's state over its ZeRO group
                    group, owner = owner_of[p]
                    dist.broadcast(t, src=layout.ranks(group)[owner], group=layout.group(group))
                rec[k] = t
            if "step" in state:
                steps.append(float(state["step"]))
        rec = {k: gather(v, spec.get(name), layout) for k, v in rec.items()}
        records[name] = {k: v.detach().to("cpu", copy=True) for k, v in rec.items()}
    step = torch.tensor(max(steps) if steps else 0.0, device=engine.device)
    dist.all_reduce(step, op=dist.ReduceOp.MAX)
    full = merge_over_pp(records if layout.rank("dp_cp") == 0 else None, layout, rank0_only=True)
    record = record_for(engine, full, float(step.item()), engine._hf) if layout.global_rank == 0 else None
    write_agreed(record, os.path.join(save_dir, FILE), engine.device)  # every rank learns whether it was written


def load_pipeline_checkpoint(engine, load_dir: str) -> dict[str, Any]:
    """Resume this rank's stages from engine.save's file or a convert-checkpoint folder; every rank calls."""
    from .folder import checkpoint_kind

    layout, keys = engine.layout, state_view(engine.optimizer)[1]
    what = f"engine.load({load_dir!r})"
    if agreed(lambda: checkpoint_kind(load_dir), what) == "sharded":
        return _load_sharded(engine, load_dir)
    ck, sliced = agreed(lambda: read_for_layout(load_dir, layout), what)  # engine.save's file or a converted one
    spec = engine.spec
    aliases = _aliases(engine)
    parts = agreed(lambda: validated_parts(ck, engine.model, engine._hf, spec, layout, sliced, load_dir,
                                           subset=True, aliases=aliases), what)  # everything checked before any tensor is touched
    ensure_state(engine.optimizer, keys, ck["optimizer_step"])
    states = state_view(engine.optimizer)[0]
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            rec = parts[name]
            p.copy_(rec["fp32"].to(p.dtype))
            if p in states:  # ZeRO-1: only this rank's shard of the optimizer state lives here
                for k in keys:
                    if k in rec and k in states[p]:  # Muon: a matrix's momentum, other parameters' moments
                        states[p][k].copy_(rec[k])
    return resume_progress(engine, ck)


def _aliases(engine) -> dict[str, str]:
    shared = getattr(engine, "shared", None)
    return dict(shared.aliases) if shared is not None else {}


def _load_sharded(engine, load_dir: str) -> dict[str, Any]:
    """Resume this rank's stages from a sharded (DCP) save: the weights everywhere, the Adam moments where this
    rank holds the optimizer state (ZeRO-1: its own parameters)."""
    from .sharded import load_sharded, open_sharded

    keys = state_view(engine.optimizer)[1]
    owned = {p for b, _, _ in parts(engine.optimizer) for g in b.param_groups for p in g["params"]}
    aliases = _aliases(engine)  # the last stage's copy of the word embedding reads the first stage's record
    view = dict(engine.model.named_parameters())
    named = {aliases.get(n, n): p for n, p in view.items()}
    wanted = [(aliases.get(n, n), tuple(p.shape), engine.spec.get(n), ("fp32",) + (keys if p in owned else ()))
              for n, p in view.items()]
    plan = open_sharded(engine, load_dir, wanted, engine._hf, subset=True)
    ensure_state(engine.optimizer, keys, plan["progress"]["optimizer_step"])
    states = state_view(engine.optimizer)[0]

    @torch.no_grad()
    def apply(name, rec):
        p = named[name]
        p.copy_(rec["fp32"].to(p.dtype))
        for k in keys:
            if k in rec and k in states[p]:
                states[p][k].copy_(rec[k])

    return resume_progress(engine, load_sharded(engine, plan, apply))
