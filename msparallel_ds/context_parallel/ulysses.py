"""Ulysses (DeepSpeed-Ulysses) context parallelism: all-to-all from sequence-sharded to head-sharded and back.

Each rank of the Ulysses group holds a contiguous sequence piece of all heads, [b, h, s/U, d]. One all-to-all
gives it the whole sequence (of this group) for h/U heads, attention runs locally on that, and the inverse
all-to-all returns the output to the sequence-sharded layout. Layout inside context_parallel/ is [b, h, s, d].

GQA (DeepSpeed ALST's rule): kv heads are split like q heads when h_kv % U == 0; when U % h_kv == 0 each kv head is
replicated U/h_kv times first (autograd of the replication sums the replicas' gradients); otherwise a clear error.

Packed sequences (doc_ids): after the all-to-all every rank holds the whole sequence in order, so the documents'
ids are all-gathered once (tiny) and each document runs as its own causal block (allgather.doc_blocks): nothing
crosses a document and no [S, S] mask is built.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

# The all-to-all pair lives with the other autograd collectives (DESIGN: one place); re-exported here.
from ..tensor_parallel.mappings import HeadToSeqAllToAll, SeqToHeadAllToAll, head_to_seq, seq_to_head
from .allgather import attend_blocks, attend_blocks_backward, doc_blocks, gather_doc_ids
from .kernels import Backend, block_backward, block_forward, select_backend
from .ring import _acc_dtype

__all__ = ["SeqToHeadAllToAll", "HeadToSeqAllToAll", "seq_to_head", "head_to_seq", "local_attention",
           "ulysses_attention", "ulysses_wrap", "check_ulysses_heads", "valid_ulysses_degrees", "resolve_backend"]


# ---------------------------------------------------------------------------------------------- local attention
def resolve_backend(backend: Union[None, str, Backend], q: Tensor) -> Backend:
    return backend if isinstance(backend, Backend) else select_backend(q.device, q.dtype, name=backend)


class _LocalAttention(torch.autograd.Function):
    """One block over the whole local sequence; saves only q, k, v, out, lse (flash-style memory)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, backend):
        out, lse = block_forward(q, k, v, causal=causal, scale=scale, backend=backend)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.backend = causal, scale, backend
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = block_backward(dout.contiguous(), q, k, v, out, lse, causal=ctx.causal, scale=ctx.scale,
                                    backend=ctx.backend)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


class _PackedAttention(torch.autograd.Function):
    """Local attention following a document plan (allgather.doc_blocks) over the whole local sequence."""

    @staticmethod
    def forward(ctx, q, k, v, plan, scale, backend):
        out, lse = attend_blocks(q, k, v, plan, scale, backend)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale, ctx.backend = plan, scale, backend
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = (torch.zeros(t.shape, dtype=_acc_dtype(q.dtype), device=q.device) for t in (q, k, v))
        attend_blocks_backward(dout, q, k, v, out, lse, ctx.plan, ctx.scale, ctx.backend, dq, dk, dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def local_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float,
                    backend: Union[None, str, Backend] = None) -> Tensor:
    """Plain attention on this rank's tensors ([b, h, s, d], k/v with h_kv heads, v with its own head dim) through
    the block kernels."""
    return _LocalAttention.apply(q, k, v, causal, scale, resolve_backend(backend, q))


# ---------------------------------------------------------------------------------------------- head rules
def _ok(h: int, h_kv: int, u: int) -> bool:
    return h % u == 0 and (h_kv % u == 0 or u % h_kv == 0)


def valid_ulysses_degrees(num_heads: int, num_kv_heads: int) -> list[int]:
    """Ulysses degrees that these head counts allow (h % U == 0 and h_kv % U == 0 or U % h_kv == 0)."""
    return [u for u in range(1, num_heads + 1) if _ok(num_heads, num_kv_heads, u)]


def check_ulysses_heads(num_heads: int, num_kv_heads: int, degree: int) -> None:
    """Raise a ValueError naming the numbers and the nearest valid degrees when U cannot split these heads."""
    if _ok(num_heads, num_kv_heads, degree):
        return
    valid = valid_ulysses_degrees(num_heads, num_kv_heads)
    below = max((u for u in valid if u < degree), default=None)
    above = min((u for u in valid if u > degree), default=None)
    nearest = " or ".join(str(u) for u in (below, above) if u is not None)
    if num_heads % degree:
        rule = f"num_heads={num_heads} is not divisible by the Ulysses degree {degree}"
    else:
        rule = (f"num_kv_heads={num_kv_heads} and the Ulysses degree {degree} do not divide each other (need "
                f"num_kv_heads % {degree} == 0, or {degree} % num_kv_heads == 0 to replicate each kv head)")
    raise ValueError(f"Ulysses attention: {rule}. Valid Ulysses degrees for {num_heads} heads / {num_kv_heads} kv "
                     f"heads: {valid}; nearest: {nearest}. Change ulysses_degree_in_cp / context_parallel, or use "
                     f"context_parallel_algo colossalai_cp (ring/all-gather have no head constraint).")


def _replicate_kv(x: Tensor, u: int) -> Tensor:
    """h_kv < U with U % h_kv == 0: each kv head U/h_kv times so every rank gets the kv head of its q heads."""
    h_kv = x.shape[1]
    return x if h_kv % u == 0 else x.repeat_interleave(u // h_kv, dim=1)


# ---------------------------------------------------------------------------------------------- attention
def ulysses_wrap(q: Tensor, k: Tensor, v: Tensor, group, inner: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Tensor:
    """all-to-all q/k/v to head-sharded over `group`, out = inner(q, k, v) on the gathered sequence, all-to-all back.

    Shared by Ulysses (inner = local attention) and hybrid (inner = ring attention over cp_ring).
    """
    u = dist.get_world_size(group)
    check_ulysses_heads(q.shape[1], k.shape[1], u)
    if u == 1:
        return inner(q, k, v)
    qh = seq_to_head(q, group)
    kh = seq_to_head(_replicate_kv(k, u), group)
    vh = seq_to_head(_replicate_kv(v, u), group)
    return head_to_seq(inner(qh, kh, vh), group)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group, *, causal: bool, scale: float,
                      backend: Union[None, str, Backend] = None, doc_ids: Optional[Tensor] = None) -> Tensor:
    """q [b, h, s_local, d], k [b, h_kv, s_local, d], v [b, h_kv, s_local, d_v]: this rank's contiguous sequence
    piece (rank order) over `group`. Returns [b, h, s_local, d_v]. Autograd flows through both all-to-alls and the
    block kernels.
    doc_ids [b, s_local]: this piece's document ids (non-decreasing along the full row): document-causal attention."""
    be = resolve_backend(backend, q)
    if doc_ids is None:
        return ulysses_wrap(q, k, v, group, lambda q_, k_, v_: local_attention(q_, k_, v_, causal=causal,
                                                                                scale=scale, backend=be))
    full = gather_doc_ids(doc_ids, group, 1, dist.get_world_size(group))
    plan = doc_blocks(full, [(0, 0, full.shape[1])], causal)
    return ulysses_wrap(q, k, v, group, lambda q_, k_, v_: _PackedAttention.apply(q_, k_, v_, plan, scale, be))
