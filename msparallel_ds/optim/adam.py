"""The Adam variants MindSpore/MindFormers compute that torch.optim.AdamW does not.

- AdamWeightDecay (nn.AdamWeightDecay, FP32StateAdamWeightDecay, FusedAdamWeightDecay, 1.x `adamw`): no bias
  correction, p -= lr * (m / (sqrt(v) + eps) + wd * p), states in float32 whatever the parameter dtype.
- bias_correction=True is AdamWeightDecayX (research/qwen): the Adam paper's form,
  p -= lr * wd * p + lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps) (eps outside the correction, unlike
  torch.optim.AdamW, which MindFormers' AdamW matches).
- PmaAdamW (2.x core/optim/pma_adamw.py): torch's AdamW step, then every interleave_step steps the weights are folded
  into an EMA/SMA buffer, and every fused_num * interleave_step steps the weights are replaced by it.

Element-wise maths on whatever tensors the groups hold, so DeepSpeed ZeRO-1/2 (flat fp32 partitions) and torch's
ZeroRedundancyOptimizer (a shard of the parameters) run it unchanged. On CUDA, DeepSpeed's FusedAdam with
bias_correction=False computes the same update (build.py picks it when its op is prebuilt).
"""
from __future__ import annotations

import torch

__all__ = ["AdamWeightDecay", "PmaAdamW"]


class AdamWeightDecay(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0,
                 bias_correction: bool = False, foreach: bool = True):
        if lr < 0 or eps <= 0 or not (0 < betas[0] < 1 and 0 < betas[1] < 1) or weight_decay < 0:
            raise ValueError(f"AdamWeightDecay: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}: need "
                             "lr >= 0, 0 < beta < 1, eps > 0, weight_decay >= 0 (MindSpore's checks)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction, foreach=foreach))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            b1, b2 = group["betas"]
            states = [self._state(p) for p in params]
            for s in states:
                s["step"] += 1
            p32 = [p if p.dtype == torch.float32 else p.float() for p in params]
            grads = [p.grad.float() for p in params]
            ms, vs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
            if group["foreach"] and all(p.device == params[0].device for p in params):
                torch._foreach_mul_(ms, b1)  # MindSpore's order: m = b1*m + (1-b1)*g
                torch._foreach_add_(ms, grads, alpha=1 - b1)
                torch._foreach_mul_(vs, b2)
                torch._foreach_addcmul_(vs, grads, grads, 1 - b2)
                update = torch._foreach_sqrt(vs)
                torch._foreach_add_(update, group["eps"])
                update = torch._foreach_div(ms, update)
            else:
                update = []
                for m, v, g in zip(ms, vs, grads):
                    m.mul_(b1).add_(g, alpha=1 - b1)
                    v.mul_(b2).addcmul_(g, g, value=1 - b2)
                    update.append(m / (v.sqrt() + group["eps"]))
            lr, wd = group["lr"], group["weight_decay"]
            for p, w, u, s in zip(params, p32, update, states):
                scale = lr
                if group["bias_correction"]:
                    t = float(s["step"])
                    scale = lr * (1 - b2 ** t) ** 0.5 / (1 - b1 ** t)
                if wd:
                    w.sub_(w, alpha=lr * wd)  # the decay reads the pre-update weight (lr*wd*p)
                w.sub_(u, alpha=scale)
                if w is not p:
                    p.copy_(w)
        return loss

    def _state(self, p):
        s = self.state[p]
        if not s:
            s["step"] = torch.tensor(0.0)  # torch's convention (checkpoint/ reads and restores it)
            s["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            s["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        return s


class PmaAdamW(torch.optim.AdamW):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 fused_num: int = 10, interleave_step: int = 1000, fused_algo: str = "ema", ema_alpha: float = 0.2):
        if fused_algo not in ("ema", "sma") or fused_num < 1 or interleave_step < 1 or not 0 < ema_alpha < 1:
            raise ValueError(f"PmaAdamW: fused_algo={fused_algo!r}, fused_num={fused_num}, interleave_step="
                             f"{interleave_step}, ema_alpha={ema_alpha}: need ema|sma, counts >= 1, 0 < ema_alpha < 1")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.pma = dict(fused_num=fused_num, interleave_step=interleave_step, fused_algo=fused_algo,
                        ema_alpha=ema_alpha)

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        c = self.pma
        for group in self.param_groups:  # DeepSpeed ZeRO steps one group at a time: count per parameter
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                t = int(state["step"])  # AdamW's own step count, as MindFormers' global_step
                if t % c["interleave_step"]:
                    continue
                buf = state.setdefault("pma_weight", torch.zeros_like(p, dtype=torch.float32))
                if c["fused_algo"] == "ema":
                    buf.mul_(1 - c["ema_alpha"]).add_(p.float(), alpha=c["ema_alpha"])
                else:
                    buf.add_(p.float())
                if t % (c["fused_num"] * c["interleave_step"]) == 0:
                    if c["fused_algo"] == "sma":
                        buf.div_(c["fused_num"])
                    p.copy_(buf)
                    buf.zero_()
        return loss
