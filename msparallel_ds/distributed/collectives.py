"""Plain (non-autograd) collectives: the one place where msparallel_ds issues a collective by hand.

Group-level (tp/sp/cp layers, weights): all_reduce, all_gather_along, reduce_scatter_along, split_along take the
process group explicitly and return the input untouched on a size-1 group. Slices are in group-rank order: rank r
owns elements [r*n/N, (r+1)*n/N) of `dim`. Gathers and reduce-scatters move `dim` to the front so each rank's
piece is one contiguous block (the tensor-form collectives need that), so they work for any dim on any backend and
device. Sums run in the tensor's dtype. They report to distributed.instruments.

Agreement checks: gather_ints (one tiny all-gather of int64 metadata, e.g. shapes, dtype_code, content hashes)
lets every rank of a group compare what its peers were given before the first real collective, so a mismatch is
one clear error on every rank instead of a hang or a backend abort. Not instrumented.

Layout-level (engines: losses, token counts, gradients): sum_over a named layout dim, all_reduce_flat
and clip_grad_norm_. In place, skipped on a size-1 dim, and not instrumented (they run outside the interleaved
forward/backward that the instruments measure).
"""
from __future__ import annotations

import math
import zlib
from typing import TYPE_CHECKING, Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .instruments import bus_bytes, sync_done, sync_start

if TYPE_CHECKING:
    from .layout import ParallelLayout

__all__ = ["all_reduce", "all_gather_along", "all_to_all_v", "exchange_counts", "reduce_scatter_along",
           "start_reduce_scatter", "split_along", "gather_ints", "start_gather_ints", "dtype_code", "sum_over",
           "start_sum_over", "all_reduce_flat", "global_grad_norm", "clip_grad_norm_"]


# ---------------------------------------------------------------------------------------------- group-level
def _size(group) -> int:
    return dist.get_world_size(group)


def _chunk(x: Tensor, group, dim: int) -> int:
    """Length of one rank's slice of `dim`; a clear error (on every rank, before any collective) if it is not even."""
    n, length = _size(group), x.shape[dim]
    if length % n:
        raise ValueError(f"dim {dim} of a tensor of shape {tuple(x.shape)} has size {length}, which is not divisible "
                         f"by the group size {n}: every rank must hold an equal slice (pad the sequence/features)")
    return length // n


def _unsupported(e: Exception) -> bool:  # old gloo lacks the tensor-form collectives ("... does not support ...")
    return "support" in str(e)


def all_reduce(x: Tensor, group, op=dist.ReduceOp.SUM) -> Tensor:
    """Out of place: autograd may share `x` (a grad fanned out to several branches, a saved activation)."""
    if _size(group) == 1:
        return x
    t0 = sync_start()
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=op, group=group)
    sync_done(t0, "all_reduce", bus_bytes("all_reduce", out, _size(group)))
    return out


def _gather_concat(x: Tensor, group, n: int) -> Tensor:
    """Every rank's contiguous x concatenated along dim 0 (the concat form every backend accepts)."""
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    try:
        # torch 2.13 renamed all_gather_into_tensor; look up per call so wrappers (byte counters) see it
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, group=group)
    except (RuntimeError, NotImplementedError) as e:
        if not _unsupported(e):
            raise
        dist.all_gather(list(out.chunk(n)), x, group=group)
    return out


def all_gather_along(x: Tensor, group, dim: int) -> Tensor:
    """Every rank's x concatenated along dim, in group-rank order (contiguous result)."""
    n = _size(group)
    if n == 1:
        return x
    dim %= x.dim()
    t0 = sync_start()
    x = x.contiguous()
    out = _gather_concat(x, group, n)
    sync_done(t0, "all_gather", bus_bytes("all_gather", out, n))
    # rank-major blocks -> rank slices along dim: a view when dim == 0, else one copy
    return out.unflatten(0, (n, x.shape[0])).movedim(0, dim).flatten(dim, dim + 1)


def _native_reduce_scatter(group) -> bool:
    """Whether the group's backend has a real reduce-scatter. gloo's reduce_scatter_tensor is a full all-reduce of a
    clone plus a copy of this rank's block (ProcessGroupGloo::reduce_scatter_tensor_coalesced, torch 2.x): it moves
    all-reduce bytes, so sequence parallel paid an all-reduce AND an all-gather where tp alone pays one all-reduce.
    There an all-to-all of the destination blocks and a local sum move what a reduce-scatter should."""
    return dist.get_backend(group) != "gloo"


def start_reduce_scatter(send: Tensor, group, async_op: bool = False) -> tuple[Optional[object], Callable[[], Tensor]]:
    """Reduce-scatter of `send` [n, *block] (contiguous, destination rank first): (work, finish() -> this rank's
    summed block). Blocking when not async_op (work is then None or done). `send` is never written."""
    if not _native_reduce_scatter(group):
        recv = torch.empty_like(send)  # recv[i] = rank i's block for this rank, summed in rank order
        work = dist.all_to_all_single(recv, send, group=group, async_op=async_op)
        return work, (lambda: recv.sum(0))
    out = send.new_empty(send.shape[1:])
    try:
        work = (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(
            out, send.flatten(0, 1), group=group, async_op=async_op)
        return work, (lambda: out)
    except (RuntimeError, NotImplementedError) as e:
        if not _unsupported(e):
            raise
    summed = send.clone()  # send may be a view of the caller's tensor: reduce a copy
    work = dist.all_reduce(summed, group=group, async_op=async_op)
    rank = dist.get_rank(group)
    return work, (lambda: summed[rank])


def reduce_scatter_along(x: Tensor, group, dim: int) -> Tensor:
    """Sum of every rank's x, of which this rank keeps its slice along dim."""
    n = _size(group)
    if n == 1:
        return x
    dim %= x.dim()
    piece = _chunk(x, group, dim)
    t0 = sync_start()
    send = x.unflatten(dim, (n, piece)).movedim(dim, 0).contiguous()  # destination rank first (concat form)
    out = start_reduce_scatter(send, group)[1]()
    sync_done(t0, "reduce_scatter", bus_bytes("reduce_scatter", send, n))
    return out


def split_along(x: Tensor, group, dim: int) -> Tensor:
    """This rank's slice of dim (contiguous, so the caller may free x)."""
    if _size(group) == 1:
        return x
    piece = _chunk(x, group, dim)
    return x.narrow(dim, dist.get_rank(group) * piece, piece).contiguous()


def exchange_counts(send_counts: Tensor, group) -> Tensor:
    """How many rows each rank of `group` will send this rank, from how many this rank sends each (int64 [n])."""
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts.contiguous(), group=group)
    return recv


def all_to_all_v(x: Tensor, send: list[int], recv: list[int], group) -> Tensor:
    """Rows of `x` in destination-rank blocks of sizes `send` -> the rows every rank sent here, in source-rank blocks
    of sizes `recv` (the expert-parallel token exchange)."""
    t0 = sync_start()
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
    row = math.prod(x.shape[1:]) * x.element_size()
    mine = send[dist.get_rank(group)] if send else 0
    sync_done(t0, "all_to_all", float((sum(send) - mine) * row))
    return out


def dtype_code(dtype) -> int:
    """A number naming `dtype` that is the same in every process (for gather_ints); 0 for None."""
    return 0 if dtype is None else zlib.crc32(str(dtype).encode())


def gather_ints(values: Sequence[int], group, device=None) -> list[list[int]]:
    """Every rank's `values` (int64 range, the same count on every rank) in group-rank order, from one all-gather;
    `device`: where the tensor goes (the group's backend must accept it; default CPU). [values] on a size-1 group."""
    return start_gather_ints(values, group, device)()


def start_gather_ints(values: Sequence[int], group, device=None) -> Callable[[], list[list[int]]]:
    """gather_ints started async; returns wait(), which gives the rows (the latency hides behind what runs between
    the two, e.g. building the next collective's send buffer)."""
    n = _size(group)
    if n == 1:
        return lambda: [list(values)]
    x = torch.tensor(list(values), dtype=torch.int64, device=device)
    out = x.new_empty((n, x.numel()))
    work = dist.all_gather(list(out.unbind(0)), x, group=group, async_op=True)  # the list form: every backend

    def wait() -> list[list[int]]:
        work.wait()
        return out.cpu().tolist()

    return wait


# ---------------------------------------------------------------------------------------------- layout-level
def sum_over(layout: ParallelLayout, name: str, t: Tensor) -> Tensor:
    """t summed in place over layout dim `name` (e.g. "dp", "cp", "dp_cp"); returns t."""
    if layout.size(name) > 1:
        dist.all_reduce(t, group=layout.group(name))
    return t


def start_sum_over(layout: ParallelLayout, name: str, t: Tensor) -> Callable[[], Tensor]:
    """Start summing t in place over layout dim `name`; returns wait(), which gives t once summed. The collective's
    latency then hides behind whatever runs between the two (a forward, a backward)."""
    if layout.size(name) <= 1:
        return lambda: t
    work = dist.all_reduce(t, group=layout.group(name), async_op=True)

    def wait() -> Tensor:
        work.wait()
        return t

    return wait


def all_reduce_flat(tensors: Sequence[Tensor], layout: ParallelLayout, name: str,
                    bucket_numel: Optional[int] = None) -> None:
    """Sum every tensor in place over layout dim `name`, packing consecutive small tensors into one all-reduce of
    their concatenation (one latency for many small gradients). `bucket_numel` bounds each concatenation, and so the
    copy's memory (MindFormers' gradient fusion groups, DeepSpeed's reduce_bucket_size): a tensor at least that
    big is summed on its own, in place, with no copy. None: one concatenation of everything."""
    if layout.size(name) <= 1 or not tensors:
        return
    group = layout.group(name)
    cap = bucket_numel or sum(t.numel() for t in tensors)
    bucket: list[Tensor] = []
    filled = 0
    for t in tensors:
        if bucket and filled + t.numel() > cap:
            _sum_bucket(bucket, group)
            bucket, filled = [], 0
        bucket.append(t)
        filled += t.numel()
    _sum_bucket(bucket, group)


def _sum_bucket(tensors: list[Tensor], group) -> None:
    if len(tensors) == 1 and tensors[0].is_contiguous():  # alone in its bucket (at least cap big): in place
        dist.all_reduce(tensors[0], group=group)
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    # Free the copy here: the backend's worker thread may hold its work's reference a moment longer, and a free
    # made there is one no profiler of this thread sees (benchmarks/memory.py counted such a bucket as live)
    flat.untyped_storage().resize_(0)


def global_grad_norm(params: Iterable[torch.nn.Parameter], layout: ParallelLayout,
                     device: Optional[torch.device] = None) -> Tensor:
    """The global L2 norm of the grads (grads already summed over dp_cp), the same on every rank; non-finite when any
    gradient is. Global over the model's shards: tp-sharded parameters (attribute tensor_model_parallel) count on
    every tp rank, replicated ones on tp rank 0 only, and the squares are summed over "pp_tp" (the stages and tp
    shards of one replica; a copy marked shared_embedding is counted once, on its first stage). Expert-parallel parameters (attribute expert_parallel; their grads already summed over
    edp) are distinct per ep rank: their squares are summed over "ep" (all of a stage's experts) and then counted
    once per stage, on tp rank 0. Every param must have a grad. `device`: where the norm is computed (default: the
    first grad's)."""
    params = list(params)
    if device is None:
        device = params[0].grad.device if params else torch.device("cpu")
    tp_rank0 = layout.rank("tp") == 0
    sq = torch.zeros((), dtype=torch.float32, device=device)
    expert_sq = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if getattr(p, "shared_embedding", False):  # the last stage's copy of the first stage's (pipeline.shared)
            continue
        if getattr(p, "expert_parallel", False):
            expert_sq += p.grad.detach().float().pow(2).sum()
        elif getattr(p, "tensor_model_parallel", False) or tp_rank0:
            sq += p.grad.detach().float().pow(2).sum()
    if layout.size("ep") > 1:
        sum_over(layout, "ep", expert_sq)
    if tp_rank0:
        sq += expert_sq
    sum_over(layout, "pp_tp", sq)
    return sq.sqrt()


def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float, layout: ParallelLayout,
                    device: Optional[torch.device] = None) -> Tensor:
    """Scale the grads in place so their global L2 norm (global_grad_norm) is at most max_norm; returns the norm
    before clipping."""
    params = list(params)
    norm = global_grad_norm(params, layout, device)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(coef.to(p.grad.dtype))
    return norm
