"""The replicated output head's weight-grad GEMM, put off to the end of the backward (Megatron's
defer_embedding_wgrad_compute), where it runs while each copy's layer-0 scatter all-gathers its input grad.

Under sequence parallel with a replicated head (vocab_emb_dp), the head's backward has no collective: its input's
all-gather transposes to keeping this rank's slice. Its weight-grad GEMM, the head's biggest, hides nothing at the
start of the backward. The backward's last collectives, the layer-0 scatters' all-gathers (each copy's grad of
the whole sequence, for the replicated embedding), have nothing after them to hide behind: the embedding's own
backward needs their result. So the head leaves (grad output, input) to a DeferredWgrad, and copy c's scatter,
after starting its all-gather, computes the part of the weight grad from copy c's rows and returns it as the
weight's grad (the head's weight is an input of that node, so autograd sums the parts into one .grad and any
grad hook of the weight, DeepSpeed's included, sees the whole sum once).

One DeferredWgrad per forward of a whole causal LM (multi_copy._Head arms it). The head defers only if every
copy's scatter took the box in that forward (`ready`), else it computes its weight grad itself, so no grad is
lost where layer 0 runs whole (recomputed) or the stack has no scatter.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ..distributed.instruments import record
from .overlap import AsyncCollective, issue, wait, weight_grad

__all__ = ["DeferredWgrad", "scatter"]


class DeferredWgrad:
    """The head weight's grad from `copies` copies' rows (dim 0 of the head's input split in `copies`)."""

    def __init__(self, weight: nn.Parameter, copies: int):
        self.weight, self.copies, self.attached = weight, copies, 0
        self._saved: Optional[tuple[Tensor, Tensor]] = None
        self._left = 0

    @property
    def ready(self) -> bool:
        """Every copy's scatter holds this box (so every part of the weight grad will be computed)."""
        return self.attached == self.copies

    def put(self, grad_out: Tensor, x: Tensor) -> None:
        """The head's grad output [rows, ..., out] and input [rows, ..., in], kept until every copy took its part."""
        self._saved, self._left = (grad_out, x), self.copies

    def take(self, copy: int) -> Optional[Tensor]:
        """Copy `copy`'s part of the weight grad (None if the head did not defer in this backward)."""
        if self._saved is None:
            return None
        g, x = (t.chunk(self.copies, 0)[copy] for t in self._saved)
        self._left -= 1
        if not self._left:
            self._saved = None  # the last part: free the head's grad output
        record("compute", "output_head:wgrad_deferred", "bwd", copy)
        return weight_grad(g, x).to(self.weight.dtype)


class _ScatterWait(torch.autograd.Function):
    """The wait of a layer-0 scatter whose backward, after starting the all-gather, computes copy's part of the
    deferred weight grad (returned as the weight's grad)."""

    @staticmethod
    def forward(ctx, token: Tensor, link: AsyncCollective, box: DeferredWgrad, copy: int, weight: Tensor) -> Tensor:
        ctx.link, ctx.box, ctx.copy = link, box, copy
        return link.finish("fwd")

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.link.start(grad, "bwd")
        return grad.new_empty(0), None, None, None, ctx.box.take(ctx.copy)


def scatter(h: Tensor, group, dim: int, *, copy: int, box: Optional[DeferredWgrad] = None) -> Tensor:
    """This rank's slice of h along dim (the model's layer-0 scatter under SP). Backward: the all-gather of the
    grad, in flight from this node until autograd reaches the next lower-numbered node (another copy's layer-0
    work runs between), with the deferred weight grad's part of copy `copy` computed first when `box` is given."""
    link = AsyncCollective("scatter", group, dim, name="L0.scatter", copy=copy)
    token = issue(h, link)
    if box is None or not torch.is_grad_enabled():
        return wait(token, link)
    box.attached += 1
    return _ScatterWait.apply(token, link, box, copy, box.weight)
