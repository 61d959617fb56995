"""One tensor-parallel decoder layer as a schedule of steps, its tokens split into chunks (fine_grain_interleave).

MindFormers' fine_grain_interleave (llama_interleave.py) splits a layer's tokens into N parts: per part norm + QKV,
concat, attention on the whole, per part out-proj + residual + norm + FFN + residual. The parts' sequence-parallel
collectives overlap the other parts' matmuls, and the split chains across layers (layer 0 skips the first split,
the last layer the second): between layers the hidden state stays in parts. `layer_steps` is that layer, written
once for any number of chunks; with one chunk it is the multi-copy layer (interleave/multi_copy.py runs one
instance per copy), so both features share this schedule.

Per chunk, a step runs until it has started a collective (comm.issue) and then yields; the scheduler
(multi_copy.round_robin) runs the next chunk (or copy), and the chunk waits for its result only when it resumes:

    A  wait(prev layer's FFN reduce) + residual, norm, issue gather -> yield -> wait + q/k/v GEMMs (wait_linears)
       concat q/k/v of all chunks, attention on the whole (its own cp ring/all-gather inside), split
    B  out-proj, issue reduce -> yield -> wait + residual, norm, issue gather -> yield -> wait + gate/up GEMMs,
       down-proj, issue reduce; the result is waited at the next layer's A (or by run_layers after the last layer)

Collectives: with sequence parallel the gather is an all-gather and the reduce a reduce-scatter along the sequence
(backward: the transposes); without it the gather is Megatron's f (identity, all-reduce of the input grad) and the
reduce an all-reduce. With SP a chunk is 1/N of this rank's sequence slice, so the gathered chunk j holds every tp
rank's chunk j: q/k/v are permuted back to sequence order before attention and the attention output permuted
to chunk order after it (a copy each; RoPE, masks and cp attention see the true order).

Layers that cannot be decomposed run whole as one step (HF forward, blocking collectives): tp = 1 (no tp
collective to overlap), a recomputed layer or submodule (checkpointing wraps the module's forward), or a module
layout other than the Llama family's (self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj).
"""
from __future__ import annotations

import sys
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..tensor_parallel.comm import (AsyncCollective, copy_to_region, issue, mark_compute, scatter_to_region, wait,
                                    wait_linears)

__all__ = ["layer_steps", "decomposable", "split_chunks", "join_chunks", "Pending", "SEQ_DIM"]

SEQ_DIM = 1  # HF hidden states are [batch, seq, hidden]


# ---------------------------------------------------------------------------------------------- the layer's parts
def _row(module: nn.Module):
    from ..tensor_parallel.layers import RowParallelLinear

    return module if isinstance(module, RowParallelLinear) else None


def decomposable(layer: nn.Module) -> bool:
    """True if layer_steps can run `layer` as steps (else it runs whole, see the module docstring)."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return False
    if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return False
    if _row(attn.o_proj) is None or _row(mlp.down_proj) is None:
        return False  # tp = 1: nothing to overlap
    return not any(getattr(m, "_msp_recompute", False) for m in layer.modules())


def _col_weights(module: nn.Module) -> tuple[Tensor, Optional[Tensor]]:
    """(weight, bias) of a column-side linear: this rank's shard, or for ReplicatedKVLinear the kv head's rows of
    the replicated weight (through f, whose backward sums the replicas' grads, as its own forward does)."""
    from ..tensor_parallel.apply import ReplicatedKVLinear

    if isinstance(module, ReplicatedKVLinear):
        start, n = module.kv_head * module.head_dim, module.head_dim
        w = copy_to_region(module.weight, module.group).narrow(0, start, n)
        b = None if module.bias is None else copy_to_region(module.bias, module.group).narrow(0, start, n)
        return w, b
    return module.weight, module.bias


class _Kinds:
    """The layer's tp group and collective kinds (SP: all-gather / reduce-scatter; else f / all-reduce)."""

    def __init__(self, layer: nn.Module):
        row = _row(layer.self_attn.o_proj)
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
                         f"of {n} x model_parallel x context_parallel (x2 for a causal ring), or fine_grain_interleave: 1")
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


# ---------------------------------------------------------------------------------------------- attention
def _attention(attn: nn.Module, q: Tensor, k: Tensor, v: Tensor, kw: dict) -> Tensor:
    """HF's attention block between the projections: heads, q/k norm (Qwen3), RoPE, the model's attention
    function (eager / sdpa / our cp backend); [b, s, h*d] in and out."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    mod = sys.modules[type(attn).__module__]
    shape = (*q.shape[:-1], -1, attn.head_dim)
    q, k, v = q.view(shape), k.view(shape), v.view(shape)
    if getattr(attn, "q_norm", None) is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    cos, sin = kw["position_embeddings"]
    q, k = mod.apply_rotary_pos_emb(q, k, cos, sin)
    fn = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, mod.eager_attention_forward)
    extra = {k_: v_ for k_, v_ in kw.items() if k_ not in ("position_embeddings", "attention_mask", "use_cache",
                                                           "past_key_values", "cache_position")}
    window = getattr(attn, "sliding_window", getattr(attn.config, "sliding_window", None))
    out, _ = fn(attn, q, k, v, kw.get("attention_mask"), dropout=attn.attention_dropout if attn.training else 0.0,
                scaling=attn.scaling, sliding_window=window, **extra)
    return out.reshape(*out.shape[:2], -1).contiguous()


# ---------------------------------------------------------------------------------------------- the layer
def _round_robin(gens: list, ids: list):
    from .multi_copy import round_robin

    return round_robin(gens, ids)


def layer_steps(layer: nn.Module, hs: list, kw: dict[str, Any], *, index: int = 0, copy: Any = 0):
    """Generator: run `layer` on the chunks `hs` (tensors or Pending) of one copy; yields after every collective it
    starts; returns the chunks' outputs (Pending: the last reduce may still be in flight). `kw`: the HF layer
    kwargs for this copy (position_embeddings, attention_mask, position_ids, ...)."""
    if not decomposable(layer):
        out = layer(join_chunks([resolve(h) for h in hs]), **kw)  # its own pre-hooks and blocking collectives
        return split_chunks(mark_compute(out, f"L{index}.whole"), len(hs))
        yield  # unreachable; makes this function a generator
    kinds, attn, mlp = _Kinds(layer), layer.self_attn, layer.mlp
    n = len(hs)
    ids = [copy if n == 1 else (copy, j) for j in range(n)]
    qkv_w = [_col_weights(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
    gate_up_w = [_col_weights(m) for m in (mlp.gate_proj, mlp.up_proj)]
    residual: list = [None] * n

    def part_a(j):  # residual, norm, QKV of chunk j
        h = resolve(hs[j])
        residual[j] = h
        x = mark_compute(layer.input_layernorm(h), f"L{index}.norm1")
        link = AsyncCollective(kinds.gather, kinds.group, SEQ_DIM, name=f"L{index}.qkv_in")
        token = issue(x, link)
        yield
        return wait_linears(token, link, [w for w, _ in qkv_w], [b for _, b in qkv_w])

    qkv = yield from _round_robin([part_a(j) for j in range(n)], ids)
    q, k, v = (_to_sequence_order([c[i] for c in qkv], kinds.tp if kinds.sp else 1) for i in range(3))
    o = mark_compute(_attention(attn, q, k, v, kw), f"L{index}.attention")
    o_chunks = _to_chunk_order(o, n, kinds.tp if kinds.sp else 1)

    def part_b(j):  # out-proj + residual + norm + FFN of chunk j; the FFN's reduce is left in flight
        y = mark_compute(F.linear(o_chunks[j], attn.o_proj.weight), f"L{index}.o_proj")
        link = AsyncCollective(kinds.reduce, kinds.group, SEQ_DIM, name=f"L{index}.o_proj")
        token = issue(y, link)
        yield
        h = Pending(residual[j], token, link, attn.o_proj).result()
        x = mark_compute(layer.post_attention_layernorm(h), f"L{index}.norm2")
        link = AsyncCollective(kinds.gather, kinds.group, SEQ_DIM, name=f"L{index}.mlp_in")
        token = issue(x, link)
        yield
        gate, up = wait_linears(token, link, [w for w, _ in gate_up_w], [b for _, b in gate_up_w])
        y = F.linear(mark_compute(mlp.act_fn(gate) * up, f"L{index}.mlp"), mlp.down_proj.weight)
        link = AsyncCollective(kinds.reduce, kinds.group, SEQ_DIM, name=f"L{index}.down_proj")
        pending = Pending(h, issue(y, link), link, mlp.down_proj)
        yield  # in flight while the other chunks/copies run; waited at the next layer's part A
        return pending

    return (yield from _round_robin([part_b(j) for j in range(n)], ids))


def scatter_input(layer: nn.Module, h: Tensor) -> Tensor:
    """The SP split a first decoder layer's pre-hook would do (layer_steps bypasses the layer's own call)."""
    group = getattr(layer, "msp_sequence_scatter_group", None)
    if group is None or not decomposable(layer):
        return h  # a layer run whole applies its own pre-hook
    return scatter_to_region(h, group, SEQ_DIM)
