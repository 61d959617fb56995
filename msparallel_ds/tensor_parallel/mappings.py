"""Megatron-style autograd collectives: the one place where tp/sp/cp layers talk to other ranks (DESIGN style 2).

Each Function is named <what forward does><what backward does> and takes its process group explicitly (no module
state). Layers call the lowercase wrappers, which return the input untouched on a size-1 group (no communication).

| wrapper                                      | forward                  | backward                 | Megatron        |
|----------------------------------------------|--------------------------|--------------------------|-----------------|
| copy_to_region(x, g)                         | identity                 | all-reduce (sum)         | f               |
| reduce_from_region(x, g)                     | all-reduce (sum)         | identity                 | g               |
| gather_from_sequence_region(x, g, dim)       | all-gather along dim     | reduce-scatter along dim | SP, into column |
| reduce_scatter_to_sequence_region(x, g, dim) | reduce-scatter along dim | all-gather along dim     | SP after row    |
| scatter_to_region(x, g, dim)                 | keep my slice of dim     | all-gather along dim     | scatter_to_tp   |
| gather_from_region(x, g, dim)                | all-gather along dim     | keep my slice of dim     | gather_output   |
| seq_to_head(x, g) / head_to_seq(x, g)        | Ulysses all-to-all       | the inverse all-to-all   | Ulysses         |
| exchange_rows(x, send, recv, g)              | all-to-all-v of rows     | the reverse all-to-all-v | EP dispatch     |

The plain collectives underneath (slices in group-rank order, sums in the tensor's dtype) are in
msparallel_ds.distributed.collectives; the async issue/wait pairs of the interleave in msparallel_ds.interleave.overlap.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..distributed.collectives import (_chunk, _size, all_gather_along, all_reduce, all_to_all_v, reduce_scatter_along,
                                       split_along)

__all__ = ["IdentityAllReduce", "AllReduceIdentity", "AllGatherReduceScatter", "ReduceScatterAllGather",
           "SplitAllGather", "AllGatherSplit", "SeqToHeadAllToAll", "HeadToSeqAllToAll", "RowsAllToAll",
           "copy_to_region", "reduce_from_region", "gather_from_sequence_region", "reduce_scatter_to_sequence_region",
           "scatter_to_region", "gather_from_region", "seq_to_head", "head_to_seq", "exchange_rows"]


# ---------------------------------------------------------------------------------------------- autograd pairs
class IdentityAllReduce(torch.autograd.Function):
    """Megatron f. Forward: identity. Backward: all-reduce (each rank's branch contributed part of the grad)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return x.view_as(x)  # a new tensor object, so autograd records this node

    @staticmethod
    def backward(ctx, grad: Tensor):
        return all_reduce(grad, ctx.group), None


class AllReduceIdentity(torch.autograd.Function):
    """Megatron g. Forward: all-reduce of partial results. Backward: identity (the output is replicated)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def _dim_pair(name: str, forward, backward, doc: str) -> type:
    """An autograd Function (x, group, dim) whose forward is `forward(x, group, dim)` and whose backward is
    `backward(grad, group, dim)`: the four sequence/tensor-parallel pairs below differ only in those two collectives."""
    def fwd(ctx, x: Tensor, group, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return forward(x, group, dim)

    def bwd(ctx, grad: Tensor):
        return backward(grad, ctx.group, ctx.dim), None, None

    return type(name, (torch.autograd.Function,), {"__doc__": doc, "__module__": __name__,
                                                     "forward": staticmethod(fwd), "backward": staticmethod(bwd)})


AllGatherReduceScatter = _dim_pair(
    "AllGatherReduceScatter", all_gather_along, reduce_scatter_along,
    "SP into a column-parallel region. Forward: all-gather along dim. Backward: reduce-scatter along dim (every "
    "rank's branch used the whole gathered tensor, so each slice's grad is the sum over ranks).")
ReduceScatterAllGather = _dim_pair(
    "ReduceScatterAllGather", reduce_scatter_along, all_gather_along,
    "SP out of a row-parallel region. Forward: reduce-scatter along dim. Backward: all-gather along dim.")
SplitAllGather = _dim_pair(
    "SplitAllGather", split_along, all_gather_along,
    "Forward: keep this rank's slice of a replicated tensor. Backward: all-gather the slices' grads.")
AllGatherSplit = _dim_pair(
    "AllGatherSplit", all_gather_along, split_along,
    "Forward: all-gather slices into a replicated tensor. Backward: keep this rank's slice of the grad (every rank "
    "holds the same replicated grad, so no sum).")


def copy_to_region(x: Tensor, group) -> Tensor:
    return x if _size(group) == 1 else IdentityAllReduce.apply(x, group)


def reduce_from_region(x: Tensor, group) -> Tensor:
    return x if _size(group) == 1 else AllReduceIdentity.apply(x, group)


def gather_from_sequence_region(x: Tensor, group, dim: int) -> Tensor:
    return x if _size(group) == 1 else AllGatherReduceScatter.apply(x, group, dim)


def reduce_scatter_to_sequence_region(x: Tensor, group, dim: int) -> Tensor:
    if _size(group) == 1:
        return x
    _chunk(x, group, dim)  # raise the clear error here, outside autograd
    return ReduceScatterAllGather.apply(x, group, dim)


def scatter_to_region(x: Tensor, group, dim: int) -> Tensor:
    return x if _size(group) == 1 else SplitAllGather.apply(x, group, dim)


def gather_from_region(x: Tensor, group, dim: int) -> Tensor:
    return x if _size(group) == 1 else AllGatherSplit.apply(x, group, dim)


# ---------------------------------------------------------------------------------------------- Ulysses all-to-all
def _seq_to_head(x: Tensor, group) -> Tensor:
    """[b, h, s, d] (sequence piece `rank`) -> [b, h/U, U*s, d] (head chunk `rank`, sequence in rank order)."""
    u = dist.get_world_size(group)
    b, h, s, d = x.shape
    # dim 0 = destination rank: head chunk j goes to rank j (all_to_all_single splits dim 0 evenly)
    send = x.reshape(b, u, h // u, s, d).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # dim 0 = source rank = its sequence piece: put it in front of the sequence dim
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // u, u * s, d)


def _head_to_seq(x: Tensor, group) -> Tensor:
    """Inverse of _seq_to_head: [b, h/U, U*s, d] -> [b, h, s, d]."""
    u = dist.get_world_size(group)
    b, hu, us, d = x.shape
    s = us // u
    send = x.reshape(b, hu, u, s, d).permute(2, 0, 1, 3, 4).contiguous()  # dim 0 = destination's sequence piece
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1).reshape(b, u * hu, s, d)  # dim 0 = source rank = head chunk


class SeqToHeadAllToAll(torch.autograd.Function):
    """Forward: gather the sequence, scatter the heads over `group`. Backward: the inverse (head-to-seq)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return _seq_to_head(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _head_to_seq(grad, ctx.group), None


class HeadToSeqAllToAll(torch.autograd.Function):
    """Forward: gather the heads, scatter the sequence over `group`. Backward: the inverse (seq-to-head)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return _head_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _seq_to_head(grad, ctx.group), None


def seq_to_head(x: Tensor, group) -> Tensor:
    return x if _size(group) == 1 else SeqToHeadAllToAll.apply(x, group)


def head_to_seq(x: Tensor, group) -> Tensor:
    return x if _size(group) == 1 else HeadToSeqAllToAll.apply(x, group)


# ---------------------------------------------------------------------------------------------- expert-parallel rows
class RowsAllToAll(torch.autograd.Function):
    """Forward: rows in destination-rank blocks (sizes `send`) go to their ranks; this rank gets source-rank blocks
    (sizes `recv`). Backward: the same exchange reversed (each row's grad goes back to the rank that sent it)."""

    @staticmethod
    def forward(ctx, x: Tensor, send: list[int], recv: list[int], group) -> Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return all_to_all_v(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return all_to_all_v(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def exchange_rows(x: Tensor, send: list[int], recv: list[int], group) -> Tensor:
    return x if _size(group) == 1 else RowsAllToAll.apply(x, send, recv, group)
