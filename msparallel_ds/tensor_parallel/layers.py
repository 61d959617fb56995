"""Column- and row-parallel Linear (Megatron) over an explicit tp group, with optional sequence parallel (SP).

A column layer feeding a row layer is the Megatron MLP/attention pattern: one all-reduce in forward (row output) and
one in backward (column input), or with SP an all-gather before the column layer and a reduce-scatter after the row
layer, the residual stream staying sharded along seq_dim in between blocks.

Parameters keep nn.Linear's names (`weight`, `bias`) so HF state-dict keys map back; sharded ones carry Megatron's
attributes (tensor_model_parallel, partition_dim, partition_stride), which DeepSpeed reads to count each shard once
in the gradient norm while counting replicated parameters on tp rank 0 only.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .comm import (copy_to_region, gather_from_region, gather_from_sequence_region, reduce_from_region,
                   reduce_scatter_to_sequence_region, scatter_to_region)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "divide"]


def divide(n: int, tp: int, what: str, hint: str = "") -> int:
    """n / tp, or a clear error naming both numbers."""
    if n % tp:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size tp={tp} (model_parallel): every tp "
                         f"rank needs an equal shard; pick a model_parallel that divides {n}{hint}")
    return n // tp


def _param(data: Tensor, partition_dim: int | None, requires_grad: bool = True) -> nn.Parameter:
    p = nn.Parameter(data, requires_grad=requires_grad)
    if partition_dim is not None:
        p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, partition_dim, 1
    return p


def _shard(t: Tensor, tp: int, rank: int, dim: int) -> Tensor:
    # A contiguous copy: no view keeps the full tensor alive, so the caller can free it.
    return t.detach().chunk(tp, dim)[rank].clone(memory_format=torch.contiguous_format)


class _ParallelLinear(nn.Module):
    _split_dim: int  # 0: weight rows (out features) are split; 1: columns (in features)
    _divide_hint = ""  # appended to the divisibility error

    def __init__(self, in_features: int, out_features: int, bias: bool, group, *, sequence_parallel: bool,
                 seq_dim: int, device=None, dtype=None):
        super().__init__()
        self.group, self.tp, self.tp_rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        split = (out_features, in_features)[self._split_dim]
        what = f"{type(self).__name__}: {('out_features', 'in_features')[self._split_dim]}"
        shape = [out_features, in_features]
        shape[self._split_dim] = divide(split, self.tp, what, self._divide_hint)
        kw = {"device": device, "dtype": dtype}
        self.weight = _param(torch.empty(shape, **kw), self._split_dim)
        # Column: bias split like the output features. Row: full bias, added once after the reduction.
        self.register_parameter("bias", _param(torch.empty(shape[0], **kw), 0 if self._split_dim == 0 else None)
                                if bias else None)  # as nn.Linear: `bias` exists, None when absent
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's distribution, U(+-1/sqrt(fan_in)) with the FULL fan_in (a row shard's own fan_in is in/tp).
        bound = 1 / math.sqrt(self.in_features) if self.in_features else 0
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, **kwargs):
        """This rank's shard of `linear` (a clean copy: `linear` can be freed). kwargs: the constructor's options."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group, device="meta",
                    dtype=linear.weight.dtype, **kwargs)
        w = linear.weight
        layer.weight = _param(_shard(w, layer.tp, layer.tp_rank, cls._split_dim), cls._split_dim, w.requires_grad)
        if linear.bias is not None:
            b = linear.bias
            data = _shard(b, layer.tp, layer.tp_rank, 0) if cls._split_dim == 0 else b.detach().clone()
            layer.bias = _param(data, 0 if cls._split_dim == 0 else None, b.requires_grad)
        return layer

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"tp={self.tp}, shard={tuple(self.weight.shape)}, sequence_parallel={self.sequence_parallel}")


class ColumnParallelLinear(_ParallelLinear):
    """y = x W^T + b with W's rows (output features) split over `group`: weight [out/tp, in], bias [out/tp].

    Input: replicated over the group (its grad is all-reduced in backward, Megatron's f), or with sequence_parallel
    this rank's slice along seq_dim (all-gathered here; backward reduce-scatters), or with input_is_gathered the
    full sequence already all-gathered once for a whole block by the caller (SP with one all-gather shared by
    q/k/v or gate/up): no collective here, that gather's reduce-scatter sums the partial input grads. Output: this
    rank's out/tp features, or all of them with gather_output=True.
    """
    _split_dim = 0

    def __init__(self, in_features: int, out_features: int, bias: bool, group, *, gather_output: bool = False,
                 sequence_parallel: bool = False, input_is_gathered: bool = False, seq_dim: int = 1, device=None,
                 dtype=None):
        super().__init__(in_features, out_features, bias, group, sequence_parallel=sequence_parallel,
                         seq_dim=seq_dim, device=device, dtype=dtype)
        if input_is_gathered and sequence_parallel:
            raise ValueError("ColumnParallelLinear: input_is_gathered and sequence_parallel exclude each other "
                             "(the first means the caller already all-gathered the sequence)")
        self.gather_output, self.input_is_gathered = gather_output, input_is_gathered

    def forward(self, x: Tensor) -> Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_region(x, self.group, self.seq_dim)
        elif not self.input_is_gathered:
            x = copy_to_region(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_region(y, self.group, -1) if self.gather_output else y


class RowParallelLinear(_ParallelLinear):
    """y = x W^T + b with W's columns (input features) split over `group`: weight [out, in/tp], bias [out] (full).

    Input: this rank's in/tp features (input_is_parallel, e.g. a ColumnParallelLinear's output), else the full
    input, of which this rank keeps its slice. The partial products are all-reduced, or with sequence_parallel
    reduce-scattered along seq_dim; the bias is added after that, once.
    """
    _split_dim = 1

    def __init__(self, in_features: int, out_features: int, bias: bool, group, *, input_is_parallel: bool = True,
                 sequence_parallel: bool = False, seq_dim: int = 1, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, group, sequence_parallel=sequence_parallel,
                         seq_dim=seq_dim, device=device, dtype=dtype)
        self.input_is_parallel = input_is_parallel

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.group, -1)
        y = F.linear(x, self.weight)
        if not self.sequence_parallel:
            y = reduce_from_region(y, self.group)
            return y if self.bias is None else y + self.bias
        y = reduce_scatter_to_sequence_region(y, self.group, self.seq_dim)
        if self.bias is None:
            return y
        # Each rank adds the bias to its own tokens only, so its bias grad is partial: f (identity forward,
        # all-reduce backward) sums it over the group inside autograd, under any engine and with recompute.
        return y + copy_to_region(self.bias, self.group)
