"""The global-batch token mean both engines train on: the batch check, the global token count, the token-loss sum.

Every rank back-propagates sum(its token losses) / N, N = valid (shifted, not ignored) tokens of the GLOBAL batch
(HF's loss with num_items_in_batch, Megatron's per-token loss), so micro-batches, cp shards, pipeline stages and
ignored labels weigh tokens exactly as one process would.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .labels import IGNORE_INDEX, shift_labels
from .distributed.collectives import sum_over
from .distributed.layout import ParallelLayout

__all__ = ["check_batch", "global_token_count", "token_loss_sum"]


def check_batch(batch: Mapping[str, Any], engine, accumulation_key: str) -> tuple[Tensor, Tensor]:
    """(input_ids, labels) of train_batch's `batch`, which must be this dp rank's share of one global step:
    engine.micro_batch_size x engine.gradient_accumulation_steps rows (accumulation_key names the YAML key of the
    latter)."""
    ids = batch.get("input_ids")
    if ids is None or ids.dim() != 2:
        raise ValueError("train_batch needs batch['input_ids'] of shape [rows, seq] (this dp rank's share of the "
                         "global batch)")
    rows = engine.micro_batch_size * engine.gradient_accumulation_steps
    if ids.shape[0] != rows:
        raise ValueError(
            f"train_batch got {ids.shape[0]} rows; this dp rank's share of a global step is {rows} = "
            f"runner_config.batch_size x micro_batch_interleave_num ({engine.micro_batch_size}) x {accumulation_key} "
            f"({engine.gradient_accumulation_steps}); global batch {engine.plan.global_batch_size} / data_parallel "
            f"{engine.layout.size('dp')}")
    labels = batch.get("labels", ids)
    if labels.shape != ids.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} != input_ids shape {tuple(ids.shape)}")
    return ids, labels


def global_token_count(labels: Tensor, layout: ParallelLayout, device) -> Tensor:
    """Valid (shifted, not ignored) tokens of the global batch from this dp rank's labels, at least 1, fp32; tp
    and cp peers of a dp rank hold the same rows, so the sum runs over dp only."""
    count = (shift_labels(labels) != IGNORE_INDEX).sum().to(torch.float32).to(device)
    return sum_over(layout, "dp", count).clamp_min(1.0)


def token_loss_sum(logits: Tensor, targets: Tensor, head: Optional[nn.Module]) -> Tensor:
    """Sum of the token cross-entropies (ignored labels skipped), in fp32; vocab-parallel logits [..., V/tp] when
    `head` (the model's output head) is a vocab-parallel one."""
    from .tensor_parallel.vocab import ParallelLMHead, vocab_parallel_cross_entropy

    if isinstance(head, ParallelLMHead) and head.tp > 1:
        return vocab_parallel_cross_entropy(logits, targets, head.group, IGNORE_INDEX, "sum")
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")
