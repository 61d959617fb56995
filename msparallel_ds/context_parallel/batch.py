"""Sharding a HF causal-LM batch over context parallel, and the loss reduction that goes with it.

Labels are shifted BEFORE sharding (token t predicts t+1 of the full sequence; after a zigzag split a rank's
neighbour token is usually on another rank) and handed to HF models as `shift_labels`, which their loss uses
without shifting again. position_ids are sharded with the same permutation so RoPE sees global positions.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100


def shift_labels(labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """[b, s] labels -> [b, s] targets: position t holds labels[t+1]; the last position is ignored."""
    return F.pad(labels[:, 1:], (0, 1), value=ignore_index)


def shard_batch(batch: Mapping[str, Any], layout, *, algo: Optional[str] = None,
                ignore_index: int = IGNORE_INDEX) -> dict[str, Any]:
    """This cp rank's part of a HF batch: input_ids / inputs_embeds, shift_labels, position_ids (made when absent).

    An attention_mask that masks padding cannot be split by position: pass packed sequences (position_ids that
    restart at 0) or unpadded rows instead; an all-ones mask is dropped.
    """
    from .api import shard_sequence

    out: dict[str, Any] = {}
    ids = batch.get("input_ids")
    ref = ids if ids is not None else batch.get("inputs_embeds")
    if ref is None:
        raise ValueError("shard_batch needs input_ids or inputs_embeds")
    b, s = ref.shape[:2]
    mask = batch.get("attention_mask")
    if mask is not None and not bool(torch.all(mask.bool())):
        raise ValueError("attention_mask with padding cannot be sharded over context parallel; pack the sequences "
                         "(position_ids restarting at 0 per document) or drop the padding")
    position_ids = batch.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(s, device=ref.device).unsqueeze(0).expand(b, s)
    labels = batch.get("labels")
    targets = batch.get("shift_labels")
    if targets is None and labels is not None:
        targets = shift_labels(labels, ignore_index)
    for key, value in (("input_ids", ids), ("inputs_embeds", batch.get("inputs_embeds")),
                       ("position_ids", position_ids), ("shift_labels", targets)):
        if value is not None:
            out[key] = shard_sequence(value, layout, dim=1, algo=algo)
    for key, value in batch.items():  # anything else (e.g. num_items_in_batch) passes through
        if key not in out and key not in ("labels", "attention_mask", "input_ids", "inputs_embeds"):
            out[key] = value
    return out


def cp_token_loss(logits: Tensor, shift_labels: Tensor, layout, *, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """This rank's share of the sequence-mean cross-entropy: sum over its tokens / valid tokens on all cp ranks.

    Summed over the cp group it is the full-sequence mean; DeepSpeed sums gradients over dp x cp and divides by
    dp, so this is the loss each cp rank must back-propagate.
    """
    loss_sum = F.cross_entropy(logits.flatten(0, -2).float(), shift_labels.flatten(), ignore_index=ignore_index,
                               reduction="sum")
    count = (shift_labels != ignore_index).sum().to(torch.float32)
    if layout.size("cp") > 1:
        count = count.clone()
        dist.all_reduce(count, group=layout.group("cp"))
    return loss_sum / count.clamp_min(1.0)


def cp_mean_loss(local_share: Tensor, layout) -> Tensor:
    """For logging: the full-sequence mean loss on every cp rank (sum of the shares, no gradient)."""
    total = local_share.detach().clone()
    if layout.size("cp") > 1:
        dist.all_reduce(total, group=layout.group("cp"))
    return total
