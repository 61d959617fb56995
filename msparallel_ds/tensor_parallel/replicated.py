"""Gradients of tp-replicated weights (SP norms, Qwen3's q/k norms, tp-replicated experts), summed over tp.

Each tp rank's copy of such a weight saw different inputs (its sequence slice, its heads), so its grad is partial and
the sum over tp is the true grad. Two mechanisms, and every contribution is summed exactly once:

- `mark(module, group)`: a tensor hook on each weight sums its grad over tp, blocking, as it reaches the weight. On
  its own this is one rendezvous per weight in the middle of the backward (9 per step for SP at 4 layers), each
  stalling the backward until the slowest tp rank gets there.
- `install(part)` on a whole model: each forward routes the part's marked weights through two kinds of autograd node,
      w_1..w_n --[_Sums: one node]--> u_1..u_n --[_Start_i]--> v_i   (the module reads v_i as its weight)
  Backward: _Start_i starts an async all-reduce of w_i's grad as soon as autograd has summed all of w_i's uses
  (all multi-copy copies included); _Sums runs once every _Start did (autograd runs a node when all its outputs'
  grads are in), waits for the sums and hands them to the weights' grad accumulators, where DeepSpeed's ZeRO hooks
  copy them. So the reductions hide behind the rest of the backward and the step has one wait instead of n
  rendezvous (Megatron sums its layernorm grads once after the backward; ZeRO's hooks copy each grad the moment it
  is accumulated, so here the sums have to be done by then). The hook of `mark` sees these grads tagged as summed
  and passes them through; a grad that reached a weight another way (a reentrant checkpoint's recompute reads the
  real weight) is still summed by the hook.

The weights are swapped into the modules' `_parameters` for the forward only (as torch.func.functional_call does),
so names, state dicts and optimizer groups are unchanged. Not installed on pipeline stages: torch.pipelining's
zero-bubble schedules split a stage's backward into input and weight grads by walking the graph from the weights,
and the hooks alone do the sum there.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..distributed import instruments
from ..distributed.collectives import _size, all_reduce
from ..distributed.instruments import bus_bytes

__all__ = ["mark", "install"]

_GROUP = "tp_grad_allreduce"  # parameter attribute: the group its grad is summed over (set by mark)
_SUMMED = "_msp_tp_summed"    # grad attribute: already summed by _Sums (the hook passes it through)


def mark(module: nn.Module, group) -> None:
    """Sum the grads of `module`'s own parameters over `group` (replicated weights that saw different inputs)."""
    if _size(group) == 1:
        return
    for p in module.parameters(recurse=False):
        if p.requires_grad and getattr(p, _GROUP, None) is None:
            setattr(p, _GROUP, group)
            p.register_hook(lambda g, group=group: _sum_unless_summed(g, group))


def _sum_unless_summed(grad: Optional[Tensor], group) -> Optional[Tensor]:
    if grad is None or getattr(grad, _SUMMED, False):
        return grad
    return all_reduce(grad, group)


class _InFlight:
    """One forward's sums: per weight, (async work, its result buffer, start clock) once its grad is complete."""

    def __init__(self, groups: list) -> None:
        self.groups = groups
        self.pending: list[Optional[tuple]] = [None] * len(groups)

    def start(self, i: int, grad: Tensor) -> Tensor:
        group = self.groups[i]
        t0 = instruments.issue_clock()
        out = grad.clone(memory_format=torch.contiguous_format)
        self.pending[i] = (dist.all_reduce(out, group=group, async_op=True), out, t0)
        instruments.async_started("replicated_grad", "bwd", None, event="grad_issue")
        return out

    def finish(self, i: int) -> Optional[Tensor]:
        if self.pending[i] is None:  # this weight took no part in the forward's loss
            return None
        work, out, t0 = self.pending[i]
        self.pending[i] = None
        blocked_from = instruments.wait_clock()
        work.wait()
        instruments.async_finished(t0, blocked_from, bus_bytes("all_reduce", out, _size(self.groups[i])),
                                   "replicated_grad", "bwd", None, event="grad_wait")
        setattr(out, _SUMMED, True)
        return out


class _Sums(torch.autograd.Function):
    """Forward: every weight as a view, one node for all. Backward: wait for every weight's sum and return them."""

    @staticmethod
    def forward(ctx, flight: _InFlight, *weights: Tensor):
        ctx.flight = flight
        return tuple(w.view_as(w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *(ctx.flight.finish(i) for i in range(len(grads))))


class _Start(torch.autograd.Function):
    """Forward: a view. Backward: start the sum of the weight's complete grad (the buffer it returns is filled by the
    all-reduce; _Sums waits for it and returns it)."""

    @staticmethod
    def forward(ctx, u: Tensor, flight: _InFlight, i: int) -> Tensor:
        ctx.flight, ctx.i = flight, i
        return u.view_as(u)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.flight.start(ctx.i, grad), None, None


def install(part: nn.Module) -> None:
    """Route the marked weights of `part` (a whole model) through one _Sums per forward that records grads (nothing
    when it has none)."""
    slots = [(m, n) for m in part.modules() for n, p in m._parameters.items()
             if p is not None and getattr(p, _GROUP, None) is not None]
    if not slots or getattr(part, "_msp_replicated_grads", False):
        return
    part._msp_replicated_grads = True
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []

    def pre(module, args, kwargs):
        if swapped or not torch.is_grad_enabled():  # a nested call, or no graph to record
            return
        weights = list({id(p): p for p in (m._parameters[n] for m, n in slots)}.values())  # a shared one once
        flight = _InFlight([getattr(w, _GROUP) for w in weights])
        views = {id(w): _Start.apply(u, flight, i)
                 for i, (w, u) in enumerate(zip(weights, _Sums.apply(flight, *weights)))}
        for m, n in slots:
            swapped.append((m, n, m._parameters[n]))
            m._parameters[n] = views[id(m._parameters[n])]

    def post(module, args, kwargs, output):
        while swapped:
            m, n, w = swapped.pop()
            m._parameters[n] = w

    part.register_forward_pre_hook(pre, with_kwargs=True)
    part.register_forward_hook(post, with_kwargs=True, always_call=True)
