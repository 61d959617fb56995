"""The CUDA kernels' contract in plain PyTorch (any device, any dtype): the specification the GPU tests hold the
kernels to, and the stand-in that lets the ring sequencing (ring_steps.py) be tested on CPU.

Same functions and signatures as msparallel_ds.ops.attention. Math runs in float64 for float64 inputs, else in
float32; unlike the kernels it never rounds P or dS to the input dtype.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .modes import Mode

__all__ = ["State", "backward_preprocess", "backward_step", "finalize", "forward_step", "merge_", "new_state"]

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)


class State(NamedTuple):
    acc: Tensor
    m: Tensor  # running row max of the scaled scores in log2 units
    l: Tensor


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _expand(x: Tensor, groups: int) -> Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def parts(mode: Mode, s_q: int, s_k: int) -> tuple[slice, slice, int | None]:
    """(query rows, keys, causal offset or None) a mode computes; causal: key j visible to row i iff j <= i + off."""
    mode = Mode(mode)
    if mode in (Mode.KV_FIRST_HALF, Mode.Q_SECOND_HALF) and (s_k if mode == Mode.KV_FIRST_HALF else s_q) % 2:
        raise ValueError(f"{mode.name} needs an even length, got s_q={s_q}, s_k={s_k}")
    if mode == Mode.FULL:
        return slice(0, s_q), slice(0, s_k), None
    if mode == Mode.CAUSAL:
        return slice(0, s_q), slice(0, s_k), s_k - s_q
    if mode == Mode.KV_FIRST_HALF:
        return slice(0, s_q), slice(0, s_k // 2), None
    return slice(s_q // 2, s_q), slice(0, s_k), None


def _scores2(q: Tensor, k: Tensor, scale: float, offset: int | None, acc: torch.dtype) -> Tensor:
    """Scaled scores in log2 units [b, h, n_q, n_k], -inf where causality hides the key."""
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * (scale * LOG2E)
    if offset is not None:
        i = torch.arange(s.shape[-2], device=s.device).unsqueeze(-1)
        j = torch.arange(s.shape[-1], device=s.device).unsqueeze(0)
        s = s.masked_fill(j > i + offset, float("-inf"))
    return s


def new_state(q: Tensor) -> State:
    acc = _acc(q.dtype)
    b, h, s, d = q.shape
    return State(torch.zeros(b, h, s, d, dtype=acc, device=q.device),
                 torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device),
                 torch.zeros(b, h, s, dtype=acc, device=q.device))


def forward_step(q: Tensor, k: Tensor, v: Tensor, state: State, mode: Mode, scale: float) -> None:
    rows, keys, off = parts(mode, q.shape[2], k.shape[2])
    if rows.stop <= rows.start or keys.stop <= keys.start:
        return
    acc = state.acc.dtype
    groups = q.shape[1] // k.shape[1]
    s2 = _scores2(q[:, :, rows], _expand(k[:, :, keys], groups), scale, off, acc)
    m_old = state.m[:, :, rows]
    m_new = torch.maximum(m_old, s2.amax(-1))
    m_use = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
    alpha = torch.exp2(m_old - m_use)
    p = torch.exp2(s2 - m_use.unsqueeze(-1))
    state.l[:, :, rows] = state.l[:, :, rows] * alpha + p.sum(-1)
    state.acc[:, :, rows] = state.acc[:, :, rows] * alpha.unsqueeze(-1) + torch.matmul(
        p, _expand(v[:, :, keys], groups).to(acc))
    state.m[:, :, rows] = m_new


def finalize(state: State, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    seen = state.l > 0
    l_safe = torch.where(seen, state.l, torch.ones_like(state.l))
    out = torch.where(seen.unsqueeze(-1), state.acc / l_safe.unsqueeze(-1), torch.zeros_like(state.acc))
    lse = torch.where(seen, (state.m + torch.log2(l_safe)) * LN2, torch.full_like(state.l, float("-inf")))
    return out.to(dtype), lse.to(_acc(state.l.dtype))


def backward_preprocess(out: Tensor, dout: Tensor) -> Tensor:
    acc = _acc(out.dtype)
    return (out.to(acc) * dout.to(acc)).sum(-1)


def backward_step(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor, dq: Tensor,
                  dk: Tensor, dv: Tensor, mode: Mode, scale: float) -> None:
    rows, keys, off = parts(mode, q.shape[2], k.shape[2])
    if rows.stop <= rows.start or keys.stop <= keys.start:
        return
    acc = dq.dtype
    b, h_kv = k.shape[0], k.shape[1]
    groups = q.shape[1] // h_kv
    qr, dor = q[:, :, rows].to(acc), dout[:, :, rows].to(acc)
    kk, vv = _expand(k[:, :, keys], groups).to(acc), _expand(v[:, :, keys], groups).to(acc)
    s2 = _scores2(qr, kk, scale, off, acc)
    lse2 = lse[:, :, rows].to(acc) * LOG2E
    lse2 = torch.where(lse2 == float("-inf"), torch.full_like(lse2, float("inf")), lse2)  # rows that saw nothing
    p = torch.exp2(s2 - lse2.unsqueeze(-1))
    dp = torch.matmul(dor, vv.transpose(-1, -2))
    ds = p * (dp - delta[:, :, rows].to(acc).unsqueeze(-1))
    dq[:, :, rows] += torch.matmul(ds, kk) * scale
    dkh = torch.matmul(ds.transpose(-1, -2), qr) * scale
    dvh = torch.matmul(p.transpose(-1, -2), dor)
    n = dkh.shape[2]
    dk[:, :, keys] += dkh.view(b, h_kv, groups, n, -1).sum(2)
    dv[:, :, keys] += dvh.view(b, h_kv, groups, n, -1).sum(2)


def merge_(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> Tensor:
    new_lse = torch.logaddexp(acc_lse, lse)
    w_acc = torch.exp(acc_lse - new_lse).nan_to_num_(0.0).unsqueeze(-1)
    w_blk = torch.exp(lse - new_lse).nan_to_num_(0.0).unsqueeze(-1)
    acc_out.mul_(w_acc).addcmul_(out.to(acc_out.dtype), w_blk)
    return new_lse
