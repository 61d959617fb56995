"""Sharding a HF causal-LM batch over context parallel, and the loss reduction that goes with it.

Labels are shifted BEFORE sharding (token t predicts t+1 of the full sequence; after a zigzag split a rank's
neighbour token is usually on another rank) and handed to HF models as `shift_labels`, which their loss uses
without shifting again. position_ids are sharded with the same permutation so RoPE sees global positions.

Packed rows (several documents per row: position_ids restarting at 0, flash-attn style cu_seqlens, or explicit
doc_ids) also get a sharded `doc_ids` entry, computed on the FULL row before sharding (a shard cannot see the
boundaries on other ranks); pass it to the model for document-causal attention (hf_attention). Labels are used as
given: a target crossing into the next document is ignored only if its label is (DataCollatorWithFlattening puts
-100 on each document's first token).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..distributed.collectives import sum_over
from ..labels import IGNORE_INDEX, shift_labels

if TYPE_CHECKING:
    from ..distributed.layout import ParallelLayout

# flash-attn varlen metadata describes the unsharded rows: consumed here (as doc_ids), never passed on to the model
_VARLEN_KEYS = ("cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def doc_ids_from_position_ids(position_ids: Tensor) -> Tensor:
    """[b, s] document ids, a new document wherever position_ids restart at 0 (non-decreasing along each row)."""
    return torch.cumsum(position_ids == 0, dim=-1)


def doc_ids_from_cu_seqlens(cu_seqlens: Tensor, batch: int, seq_len: int) -> Tensor:
    """[b, s] document ids from cumulative document lengths over the flattened batch ([0, l1, l1+l2, ..., b*s],
    the flash-attn varlen convention); a document may not cross a row."""
    cu = torch.as_tensor(cu_seqlens).flatten().long().cpu()
    rows = torch.arange(batch + 1) * seq_len
    if cu.numel() < 2 or cu[0] != 0 or cu[-1] != batch * seq_len or bool((cu[1:] <= cu[:-1]).any()) \
            or not bool(torch.isin(rows, cu).all()):
        raise ValueError(f"cu_seqlens must increase from 0 to batch*seq_len = {batch * seq_len} and include every "
                         f"row start {rows.tolist()} (documents cannot cross rows); got {cu.tolist()}")
    starts = torch.zeros(batch * seq_len, dtype=torch.long)
    starts[cu[1:-1]] = 1
    return starts.cumsum(0).view(batch, seq_len)


def positions_from_doc_ids(doc_ids: Tensor) -> Tensor:
    """[b, s] position of each token inside its document (0 at each document's first token)."""
    idx = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    first = torch.ones_like(doc_ids, dtype=torch.bool)
    first[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return idx - torch.where(first, idx, 0).cummax(dim=1).values


def shard_batch(batch: Mapping[str, Any], layout: ParallelLayout, *, algo: Optional[str] = None,
                ignore_index: int = IGNORE_INDEX) -> dict[str, Any]:
    """This cp rank's part of a HF batch: input_ids / inputs_embeds, shift_labels, position_ids (made when absent),
    and doc_ids for packed rows.

    An attention_mask that masks padding cannot be split by position: pass packed sequences (position_ids that
    restart at 0) or unpadded rows instead; an all-ones mask is dropped. Documents come from `doc_ids` [b, s],
    else `cu_seqlens` (or HF's `cu_seq_lens_q`), else position_ids restarting at 0; `doc_ids` is returned when the
    batch gives ids or cu_seqlens, or when some row holds several documents. Missing position_ids restart per
    document.
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
    doc_ids = batch.get("doc_ids")
    cu = batch.get("cu_seqlens", batch.get("cu_seq_lens_q"))
    if doc_ids is None and cu is not None:
        doc_ids = doc_ids_from_cu_seqlens(cu, b, s).to(ref.device)
    if doc_ids is not None and tuple(doc_ids.shape) != (b, s):
        raise ValueError(f"doc_ids must have the batch's shape [batch, seq] = {(b, s)}, got {tuple(doc_ids.shape)}")
    if position_ids is None:
        position_ids = (positions_from_doc_ids(doc_ids) if doc_ids is not None
                        else torch.arange(s, device=ref.device).unsqueeze(0).expand(b, s))
    elif doc_ids is None:
        derived = doc_ids_from_position_ids(position_ids.expand(b, s))
        if bool((derived[:, -1] != derived[:, 0]).any()):  # only packed rows pay for the document path
            doc_ids = derived
    labels = batch.get("labels")
    targets = batch.get("shift_labels")
    if targets is None and labels is not None:
        targets = shift_labels(labels, ignore_index)
    for key, value in (("input_ids", ids), ("inputs_embeds", batch.get("inputs_embeds")),
                       ("position_ids", position_ids), ("shift_labels", targets), ("doc_ids", doc_ids)):
        if value is not None:
            out[key] = shard_sequence(value, layout, dim=1, algo=algo)
    for key, value in batch.items():  # anything else (e.g. num_items_in_batch) passes through
        if key not in out and key not in ("labels", "attention_mask", "input_ids", "inputs_embeds", *_VARLEN_KEYS):
            out[key] = value
    return out


def inputs_and_targets(batch: Mapping[str, Any], layout: ParallelLayout) -> tuple[dict[str, Any], Tensor]:
    """A micro-batch -> (model inputs, shifted targets) for this rank: sharded over cp by shard_batch when cp > 1
    (labels shifted before the split), else the batch without labels and the shifted labels. Already shifted
    targets (`shift_labels` [rows, S], HF's convention: position t's target, IGNORE_INDEX for none) are used as
    given and win over `labels`; labels default to input_ids."""
    batch = dict(batch)
    if batch.get("shift_labels") is None:
        batch["shift_labels"] = shift_labels(batch.get("labels", batch["input_ids"]))
    batch.pop("labels", None)
    if layout.size("cp") > 1:
        inputs = shard_batch(batch, layout)
    else:
        inputs = batch
    targets = inputs.pop("shift_labels")
    inputs.pop("labels", None)
    return inputs, targets


def cp_token_loss(logits: Tensor, shift_labels: Tensor, layout: ParallelLayout, *,
                  ignore_index: int = IGNORE_INDEX) -> Tensor:
    """This rank's share of the sequence-mean cross-entropy: sum over its tokens / valid tokens on all cp ranks.

    Summed over the cp group it is the full-sequence mean; DeepSpeed sums gradients over dp x cp and divides by
    dp, so this is the loss each cp rank must back-propagate.
    """
    loss_sum = F.cross_entropy(logits.flatten(0, -2).float(), shift_labels.flatten(), ignore_index=ignore_index,
                               reduction="sum")
    count = sum_over(layout, "cp", (shift_labels != ignore_index).sum().to(torch.float32))  # a fresh tensor
    return loss_sum / count.clamp_min(1.0)


def cp_mean_loss(local_share: Tensor, layout: ParallelLayout) -> Tensor:
    """For logging: the full-sequence mean loss on every cp rank (sum of the shares, no gradient)."""
    return sum_over(layout, "cp", local_share.detach().clone())
