"""Full tensors from tp shards and back, by the shard spec (msparallel_ds.tensor_parallel.spec) alone.

    full  = gather_full_state_dict(model, layout)          # HF-keyed, CPU; None off global rank 0
    local = fit(full_tensor, spec.get(name), layout, sliced, p.shape)

Saving gathers each split tensor over tp with its Shard (with pp > 1 the stages are then merged over the pp group
on global rank 0's pipeline path); loading cuts this tp rank's part with the same Shard and checks its shape. The
spec is the only place the layout rule lives, so save, load, convert-checkpoint and the HF export cannot disagree.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch.distributed as dist
from torch import Tensor, nn

from ..tensor_parallel.spec import Shard, ShardSpec

if TYPE_CHECKING:
    from ..distributed.layout import ParallelLayout

__all__ = ["fit", "gather", "gather_full_state_dict", "gather_pipeline_state_dict", "gather_state_dict",
           "merge_over_pp"]


def gather(t: Tensor, shard: Shard, layout: ParallelLayout) -> Tensor:
    """The full tensor of which `t` is this rank's part (a collective over the shard's group, tp or ep, when split);
    `t` when replicated."""
    return shard.gather(t, layout.group(shard.group)) if layout.size(shard.group) > 1 else t


def fit(t: Tensor, shard: Shard, layout: ParallelLayout, sliced: bool, shape) -> Tensor:
    """This rank's part (over the shard's group) of checkpoint tensor `t` (a full tensor, or already this rank's
    when `sliced`), checked against the parameter's local `shape`: a checkpoint of another model is one clear error,
    not a wrong copy."""
    if not sliced or shard.group != "tp":  # convert-checkpoint slices over tp only; experts are cut here
        t = shard.local(t, layout.size(shard.group), layout.rank(shard.group))
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"checkpoint tensor of shape {tuple(t.shape)} does not fit parameter of shape "
                         f"{tuple(shape)} under this layout (was it saved from another model?)")
    return t


def gather_state_dict(model: nn.Module, layout: ParallelLayout, spec: ShardSpec,
                      keep: bool) -> Optional[dict[str, Tensor]]:
    """model.state_dict() with split tensors gathered over tp (a collective: every tp rank calls), detached,
    contiguous, on CPU; None where not `keep`. A tied tensor is gathered once (every rank walks the same order) and
    its keys share it, as in the unsharded state dict."""
    full, done = {}, {}
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) not in done:
            t = gather(value.detach(), spec.get(key), layout)
            done[id(value)] = t.to("cpu").contiguous() if keep else None
        full[key] = done[id(value)]
    return full if keep else None


def merge_over_pp(local: Optional[dict], layout: ParallelLayout, rank0_only: bool) -> Optional[dict]:
    """One dict from every pp stage's `local` records: on global rank 0 only (rank0_only; only ranks with dp_cp and
    tp coordinate 0 take part) or on every rank."""
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


def gather_pipeline_state_dict(view: nn.Module, layout: ParallelLayout, *, spec: Optional[ShardSpec] = None,
                               rank0_only: bool = True) -> Optional[dict[str, Tensor]]:
    """HF-keyed full state dict from every rank's stage view (pipeline stages keep HF names); None off global rank 0
    when rank0_only."""
    if rank0_only and layout.rank("dp_cp") != 0 and layout.rank("edp") != 0:
        return None  # the experts of dp_cp rank 0's ep group also live on its ep peers (edp rank 0): they gather too
    local = gather_state_dict(view, layout, ShardSpec.of_module(view) if spec is None else spec, keep=True)
    return merge_over_pp(local, layout, rank0_only)


def gather_full_state_dict(model: nn.Module, layout: ParallelLayout, *, spec: Optional[ShardSpec] = None,
                           rank0_only: bool = True) -> Optional[dict[str, Tensor]]:
    """model.state_dict() with every split tensor gathered over tp (and, with pp > 1, `model` being this rank's
    pipeline stage view, the stages over pp). spec: default read back from the model's parameters.
    rank0_only: other ranks return None; only the tp group holding global rank 0 gathers."""
    if layout.size("pp") > 1:
        return gather_pipeline_state_dict(model, layout, spec=spec, rank0_only=rank0_only)
    keep = not rank0_only or layout.global_rank == 0
    if not keep and 0 not in layout.ranks("tp") and 0 not in layout.ranks("ep"):
        return None  # no rank of this tp (or ep) group keeps anything: skip the collectives
    return gather_state_dict(model, layout, ShardSpec.of_module(model) if spec is None else spec, keep)
