"""All-gather context parallelism (MindFormers' colossalai_cp): gather K/V over cp, attend locally.

Every rank holds its zigzag shard (sharding.py with R = cp, U = 1): query chunks r and 2R-1-r, so causal work is
balanced. Forward all-gathers only the h_kv heads of K and V (one packed buffer) and reassembles the full sequence
in global order; each local query chunk m attends to the prefix before it (no mask) and to itself (causal
diagonal), merged in fp32: no full mask is ever built. Backward re-gathers K/V (nothing sequence-sized is saved),
accumulates dK/dV for the whole sequence in fp32 and reduce-scatters (sum) them back to their owners in fp32.

One autograd.Function covers gather -> attend -> reduce-scatter so the dK/dV partial sums cross ranks in fp32
(split into two Functions, autograd would round them to the input dtype at the boundary before the sum).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import sharding
from .kernels import Backend, block_backward, block_forward, merge, select_backend
from .ring import _acc_dtype, _check

__all__ = ["allgather_attention"]

# torch >= 2.13 renamed the tensor-form collectives; older ones only have the *_tensor names.
def _all_gather_single(*args, **kwargs):  # looked up per call, so wrappers (e.g. byte counters) see it
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter_single(*args, **kwargs):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


def _all_gather_kv(k: Tensor, v: Tensor, group) -> Tensor:
    """[2, b, h_kv, S, d]: every rank's K/V shard, in global token order."""
    n = dist.get_world_size(group)
    kv = torch.stack([k, v]).contiguous()
    out = torch.empty((n * 2, *kv.shape[1:]), dtype=kv.dtype, device=kv.device)  # concat form: any backend
    _all_gather_single(out, kv, group=group)
    return sharding.unshard(list(out.view(n, *kv.shape).unbind(0)), 3, n, 1)


def _reduce_scatter_dkv(dkv_full: Tensor, group) -> Tensor:
    """Sum every rank's full-sequence dK/dV [2, b, h_kv, S, d] and give each rank its own shard of the sum."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    parts = torch.cat([sharding.shard(dkv_full, 3, n, 1, j, 0) for j in range(n)], dim=0)  # rank-major
    out = torch.empty_like(parts[:2])
    try:
        _reduce_scatter_single(out, parts, group=group)
    except (RuntimeError, NotImplementedError):  # backends without reduce_scatter (old gloo): all-reduce + slice
        dist.all_reduce(parts, group=group)
        out = parts[2 * me: 2 * me + 2]
    return out


def _chunks(R: int, r: int, half: int, causal: bool):
    """(local query slice, global chunk id) pairs; non-causal: the whole local segment, no chunk."""
    if not causal:
        return [(slice(None), None)]
    return [(slice(0, half), r), (slice(half, 2 * half), 2 * R - 1 - r)]


class _AllGatherKVAttendReduceScatterDKV(torch.autograd.Function):
    """forward: all-gather K/V over the cp group, attend; backward: block grads, reduce-scatter dK/dV (fp32 sum)."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, backend):
        R, r, half = dist.get_world_size(group), dist.get_rank(group), q.shape[2] // 2
        kv = _all_gather_kv(k, v, group)
        outs, lses = [], []
        for qs, m in _chunks(R, r, half, causal):
            qc = q[:, :, qs]
            if m is None:
                out, lse = block_forward(qc, kv[0], kv[1], causal=False, scale=scale, backend=backend)
            else:
                diag = slice(m * half, (m + 1) * half)
                out, lse = merge(None, None, *block_forward(qc, kv[0, :, :, diag], kv[1, :, :, diag], causal=True,
                                                            scale=scale, backend=backend))
                if m > 0:  # everything before this chunk is fully visible
                    pre = slice(0, m * half)
                    out, lse = merge(out, lse, *block_forward(qc, kv[0, :, :, pre], kv[1, :, :, pre], causal=False,
                                                              scale=scale, backend=backend))
            outs.append(out)
            lses.append(lse)
        out, lse = torch.cat(outs, 2).to(q.dtype), torch.cat(lses, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.backend = group, causal, scale, backend
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale, backend = ctx.group, ctx.causal, ctx.scale, ctx.backend
        R, r, half = dist.get_world_size(group), dist.get_rank(group), q.shape[2] // 2
        acc = _acc_dtype(q.dtype)
        kv = _all_gather_kv(k, v, group)  # re-gathered: saving it would keep S-sized K/V per layer alive
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        for qs, m in _chunks(R, r, half, causal):
            qc, oc, lc, dc = (t[:, :, qs].contiguous() for t in (q, out, lse, dout))
            if m is None:
                blocks = [(slice(None), False)]
            else:
                blocks = [(slice(m * half, (m + 1) * half), True)] + ([(slice(0, m * half), False)] if m > 0 else [])
            for ks, blk_causal in blocks:
                g = block_backward(dc, qc, kv[0, :, :, ks], kv[1, :, :, ks], oc, lc, causal=blk_causal, scale=scale,
                                   backend=backend)
                dq[:, :, qs] += g[0]
                dkv[0, :, :, ks] += g[1]
                dkv[1, :, :, ks] += g[2]
        dkv = _reduce_scatter_dkv(dkv, group)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def allgather_attention(q: Tensor, k: Tensor, v: Tensor, group: Optional[dist.ProcessGroup], *, causal: bool,
                        scale: Optional[float] = None, backend: Optional[str | Backend] = None) -> Tensor:
    """colossalai_cp attention of this rank's zigzag-sharded q over the all-gathered k/v of `group` (the cp group).
    q [b, h, s_local, d], k/v [b, h_kv, s_local, d] -> [b, h, s_local, d] in q.dtype."""
    _check(q, k, v, causal)
    if group is None:
        group = dist.group.WORLD
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if not isinstance(backend, Backend):
        backend = select_backend(q.device, q.dtype, name=backend)
    return _AllGatherKVAttendReduceScatterDKV.apply(q, k, v, group, causal, scale, backend)
