"""Column- and row-parallel HF Conv1D (GPT-2's projections: y = x W + b with W stored [in, out], the transpose of
nn.Linear's), over an explicit tp group, with optional sequence parallel; the Conv1D counterpart of layers.py.

Styles (shard spec, spec.py): conv1d_colwise splits W's columns (output features, dim 1) and the bias;
conv1d_colwise_qkv does so per third of a fused [q | k | v] output (GPT-2's c_attn, split in three after it);
conv1d_rowwise splits W's rows (input features, dim 0) and keeps the bias whole, added once after the reduction.
Parameters keep Conv1D's names and layout, so HF state-dict keys and checkpoints map back.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .layers import _cut, divide
from .mappings import (copy_to_region, gather_from_sequence_region, reduce_from_region,
                       reduce_scatter_to_sequence_region)
from .spec import STYLE_PARAM_SHARDS

__all__ = ["CONV1D_STYLES", "ParallelConv1D"]

CONV1D_STYLES = ("conv1d_colwise", "conv1d_colwise_qkv", "conv1d_rowwise")


class ParallelConv1D(nn.Module):
    """This rank's shard of a HF Conv1D (`conv`) by `style`. Column: input replicated (grad all-reduced), or the
    block's gathered sequence (input_is_gathered: SP gathered once for the block); output this rank's features.
    Row: input this rank's features; output all-reduced, or reduce-scattered along seq_dim under SP."""

    def __init__(self, conv: nn.Module, style: str, group, *, sequence_parallel: bool = False,
                 input_is_gathered: bool = False, seq_dim: int = 1):
        super().__init__()
        self.style, self.group = style, group
        self.tp, self.tp_rank = dist.get_world_size(group), dist.get_rank(group)
        self.column = style != "conv1d_rowwise"
        self.sequence_parallel, self.input_is_gathered, self.seq_dim = sequence_parallel, input_is_gathered, seq_dim
        n_in, n_out = conv.weight.shape
        parts = 3 if style == "conv1d_colwise_qkv" else 1
        divide(n_out // parts if self.column else n_in, self.tp, f"Conv1D {('in', 'out')[self.column]} features")
        self.nx, self.nf = n_in, n_out
        shards = STYLE_PARAM_SHARDS[style]
        self.weight = _cut(conv.weight, shards["weight"], self.tp, self.tp_rank)
        self.bias = None if conv.bias is None else _cut(conv.bias, shards["bias"], self.tp, self.tp_rank)

    def forward(self, x: Tensor) -> Tensor:
        if self.column:
            if self.sequence_parallel and not self.input_is_gathered:
                x = gather_from_sequence_region(x, self.group, self.seq_dim)
            elif not self.input_is_gathered:
                x = copy_to_region(x, self.group)
            y = torch.matmul(x, self.weight)
            return y if self.bias is None else y + self.bias
        y = torch.matmul(x, self.weight)
        if not self.sequence_parallel:
            y = reduce_from_region(y, self.group)
            return y if self.bias is None else y + self.bias
        y = reduce_scatter_to_sequence_region(y, self.group, self.seq_dim)
        # each rank adds the bias to its own tokens: f sums its partial grad over tp (as RowParallelLinear)
        return y if self.bias is None else y + copy_to_region(self.bias, self.group)

    def extra_repr(self) -> str:
        return f"nx={self.nx}, nf={self.nf}, style={self.style}, tp={self.tp}, shard={tuple(self.weight.shape)}"
