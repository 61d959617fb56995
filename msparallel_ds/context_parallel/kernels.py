"""Local block attention behind one interface, for every context-parallel algorithm.

Layout inside context_parallel/ is [b, h, s, d] (what the kernels want); GQA: k/v have h_kv heads, h % h_kv == 0,
and are never repeated before a call; v may have its own head dim d_v (DeepSeek MLA): out and dv then have d_v
columns. A block call returns (out, lse) with lse [b, h, s_q] in fp32; `merge` folds a block into an fp32 running
(out, lse) so a result is rounded to the input dtype once, at the very end.
The backward of one block takes the FINAL out and lse (flash-attention's trick), so per-block gradients add up.

Backends (picked per device/dtype, forced with `backend=` or MSPARALLEL_ATTN_BACKEND, logged at debug level):
- cpu_flash: aten._scaled_dot_product_flash_attention_for_cpu and its backward. Half/bf16 blocks run in fp32 so
  no block output is rounded before the merge.
- cuda_flash / cuda_efficient: torch's CUDA SDPA ops that return lse (block outputs come back in the input dtype;
  the fused kernels in ops/ remove that rounding).
- math: plain PyTorch matmuls with an explicit lse, any device/dtype, and the only one taking an arbitrary mask
  (the CPU flash op returns a wrong lse when given attn_mask).
- cuda_fused: our CUDA kernels (ops/, msparallel_ds.ops): fp16/bf16 on sm_80+, head dim 64/128 (others fall back
  to cuda_flash / cuda_efficient inside the backend); block outputs come back in fp32. Opt-in until the kernels
  have been verified on a GPU: force it by name (backend= or MSPARALLEL_ATTN_BACKEND=cuda_fused), which builds it
  on first use. When the extension is loaded, `merge` runs as one fused CUDA kernel. Never on CPU.

Every backend but math needs one head dim for q, k and v (torch's flash/efficient ops and ops/ alike):
block_forward / block_backward zero-pad the smaller of d_qk / d_v to the larger and slice the results. That is
exact: zero columns of q/k add nothing to the scores, the padded columns of out are 0, and the gradients of the
padded columns (0 too) are dropped. The fused kernels then see v padded to d_qk (run when that is 64 or 128).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

log = logging.getLogger(__name__)

ENV_BACKEND = "MSPARALLEL_ATTN_BACKEND"


@dataclass(frozen=True)
class Backend:
    name: str
    forward: Callable[..., tuple[Tensor, Tensor]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]]
    supports: Callable[[torch.device, torch.dtype, bool], bool]  # (device, dtype, has_mask)
    same_head_dim: bool = True  # the op needs v.shape[-1] == q.shape[-1]: block_forward/backward pad for it


# ---------------------------------------------------------------------------------------------- math
def _expand_kv(x: Tensor, groups: int) -> Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _sum_groups(g: Tensor, groups: int) -> Tensor:
    """[b, h, s, d] gradients of repeated kv heads -> [b, h // groups, s, d] (d of g itself: dk and dv differ)."""
    if groups == 1:
        return g
    b, h, s, d = g.shape
    return g.view(b, h // groups, groups, s, d).sum(2)


def _scores(q: Tensor, k: Tensor, causal: bool, scale: float, mask: Optional[Tensor]) -> Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        sq, sk = s.shape[-2], s.shape[-1]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril(sk - sq)  # bottom-right aligned
        s = s.masked_fill(~keep, float("-inf"))
    if mask is not None:  # bool, True = attend; broadcastable to [b, h, sq, sk]
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _probs(s: Tensor, lse: Tensor) -> Tensor:
    """exp(s - lse); a fully masked row (lse = -inf, where -inf - -inf would be NaN) gives p = 0. NaN scores or lse
    (a NaN query, key or softmax_scale) stay NaN, as in single-process SDPA."""
    lse = lse.unsqueeze(-1)
    return torch.where(torch.isneginf(lse), 0.0, torch.exp(s - lse))


def _math_forward(q, k, v, causal, scale, mask=None):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    groups = q.shape[1] // k.shape[1]
    qf, kf, vf = q.to(acc), _expand_kv(k, groups).to(acc), _expand_kv(v, groups).to(acc)
    s = _scores(qf, kf, causal, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(_probs(s, lse), vf), lse


def _math_backward(dout, q, k, v, out, lse, causal, scale, mask=None):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    groups = q.shape[1] // k.shape[1]
    qf, kf, vf = q.to(acc), _expand_kv(k, groups).to(acc), _expand_kv(v, groups).to(acc)
    do, o = dout.to(acc), out.to(acc)
    p = _probs(_scores(qf, kf, causal, scale, mask), lse.to(acc))
    dp = torch.matmul(do, vf.transpose(-1, -2))
    ds = p * (dp - (do * o).sum(-1, keepdim=True))
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    dv = torch.matmul(p.transpose(-1, -2), do)
    return dq, _sum_groups(dk, groups), _sum_groups(dv, groups)


# ---------------------------------------------------------------------------------------------- cpu flash
def _cpu_dtype(x: Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _has_nan(scale: float, *ts: Tensor) -> bool:
    """torch's CPU flash op returns out = 0, lse = 0 for NaN rows (a finite result from a NaN input): such calls go
    to the math kernel, which keeps the NaN like single-process SDPA does. One cheap pass over q/k, CPU only: a sum
    (a NaN anywhere makes it NaN; no bool tensor of the input's size as isnan().any() builds). Only +inf and -inf
    together in one input also give NaN: those calls take the math kernel too, which is exact as well."""
    return scale != scale or any(bool(t.sum().isnan()) for t in ts if t.is_floating_point())


def _cpu_flash_forward(q, k, v, causal, scale, mask=None):
    if _has_nan(scale, q, k):
        return _math_forward(q, k, v, causal, scale)
    dt = _cpu_dtype(q)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.to(dt), k.to(dt), v.to(dt), 0.0, causal, scale=scale)
    return out, lse.float() if lse.dtype != torch.float64 else lse


def _cpu_flash_backward(dout, q, k, v, out, lse, causal, scale, mask=None):
    if _has_nan(scale, q, k, lse):
        return _math_backward(dout, q, k, v, out, lse, causal, scale)
    dt = _cpu_dtype(q)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.to(dt), q.to(dt), k.to(dt), v.to(dt), out.to(dt), lse.to(dt), 0.0, causal, scale=scale)


# ---------------------------------------------------------------------------------------------- cuda
def _cuda_flash_forward(q, k, v, causal, scale, mask=None):
    groups = q.shape[1] // k.shape[1]
    res = torch.ops.aten._scaled_dot_product_flash_attention(
        q, _expand_kv(k, groups), _expand_kv(v, groups), 0.0, causal, False, scale=scale)
    return res[0], res[1].float()


def _cuda_flash_backward(dout, q, k, v, out, lse, causal, scale, mask=None):
    # torch's flash backward needs the forward's rng/cum_seq bookkeeping; recomputing through the efficient
    # kernel's backward is exact for the same (q, k, v, out, lse).
    return _cuda_efficient_backward(dout, q, k, v, out, lse, causal, scale)


def _cuda_efficient_forward(q, k, v, causal, scale, mask=None):
    groups = q.shape[1] // k.shape[1]
    res = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, _expand_kv(k, groups), _expand_kv(v, groups), None, True, 0.0, causal, scale=scale)
    return res[0], res[1][..., : q.shape[2]].float()


def _cuda_efficient_backward(dout, q, k, v, out, lse, causal, scale, mask=None):
    groups = q.shape[1] // k.shape[1]
    ke, ve = _expand_kv(k, groups), _expand_kv(v, groups)
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout.to(q.dtype), q, ke, ve, None, out.to(q.dtype), lse.contiguous(), seed, seed, 0.0,
        [True, True, True, False], causal, scale=scale)
    return dq, _sum_groups(dk, groups), _sum_groups(dv, groups)


# ---------------------------------------------------------------------------------------------- fused cuda (ops/)
# Guarded: nothing below runs (or imports msparallel_ds.ops' CUDA side) unless the device is CUDA.
def _fused_forward(q, k, v, causal, scale, mask=None):
    from ..ops import attention as fa

    if not fa.supports(q, k):  # head dim, dtype or GPU the step kernel does not cover
        return _cuda_flash_forward(q, k, v, causal, scale)
    state = fa.new_state(q)
    fa.forward_step(q, k, v, state, fa.Mode.CAUSAL if causal else fa.Mode.FULL, scale)
    return fa.finalize(state, torch.float32)  # fp32: no rounding before the merge


def _fused_backward(dout, q, k, v, out, lse, causal, scale, mask=None):
    from ..ops import attention as fa

    if not fa.supports(q, k):
        return _cuda_efficient_backward(dout, q, k, v, out, lse, causal, scale)
    delta = fa.backward_preprocess(out.to(q.dtype), dout)
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
    fa.backward_step(dout, q, k, v, lse, delta, dq, dk, dv, fa.Mode.CAUSAL if causal else fa.Mode.FULL, scale)
    return dq, dk, dv


def _fused_supports(dev: torch.device, dt: torch.dtype, has_mask: bool) -> bool:
    if dev.type != "cuda" or dt not in (torch.float16, torch.bfloat16) or has_mask:
        return False
    from .. import ops

    return ops.unavailable_reason(device=dev) is None


def _fused_merge(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> Tensor | None:
    """The new lse from the one-pass CUDA merge (acc_out updated in place), or None where it does not apply."""
    from .. import ops

    if ops.loaded() is None:
        return None
    from ..ops import attention as fa

    return fa.merge_(acc_out, acc_lse, out, lse) if fa.can_merge(acc_out, acc_lse, out, lse) else None


BACKENDS: dict[str, Backend] = {
    "cpu_flash": Backend("cpu_flash", _cpu_flash_forward, _cpu_flash_backward,
                         lambda dev, dt, m: dev.type == "cpu" and not m),
    "cuda_flash": Backend("cuda_flash", _cuda_flash_forward, _cuda_flash_backward,
                          lambda dev, dt, m: dev.type == "cuda" and dt in (torch.float16, torch.bfloat16) and not m),
    "cuda_efficient": Backend("cuda_efficient", _cuda_efficient_forward, _cuda_efficient_backward,
                              lambda dev, dt, m: dev.type == "cuda" and dt != torch.float64 and not m),
    "math": Backend("math", _math_forward, _math_backward, lambda dev, dt, m: True, same_head_dim=False),
    "cuda_fused": Backend("cuda_fused", _fused_forward, _fused_backward, _fused_supports),
}
PREFERENCE = ("cuda_flash", "cuda_efficient", "cpu_flash", "math")  # cuda_fused: opt-in (not yet GPU-verified)


def select_backend(device: torch.device, dtype: torch.dtype, *, has_mask: bool = False,
                   name: Optional[str] = None) -> Backend:
    """The fastest backend that supports this call, or the one forced by `name` / MSPARALLEL_ATTN_BACKEND."""
    forced = name or os.environ.get(ENV_BACKEND)
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"attention backend {forced!r} is unknown; choose one of {sorted(BACKENDS)}")
        backend = BACKENDS[forced]
        if not backend.supports(device, dtype, has_mask):
            raise ValueError(f"attention backend {forced!r} cannot run {dtype} on {device.type}"
                             + (" with a mask" if has_mask else "") + f"; use one of {sorted(BACKENDS)} or unset it")
        if forced == "cuda_fused":  # build (first use) or load now: a clear OpsUnavailable instead of a late failure
            from .. import ops

            ops.load()
        return backend
    for candidate in PREFERENCE:
        if BACKENDS[candidate].supports(device, dtype, has_mask):
            log.debug("context-parallel attention: block backend %s for %s on %s", candidate, dtype, device.type)
            return BACKENDS[candidate]
    return BACKENDS["math"]


def _padded_dim(backend: Backend, q: Tensor, v: Tensor) -> Optional[int]:
    """The common head dim to zero-pad q/k/v to when `backend` cannot take v.shape[-1] != q.shape[-1], else None."""
    if not backend.same_head_dim or v.shape[-1] == q.shape[-1]:
        return None
    return max(q.shape[-1], v.shape[-1])


def pad_head_dim(x: Tensor, d: int) -> Tensor:
    """x with zero columns appended to the last dim up to d (x itself when it already has d)."""
    return x if x.shape[-1] == d else torch.nn.functional.pad(x, (0, d - x.shape[-1]))


def block_forward(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, backend: Backend,
                  mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """One block. causal masks bottom-right aligned (square blocks: the usual diagonal). lse is fp32/fp64.
    out has v's head dim (padded for backends that need one head dim, module docstring)."""
    d = _padded_dim(backend, q, v)
    if d is None:
        return backend.forward(q, k, v, causal, scale, mask)
    out, lse = backend.forward(pad_head_dim(q, d), pad_head_dim(k, d), pad_head_dim(v, d), causal, scale, mask)
    return out[..., : v.shape[-1]].contiguous(), lse  # contiguous: merge may keep it as the running accumulator


def block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool,
                   scale: float, backend: Backend, mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the final out and lse; dk/dv come back with h_kv heads, dv with v's head dim."""
    d = _padded_dim(backend, q, v)
    if d is None:
        return backend.backward(dout, q, k, v, out, lse, causal, scale, mask)
    dq, dk, dv = backend.backward(*(pad_head_dim(t, d) for t in (dout, q, k, v, out)), lse, causal, scale, mask)
    dqk = q.shape[-1]
    return dq[..., :dqk], dk[..., :dqk], dv[..., : v.shape[-1]]


def merge(acc_out: Optional[Tensor], acc_lse: Optional[Tensor], out: Tensor,
          lse: Tensor) -> tuple[Tensor, Tensor]:
    """Fold a block's (out, lse) into the running fp32 state: lse = logaddexp, out weighted by exp(lse_i - lse).
    acc_out is updated in place (and returned); acc_lse is replaced."""
    acc_dtype = torch.float64 if out.dtype == torch.float64 else torch.float32
    if acc_out is not None and acc_out.is_cuda and acc_dtype == torch.float32:  # one-pass CUDA merge (ops/merge.cu)
        new_lse = _fused_merge(acc_out, acc_lse, out, lse)
        if new_lse is not None:
            return acc_out, new_lse
    out, lse = out.to(acc_dtype), lse.to(acc_dtype)
    if acc_out is None:  # block outputs are fresh tensors: the first one becomes the accumulator
        return out, lse
    new_lse = torch.logaddexp(acc_lse, lse)
    # rows where both are -inf (nothing visible yet) stay 0 instead of NaN; a NaN lse (NaN input) stays NaN
    empty = torch.isneginf(new_lse)
    w_acc = torch.where(empty, 0.0, torch.exp(acc_lse - new_lse)).unsqueeze(-1)
    w_blk = torch.where(empty, 0.0, torch.exp(lse - new_lse)).unsqueeze(-1)
    # in place: the running output is the largest buffer a ring step holds; no [b, h, s, d] temporaries
    return acc_out.mul_(w_acc).addcmul_(out, w_blk), new_lse
