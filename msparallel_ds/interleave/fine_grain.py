"""One tensor-parallel decoder layer as a schedule of steps, its tokens split into chunks (fine_grain_interleave).

MindFormers' fine_grain_interleave (llama_interleave.py) splits a layer's tokens into N parts: per part norm + QKV,
concat, attention on the whole, per part out-proj + residual + norm + FFN + residual. The parts' sequence-parallel
collectives overlap the other parts' matmuls, and the split chains across layers (layer 0 skips the first split,
the last layer the second): between layers the hidden state stays in parts. `layer_steps` is that layer, written
once for any number of chunks; with one chunk it is the multi-copy layer (interleave/multi_copy.py runs one
instance per copy), so both features share this schedule.

Per chunk, a step runs until it has started a collective (overlap.issue) and then yields; the scheduler
(schedule.round_robin) runs the next chunk (or copy), and the chunk waits for its result only when it resumes:

    A  wait(prev layer's FFN reduce) + residual, norm, issue gather -> yield -> wait + q/k/v GEMMs (wait_linears)
       concat q/k/v of all chunks, attention on the whole (its own cp ring/all-gather inside), split -> yield
    B  out-proj, issue reduce -> yield -> wait + residual, norm, issue gather -> yield -> wait + gate/up GEMMs
       -> yield -> act, down-proj, issue reduce; the result is waited at the next layer's A (or by run_layers)
The yields without a collective split each GEMM block in two, so every collective of another copy has a GEMM
step (not only a norm) between its issue and its wait.

Collectives: with sequence parallel the gather is an all-gather and the reduce a reduce-scatter along the sequence
(backward: the transposes); without it the gather is Megatron's f (identity, all-reduce of the input grad) and the
reduce an all-reduce. With SP a chunk is 1/N of this rank's sequence slice, so the gathered chunk j holds every tp
rank's chunk j: q/k/v are permuted back to sequence order before attention and the attention output permuted
to chunk order after it (a copy each; RoPE, masks and cp attention see the true order).

Layers that cannot be decomposed run whole as one step (HF forward, blocking collectives): tp = 1 (no tp
collective to overlap), a recomputed or activation-offloaded layer or submodule (both wrap the module's forward),
or a layer whose family adapter gives no LayerParts (msparallel_ds.models: the adapter says which modules are the
norms, projections and MLP, and runs the attention between the projections).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..models import LayerParts
from ..tensor_parallel.layers import ReplicatedKVLinear, RowParallelLinear
from ..tensor_parallel.mappings import copy_to_region
from .overlap import AsyncCollective, issue, mark_compute, wait, wait_linears
from .schedule import round_robin

__all__ = ["layer_steps", "decomposable", "split_chunks", "join_chunks", "Pending", "SEQ_DIM"]

SEQ_DIM = 1  # HF hidden states are [batch, seq, hidden]


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
def split_chunks(h: Tensor, n: int) -> list[Tensor]:
    """n chunks of this rank's (sequence-parallel slice of the) sequence."""
    if n == 1:
        return [h]
    if h.shape[SEQ_DIM] % n:
        raise ValueError(f"fine_grain_interleave={n}: this rank's sequence length {h.shape[SEQ_DIM]} (after the "
                         f"sequence-parallel / cp split) is not divisible by {n}; use a seq_length that is a multiple "
                         f"of {n} x model_parallel x context_parallel (x2 for a causal ring), or "
                         "fine_grain_interleave: 1")
    return list(h.chunk(n, SEQ_DIM))


def join_chunks(chunks: list[Tensor]) -> Tensor:
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, SEQ_DIM)


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


# ---------------------------------------------------------------------------------------------- the layer
def layer_steps(layer: nn.Module, parts: Optional[LayerParts], hs: list, kw: dict[str, Any], *, index: int = 0,
                copy: Any = 0, lag: int = 0):
    """Generator: run `layer` (its adapter's `parts`) on the chunks `hs` (tensors or Pending) of one copy; yields
    after every collective it starts and in the middle of the attention and FFN blocks; returns the chunks'
    outputs (Pending: the last reduce may still be in flight). `kw`: the HF layer kwargs for this copy
    (position_embeddings, attention_mask, position_ids, ...). lag: extra yields before the first gather is
    issued, so this copy runs that many steps behind the copies before it (see multi_copy.copy_steps)."""
    if not decomposable(layer, parts):
        out = layer(join_chunks([resolve(h) for h in hs]), **kw)  # its own pre-hooks and blocking collectives
        return split_chunks(mark_compute(out, f"L{index}.whole"), len(hs))
        yield  # unreachable; makes this function a generator
    kinds = _Kinds(parts.attn_out)
    n = len(hs)
    ids = [copy if n == 1 else (copy, j) for j in range(n)]
    qkv_w = [_col_weights(m) for m in parts.qkv]
    gate_up_w = [_col_weights(m) for m in parts.ffn_in]
    residual: list = [None] * n

    def part_a(j):  # residual, norm, QKV of chunk j
        h = resolve(hs[j])
        residual[j] = h
        x = mark_compute(parts.input_norm(h), f"L{index}.norm1")
        for _ in range(lag):
            yield
        link = AsyncCollective(kinds.gather, kinds.group, SEQ_DIM, name=f"L{index}.qkv_in")
        token = issue(x, link)
        yield
        return wait_linears(token, link, [w for w, _ in qkv_w], [b for _, b in qkv_w])

    qkv = yield from round_robin([part_a(j) for j in range(n)], ids)
    q, k, v = (_to_sequence_order([c[i] for c in qkv], kinds.tp if kinds.sp else 1) for i in range(3))
    o = mark_compute(parts.attention(q, k, v, kw), f"L{index}.attention")
    o_chunks = _to_chunk_order(o, n, kinds.tp if kinds.sp else 1)
    yield  # QKV + attention and out-proj are two steps: each can cover one collective of another copy

    def part_b(j):  # out-proj + residual + norm + FFN of chunk j; the FFN's reduce is left in flight
        y = mark_compute(F.linear(o_chunks[j], parts.attn_out.weight), f"L{index}.attn_out")
        link = AsyncCollective(kinds.reduce, kinds.group, SEQ_DIM, name=f"L{index}.attn_out")
        token = issue(y, link)
        yield
        h = Pending(residual[j], token, link, parts.attn_out).result()
        x = mark_compute(parts.post_norm(h), f"L{index}.norm2")
        link = AsyncCollective(kinds.gather, kinds.group, SEQ_DIM, name=f"L{index}.ffn_in")
        token = issue(x, link)
        yield
        gate, up = wait_linears(token, link, [w for w, _ in gate_up_w], [b for _, b in gate_up_w])
        yield  # gate/up and act + down-proj are two steps, like the attention block
        y = F.linear(mark_compute(parts.act(gate) * up, f"L{index}.ffn"), parts.ffn_out.weight)
        link = AsyncCollective(kinds.reduce, kinds.group, SEQ_DIM, name=f"L{index}.ffn_out")
        pending = Pending(h, issue(y, link), link, parts.ffn_out)
        yield  # in flight while the other chunks/copies run; waited at the next layer's part A
        return pending

    return (yield from round_robin([part_b(j) for j in range(n)], ids))
