"""Causal-LM labels: the one ignore label and the one shift (token t is trained to predict token t+1)."""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

__all__ = ["IGNORE_INDEX", "shift_labels"]

IGNORE_INDEX = -100  # HF's and torch's cross-entropy ignore label


def shift_labels(labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """[b, s] labels -> [b, s] targets: position t holds labels[t+1]; the last position is ignored."""
    return F.pad(labels[:, 1:], (0, 1), value=ignore_index)
