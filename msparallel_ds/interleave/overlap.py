"""Async collectives for the multi-copy / fine-grain interleave: one collective in flight between issue and wait.

`AsyncCollective(kind, group, dim)` is one collective of one copy, in flight between `issue(x, link)` and
`wait(token, link)`, or between `issue(x, link, linears=(weights, biases))` and `wait_linears(token, link)`, which
also runs those colwise GEMMs on the result. Such an all-gather multiplies this rank's own rows at once, while the
other ranks' rows are in flight, and the rest after the wait (the local-first split of Megatron's and torch's
async TP): the copy's own GEMM widens its collective's window, not only other copies' steps. Its mirror for a
row-parallel linear's reduce-scatter, `issue_linear(x, weight, link)`, is remote-first: the rows other ranks keep
are multiplied and sent, then this rank's own rows are multiplied while they travel and added at the wait.

Forward: issue starts the collective (async_op=True) and returns a 0-size token that only links the two autograd
nodes; wait finishes it and returns the result. Backward swaps the roles: wait's backward starts the transposed
collective on the grad, issue's backward waits for it, so eager autograd's reverse-creation order keeps another
copy's backward between the two. wait_linears' backward starts the input-grad collective right after the dgrad
GEMM and runs the wgrad GEMMs while it is in flight (Megatron's async grad all-reduce / reduce-scatter).

| kind              | forward                             | backward (transpose)                           |
|-------------------|-------------------------------------|------------------------------------------------|
| all_gather        | all-gather along dim                | reduce-scatter                                 |
| reduce_scatter    | reduce-scatter                      | all-gather                                     |
| all_reduce        | all-reduce                          | identity                                       |
| identity          | identity                            | all-reduce                                     |
| scatter           | this rank's slice along dim (local) | all-gather                                     |
| gather_replicated | all-gather along dim                | this rank's slice (a replicated reader: every  |
|                   |                                     | rank computed the same grad, nothing to sum)   |

Layouts and slices are those of the blocking collectives (msparallel_ds.distributed.collectives); the events and
timings go to msparallel_ds.distributed.instruments (mark_compute logs the compute between issue and wait).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ..distributed import instruments
from ..distributed.collectives import _chunk, _size, _unsupported, split_along, start_reduce_scatter
from ..distributed.instruments import bus_bytes, record
from . import chunk_layout

__all__ = ["AsyncCollective", "issue", "issue_linear", "wait", "wait_linears", "mark_compute", "weight_grad"]

_TRANSPOSE = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather", "all_reduce": "identity",
              "identity": "all_reduce", "scatter": "all_gather", "gather_replicated": "scatter"}
_GATHERS = ("all_gather", "gather_replicated")


def _start(kind: str, x: Tensor, group, dim: int, stacked: bool = False
           ) -> tuple[Optional[object], Callable[[], Tensor], float]:
    """Start collective `kind` on x without blocking: (work or None, finish() -> result, bus bytes). stacked: x is
    a reduce-scatter's send buffer already [n, *block] (destination rank first, contiguous)."""
    n = _size(group)
    if kind == "identity" or n == 1:
        return None, (lambda: x), 0.0
    if kind == "all_reduce":
        out = x.clone(memory_format=torch.contiguous_format)
        return dist.all_reduce(out, group=group, async_op=True), (lambda: out), bus_bytes(kind, out, n)
    dim %= x.dim()
    if kind == "scatter":
        piece = split_along(x, group, dim)
        return None, (lambda: piece), 0.0
    if kind in _GATHERS:
        x = x.contiguous()
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        try:
            work = (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(
                out, x, group=group, async_op=True)
        except (RuntimeError, NotImplementedError) as e:
            if not _unsupported(e):
                raise
            work = dist.all_gather(list(out.chunk(n)), x, group=group, async_op=True)
        b = x.shape[0]
        return work, (lambda: out.unflatten(0, (n, b)).movedim(0, dim).flatten(dim, dim + 1)), \
            bus_bytes("all_gather", out, n)
    if kind == "reduce_scatter":
        send = x if stacked else x.unflatten(dim, (n, _chunk(x, group, dim))).movedim(dim, 0).contiguous()
        work, finish = start_reduce_scatter(send, group, async_op=True)  # x's layout, dim shrunk
        return work, finish, bus_bytes(kind, send, n)
    raise ValueError(f"unknown collective kind {kind!r}; one of {', '.join(_TRANSPOSE)}")


class AsyncCollective:
    """One copy's collective `kind` over `group` along `dim`, in flight between issue() and wait(); the backward
    runs the transposed kind in flight between wait's backward and issue's backward. One object per use."""

    def __init__(self, kind: str, group, dim: int = 1, *, name: str = "", copy: Optional[int] = None):
        if kind not in _TRANSPOSE:
            raise ValueError(f"unknown collective kind {kind!r}; one of {', '.join(_TRANSPOSE)}")
        self.kind, self.group, self.dim, self.name = kind, group, dim, name or kind
        self.copy = instruments.active_copy() if copy is None else copy
        self._pending: Optional[tuple] = None
        self._linears: Optional[tuple] = None  # (weights, biases) of the GEMMs that consume the result
        self._local: Optional[tuple] = None  # this rank's rows through them (set_linears)
        self.addend: Optional[Tensor] = None  # a remote-first reduce-scatter's own rows, added at the wait
        self.rows: Optional[tuple] = None  # issue_linear's (dim, this rank, rows per rank)
        self.grad_own: Optional[Tensor] = None  # and its output grad for this rank's rows (the wait's backward)
        self.deferred = None  # a DeferredWgrad: wait_linears' backward leaves its first weight's grad to it
        # > 1: an all-gather of the chunk layout (rank r's rows are the sequence's blocks j*tp + r, j < blocks);
        # wait_linears' outputs and the grads it takes are in sequence order (chunk_layout.py)
        self.blocks = 1

    def start(self, x: Tensor, phase: str, stacked: bool = False) -> None:
        kind = self.kind if phase == "fwd" else _TRANSPOSE[self.kind]
        t0 = instruments.issue_clock()
        work, finish, nbytes = _start(kind, x, self.group, self.dim, stacked)
        self._pending = (work, finish, nbytes, t0, kind)
        if work is not None:
            instruments.async_started(f"{self.name}:{kind}", phase, self.copy)

    def set_linears(self, x: Tensor, weights, biases) -> None:
        """The GEMMs wait_linears will run on the result. While an all-gather is in flight, F.linear(x, w, b) of
        this rank's own rows x is run now (values only: wait_linears' backward computes every grad from the
        gathered input)."""
        self._linears = (tuple(weights), tuple(biases))
        if self.kind not in _GATHERS or self._pending is None or self._pending[0] is None:
            return
        with torch.no_grad():
            self._local = tuple(F.linear(x, w, b) for w, b in zip(weights, biases))
        record("compute", f"{self.name}:gemm_local", "fwd", self.copy)

    def take_linears(self) -> tuple[tuple, tuple]:
        """(weights, biases) given to set_linears, handed over once (to wait_linears)."""
        if self._linears is None:
            raise RuntimeError(f"wait_linears on {self.name}: issue it with linears=(weights, biases)")
        wb, self._linears = self._linears, None
        return wb

    def in_order(self, gathered: Tensor) -> Tensor:
        """The gathered tensor in sequence order (the chunk layout's blocks put back; else itself)."""
        return gathered if self.blocks == 1 else chunk_layout.to_sequence_order(gathered, _size(self.group),
                                                                                  self.blocks)

    def linears(self, gathered: Tensor, x: Tensor, weights, biases) -> tuple[Tensor, ...]:
        """F.linear(x, w, b) for each weight, x = in_order(gathered) the finished all-gather in sequence order:
        the other ranks' rows only when this rank's are in (set_linears), the pieces placed in sequence order."""
        local, self._local = self._local, None
        if local is None:
            return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))
        dim = self.dim % x.dim()
        me, s, k = dist.get_rank(self.group), local[0].shape[dim], self.blocks
        outs = []
        for loc, w, b in zip(local, weights, biases):
            parts = [loc if r == me else F.linear(gathered.narrow(dim, r * s, s), w, b)
                     for r in range(_size(self.group))]
            outs.append(torch.cat([p.narrow(dim, j * (s // k), s // k) for j in range(k) for p in parts], dim))
        return tuple(outs)

    def finish(self, phase: str) -> Tensor:
        work, finish, nbytes, t0, kind = self._pending
        self._pending = None
        if work is not None:
            blocked_from = instruments.wait_clock()
            work.wait()
            instruments.async_finished(t0, blocked_from, nbytes, f"{self.name}:{kind}", phase, self.copy)
        return finish()


def weight_grad(grad_out: Tensor, x: Tensor) -> Tensor:
    """A linear's weight grad, grad_out^T x summed over every leading (row, token) dim."""
    return grad_out.reshape(-1, grad_out.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))


class _Issue(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, link: AsyncCollective) -> Tensor:
        ctx.link = link
        link.start(x, "fwd")
        return x.new_empty(0)  # the token: links this node to the wait; the data travels in `link`

    @staticmethod
    def backward(ctx, _token_grad):
        return ctx.link.finish("bwd"), None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token: Tensor, link: AsyncCollective) -> Tensor:
        ctx.link = link
        out, own, link.addend = link.finish("fwd"), link.addend, None
        return out if own is None else out + own  # own: issue_linear's own rows (its backward takes their grad)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.link.start(grad, "bwd")
        if ctx.link.rows is not None:  # issue_linear's: its backward multiplies these (own) rows before its wait
            ctx.link.grad_own = grad
        return grad.new_empty(0), None


class _IssueLinear(torch.autograd.Function):
    """issue() of F.linear(x, w) under a reduce-scatter, remote-first: the rows that other ranks keep are
    multiplied and their reduce-scatter started (this rank's block zero), then this rank's own rows are multiplied
    while it is in flight and kept as the wait's addend. Backward, the mirror: the own rows' dgrad and wgrad with
    this rank's output grad (kept by the wait's backward, which started the all-gather of every rank's), then the
    wait and the other rows' GEMMs."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, link: AsyncCollective) -> Tensor:
        dim, me, n = link.dim % x.dim(), dist.get_rank(link.group), _size(link.group)
        s = _chunk(x, link.group, dim)
        block = list(x.shape)
        block[dim], block[-1] = s, w.shape[0]
        send = x.new_empty((n, *block))  # the reduce-scatter's send layout: each rank's GEMM written in place
        for r in range(n):
            if r != me:
                torch.matmul(x.narrow(dim, r * s, s), w.t(), out=send[r])
        send[me].zero_()
        link.start(send, "fwd", stacked=True)
        link.addend = F.linear(x.narrow(dim, me * s, s), w)
        record("compute", f"{link.name}:gemm_local", "fwd", link.copy)
        link.rows = (dim, me, s)
        ctx.link = link
        ctx.save_for_backward(x, w)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _token_grad):
        link, (x, w) = ctx.link, ctx.saved_tensors
        (dim, me, s), g_own, link.grad_own = link.rows, link.grad_own, None
        need_dx, need_dw = ctx.needs_input_grad[:2]
        dxs = [None] * (x.shape[dim] // s)
        dxs[me] = g_own.matmul(w) if need_dx else None
        dw = weight_grad(g_own, x.narrow(dim, me * s, s)) if need_dw else None
        record("compute", f"{link.name}:grad_local", "bwd", link.copy)
        g = link.finish("bwd")  # every rank's rows
        for r in range(len(dxs)):
            if r != me:
                g_r = g.narrow(dim, r * s, s)
                dxs[r] = g_r.matmul(w) if need_dx else None
                if need_dw:
                    dw.add_(weight_grad(g_r, x.narrow(dim, r * s, s)))
        return (torch.cat(dxs, dim) if need_dx else None), dw, None


class _WaitLinears(torch.autograd.Function):
    """wait + the GEMMs that consume the result: y_i = x W_i^T + b_i. Backward: dgrad, start the input-grad
    collective, then the wgrad GEMMs while it is in flight."""

    @staticmethod
    def forward(ctx, token: Tensor, link: AsyncCollective, n: int, *wb):
        gathered = link.finish("fwd")
        record("compute", f"{link.name}:gemm", "fwd", link.copy)
        ws, bs = wb[:n], wb[n:]
        x = link.in_order(gathered)
        outs = link.linears(gathered, x, ws, bs)
        ctx.link, ctx.n, ctx.has_bias = link, n, tuple(b is not None for b in bs)
        ctx.save_for_backward(x, *ws)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        x, *ws = ctx.saved_tensors
        link = ctx.link
        record("compute", f"{link.name}:dgrad", "bwd", link.copy)
        dx = None
        for g, w in zip(grads, ws):
            if g is not None:
                d = g.matmul(w)
                dx = d if dx is None else dx.add_(d)
        if link.blocks > 1:  # back to the gathered order
            dx = chunk_layout.from_sequence_order(dx, _size(link.group), link.blocks)
        link.start(dx, "bwd")  # the input-grad collective runs while the weight grads are computed
        record("compute", f"{link.name}:wgrad", "bwd", link.copy)
        dws, dbs = [], []
        for i, (g, w, has_b) in enumerate(zip(grads, ws, ctx.has_bias)):
            if i == 0 and g is not None and link.deferred is not None:
                link.deferred.put(g, x)  # computed later, beside a collective at the end of the backward
                dws.append(None)
            else:
                dws.append(None if g is None else weight_grad(g, x))
            dbs.append(None if g is None or not has_b else g.reshape(-1, g.shape[-1]).sum(0))
        return (dx.new_empty(0), None, None, *dws, *dbs)


class _Mark(torch.autograd.Function):
    """Identity that logs a compute event in forward and in backward (for the order tests)."""

    @staticmethod
    def forward(ctx, x: Tensor, name: str, copy: Optional[int]) -> Tensor:
        ctx.name, ctx.copy = name, copy
        record("compute", name, "fwd", copy)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        record("compute", ctx.name, "bwd", ctx.copy)
        return grad, None, None


def issue(x: Tensor, link: AsyncCollective, linears: Optional[tuple] = None) -> Tensor:
    """Start link's collective on x; returns the token to pass to wait, or with linears=(weights, biases) (the
    GEMMs to run on the result) to wait_linears; an all-gather's are run on this rank's rows now."""
    token = _Issue.apply(x, link)
    if linears is not None:
        link.set_linears(x, *linears)
    return token


def issue_linear(x: Tensor, weight: Tensor, link: AsyncCollective, remote_first: bool = True) -> Tensor:
    """issue(F.linear(x, weight), link): a row-parallel linear's partial output into link's reduce. With
    remote_first, a reduce-scatter's rows are multiplied remote-first (_IssueLinear), so this rank's own rows are
    its window; else (or for other kinds) the whole GEMM runs before the collective starts."""
    split = link.kind == "reduce_scatter" and _size(link.group) > 1 and link.dim % x.dim() != x.dim() - 1
    if not (remote_first and split):
        return issue(mark_compute(F.linear(x, weight), f"{link.name}:gemm"), link)
    return _IssueLinear.apply(x, weight, link)


def wait(token: Tensor, link: AsyncCollective) -> Tensor:
    """The result of link's collective (blocks until it is done)."""
    return _Wait.apply(token, link)


def wait_linears(token: Tensor, link: AsyncCollective) -> tuple[Tensor, ...]:
    """wait(token, link) followed by F.linear(result, w, b) for each (w, b) the issue named, in one node whose
    backward overlaps the input-grad collective with the weight-grad GEMMs."""
    weights, biases = link.take_linears()
    return _WaitLinears.apply(token, link, len(weights), *weights, *biases)


def mark_compute(x: Tensor, name: str) -> Tensor:
    """x unchanged; logs a compute event for the current copy in forward and backward while recording (else x)."""
    if not instruments.is_recording():
        return x
    if not torch.is_grad_enabled():
        record("compute", name, "fwd")
        return x
    return _Mark.apply(x, name, instruments.active_copy())
