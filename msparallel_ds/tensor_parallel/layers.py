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

from .replicated import mark
from .spec import STYLE_PARAM_SHARDS, Shard
from .mappings import (copy_to_region, gather_from_region, gather_from_sequence_region, reduce_from_region,
                       reduce_scatter_to_sequence_region, scatter_to_region)

__all__ = ["ColumnParallelLinear", "FusedColumnParallelLinear", "ReplicatedKVLinear", "RowParallelLinear", "divide"]


def divide(n: int, tp: int, what: str, hint: str = "") -> int:
    """n / tp, or a clear error naming both numbers."""
    if n % tp:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size tp={tp} (model_parallel): every tp "
                         f"rank needs an equal shard; pick a model_parallel that divides {n}{hint}")
    return n // tp


def _cut(t: Tensor, shard: Shard, tp: int, rank: int) -> nn.Parameter:
    """This rank's part of `t` by the shard spec, as a Parameter: a contiguous copy, so no view keeps the full
    tensor alive and the caller can free it."""
    data = shard.local(t.detach(), tp, rank).clone(memory_format=torch.contiguous_format)
    return shard.parameter(data, t.requires_grad)


class _ParallelLinear(nn.Module):
    _style: str  # the TP plan style: STYLE_PARAM_SHARDS[_style] (the shard spec) says how weight and bias are cut
    _divide_hint = ""  # appended to the divisibility error

    @classmethod
    def _shards(cls) -> dict[str, Shard]:
        return STYLE_PARAM_SHARDS[cls._style]

    @classmethod
    def _split_dim(cls) -> int:  # 0: weight rows (out features) are split; 1: columns (in features)
        return cls._shards()["weight"].dim

    def __init__(self, in_features: int, out_features: int, bias: bool, group, *, sequence_parallel: bool,
                 seq_dim: int, device=None, dtype=None):
        super().__init__()
        self.group, self.tp, self.tp_rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        dim, shards = self._split_dim(), self._shards()
        split = (out_features, in_features)[dim]
        what = f"{type(self).__name__}: {('out_features', 'in_features')[dim]}"
        shape = [out_features, in_features]
        shape[dim] = divide(split, self.tp, what, self._divide_hint)
        kw = {"device": device, "dtype": dtype}
        self.weight = shards["weight"].parameter(torch.empty(shape, **kw))
        # Column: bias split like the output features. Row: full bias, added once after the reduction.
        self.register_parameter("bias", shards["bias"].parameter(torch.empty(shape[0], **kw))
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
        shards = cls._shards()
        layer.weight = _cut(linear.weight, shards["weight"], layer.tp, layer.tp_rank)
        if linear.bias is not None:
            layer.bias = _cut(linear.bias, shards["bias"], layer.tp, layer.tp_rank)
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
    _style = "colwise"

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


class FusedColumnParallelLinear(ColumnParallelLinear):
    """A column layer whose output is two fused blocks, [gate; up] (GLM's gate_up_proj, chunked in two after it):
    each block is split over tp on its own, so this rank's output is [gate_r; up_r] and the model's chunk(2) pairs
    them (Megatron's linear_fc1 with partition_stride 2)."""
    _style = "colwise_halves"
    _divide_hint = " (each of the two fused halves is split: out_features / 2 must divide too)"

    def __init__(self, in_features: int, out_features: int, *args, **kwargs):
        super().__init__(in_features, out_features, *args, **kwargs)
        if (out_features // 2) % self.tp:
            divide(out_features // 2, self.tp, f"{type(self).__name__}: out_features / 2", self._divide_hint)


class RowParallelLinear(_ParallelLinear):
    """y = x W^T + b with W's columns (input features) split over `group`: weight [out, in/tp], bias [out] (full).

    Input: this rank's in/tp features (input_is_parallel, e.g. a ColumnParallelLinear's output), else the full
    input, of which this rank keeps its slice. The partial products are all-reduced, or with sequence_parallel
    reduce-scattered along seq_dim; the bias is added after that, once.
    """
    _style = "rowwise"

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


class ReplicatedKVLinear(nn.Module):
    """A key or value projection when tp > kv heads (tp % kv == 0): tp rank r computes kv head r // (tp/kv), the one
    its query heads use. The full weight (and bias) is kept on every rank under nn.Linear's names; forward narrows it
    to the head's rows, and its grad (those rows only) is summed over tp like the other tp-replicated weights
    (replicated.mark: async with one wait per backward, once per backward whatever the number of uses), so every
    rank ends with the full grad."""

    def __init__(self, linear: nn.Linear, group, n_kv_heads: int, *, input_is_gathered: bool = False):
        super().__init__()
        self.group, self.tp, self.tp_rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.input_is_gathered = input_is_gathered  # SP: the block's all-gather sums the input grad
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.head_dim = linear.out_features // n_kv_heads
        self.kv_head = self.tp_rank // (self.tp // n_kv_heads)
        self.weight = nn.Parameter(linear.weight.detach().clone(), requires_grad=linear.weight.requires_grad)
        self.bias = (None if linear.bias is None else
                     nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad))
        mark(self, group)

    def local_weights(self) -> tuple[Tensor, Tensor | None]:
        """(weight, bias) rows of this rank's kv head."""
        start, n = self.kv_head * self.head_dim, self.head_dim
        return self.weight.narrow(0, start, n), None if self.bias is None else self.bias.narrow(0, start, n)

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_gathered:
            x = copy_to_region(x, self.group)  # column-style input: its grad is partial per rank
        return F.linear(x, *self.local_weights())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, tp={self.tp}, "
                f"kv_head={self.kv_head}, head_dim={self.head_dim}")
