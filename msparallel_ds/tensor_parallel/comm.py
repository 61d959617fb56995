"""Collectives as autograd functions: the one place where tp/sp/cp layers talk to other ranks (DESIGN style 2).

Each Function is named <what forward does><what backward does> and takes its process group explicitly (no module
state). Layers call the lowercase wrappers, which return the input untouched on a size-1 group (no communication).

| wrapper                                      | forward                    | backward                   | Megatron           |
|----------------------------------------------|----------------------------|----------------------------|--------------------|
| copy_to_region(x, g)                         | identity                   | all-reduce (sum)           | f                  |
| reduce_from_region(x, g)                     | all-reduce (sum)           | identity                   | g                  |
| gather_from_sequence_region(x, g, dim)       | all-gather along dim       | reduce-scatter along dim   | SP before column   |
| reduce_scatter_to_sequence_region(x, g, dim) | reduce-scatter along dim   | all-gather along dim       | SP after row       |
| scatter_to_region(x, g, dim)                 | keep my slice of dim       | all-gather along dim       | scatter_to_tp      |
| gather_from_region(x, g, dim)                | all-gather along dim       | keep my slice of dim       | gather_output      |
| seq_to_head(x, g) / head_to_seq(x, g)        | Ulysses all-to-all         | the inverse all-to-all     | (DeepSpeed-Ulysses)|

Slices are in group-rank order: rank r owns elements [r*n/N, (r+1)*n/N) of `dim`. Gathers and reduce-scatters
move `dim` to the front so each rank's piece is one contiguous block (the tensor-form collectives need that), so
they work for any dim on any backend and device. Sums run in the tensor's dtype.

Async pairs (multi-copy / fine-grain interleave, msparallel_ds.interleave): `AsyncCollective(kind, group, dim)` is
one collective of one copy, in flight between `issue(x, link)` and `wait(token, link)` (or `wait_linears`, which
also runs the colwise GEMMs that consume the result). Forward: issue starts the collective (async_op=True) and
returns a 0-size token that only links the two autograd nodes; wait finishes it and returns the result. Backward
swaps the roles: wait's backward starts the transposed collective on the grad, issue's backward waits for it, so
eager autograd's reverse-creation order keeps another copy's backward between the two. wait_linears' backward
starts the input-grad collective right after the dgrad GEMM and runs the wgrad GEMMs while it is in flight
(Megatron's async grad all-reduce / reduce-scatter).

| kind           | forward              | backward (transpose) |
|----------------|----------------------|----------------------|
| all_gather     | all-gather along dim | reduce-scatter       |
| reduce_scatter | reduce-scatter       | all-gather           |
| all_reduce     | all-reduce           | identity             |
| identity       | identity             | all-reduce           |

Instruments (off by default, one `is None` test per collective when off): `recording()` logs issue / wait /
compute / sync events with the copy id and phase (fwd/bwd) for the order tests; `modelled_link(alpha, bw)` floors
every collective's completion at alpha + bus_bytes / bw after its start by sleeping (no CPU), so overlap can be
measured on a machine whose real link shares the cores with compute.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

__all__ = ["all_reduce", "all_gather_along", "reduce_scatter_along", "split_along",
           "IdentityAllReduce", "AllReduceIdentity", "AllGatherReduceScatter", "ReduceScatterAllGather",
           "SplitAllGather", "AllGatherSplit", "SeqToHeadAllToAll", "HeadToSeqAllToAll",
           "copy_to_region", "reduce_from_region", "gather_from_sequence_region", "reduce_scatter_to_sequence_region",
           "scatter_to_region", "gather_from_region", "seq_to_head", "head_to_seq",
           "AsyncCollective", "issue", "wait", "wait_linears", "mark_compute", "recording", "modelled_link",
           "current_copy", "record", "comm_stats"]


# ---------------------------------------------------------------------------------------------- instruments
class _Instruments:
    """Module state of the two debugging/benchmark instruments; both None (off) unless a context enables them."""
    log: Optional[list] = None                       # recording(): list of event tuples
    link: Optional[tuple[float, float]] = None       # modelled_link(): (alpha seconds, bytes per second)
    copy: Optional[int] = None                       # the copy (or chunk) whose forward code runs now
    stats: Optional[dict] = None                     # comm_stats(): counters of the collectives that completed


def record(event: str, name: str, phase: Optional[str] = None, copy: Optional[int] = None) -> None:
    """Append (event, copy, phase, name) to the active recording; no-op (one test) when none is active.
    phase None: bwd inside an autograd backward, else fwd."""
    if _Instruments.log is not None:
        if phase is None:
            phase = "bwd" if torch._C._current_autograd_node() is not None else "fwd"
        _Instruments.log.append((event, _Instruments.copy if copy is None else copy, phase, name))


@contextlib.contextmanager
def recording():
    """Log collectives and compute marks: yields the list of (event, copy, phase, name) tuples, event in
    issue | wait | compute | sync (a blocking collective), phase fwd | bwd."""
    prev, _Instruments.log = _Instruments.log, []
    try:
        yield _Instruments.log
    finally:
        _Instruments.log = prev


@contextlib.contextmanager
def modelled_link(alpha_s: float, bytes_per_s: float):
    """Every collective completes no earlier than alpha_s + bus_bytes / bytes_per_s after it started (a sleep,
    which frees the core); bus bytes: ring volume per rank, (n-1)/n of the gathered size (x2 for all-reduce)."""
    prev, _Instruments.link = _Instruments.link, (float(alpha_s), float(bytes_per_s))
    try:
        yield
    finally:
        _Instruments.link = prev


@contextlib.contextmanager
def comm_stats():
    """Count the collectives completed inside: yields {collectives, bus_bytes, blocked_s (wall time the caller
    spent waiting in them), modelled_s (their modelled durations, with modelled_link)}."""
    prev = _Instruments.stats
    _Instruments.stats = {"collectives": 0, "bus_bytes": 0.0, "blocked_s": 0.0, "modelled_s": 0.0}
    try:
        yield _Instruments.stats
    finally:
        _Instruments.stats = prev


def _count(nbytes: float, blocked_from: float) -> None:
    st = _Instruments.stats
    st["collectives"] += 1
    st["bus_bytes"] += nbytes
    st["blocked_s"] += time.perf_counter() - blocked_from
    if _Instruments.link is not None:
        st["modelled_s"] += _Instruments.link[0] + nbytes / _Instruments.link[1]


@contextlib.contextmanager
def current_copy(copy: Optional[int]):
    """Tag the events of the code inside with this copy id (the interleave scheduler sets it per step)."""
    prev, _Instruments.copy = _Instruments.copy, copy
    try:
        yield
    finally:
        _Instruments.copy = prev


def _bus_bytes(kind: str, full: Tensor, n: int) -> float:
    """Bytes one rank moves in a ring implementation; `full` is the gathered / pre-reduction tensor."""
    b = full.numel() * full.element_size() * (n - 1) / n
    return 2 * b if kind == "all_reduce" else b


def _floor(t0: float, nbytes: float) -> None:
    alpha, bw = _Instruments.link
    left = t0 + alpha + nbytes / bw - time.perf_counter()
    if left > 0:
        time.sleep(left)


def _sync_start() -> Optional[float]:
    return time.perf_counter() if _Instruments.link is not None or _Instruments.stats is not None else None


def _sync_done(t0: Optional[float], kind: str, nbytes: float) -> None:
    if t0 is not None:
        if _Instruments.link is not None:
            _floor(t0, nbytes)
        if _Instruments.stats is not None:
            _count(nbytes, t0)
    record("sync", kind)


# ---------------------------------------------------------------------------------------------- plain collectives
def _size(group) -> int:
    return dist.get_world_size(group)


def _chunk(x: Tensor, group, dim: int) -> int:
    """Length of one rank's slice of `dim`; a clear error (on every rank, before any collective) if it is not even."""
    n, length = _size(group), x.shape[dim]
    if length % n:
        raise ValueError(f"dim {dim} of a tensor of shape {tuple(x.shape)} has size {length}, which is not divisible "
                         f"by the group size {n}: every rank must hold an equal slice (pad the sequence/features)")
    return length // n


def _unsupported(e: Exception) -> bool:  # old gloo lacks the tensor-form collectives ("... does not support ...")
    return "support" in str(e)


def all_reduce(x: Tensor, group, op=dist.ReduceOp.SUM) -> Tensor:
    """Out of place: autograd may share `x` (a grad fanned out to several branches, a saved activation)."""
    if _size(group) == 1:
        return x
    t0 = _sync_start()
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=op, group=group)
    _sync_done(t0, "all_reduce", _bus_bytes("all_reduce", out, _size(group)))
    return out


def all_gather_along(x: Tensor, group, dim: int) -> Tensor:
    """Every rank's x concatenated along dim, in group-rank order (contiguous result)."""
    n = _size(group)
    if n == 1:
        return x
    dim %= x.dim()
    t0 = _sync_start()
    x = x.contiguous()
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))  # concat form along dim 0: every backend accepts it
    try:
        # torch 2.13 renamed all_gather_into_tensor; look up per call so wrappers (byte counters) see it
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, group=group)
    except (RuntimeError, NotImplementedError) as e:
        if not _unsupported(e):
            raise
        dist.all_gather(list(out.chunk(n)), x, group=group)
    _sync_done(t0, "all_gather", _bus_bytes("all_gather", out, n))
    # rank-major blocks -> rank slices along dim: a view when dim == 0, else one copy
    return out.unflatten(0, (n, x.shape[0])).movedim(0, dim).flatten(dim, dim + 1)


def reduce_scatter_along(x: Tensor, group, dim: int) -> Tensor:
    """Sum of every rank's x, of which this rank keeps its slice along dim."""
    n = _size(group)
    if n == 1:
        return x
    dim %= x.dim()
    piece = _chunk(x, group, dim)
    t0 = _sync_start()
    send = x.unflatten(dim, (n, piece)).movedim(dim, 0).contiguous()  # destination rank first (concat form)
    out = x.new_empty(send.shape[1:])
    try:
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, send.flatten(0, 1),
                                                                                      group=group)
    except (RuntimeError, NotImplementedError) as e:
        if not _unsupported(e):
            raise
        out = all_reduce(send, group)[dist.get_rank(group)]  # send may be a view of x: out of place
    _sync_done(t0, "reduce_scatter", _bus_bytes("reduce_scatter", send, n))
    return out


def split_along(x: Tensor, group, dim: int) -> Tensor:
    """This rank's slice of dim (contiguous, so the caller may free x)."""
    if _size(group) == 1:
        return x
    piece = _chunk(x, group, dim)
    return x.narrow(dim, dist.get_rank(group) * piece, piece).contiguous()


# ---------------------------------------------------------------------------------------------- autograd pairs
class IdentityAllReduce(torch.autograd.Function):
    """Megatron f. Forward: identity. Backward: all-reduce (each rank's branch contributed part of the grad)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return x.view_as(x)  # a new tensor object, so autograd records this node

    @staticmethod
    def backward(ctx, grad: Tensor):
        return all_reduce(grad, ctx.group), None


class AllReduceIdentity(torch.autograd.Function):
    """Megatron g. Forward: all-reduce of partial results. Backward: identity (the output is replicated)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class AllGatherReduceScatter(torch.autograd.Function):
    """SP into a column-parallel region. Forward: all-gather along dim. Backward: reduce-scatter along dim (every
    rank's branch used the whole gathered tensor, so each slice's grad is the sum over ranks)."""

    @staticmethod
    def forward(ctx, x: Tensor, group, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return all_gather_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return reduce_scatter_along(grad, ctx.group, ctx.dim), None, None


class ReduceScatterAllGather(torch.autograd.Function):
    """SP out of a row-parallel region. Forward: reduce-scatter along dim. Backward: all-gather along dim."""

    @staticmethod
    def forward(ctx, x: Tensor, group, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return reduce_scatter_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return all_gather_along(grad, ctx.group, ctx.dim), None, None


class SplitAllGather(torch.autograd.Function):
    """Forward: keep this rank's slice of a replicated tensor. Backward: all-gather the slices' grads."""

    @staticmethod
    def forward(ctx, x: Tensor, group, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return split_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return all_gather_along(grad, ctx.group, ctx.dim), None, None


class AllGatherSplit(torch.autograd.Function):
    """Forward: all-gather slices into a replicated tensor. Backward: keep this rank's slice of the grad (every rank
    holds the same replicated grad, so no sum)."""

    @staticmethod
    def forward(ctx, x: Tensor, group, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return all_gather_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return split_along(grad, ctx.group, ctx.dim), None, None


def copy_to_region(x: Tensor, group) -> Tensor:
    return x if _size(group) == 1 else IdentityAllReduce.apply(x, group)


def reduce_from_region(x: Tensor, group) -> Tensor:
    return x if _size(group) == 1 else AllReduceIdentity.apply(x, group)


def gather_from_sequence_region(x: Tensor, group, dim: int) -> Tensor:
    return x if _size(group) == 1 else AllGatherReduceScatter.apply(x, group, dim)


def reduce_scatter_to_sequence_region(x: Tensor, group, dim: int) -> Tensor:
    if _size(group) == 1:
        return x
    _chunk(x, group, dim)  # raise the clear error here, outside autograd
    return ReduceScatterAllGather.apply(x, group, dim)


def scatter_to_region(x: Tensor, group, dim: int) -> Tensor:
    return x if _size(group) == 1 else SplitAllGather.apply(x, group, dim)


def gather_from_region(x: Tensor, group, dim: int) -> Tensor:
    return x if _size(group) == 1 else AllGatherSplit.apply(x, group, dim)


# ---------------------------------------------------------------------------------------------- Ulysses all-to-all
def _seq_to_head(x: Tensor, group) -> Tensor:
    """[b, h, s, d] (sequence piece `rank`) -> [b, h/U, U*s, d] (head chunk `rank`, sequence in rank order)."""
    u = dist.get_world_size(group)
    b, h, s, d = x.shape
    # dim 0 = destination rank: head chunk j goes to rank j (all_to_all_single splits dim 0 evenly)
    send = x.reshape(b, u, h // u, s, d).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # dim 0 = source rank = its sequence piece: put it in front of the sequence dim
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // u, u * s, d)


def _head_to_seq(x: Tensor, group) -> Tensor:
    """Inverse of _seq_to_head: [b, h/U, U*s, d] -> [b, h, s, d]."""
    u = dist.get_world_size(group)
    b, hu, us, d = x.shape
    s = us // u
    send = x.reshape(b, hu, u, s, d).permute(2, 0, 1, 3, 4).contiguous()  # dim 0 = destination's sequence piece
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1).reshape(b, u * hu, s, d)  # dim 0 = source rank = head chunk


class SeqToHeadAllToAll(torch.autograd.Function):
    """Forward: gather the sequence, scatter the heads over `group`. Backward: the inverse (head-to-seq)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return _seq_to_head(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _head_to_seq(grad, ctx.group), None


class HeadToSeqAllToAll(torch.autograd.Function):
    """Forward: gather the heads, scatter the sequence over `group`. Backward: the inverse (seq-to-head)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return _head_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _seq_to_head(grad, ctx.group), None


def seq_to_head(x: Tensor, group) -> Tensor:
    return x if _size(group) == 1 else SeqToHeadAllToAll.apply(x, group)


def head_to_seq(x: Tensor, group) -> Tensor:
    return x if _size(group) == 1 else HeadToSeqAllToAll.apply(x, group)


# ---------------------------------------------------------------------------------------------- async pairs
_TRANSPOSE = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather", "all_reduce": "identity",
              "identity": "all_reduce"}


def _start(kind: str, x: Tensor, group, dim: int) -> tuple[Optional[object], Callable[[], Tensor], float]:
    """Start collective `kind` on x without blocking: (work or None, finish() -> result, bus bytes)."""
    n = _size(group)
    if kind == "identity" or n == 1:
        return None, (lambda: x), 0.0
    if kind == "all_reduce":
        out = x.clone(memory_format=torch.contiguous_format)
        return dist.all_reduce(out, group=group, async_op=True), (lambda: out), _bus_bytes(kind, out, n)
    dim %= x.dim()
    if kind == "all_gather":
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
            _bus_bytes(kind, out, n)
    if kind == "reduce_scatter":
        piece = _chunk(x, group, dim)
        send = x.unflatten(dim, (n, piece)).movedim(dim, 0).contiguous()
        out = x.new_empty(send.shape[1:])
        try:
            work = (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(
                out, send.flatten(0, 1), group=group, async_op=True)
            return work, (lambda: out), _bus_bytes(kind, send, n)  # already x's layout, dim shrunk
        except (RuntimeError, NotImplementedError) as e:
            if not _unsupported(e):
                raise
        work = dist.all_reduce(send, group=group, async_op=True)
        rank = dist.get_rank(group)
        return work, (lambda: send[rank]), _bus_bytes(kind, send, n)
    raise ValueError(f"unknown collective kind {kind!r}; one of {', '.join(_TRANSPOSE)}")


class AsyncCollective:
    """One copy's collective `kind` over `group` along `dim`, in flight between issue() and wait(); the backward
    runs the transposed kind in flight between wait's backward and issue's backward. One object per use."""

    def __init__(self, kind: str, group, dim: int = 1, *, name: str = "", copy: Optional[int] = None):
        if kind not in _TRANSPOSE:
            raise ValueError(f"unknown collective kind {kind!r}; one of {', '.join(_TRANSPOSE)}")
        self.kind, self.group, self.dim, self.name = kind, group, dim, name or kind
        self.copy = _Instruments.copy if copy is None else copy
        self._pending: Optional[tuple] = None

    def start(self, x: Tensor, phase: str) -> None:
        kind = self.kind if phase == "fwd" else _TRANSPOSE[self.kind]
        t0 = time.perf_counter() if _Instruments.link is not None else None
        work, finish, nbytes = _start(kind, x, self.group, self.dim)
        self._pending = (work, finish, nbytes, t0, kind)
        if work is not None:
            record("issue", f"{self.name}:{kind}", phase, self.copy)

    def finish(self, phase: str) -> Tensor:
        work, finish, nbytes, t0, kind = self._pending
        self._pending = None
        if work is not None:
            blocked_from = time.perf_counter() if _Instruments.stats is not None else 0.0
            work.wait()
            if t0 is not None and _Instruments.link is not None:
                _floor(t0, nbytes)
            if _Instruments.stats is not None:
                _count(nbytes, blocked_from)
            record("wait", f"{self.name}:{kind}", phase, self.copy)
        return finish()


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
        return link.finish("fwd")

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.link.start(grad, "bwd")
        return grad.new_empty(0), None


class _WaitLinears(torch.autograd.Function):
    """wait + the GEMMs that consume the result: y_i = x W_i^T + b_i. Backward: dgrad, start the input-grad
    collective, then the wgrad GEMMs while it is in flight."""

    @staticmethod
    def forward(ctx, token: Tensor, link: AsyncCollective, n: int, *wb):
        x = link.finish("fwd")
        record("compute", f"{link.name}:gemm", "fwd", link.copy)
        ws, bs = wb[:n], wb[n:]
        outs = tuple(F.linear(x, w, b) for w, b in zip(ws, bs))
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
        link.start(dx, "bwd")  # the input-grad collective runs while the weight grads are computed
        record("compute", f"{link.name}:wgrad", "bwd", link.copy)
        x2 = x.reshape(-1, x.shape[-1])
        dws, dbs = [], []
        for g, w, has_b in zip(grads, ws, ctx.has_bias):
            g2 = None if g is None else g.reshape(-1, g.shape[-1])
            dws.append(None if g2 is None else g2.t().matmul(x2))
            dbs.append(None if g2 is None or not has_b else g2.sum(0))
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


def issue(x: Tensor, link: AsyncCollective) -> Tensor:
    """Start link's collective on x; returns the token to pass to wait / wait_linears."""
    return _Issue.apply(x, link)


def wait(token: Tensor, link: AsyncCollective) -> Tensor:
    """The result of link's collective (blocks until it is done)."""
    return _Wait.apply(token, link)


def wait_linears(token: Tensor, link: AsyncCollective, weights, biases) -> tuple[Tensor, ...]:
    """wait(token, link) followed by F.linear(result, w, b) for each weight, in one node whose backward overlaps
    the input-grad collective with the weight-grad GEMMs."""
    weights, biases = list(weights), list(biases)
    return _WaitLinears.apply(token, link, len(weights), *weights, *biases)


def mark_compute(x: Tensor, name: str) -> Tensor:
    """x unchanged; logs a compute event for the current copy in forward and backward while recording (else x)."""
    if _Instruments.log is None or not torch.is_grad_enabled():
        if _Instruments.log is not None:
            record("compute", name, "fwd")
        return x
    return _Mark.apply(x, name, _Instruments.copy)
