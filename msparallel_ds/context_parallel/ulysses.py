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

from typing import Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

# The generic all-to-all pair lives with the other autograd collectives (DESIGN: one place); re-exported here.
# Attention uses _ToHeads/_ToSeq below: same exchange, laid out so the kernels need no copies of their own.
from ..tensor_parallel.mappings import HeadToSeqAllToAll, SeqToHeadAllToAll, head_to_seq, seq_to_head
from .allgather import attend_blocks, attend_blocks_backward, doc_blocks, gather_doc_ids
from .kernels import Backend, block_backward, block_forward, select_backend
from .ring import _acc_dtype, release

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
        # dout as it comes: the CPU flash kernel copies any layout but [b, s, h, d] memory itself, so a
        # .contiguous() here ([b, h, s, d]) would cost a copy of the kernel's own copy
        dq, dk, dv = block_backward(dout, q, k, v, out, lse, causal=ctx.causal, scale=ctx.scale,
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


def _exchange(sends: Iterable[tuple[Tensor, Tensor]], group, finish: Callable[[Tensor, int], Tensor],
              before_send: Optional[Callable[[], None]] = None) -> list[Tensor]:
    """All-to-all each (send, source) pair's send buffer; [finish(received, i)] in order. Each exchange starts as
    soon as its buffer is built (the caller builds them lazily), so a tensor's copy overlaps the previous one's
    transfer. As soon as an exchange is done, a send buffer we allocated (not the caller's source memory) is
    freed, and the received one is handed to finish (and freed, unless finish returned a view of it).
    before_send() (the api's peer check) runs once the first buffer is built, before anything is sent."""
    pending = []
    for send, source in sends:
        if before_send is not None:
            before_send()
            before_send = None
        recv = torch.empty_like(send)
        pending.append((send, source, recv, dist.all_to_all_single(recv, send, group=group, async_op=True)))
    out = []
    for i in range(len(pending)):
        send, source, recv, work = pending[i]
        pending[i] = None  # the loop holds the buffers no longer than their exchange
        work.wait()
        if send.untyped_storage().data_ptr() != source.untyped_storage().data_ptr():
            release(send)
        del send, source
        out.append(finish(recv, i))
        if out[-1].untyped_storage().data_ptr() != recv.untyped_storage().data_ptr():
            release(recv)  # copied out of (not a view of it): gloo's thread may hold it a while longer otherwise
        del recv
    return out


def _heads_send(x: Tensor, u: int, rep: int) -> Tensor:
    """[b, h, s, d] (sequence piece `rank`, any strides) -> the send buffer [U(dst), b, s, h*rep/U, d] with each
    head replicated `rep` times (GQA, U % h_kv == 0). The one copy; for rep == 1 a [b, s, h, d]-memory input with
    b == 1 needs none (splitting h is a view)."""
    b, h, s, d = x.shape
    src = x.transpose(1, 2)  # [b, s, h, d]
    if rep == 1:
        return src.reshape(b, s, u, h // u, d).permute(2, 0, 1, 3, 4).contiguous()
    send = torch.empty(u, b, s, h * rep // u, d, dtype=x.dtype, device=x.device)  # destination j: kv head j // rep
    send.view(h, rep, b, s, d).copy_(src.permute(2, 0, 1, 3).unsqueeze(1))
    return send


def _heads_view(recv: Tensor) -> Tensor:
    """The received [U(src), b, s, hu, d] (the sequence in rank order) as [b, hu, U*s, d]; for b == 1 a view in
    [b, s, h, d] memory: what the CPU flash kernels read (and take dout in) without a copy of their own."""
    u, b, s, hu, d = recv.shape
    out = recv.view(b, u * s, hu, d) if b == 1 else recv.transpose(0, 1).reshape(b, u * s, hu, d)
    return out.transpose(1, 2)


def _seq_send(y: Tensor, u: int) -> Tensor:
    """[b, hu, U*s, d] -> the send buffer [U(dst), b, s, hu, d]: a view for a [b, s, h, d]-memory y with b == 1
    (what _heads_view and the kernels give)."""
    b, hu, us, d = y.shape
    return y.transpose(1, 2).reshape(b, u, us // u, hu, d).transpose(0, 1).contiguous()


def _seq_view(recv: Tensor, rep: int) -> Tensor:
    """The received [U(src), b, s, hu, d] -> [b, h, s, d] in [b, s, h, d] memory (the layout the caller's
    [b, s, h, d] tensors have); rep > 1 sums each head's replicas (the gradient of the replication)."""
    u, b, s, hu, d = recv.shape
    h = u * hu // rep
    out = torch.empty(b, s, h, d, dtype=recv.dtype, device=recv.device)
    if rep == 1:
        out.view(b, s, u, hu, d).copy_(recv.permute(1, 2, 0, 3, 4))
    else:  # source j held a replica of kv head j // rep (hu == 1)
        torch.sum(recv.view(h, rep, b, s, d), dim=1, out=out.permute(2, 0, 1, 3))
    return out.transpose(1, 2)


def _to_heads(xs: tuple[Tensor, ...], reps: tuple[int, ...], group, before_send=None) -> list[Tensor]:
    u = dist.get_world_size(group)
    sends = ((_heads_send(x, u, rep), x) for x, rep in zip(xs, reps))
    return _exchange(sends, group, lambda recv, i: _heads_view(recv), before_send)


def _to_seq(ys: tuple[Tensor, ...], reps: tuple[int, ...], group) -> list[Tensor]:
    u = dist.get_world_size(group)
    return _exchange(((_seq_send(y, u), y) for y in ys), group, lambda recv, i: _seq_view(recv, reps[i]))


class _ToHeads(torch.autograd.Function):
    """seq -> head all-to-all of q, k, v together (k/v with GQA replication `rep`): the three exchanges are in
    flight at once, each copy overlapping the previous transfer; backward is the inverse, summing the replicas."""

    @staticmethod
    def forward(ctx, q, k, v, group, rep, before_send):
        ctx.group, ctx.reps = group, (1, rep, rep)
        return tuple(_to_heads((q, k, v), ctx.reps, group, before_send))

    @staticmethod
    def backward(ctx, dq, dk, dv):
        return (*_to_seq((dq, dk, dv), ctx.reps, ctx.group), None, None, None)


class _ToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _to_seq((y,), (1,), group)[0]

    @staticmethod
    def backward(ctx, grad):
        return _to_heads((grad,), (1,), ctx.group)[0], None


# ---------------------------------------------------------------------------------------------- attention
def ulysses_wrap(q: Tensor, k: Tensor, v: Tensor, group, inner: Callable[[Tensor, Tensor, Tensor], Tensor],
                 before_send: Optional[Callable[[], None]] = None) -> Tensor:
    """all-to-all q/k/v to head-sharded over `group`, out = inner(q, k, v) on the gathered sequence, all-to-all back.

    Shared by Ulysses (inner = local attention) and hybrid (inner = ring attention over cp_ring). before_send()
    runs before the first collective (once q's send buffer is built).
    """
    u = dist.get_world_size(group)
    check_ulysses_heads(q.shape[1], k.shape[1], u)
    if u == 1:
        if before_send is not None:
            before_send()
        return inner(q, k, v)
    rep = 1 if k.shape[1] % u == 0 else u // k.shape[1]  # h_kv < U: each kv head U/h_kv times (check above)
    qh, kh, vh = _ToHeads.apply(q, k, v, group, rep, before_send)
    return _ToSeq.apply(inner(qh, kh, vh), group)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group, *, causal: bool, scale: float,
                      backend: Union[None, str, Backend] = None, doc_ids: Optional[Tensor] = None,
                      before_send: Optional[Callable[[], None]] = None) -> Tensor:
    """q [b, h, s_local, d], k [b, h_kv, s_local, d], v [b, h_kv, s_local, d_v]: this rank's contiguous sequence
    piece (rank order) over `group`. Returns [b, h, s_local, d_v]. Autograd flows through both all-to-alls and the
    block kernels.
    doc_ids [b, s_local]: this piece's document ids (non-decreasing along the full row): document-causal attention."""
    be = resolve_backend(backend, q)
    if doc_ids is None:
        return ulysses_wrap(q, k, v, group, lambda q_, k_, v_: local_attention(q_, k_, v_, causal=causal,
                                                                                scale=scale, backend=be),
                            before_send)
    if before_send is not None:
        before_send()
    full = gather_doc_ids(doc_ids, group, 1, dist.get_world_size(group))
    plan = doc_blocks(full, [(0, 0, full.shape[1])], causal)
    return ulysses_wrap(q, k, v, group, lambda q_, k_, v_: _PackedAttention.apply(q_, k_, v_, plan, scale, be))
