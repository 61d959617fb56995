"""Python face of the fused CUDA ring-attention kernels (ops/*.cu). Same functions, same signatures and the same
contract as msparallel_ds.ops.reference (pure torch), so the ring sequencing in ring_steps.py runs on either.

Layout (ops/ring_attn.h): q, out, dout [b, h, s_q, d]; k, v [b, h_kv, s_k, d] (GQA: h % h_kv == 0, never
repeated); lse, delta, m, l [b, h, s_q] fp32. Any strides with a contiguous last dim are accepted; 16-bit operands
whose pointer or strides do not suit the kernels' 16-byte copies are made contiguous here (a copy), while the
fp32 buffers updated in place (state, dq, dk, dv) must already suit them (they are checked, never copied, since a
copy would lose the update). fp16 / bf16 inputs, head dim 64 or 128, sm_80 or newer; `supports` tells. k and v
share a head dim: callers with another value head dim (DeepSeek MLA) zero-pad v to it and slice the output
(context_parallel.kernels does).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ._build import load
from .modes import Mode

__all__ = [
    "DTYPES",
    "HEAD_DIMS",
    "Mode",
    "State",
    "backward_preprocess",
    "backward_step",
    "can_merge",
    "finalize",
    "forward_step",
    "merge_",
    "new_state",
    "supports",
]

HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)


class State(NamedTuple):
    """fp32 running state of one q block: acc [b, h, s, d], m and l [b, h, s] (m in log2 units, ring_attn.h)."""
    acc: Tensor
    m: Tensor
    l: Tensor


def _ext():
    return load()


def supports(q: Tensor, k: Tensor) -> bool:
    """Whether the step kernels take these shapes/dtypes (else use another backend). Does not build anything."""
    if not (q.is_cuda and k.is_cuda and q.dim() == 4 and k.dim() == 4):
        return False
    if q.dtype not in DTYPES or k.dtype != q.dtype or q.shape[-1] not in HEAD_DIMS or k.shape[-1] != q.shape[-1]:
        return False
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] or q.shape[0] * q.shape[1] > 65535:
        return False
    return torch.cuda.get_device_capability(q.device) >= (8, 0)


def _strides_ok(t: Tensor, multiple: int) -> bool:
    return t.stride(-1) == 1 and all(t.shape[i] <= 1 or t.stride(i) % multiple == 0 for i in range(t.dim() - 1))


def _vec16(t: Tensor) -> Tensor:
    """A 16-bit operand the tensor-core kernels can copy in 16-byte pieces (a contiguous copy when needed)."""
    if _strides_ok(t, 8) and t.data_ptr() % 16 == 0:
        return t
    return t.contiguous()


def _rows(t: Tensor) -> Tensor:
    """A read-only fp32 [b, h, s] tensor with unit stride along s."""
    t = t.float()
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _inplace_f32(t: Tensor, name: str, vec: bool) -> Tensor:
    if t.dtype != torch.float32:
        raise ValueError(f"{name} must be float32 (it is updated in place), got {t.dtype}")
    if not _strides_ok(t, 2 if vec else 1) or (vec and t.data_ptr() % 8):
        raise ValueError(f"{name} must have a contiguous last dim, even outer strides and 8-byte alignment "
                         f"(it is updated in place, so it cannot be copied); got strides {tuple(t.stride())}")
    return t


def new_state(q: Tensor) -> State:
    """Empty running state for q [b, h, s, d]: acc = 0, m = -inf, l = 0 (fp32, on q's device)."""
    b, h, s, d = q.shape
    return State(torch.zeros(b, h, s, d, dtype=torch.float32, device=q.device),
                 torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device),
                 torch.zeros(b, h, s, dtype=torch.float32, device=q.device))


def forward_step(q: Tensor, k: Tensor, v: Tensor, state: State, mode: Mode, scale: float) -> None:
    """Fold the k/v block into `state` in place (the part `mode` selects, ring_attn.h)."""
    _ext().fwd_step(_vec16(q), _vec16(k), _vec16(v), _inplace_f32(state.acc, "acc", True),
                    _inplace_f32(state.m, "m", False), _inplace_f32(state.l, "l", False), int(mode), float(scale))


def finalize(state: State, dtype: torch.dtype, *, out: Tensor | None = None,
             lse: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(out in `dtype` (fp32, fp16 or bf16), lse fp32) from the running state; rows without keys: 0 and -inf.
    out / lse: buffers to write into (tests pass NaN-filled ones to catch unwritten elements)."""
    if out is None:
        out = torch.empty(state.acc.shape, dtype=dtype, device=state.acc.device)
    if lse is None:
        lse = torch.empty(state.m.shape, dtype=torch.float32, device=state.acc.device)
    _ext().finalize(state.acc, _rows(state.m), _rows(state.l), out, lse)
    return out, lse


def backward_preprocess(out: Tensor, dout: Tensor, *, delta: Tensor | None = None) -> Tensor:
    """delta = rowsum(dout * out) in fp32 [b, h, s] (once per backward; dout is cast to out's dtype)."""
    dout = dout.to(out.dtype)
    if delta is None:
        delta = torch.empty(out.shape[:3], dtype=torch.float32, device=out.device)
    if out.stride(-1) != 1:
        out = out.contiguous()
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    _ext().bwd_preprocess(out, dout, delta)
    return delta


def backward_step(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor, dq: Tensor,
                  dk: Tensor, dv: Tensor, mode: Mode, scale: float) -> None:
    """dq += , dk += , dv += one block's gradients (fp32, in place) given the FINAL lse and delta."""
    _ext().bwd_step(_vec16(dout.to(q.dtype)), _vec16(q), _vec16(k), _vec16(v), _rows(lse), _rows(delta),
                    _inplace_f32(dq, "dq", True), _inplace_f32(dk, "dk", True), _inplace_f32(dv, "dv", True),
                    int(mode), float(scale))


def can_merge(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> bool:
    """Whether merge_ takes these (else use kernels.merge's torch code)."""
    return (acc_out.is_cuda and acc_out.dim() == 4 and acc_out.dtype == torch.float32
            and acc_lse.dtype == torch.float32 and lse.dtype == torch.float32
            and out.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and out.shape == acc_out.shape and acc_lse.shape == lse.shape == acc_out.shape[:3]
            and out.device == acc_out.device == acc_lse.device == lse.device
            and acc_out.stride(-1) == 1)


def merge_(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor, *,
           new_lse: Tensor | None = None) -> Tensor:
    """Fold (out, lse) into the fp32 running (acc_out, acc_lse) in one pass: acc_out in place; returns the new lse
    (a fresh tensor unless new_lse is given; acc_lse is left as it was, like kernels.merge)."""
    if new_lse is None:
        new_lse = torch.empty(acc_lse.shape, dtype=torch.float32, device=acc_lse.device)
    if out.stride(-1) != 1:
        out = out.contiguous()
    _ext().merge(acc_out, _rows(acc_lse), out, _rows(lse), new_lse)
    return new_lse
