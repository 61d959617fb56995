"""Ring attention: K/V blocks travel around the cp_ring group while the current block is computed.

Inputs are this rank's zigzag shard (sharding.py with R = group size, U = 1): q [b, h, s, d], k [b, h_kv, s, d],
v [b, h_kv, s, d_v] (d_v may differ, DeepSeek MLA), local chunks (r, 2R-1-r), each s/2 tokens. Only the h_kv heads
travel, K and V packed flat into one buffer (pack_kv), so every step is one send whatever the head dims.
Causal zigzag, block from src at rank r (half = s/2):
    src == r: causal diagonal on the whole local segment (its positions increase)
    src <  r: all local queries vs the FIRST half of src's K/V; its second half is in the future: never computed
    src >  r: only the SECOND half of local queries vs all of src's K/V; the first half sees nothing: skipped
so every rank does 1 diagonal + (R-1) half blocks. The running (out, lse) stays fp32 (kernels.merge) and is rounded
to q.dtype once. Backward is a second ring: dq accumulates locally in fp32, dK/dV for the block held travel one step
behind K/V in an fp32 buffer and arrive at their owner after R hops. A backward block longer than a tile (below) is
computed tile by tile, the diagonal as causal squares plus fully visible tiles under it: the kernel's fresh
dq/dk/dv and softmax buffers (what set the per-rank peak) are then tile-sized; same blocks, same fp32 sums.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .kernels import Backend, block_backward, block_forward, merge, select_backend

__all__ = ["ring_attention"]

_TAG_KV, _TAG_DKV = 0, 1  # gloo matches p2p by tag; NCCL ignores tags and relies on identical posting order


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Ring:
    """The group's neighbours and a 'send mine to next, receive prev's' exchange that returns its requests."""

    def __init__(self, group: Optional[dist.ProcessGroup]):
        self.group = group if group is not None else dist.group.WORLD
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)

    def exchange(self, send: Tensor, recv: Tensor, tag: int) -> list:
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, self.next, self.group, tag),
                                       dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)])


def _wait(reqs: Optional[list]) -> None:
    for r in reqs or ():
        r.wait()


def release(t: Tensor) -> None:
    """Free a finished collective's CPU buffer now (its views must be dead): gloo's work object drops its reference
    from gloo's own thread, sometimes only after the next block has allocated its buffers (measured: a sent K/V or
    gather buffer alive at a rank's peak). CPU only; CUDA frees go through the caching allocator's stream
    bookkeeping instead."""
    if t.device.type == "cpu":
        t.untyped_storage().resize_(0)


def pack_kv(k: Tensor, v: Tensor) -> Tensor:
    """k and v flattened into one contiguous 1-D buffer: one collective moves both, whatever their head dims."""
    buf = torch.empty(k.numel() + v.numel(), dtype=k.dtype, device=k.device)
    kb, vb = unpack_kv(buf, k.shape, v.shape)
    kb.copy_(k)  # one copy each, also from non-contiguous (HF-layout) views
    vb.copy_(v)
    return buf


def unpack_kv(buf: Tensor, k_shape: torch.Size, v_shape: torch.Size) -> tuple[Tensor, Tensor]:
    """Contiguous views (k, v) of a pack_kv buffer (or of one of the same size in another dtype)."""
    n = k_shape.numel()
    return buf[:n].view(k_shape), buf[n:].view(v_shape)


def _check(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"context-parallel attention wants q [b, h, s, d], k [b, h_kv, s, d] and v [b, h_kv, s, d_v]; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share b, s, d, and h must be a "
                         f"multiple of h_kv")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if causal and q.shape[2] % 2:
        raise ValueError(f"causal zigzag attention needs an even local length (two chunks), got {q.shape[2]}")


def forward_step(q: Tensor, kb: Tensor, vb: Tensor, src: int, rank: int, out: Optional[Tensor],
                 lse: Optional[Tensor], *, causal: bool, scale: float, backend: Backend) -> tuple[Tensor, Tensor]:
    """Fold ring rank `src`'s K/V block into this rank's running fp32 (out, lse). Causal zigzag: the own block is
    the diagonal; from src < rank only the first half of the keys is in the past; from src > rank only the second
    half of the queries sees anything. What causality hides is not computed."""
    half = q.shape[2] // 2
    if not causal or src == rank:
        return merge(out, lse, *block_forward(q, kb, vb, causal=causal, scale=scale, backend=backend))
    if src < rank:
        return merge(out, lse, *block_forward(q, kb[:, :, :half], vb[:, :, :half], causal=False, scale=scale,
                                              backend=backend))
    o, l = block_forward(q[:, :, half:], kb, vb, causal=False, scale=scale, backend=backend)  # views, no copies
    out[:, :, half:], lse[:, :, half:] = merge(out[:, :, half:], lse[:, :, half:], o, l)
    return out, lse


# Backward tiles: a side of at most 1/_PIECES of the local segment, so a call's fresh buffers are about 1/4 of a
# whole-block call's while the calls per step stay fixed whatever the length (GPUs keep large calls); never below
# _MIN_PIECE tokens (as allgather's: shorter tiles would cost more in calls than they save).
_MIN_PIECE = 128
_PIECES = 4


def _block(src: int, rank: int, s: int, causal: bool) -> tuple[tuple[int, int], tuple[int, int], bool]:
    """(query range, key range, causal) of what this rank computes against ring rank src's K/V (forward_step's
    rules): what causality hides is never part of it."""
    half = s // 2
    if not causal or src == rank:
        return (0, s), (0, s), causal
    return ((0, s), (0, half), False) if src < rank else ((half, s), (0, s), False)


def _cuts(a: int, b: int, piece: int) -> list[tuple[int, int]]:
    """[a, b) as ceil((b - a) / piece) near-equal ranges; itself when it is no longer than piece."""
    m = max(1, -(-(b - a) // piece))
    return [(a + (b - a) * i // m, a + (b - a) * (i + 1) // m) for i in range(m)]


def backward_tiles(qr: tuple[int, int], kr: tuple[int, int], causal: bool,
                   piece: int) -> list[tuple[slice, list[tuple[slice, bool]]]]:
    """One block's backward as tiles of at most `piece` tokens a side, so a call's fresh dq/dk/dv and softmax
    buffers scale with the tile, not the block: per key piece (key-major: its dK/dV is complete once its tiles are
    done), its (query slice, causal) tiles. A causal (square, diagonal) block becomes causal squares on its diagonal
    plus fully visible tiles below it (square only: the backends disagree on how a non-square causal block is
    aligned); above the diagonal nothing is computed. A block no longer than piece a side stays one call."""
    qc, kc = _cuts(*qr, piece), _cuts(*kr, piece)
    if causal:  # qr == kr: key piece j is seen fully by query pieces i > j and causally by i == j
        return [(slice(*b), [(slice(*a), a == b) for a in qc[j:]]) for j, b in enumerate(kc)]
    return [(slice(*b), [(slice(*a), False) for a in qc]) for b in kc]


def _arrived(reqs: list, sent: Tensor, recv: Tensor, pending: list, k_shape, v_shape) -> Tensor:
    """Wait for the dK/dV exchange, free the sum sent on, add the key pieces that finished before the incoming sum
    arrived (pending: (key slice, dk, dv)); returns the incoming sum, now including them."""
    _wait(reqs)
    release(sent)
    rk, rv = unpack_kv(recv, k_shape, v_shape)
    for ks, dk, dv in pending:
        rk[:, :, ks] += dk
        rv[:, :, ks] += dv
    pending.clear()
    return recv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, backend):
        ring = _Ring(group)
        R, r = ring.size, ring.rank
        kv = own = pack_kv(k, v)  # one buffer: one send per step; kept for the backward instead of k and v
        out = lse = reqs = nxt = None
        for step in range(R):
            src = (r - step) % R
            if step > 0:
                _wait(reqs)
                if kv is not own:
                    release(kv)  # an earlier receive buffer, sent on
                kv = nxt
            if step < R - 1:  # next block in flight while this one is computed
                nxt = torch.empty_like(kv)
                reqs = ring.exchange(kv, nxt, _TAG_KV)
            out, lse = forward_step(q, *unpack_kv(kv, k.shape, v.shape), src, r, out, lse, causal=causal, scale=scale,
                                    backend=backend)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, out, lse)
        # The packed copy, not k and v: the backward sends it first and frees it after that send, and k/v (e.g.
        # hybrid's all-to-all buffers) need not live until then. On ctx (an intermediate), so the backward can drop it.
        ctx.kv, ctx.k_shape, ctx.v_shape = own, k.shape, v.shape
        ctx.ring, ctx.causal, ctx.scale, ctx.backend = ring, causal, scale, backend
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out, lse = ctx.saved_tensors
        kv, ctx.kv = ctx.kv, None
        if kv is None:
            raise RuntimeError("ring attention's backward ran a second time over the same graph (retain_graph=True): "
                               "its K/V buffer is freed by the first backward; run the forward again instead")
        k_shape, v_shape = ctx.k_shape, ctx.v_shape
        ring, causal, scale, backend = ctx.ring, ctx.causal, ctx.scale, ctx.backend
        R, r, s = ring.size, ring.rank, q.shape[2]
        acc = _acc_dtype(q.dtype)
        piece = max(-(-s // _PIECES), _MIN_PIECE)
        # dout/q/out/lse tiles are views: the CPU kernel copies dout per call (tile-sized), not for the whole backward
        dq = None  # untiled, step 0 (always the own full block) hands its dq over as the fp32 accumulator
        kv_reqs = dkv_reqs = nxt = dkv_in = dkv_out = None
        for step in range(R):
            src = (r - step) % R
            if step > 0:
                _wait(kv_reqs)
                release(kv)
                kv = nxt
            if step < R - 1:
                nxt = torch.empty_like(kv)
                kv_reqs = ring.exchange(kv, nxt, _TAG_KV)
            kb, vb = unpack_kv(kv, k_shape, v_shape)
            if step == 0:  # the travelling fp32 dK/dV sum of this block starts here
                dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
            # Later steps add into the sum the previous holder sends (at the end of its last step, so it is usually
            # here by now). Its transfer overlaps at least this step's first key piece, whose dK/dV waits in a
            # piece-sized buffer; from the second piece on it is waited for (gloo's P2P work only reports completion
            # once waited; NCCL's does before) and every piece adds straight into it.
            arrived, pending = step == 0, []
            columns = backward_tiles(*_block(src, r, s, causal), piece)
            if dq is None and (len(columns) > 1 or len(columns[0][1]) > 1):  # tiled step 0: an fp32 accumulator
                dq = torch.zeros(q.shape, dtype=acc, device=q.device)
            for column, (ks, rows) in enumerate(columns):
                if not arrived and (column > 0 or dkv_reqs[-1].is_completed()):
                    dkv, arrived = _arrived(dkv_reqs, dkv_out, dkv_in, pending, k_shape, v_shape), True
                if arrived:
                    tk, tv = (t[:, :, ks] for t in unpack_kv(dkv, k_shape, v_shape))
                else:
                    tk, tv = (torch.zeros_like(t[:, :, ks], dtype=acc) for t in (kb, vb))
                    pending.append((ks, tk, tv))
                for qs, tile_causal in rows:
                    g = block_backward(dout[:, :, qs], q[:, :, qs], kb[:, :, ks], vb[:, :, ks], out[:, :, qs],
                                       lse[:, :, qs], causal=tile_causal, scale=scale, backend=backend)
                    if dq is None:  # untiled step 0: the whole block's dq becomes the accumulator
                        dq = g[0].to(acc)
                    else:
                        dq[:, :, qs] += g[0]
                    tk += g[1]
                    tv += g[2]
                    g = None  # before the next tile's call allocates its own
            if not arrived:
                dkv = _arrived(dkv_reqs, dkv_out, dkv_in, pending, k_shape, v_shape)
            tk = tv = pending = None  # before the next step's kernel call: two steps' block gradients never coexist
            if R > 1:  # after R hops each block's sum reaches its owner
                dkv_out, dkv_in = dkv, torch.empty_like(dkv)  # dkv_out stays referenced until its send is waited
                dkv_reqs = ring.exchange(dkv_out, dkv_in, _TAG_DKV)
        if R > 1:
            _wait(dkv_reqs)
            release(dkv_out)
            dkv = dkv_in
        dk, dv = unpack_kv(dkv, k_shape, v_shape)
        return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype), None, None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: Optional[dist.ProcessGroup], *, causal: bool,
                   scale: Optional[float] = None, backend: Optional[str | Backend] = None) -> Tensor:
    """Attention of this rank's zigzag-sharded q over the whole sequence's k/v, passed around `group` (the cp_ring
    group). q [b, h, s_local, d], k [b, h_kv, s_local, d], v [b, h_kv, s_local, d_v] -> [b, h, s_local, d_v] in
    q.dtype; scale defaults to 1/sqrt(d)."""
    _check(q, k, v, causal)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if not isinstance(backend, Backend):
        backend = select_backend(q.device, q.dtype, name=backend)
    return _RingAttention.apply(q, k, v, group, causal, scale, backend)
