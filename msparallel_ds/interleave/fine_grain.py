"""One tensor-parallel decoder layer as a schedule of steps, its tokens split into chunks (fine_grain_interleave).

MindFormers' fine_grain_interleave (llama_interleave.py) splits a layer's tokens into N parts: per part norm + QKV,
concat, attention on the whole, per part out-proj + residual + norm + FFN + residual. The parts' sequence-parallel
collectives overlap the other parts' matmuls, and the split chains across layers (layer 0 skips the first split,
the last layer the second): between layers the hidden state stays in parts. `decoder_steps` runs those layers,
written once for any number of chunks; with one chunk it is the multi-copy layer (interleave/multi_copy.py runs
one instance per copy), so both features share this schedule.

Each chunk is one generator through all the consecutive decomposable layers. A step runs until it has started a
collective (overlap.issue) and then yields; the scheduler (schedule.round_robin) runs the next chunk (or copy), and
the chunk waits for its result only when it resumes:

    A  wait(prev layer's FFN reduce) + residual, norm, issue gather (+ q/k/v GEMMs of this rank's own rows with
       SP) -> yield -> wait + the other rows' q/k/v GEMMs (wait_linears); wait (yielding) until the q/k/v the
       attention needs are in
    B  attention of the first half of the batch rows -> yield -> the other half, out-proj, issue reduce (+ own
       rows' out-proj with SP: remote-first, overlap.issue_linear, with <= 2 streams) -> yield -> wait +
       residual, norm, issue gather (+ own rows' gate/up) -> yield -> wait + the other rows' gate/up, act -> yield
       -> down-proj, issue reduce (+ own rows' down-proj) -> yield; the result is waited at the next A
The yields without a collective cut a layer into six steps of about even cost, so every collective of another
copy has a GEMM or attention step (not only a norm) between its issue and its wait, forward and (autograd runs
the steps' nodes in reverse) backward. The attention is cut by batch rows where it is the chunk's own and local
(sdpa / eager, >= 2 rows; _SharedLayer.halves); otherwise it is one step, and a yield follows it.

Collectives: with sequence parallel the gather is an all-gather and the reduce a reduce-scatter along the sequence
(backward: the transposes); without it the gather is Megatron's f (identity, all-reduce of the input grad) and the
reduce an all-reduce.

The attention, with SP and several chunks, depends on where the chunks' tokens live (chunk_layout.py):
- chunk layout (causal sdpa/eager attention, a run that starts at the model's layer 0 or has >= 2 layers):
  gathered chunk j is the causal prefix block j of the sequence. Its heads (RoPE of its rows) are made when it
  arrives and its queries attend to the keys of chunks 0..j, in before it. Chunk j starts j % 3 steps behind
  chunk 0, like the copies, and each runs its attention and out-proj as two steps, so the windows are the
  copies' (forward and backward: no chunk waits for a later one). The run enters this layout at layer 0's
  scatter for free, elsewhere by an all-to-all, and leaves it by one, or at a whole model's last layer not at
  all (the output head takes its gathered blocks in sequence order, multi_copy._Head).
- rank layout (otherwise): gathered chunk j holds every tp rank's j-th slice, so a query of any chunk needs keys
  of every chunk: a barrier. q/k/v are permuted to sequence order before the attention and its output back to
  chunk order (a copy each). With causal sdpa/eager each chunk then runs only its own query rows, each block
  against the keys up to it (LayerParts.attend(rows)), odd chunks a step behind even ones; the lagging chunk's
  last gather before the barrier is the one collective per layer with nothing to hide behind. With cp backends
  (whole sequences only) the first chunk through runs the whole attention and every chunk takes its part.

Layers that cannot be decomposed run whole as one step (HF forward, blocking collectives): tp = 1 (no tp
collective to overlap), a recomputed or activation-offloaded layer or submodule (both wrap the module's forward),
or a layer whose family adapter gives no LayerParts (msparallel_ds.models: the adapter says which modules are the
norms, projections and MLP, and runs the attention between the projections).
"""
from __future__ import annotations

from functools import partial
from typing import Any, Optional

import torch
from torch import Tensor, nn

from ..models import LayerParts
from ..tensor_parallel.layers import ReplicatedKVLinear, RowParallelLinear
from ..tensor_parallel.mappings import copy_to_region
from . import chunk_layout, deferred
from .chunk_layout import SEQ_DIM, join_chunks, split_chunks
from .deferred import DeferredWgrad
from .overlap import AsyncCollective, issue, issue_linear, mark_compute, wait, wait_linears
from .schedule import round_robin

__all__ = ["decoder_steps", "decomposable", "split_chunks", "join_chunks", "split_rows", "Pending", "SEQ_DIM"]

# ---------------------------------------------------------------------------------------------- the layer's parts
def decomposable(layer: nn.Module, parts: Optional[LayerParts]) -> bool:
    """True if layer_steps can run `layer` (with its adapter's `parts`) as steps (else it runs whole, see the
    module docstring)."""
    if parts is None:
        return False
    if not (isinstance(parts.attn_out, RowParallelLinear) and isinstance(parts.ffn_out, RowParallelLinear)):
        return False  # tp = 1: nothing to overlap
    return not any(getattr(m, "_msp_recompute", False) or getattr(m, "_msp_offload", False) for m in layer.modules())


def _col_weights(module: nn.Module) -> tuple[Tensor, Optional[Tensor]]:
    """(weight, bias) of a column-side linear: this rank's shard, or for ReplicatedKVLinear the kv head's rows of
    the replicated weight (whose grad is summed over tp once per backward, tensor_parallel/replicated.py)."""
    if isinstance(module, ReplicatedKVLinear):
        return module.local_weights()
    return module.weight, module.bias


class _Kinds:
    """The layer's tp group and collective kinds (SP: all-gather / reduce-scatter; else f / all-reduce)."""

    def __init__(self, row: RowParallelLinear):
        self.group, self.tp, self.sp = row.group, row.tp, bool(row.sequence_parallel)
        self.gather = "all_gather" if self.sp else "identity"
        self.reduce = "reduce_scatter" if self.sp else "all_reduce"


def _row_bias(y: Tensor, module) -> Tensor:
    if module.bias is None:
        return y
    # SP: each rank adds the bias to its own tokens, so its grad is partial: f sums it (as RowParallelLinear does)
    return y + (copy_to_region(module.bias, module.group) if module.sequence_parallel else module.bias)


class Pending:
    """A chunk's hidden state whose last addend (a row layer's reduce) may still be in flight."""

    __slots__ = ("residual", "token", "link", "row")

    def __init__(self, residual: Tensor, token: Tensor, link: AsyncCollective, row):
        self.residual, self.token, self.link, self.row = residual, token, link, row

    def result(self) -> Tensor:
        return self.residual + _row_bias(wait(self.token, self.link), self.row)


def resolve(h) -> Tensor:
    return h.result() if isinstance(h, Pending) else h


# ---------------------------------------------------------------------------------------------- chunks
def _to_sequence_order(chunks: list[Tensor], tp: int) -> Tensor:
    """Gathered chunks [b, tp*s_c, f] (chunk j = every tp rank's chunk j) -> [b, S, f] in sequence order."""
    x = torch.cat(chunks, SEQ_DIM)
    if len(chunks) == 1 or tp == 1:
        return x
    b, _, f = x.shape
    return x.view(b, len(chunks), tp, -1, f).transpose(1, 2).reshape(b, -1, f)


def _to_chunk_order(x: Tensor, n: int, tp: int) -> list[Tensor]:
    """Inverse of _to_sequence_order: [b, S, f] -> n chunks [b, tp*s_c, f]."""
    if n == 1:
        return [x]
    if tp == 1:
        return list(x.chunk(n, SEQ_DIM))
    b, _, f = x.shape
    y = x.view(b, tp, n, -1, f).transpose(1, 2)
    return [y[:, j].reshape(b, -1, f) for j in range(n)]


def split_rows(value: Any, rows: int, n: int) -> list:
    """value split into n along dim 0 if it is per-row (dim 0 == rows), else n references to it (the copies' and
    the attention halves' HF layer kwargs)."""
    if torch.is_tensor(value) and value.dim() >= 1 and value.shape[0] == rows:
        return list(value.chunk(n, 0))
    if isinstance(value, tuple) and value and all(torch.is_tensor(v) for v in value):
        parts = [split_rows(v, rows, n) for v in value]
        return [tuple(p[c] for p in parts) for c in range(n)]
    return [value] * n


# ---------------------------------------------------------------------------------------------- attention
def _chunk_rows(j: int, n: int, tp: int, seq: int) -> list[tuple[int, int]]:
    """The query rows, in sequence order, of gathered chunk j: every tp rank's j-th 1/n of its sequence slice."""
    size = seq // (n * tp)
    return [((r * n + j) * size, (r * n + j + 1) * size) for r in range(tp)]


class _SharedLayer:
    """What the chunks of one copy share in one layer: its collective kinds, its column-side (weight, bias) pairs
    (derived once, not per chunk), and its attention.

    In the rank layout (chunk_layout.py) the attention is the chunks' barrier: a chunk's queries need keys of every
    chunk (gathered chunk j holds every tp rank's j-th slice, so even causal attention reaches into the later
    chunks). Once every chunk's q/k/v is in, each chunk runs its own query rows against the keys they see (row
    blocks: causal attention, no cp), so chunks keep running one after the other across the barrier; else the
    first chunk through runs the whole sequence's attention (cp backends) and every chunk takes its part.
    In the chunk layout (`chunked`) gathered chunk j is the causal prefix block j: its heads are made (RoPE of its
    own rows) when it arrives, and its queries attend to the keys of chunks 0..j, which arrived before it."""

    def __init__(self, parts: LayerParts, n: int, kw: dict, index: int):
        self.parts, self.n, self.kw, self.index = parts, n, kw, index
        self.chunked = False  # set by decoder_steps for the whole run (chunk_layout.wanted)
        self.kinds = _Kinds(parts.attn_out)  # the layer's collectives, for every chunk
        self.qkv_w, self.qkv_b = zip(*(_col_weights(m) for m in parts.qkv))
        self.gate_up_w, self.gate_up_b = zip(*(_col_weights(m) for m in parts.ffn_in))
        self.order_tp = self.kinds.tp if self.kinds.sp else 1
        self.local = parts.row_blocks()  # a local attention function, causal: row blocks and batch halves
        self.by_rows = n > 1 and self.local
        self.qkv: Optional[list] = [None] * n  # rank layout: dropped once the heads are made; chunk layout: heads
        self.arrived = 0
        self.heads = self.outs = None

    def arrive(self, j: int, qkv) -> None:
        if self.chunked:
            a, b = self._rows(j, qkv[0])
            kw = self.kw
            if "position_embeddings" in kw:  # RoPE of this chunk's rows
                kw = {**kw, "position_embeddings": tuple(t.narrow(SEQ_DIM, a, b - a)
                                                         for t in kw["position_embeddings"])}
            qkv = self.parts.heads(*qkv, kw)
        self.qkv[j] = qkv
        self.arrived += 1

    def ready(self, j: int) -> bool:
        """Whether chunk j's attention can run: every chunk is in (rank layout), chunks 0..j (chunk layout)."""
        return all(c is not None for c in self.qkv[:j + 1]) if self.chunked else self.arrived == self.n

    def _rows(self, j: int, x: Tensor) -> tuple[int, int]:
        """Chunk layout: the sequence rows of gathered chunk j ([b, s, f] or heads [b, h, s, d])."""
        size = x.shape[SEQ_DIM if x.dim() == 3 else 2]
        return j * size, (j + 1) * size

    def halves(self, j: int) -> bool:
        """Whether chunk j's attention runs as two steps, one per half of its batch rows: it is the chunk's own
        (one chunk, or the chunk layout), the attention function is local (sdpa / eager, no cp) and there are >= 2
        rows. Rows are independent, so the halves change no value; the step boundary inside the attention is
        where the other copies' collectives get the most even windows (benchmarks/README.md, twelfth pass)."""
        return (self.n == 1 or self.chunked) and self.local and self.qkv[j][0].shape[0] >= 2

    def _own(self, j: int) -> tuple[Tensor, Tensor, Tensor, Optional[tuple[int, int]]]:
        """(q, k, v, rows) of chunk j's own attention: the chunk layout's block j against keys 0..j, or the one
        chunk's whole sequence (its heads made here)."""
        if self.chunked:
            q = self.qkv[j][0]
            k, v = (c[0] if j == 0 else torch.cat(c, 2) for c in zip(*(h[1:] for h in self.qkv[:j + 1])))
            return q, k, v, self._rows(j, q)
        if self.heads is None:
            self.heads = self.parts.heads(*self.qkv[0], self.kw)
            self.qkv = [self.heads]  # the raw q/k/v dropped; halves() reads the row count from here
        return (*self.heads, None)

    def output_half(self, j: int, half: int) -> Tensor:
        """Chunk j's attention output of the first or second half of its batch rows (see halves)."""
        q, k, v, rows = self._own(j)
        b = q.shape[0]
        q, k, v = (t.chunk(2, 0)[half] for t in (q, k, v))
        kw = {key: split_rows(val, b, 2)[half] for key, val in self.kw.items()}
        return mark_compute(self.parts.attend(q, k, v, kw, rows), f"L{self.index}.attention")

    def output(self, j: int) -> tuple[Tensor, bool]:
        """(chunk j's attention output [b, tp*s_c, h*d] in chunk order, whether this call ran the whole attention)."""
        if self.chunked:
            q, k, v, rows = self._own(j)
            return mark_compute(self.parts.attend(q, k, v, self.kw, rows), f"L{self.index}.attention"), False
        if self.heads is None:
            self.heads = self.parts.heads(*(_to_sequence_order([c[i] for c in self.qkv], self.order_tp)
                                            for i in range(3)), self.kw)
            self.qkv = None
        q, k, v = self.heads
        if self.by_rows:
            o = torch.cat([self.parts.attend(q, k, v, self.kw, rows)
                           for rows in _chunk_rows(j, self.n, self.order_tp, q.shape[2])], SEQ_DIM)
            return mark_compute(o, f"L{self.index}.attention"), False
        ran = self.outs is None
        if ran:
            o = mark_compute(self.parts.attend(q, k, v, self.kw), f"L{self.index}.attention")
            self.outs = _to_chunk_order(o, self.n, self.order_tp)
        return self.outs[j], ran


# ---------------------------------------------------------------------------------------------- the layers
def remote_first(streams: int) -> bool:
    """Whether the reduce-scatters run remote-first (overlap.issue_linear) when `streams` copies x chunks are
    interleaved. With <= 2 a collective's window holds one other step, which this rank's own rows widen; with more
    the other streams' steps fill it already (N=4: 0.97-0.98 of the link hidden either way) and the split's extra
    small GEMMs and copies cost more main-thread time than they hide (benchmarks/README.md, thirteenth pass)."""
    return streams <= 2


def _chunk_steps(run: list, shared_layers: list, h, j: int, lag: int, rf: bool):
    """Generator: chunk j of one copy through the decomposable layers `run` ((index, layer, parts) each, their
    _SharedLayer in `shared_layers`); yields after every collective it starts and in the middle of the GEMM blocks;
    returns its output (Pending: the last reduce may still be in flight). rf: remote-first reduce-scatters."""
    for (index, _, parts), shared in zip(run, shared_layers):
        kinds = shared.kinds
        residual = resolve(h)
        x = mark_compute(parts.input_norm(residual), f"L{index}.norm1")
        for _ in range(lag):
            yield
        lag = 0
        link = AsyncCollective(kinds.gather, kinds.group, SEQ_DIM, name=f"L{index}.qkv_in")
        token = issue(x, link, (shared.qkv_w, shared.qkv_b))  # with SP: this rank's rows' q/k/v now
        yield
        shared.arrive(j, wait_linears(token, link))
        barrier = shared.by_rows and not shared.chunked
        if barrier:
            yield  # so chunk 0, not the last to arrive, goes first across the barrier
        while not shared.ready(j):
            yield
        if shared.halves(j):  # the attention as two steps (batch-row halves); the second shares the out-proj's
            first = shared.output_half(j, 0)
            yield
            o = torch.cat([first, shared.output_half(j, 1)], 0)
        else:
            o, ran_whole = shared.output(j)
            if ran_whole or shared.chunked or (barrier and j % 2):
                # attention and out-proj are two steps here: behind the barrier, odd chunks run a step behind even
                # ones, so the step inside each reduce-scatter's or gather's window is another chunk's GEMM or
                # attention block, not the same short norm step (lockstep)
                yield
        link = AsyncCollective(kinds.reduce, kinds.group, SEQ_DIM, name=f"L{index}.attn_out")
        token = issue_linear(mark_compute(o, f"L{index}.attn_out"), parts.attn_out.weight, link, rf)
        yield
        h = Pending(residual, token, link, parts.attn_out).result()
        x = mark_compute(parts.post_norm(h), f"L{index}.norm2")
        link = AsyncCollective(kinds.gather, kinds.group, SEQ_DIM, name=f"L{index}.ffn_in")
        token = issue(x, link, (shared.gate_up_w, shared.gate_up_b))
        yield
        gate, up = wait_linears(token, link)
        y = mark_compute(parts.act(gate) * up, f"L{index}.ffn")
        yield  # the other rows' gate/up + act, and down-proj, are two steps
        link = AsyncCollective(kinds.reduce, kinds.group, SEQ_DIM, name=f"L{index}.ffn_out")
        h = Pending(h, issue_linear(y, parts.ffn_out.weight, link, rf), link, parts.ffn_out)
        yield  # in flight while the other chunks/copies run; waited at the next layer's norm (or by the caller)
    return h


def decoder_steps(layers: list, h: Tensor, kw: dict[str, Any], *, n: int = 1, copy: Any = 0, lag: int = 0,
                  scatter_group=None, stay_chunked: bool = False, wgrad: Optional[DeferredWgrad] = None,
                  copies: int = 1):
    """Generator: one copy's hidden state h through `layers` ((index, layer, parts) each, parts: the family
    adapter's LayerParts) in n chunks; yields after every collective it starts (and between GEMM blocks); returns
    the chunks' outputs (tensors or Pending; in the rank layout unless stay_chunked, below). Consecutive
    decomposable layers run as one chunk generator each, round-robin, so the chunks stay a step apart across
    layers, in the chunk layout where chunk_layout.wanted; others run whole as one step. `kw`: the HF layer kwargs
    for this copy (position_embeddings, attention_mask, position_ids, ...). lag: extra yields before the first gather
    (multi_copy.copy_lag). scatter_group: the tp group when layers[0] is the model's layer 0 under SP (h is then
    the whole sequence); if that layer is decomposable the scatter its pre-hook would do is done here, else the
    layer runs whole with its own pre-hook. stay_chunked: a last run in the chunk layout is not moved back (the
    caller's output head takes the gathered blocks in sequence order, multi_copy._Head). The scatter is async
    (deferred.scatter: its backward all-gather in flight beside other copies' layer-0 backward and, with `wgrad`,
    this copy's part of the output head's deferred weight grad). copies: how many copies run interleaved, this one
    included (for remote_first). Returns (the chunks' outputs, (tp, n) if they are in the chunk layout else None)."""
    hs: Optional[list] = None  # the chunks; None while the hidden state is the whole tensor h
    ids, i = [copy if n == 1 else (copy, j) for j in range(n)], 0
    while i < len(layers):
        index, layer, parts = layers[i]
        if not decomposable(layer, parts):
            out = layer(h if hs is None else join_chunks([resolve(x) for x in hs]), **kw)  # its own hooks
            h, hs, lag, i = mark_compute(out, f"L{index}.whole"), None, 0, i + 1
            continue
        end = next((e for e in range(i, len(layers)) if not decomposable(*layers[e][1:])), len(layers))
        run = layers[i:end]
        shared = [_SharedLayer(p, n, kw, idx) for idx, _, p in run]
        kinds, scatter = shared[0].kinds, i == 0 and scatter_group is not None
        chunked = chunk_layout.wanted(n, kinds.tp, kinds.sp, all(s.by_rows for s in shared), len(run),
                                      free_entry=scatter)
        for s in shared:
            s.chunked = chunked
        if hs is None:
            cut = partial(deferred.scatter, group=kinds.group, dim=SEQ_DIM, copy=copy, box=wgrad)
            hs = chunk_layout.enter(h, n, kinds.group, scatter=scatter, chunked=chunked, cut=cut)
        elif chunked:
            hs = chunk_layout.to_chunk_layout([resolve(x) for x in hs], kinds.group)
        rf = remote_first(copies * n)
        hs = yield from round_robin([_chunk_steps(run, shared, hs[j], j, lag + (j % 3 if chunked else 0), rf)
                                      for j in range(n)], ids)
        lag, i = 0, end
        if chunked and stay_chunked and end == len(layers):
            return hs, (kinds.tp, n)
        if chunked:
            hs = chunk_layout.to_rank_layout([resolve(x) for x in hs], kinds.group)
    return ([h] if hs is None else hs), None
