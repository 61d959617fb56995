"""The word embedding shared by the first and the last pipeline stage, as Megatron-Core shares it.

A tied output head (tie_word_embeddings: GPT-2) or multi-token prediction (the MTP layers' embedding lookups, on the
last stage) needs the word embedding on the last stage while the first stage embeds the input. Megatron-Core
(parallel_state's embedding group, finalize_model_grads._allreduce_word_embedding_grads) and here:
- the last stage holds its own copy: the rank's own instance of the HF parameter (every rank built the whole model),
  set from the first stage's at set-up (a broadcast over the embedding group);
- the embedding group is {pp coordinate 0, pp coordinate L} (L: the pp rank holding the last stage) per dp/cp/tp
  coordinate (ParallelLayout.embedding_group); after the backward and before the optimizer step the two copies'
  grads are summed over it, so both see the tied model's gradient and stay identical under any optimizer, ZeRO-1
  included (each dp x cp group of a stage updates the same values from the same state);
- the copy is marked `shared_embedding` (Megatron: `shared_embedding` / `param_is_not_shared`): the global grad norm
  counts the first stage's only (collectives.clip_grad_norm_), and checkpoints write the first stage's only and load
  it into both (`aliases`: the copy's name -> the saved name).
When one rank holds both stages (zero_bubble_v puts the last stage on pp rank 0) they share one parameter (one
module for MTP): nothing to sum.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .split import stage_chunks

__all__ = ["SharedEmbedding", "share_embedding"]


class SharedEmbedding:
    """This rank's end of the shared word embedding: its parameter and the embedding group."""

    def __init__(self, param: nn.Parameter, group, aliases: dict[str, str]):
        self.param, self.group, self.aliases = param, group, aliases

    def sync_grads(self) -> None:
        """Sum the two copies' gradients (after the backward, before the optimizer step)."""
        p = self.param
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=self.group)

    @torch.no_grad()
    def broadcast(self) -> None:
        """The first stage's values into the last stage's copy (set-up; both ends call)."""
        dist.broadcast(self.param.data, src=dist.get_process_group_ranks(self.group)[0], group=self.group)


def _last_pp(pp: int, vpp: int, schedule: Optional[str]) -> int:
    return next(r for r in range(pp) if pp * vpp - 1 in stage_chunks(pp, vpp, r, schedule))


def share_embedding(stages: list[nn.Module], layout, vpp: int, schedule: Optional[str], *, embed_name: str,
                    head_name: Optional[str], mtp: bool) -> Optional[SharedEmbedding]:
    """After the stages were parallelized: join the two ends (same rank: one parameter / module again; else the
    embedding group, the set-up broadcast, the copy's mark). `embed_name` / `head_name`: the HF names of the input
    embedding's and (tied) the output head's weight; head_name None when the head is not tied. Every rank calls (the
    group is made collectively); returns this rank's end, or None where it holds neither or both."""
    pp = layout.size("pp")
    last_pp = _last_pp(pp, vpp, schedule)
    group = layout.embedding_group(last_pp) if last_pp != 0 else None
    first = next((s for s in stages if s.is_first), None)
    last = next((s for s in stages if s.is_last), None)
    embed_path = embed_name.rsplit(".", 1)[0]
    if last is not None and mtp and first is not None:  # one embedding module for both stages
        parent, attr = embed_path.rsplit(".", 1)
        setattr(last.get_submodule(parent), attr, first.get_submodule(embed_path))
    if last is not None and head_name is not None:  # the tied head reads the (local) embedding's weight
        source = first if first is not None else (last if mtp else None)
        if source is not None:
            last.get_submodule(head_name.rsplit(".", 1)[0]).weight = source.get_parameter(embed_name)
    if (first is None) == (last is None) or group is None:
        return None
    if first is not None:
        end = SharedEmbedding(first.get_parameter(embed_name), group, {})
    else:
        name = embed_name if mtp else head_name
        param = last.get_parameter(name)
        param.shared_embedding = True
        end = SharedEmbedding(param, group, {} if name == embed_name else {name: embed_name})
    end.broadcast()
    return end
