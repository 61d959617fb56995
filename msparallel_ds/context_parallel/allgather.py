"""All-gather context parallelism (MindFormers' colossalai_cp): gather K/V over cp, attend locally.

Every rank holds its zigzag shard (sharding.py with R = cp, U = 1): query chunks r and 2R-1-r, so causal work is
balanced. Forward all-gathers only the h_kv heads of K and V (one flat buffer, ring.pack_kv; V may have its own
head dim) and reassembles the full sequence in global order; each local query chunk m attends to the prefix before
it (no mask) and to itself (causal diagonal), merged in fp32: no full mask is ever built. Backward re-gathers K/V
(nothing sequence-sized is saved), accumulates dK/dV for the whole sequence in fp32 and reduce-scatters (sum) them
back to their owners in fp32.

One autograd.Function covers gather -> attend -> reduce-scatter so the dK/dV partial sums cross ranks in fp32
(split into two Functions, autograd would round them to the input dtype at the boundary before the sum).

Packed sequences (doc_ids): the work is a list of blocks (a "plan") computed on the host from the full sequence's
document ids: every run of local queries inside one document attends to that document's keys only, as a square
causal diagonal plus one fully visible rectangle, so no mask is ever built and the fast backend runs every block
(the varlen idea). Ulysses reuses the same plan and block loops on its gathered sequence.
"""
from __future__ import annotations

from itertools import pairwise
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import sharding
from .kernels import Backend, block_backward, block_forward, merge, select_backend
from .ring import _acc_dtype, _check, pack_kv, release, unpack_kv

__all__ = ["allgather_attention", "gather_doc_ids",
           "doc_blocks", "attend_blocks", "attend_blocks_backward"]

# torch >= 2.13 renamed the tensor-form collectives; older ones only have the *_tensor names.
def _all_gather_single(*args, **kwargs):  # looked up per call, so wrappers (e.g. byte counters) see it
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter_single(*args, **kwargs):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


def _all_gather_kv(k: Tensor, v: Tensor, group) -> tuple[Tensor, Tensor]:
    """(K [b, h_kv, S, d], V [b, h_kv, S, d_v]): every rank's shards in global token order, from one all-gather."""
    n = dist.get_world_size(group)
    kv = pack_kv(k, v)
    out = torch.empty(n * kv.numel(), dtype=kv.dtype, device=kv.device)  # concat form: any backend
    _all_gather_single(out, kv, group=group)
    parts = [unpack_kv(p, k.shape, v.shape) for p in out.view(n, -1).unbind(0)]
    full = tuple(sharding.unshard([p[i] for p in parts], 2, n, 1) for i in (0, 1))
    release(kv)  # pack_kv's own buffer
    release(out)
    return full


def _reduce_scatter_dkv(dkv_full: list[Tensor], group) -> tuple[Tensor, Tensor]:
    """Sum every rank's full-sequence dK/dV and give each rank its own shard of the sum (one reduce-scatter).
    dkv_full = [dK, dV] is emptied: the full-size tensors are freed once copied into the send buffer."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    dk_full, dv_full = dkv_full
    shape = list(dk_full.shape)
    shape[2] //= n
    k_shape, v_shape = torch.Size(shape), torch.Size(shape[:3] + [dv_full.shape[3]])
    m = k_shape.numel() + v_shape.numel()
    parts = torch.empty(n * m, dtype=dk_full.dtype, device=dk_full.device)  # rank-major, filled in place
    for j, p in enumerate(parts.view(n, m).unbind(0)):
        for dst, full in zip(unpack_kv(p, k_shape, v_shape), (dk_full, dv_full)):
            dst.copy_(sharding.shard(full, 2, n, 1, j, 0))
    dkv_full.clear()
    del dk_full, dv_full, full, dst  # the backend may copy `parts` (gloo does): not next to the full-size sums
    out = torch.empty_like(parts[:m])
    try:
        _reduce_scatter_single(out, parts, group=group)
        release(parts)
    except (RuntimeError, NotImplementedError):  # backends without reduce_scatter (old gloo): all-reduce + slice
        dist.all_reduce(parts, group=group)
        out = parts[m * me: m * (me + 1)]
    return unpack_kv(out, k_shape, v_shape)


# A plan is a list of blocks (rows, local query slice, ((global key slice, causal), ...)): the queries of one block
# see exactly the union of its key blocks, merged in fp32. Every local query is in exactly one block.
Block = tuple[slice, slice, tuple[tuple[slice, bool], ...]]


def _zigzag_ranges(R: int, r: int, half: int) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of this rank's two zigzag chunks."""
    return [(0, r * half, half), (half, (2 * R - 1 - r) * half, half)]


def _blocks(R: int, r: int, half: int, causal: bool) -> list[Block]:
    """One document: chunk m sees its causal diagonal and the fully visible prefix; non-causal sees everything."""
    if not causal:
        return [(slice(None), slice(None), ((slice(None), False),))]
    plan = []
    for l0, g0, n in _zigzag_ranges(R, r, half):
        keys = ((slice(g0, g0 + n), True),) + (((slice(0, g0), False),) if g0 > 0 else ())
        plan.append((slice(None), slice(l0, l0 + n), keys))
    return plan


def gather_doc_ids(doc_ids: Tensor, group, ring: int, ulysses: int) -> Tensor:
    """Every rank's doc-id shard [b, s_local] -> the full [b, S] in global order (sharding.py layout ring x ulysses)."""
    parts = [torch.empty_like(doc_ids) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, doc_ids.contiguous(), group=group)
    return sharding.unshard(parts, 1, ring, ulysses)


def doc_blocks(doc_ids: Tensor, q_ranges: list[tuple[int, int, int]], causal: bool) -> list[Block]:
    """Document-causal plan from the FULL sequence's ids [b, S] (identical on every rank, so a bad input raises on
    all of them alike). q_ranges: (local start, global start, length) of this rank's query pieces.

    A query at p in document [sd, ed) sees keys [sd, p] (causal) or [sd, ed): each run of queries [qa, qb) of one
    document is a square causal block on [qa, qb) plus a fully visible block on [sd, qa). Square only, because the
    backends disagree on how a non-square causal block is aligned. Rows with the same boundaries share one block.
    """
    doc = doc_ids.detach().to("cpu", torch.long)  # one small host copy: the plan is Python control flow
    bad = (doc[:, 1:] < doc[:, :-1]).nonzero()
    if len(bad):
        i, j = bad[0].tolist()
        raise ValueError(f"doc_ids must be non-decreasing along each row (each document one contiguous run, e.g. "
                         f"cumsum(position_ids == 0)); row {i} goes from {doc[i, j].item()} to {doc[i, j + 1].item()} "
                         f"at position {j + 1}")
    S = doc.shape[1]
    cuts = [[0] + (row[1:] != row[:-1]).nonzero().flatten().add(1).tolist() + [S] for row in doc]
    rows = [(slice(None), cuts[0])] if all(c == cuts[0] for c in cuts) else \
        [(slice(i, i + 1), c) for i, c in enumerate(cuts)]
    plan = []
    for rs, c in rows:
        for l0, g0, n in q_ranges:
            for sd, ed in pairwise(c):
                qa, qb = max(sd, g0), min(ed, g0 + n)
                if qa >= qb:  # this document has no query here: nothing to compute
                    continue
                if causal:
                    keys = ((slice(qa, qb), True),) + (((slice(sd, qa), False),) if sd < qa else ())
                else:
                    keys = ((slice(sd, ed), False),)
                plan.append((rs, slice(qa - g0 + l0, qb - g0 + l0), keys))
    return plan


def attend_blocks(q: Tensor, k: Tensor, v: Tensor, plan: list[Block], scale: float,
                  backend: Backend) -> tuple[Tensor, Tensor]:
    """fp32 (out, lse) of the local queries q [b, h, s, d] over the whole sequence's k [b, h_kv, S, d] and v
    [b, h_kv, S, d_v]; out has d_v columns."""
    acc = _acc_dtype(q.dtype)
    out = torch.zeros(*q.shape[:3], v.shape[3], dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    for rows, qs, keys in plan:
        qc, o, l = q[rows, :, qs], None, None
        for ks, c in keys:
            o, l = merge(o, l, *block_forward(qc, k[rows, :, ks], v[rows, :, ks], causal=c, scale=scale,
                                              backend=backend))
        out[rows, :, qs], lse[rows, :, qs] = o, l
    return out, lse


def attend_blocks_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                           plan: list[Block], scale: float, backend: Backend, dq: Tensor, dk: Tensor,
                           dv: Tensor) -> None:
    """Accumulate the plan's block gradients into the fp32 buffers dq [b, h, s, d], dk [b, h_kv, S, d] and dv
    [b, h_kv, S, d_v]."""
    for rows, qs, keys in plan:
        # views (the kernels read strided q/out/dout; copying them would only add chunk-sized buffers)
        qc, oc, dc = (t[rows, :, qs] for t in (q, out, dout))
        lc = lse[rows, :, qs].contiguous()
        piece = max(qc.shape[2], _MIN_PIECE)
        for ks, c in keys:
            for kp in ((ks,) if c else _pieces(ks, k.shape[2], piece)):
                g = block_backward(dc, qc, k[rows, :, kp], v[rows, :, kp], oc, lc, causal=c, scale=scale,
                                   backend=backend)
                dq[rows, :, qs] += g[0]
                dk[rows, :, kp] += g[1]
                dv[rows, :, kp] += g[2]
                del g  # freed before the next call allocates its own


_MIN_PIECE = 128  # key tokens: shorter backward pieces would cost more in calls than they save in memory


def _pieces(ks: slice, total: int, n: int) -> list[slice]:
    """A non-causal key range cut into pieces of at most n keys: a backward call's fresh dK/dV (per piece) then
    stays about the size of its query block's dq instead of the whole range's (a long prefix)."""
    a, b, _ = ks.indices(total)
    return [slice(i, min(i + n, b)) for i in range(a, b, n)] or [ks]


class _AllGatherKVAttendReduceScatterDKV(torch.autograd.Function):
    """forward: all-gather K/V over the cp group, attend; backward: block grads, reduce-scatter dK/dV (fp32 sum)."""

    @staticmethod
    def forward(ctx, q, k, v, group, plan, scale, backend):
        out, lse = attend_blocks(q, *_all_gather_kv(k, v, group), plan, scale, backend)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.plan, ctx.scale, ctx.backend = group, plan, scale, backend
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        acc = _acc_dtype(q.dtype)
        kf, vf = _all_gather_kv(k, v, ctx.group)  # re-gathered: saving it would keep S-sized K/V per layer alive
        dq, dkf, dvf = (torch.zeros(t.shape, dtype=acc, device=q.device) for t in (q, kf, vf))
        attend_blocks_backward(dout, q, kf, vf, out, lse, ctx.plan, ctx.scale, ctx.backend, dq, dkf, dvf)
        del kf, vf  # dead from here: not alive next to the reduce-scatter's buffers
        dkv = [dkf, dvf]
        del dkf, dvf  # _reduce_scatter_dkv frees them as soon as they are packed
        dk, dv = _reduce_scatter_dkv(dkv, ctx.group)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def allgather_attention(q: Tensor, k: Tensor, v: Tensor, group: Optional[dist.ProcessGroup], *, causal: bool,
                        scale: Optional[float] = None, backend: Optional[str | Backend] = None,
                        doc_ids: Optional[Tensor] = None) -> Tensor:
    """colossalai_cp attention of this rank's zigzag-sharded q over the all-gathered k/v of `group` (the cp group).
    q [b, h, s_local, d], k [b, h_kv, s_local, d], v [b, h_kv, s_local, d_v] -> [b, h, s_local, d_v] in q.dtype
    (scale defaults to 1/sqrt(d)). doc_ids [b, s_local]: this rank's shard of the packed documents' ids
    (non-decreasing along the full row): document-causal attention."""
    _check(q, k, v, causal or doc_ids is not None)  # packed: the zigzag chunks map local to global positions
    if group is None:
        group = dist.group.WORLD
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if not isinstance(backend, Backend):
        backend = select_backend(q.device, q.dtype, name=backend)
    R, r, half = dist.get_world_size(group), dist.get_rank(group), q.shape[2] // 2
    if doc_ids is None:
        plan = _blocks(R, r, half, causal)
    else:
        plan = doc_blocks(gather_doc_ids(doc_ids, group, R, 1), _zigzag_ranges(R, r, half), causal)
    return _AllGatherKVAttendReduceScatterDKV.apply(q, k, v, group, plan, scale, backend)
