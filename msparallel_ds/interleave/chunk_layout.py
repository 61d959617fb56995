"""Where fine-grain chunks' tokens live under sequence parallel, and the moves between the two layouts.

A copy's sequence is cut into tp*n equal blocks (n chunks on each of the tp ranks). Two layouts:

- rank (sequence parallel's own): rank r holds blocks r*n .. r*n+n-1, its chunk k is block r*n + k. The gathered
  chunk j (every rank's chunk j) is spread over the sequence, so the causal queries of any chunk need keys of every
  chunk: all chunks wait for each other at the attention, forward and backward (fine_grain.py's barrier).
- chunk: rank r's chunk j is block j*tp + r. The gathered chunk j is then the contiguous rows [j*S/n, (j+1)*S/n),
  a causal prefix block: its queries see the keys of chunks 0..j only, which are in already (the chunks run in
  order), and in backward its keys' grads come from chunks j..n-1, which run first. No barrier.

Everything outside a run of decomposable layers (embedding, pipeline sends, layers run whole) sees the rank layout.
Entering the chunk layout at the model's layer 0 is free (the whole sequence is on every rank before the scatter:
permute, then take this rank's slice); elsewhere, and leaving it, is one all-to-all of the blocks that change rank
(half of them at tp=2). So a run uses it when its entry is that scatter or it has at least two layers (one
all-to-all in, one out, against one barrier per layer). A run that ends at a whole model's last layer need not
leave it: the final norm is per token, and the output head all-gathers the sequence anyway, so the head takes the
gathered blocks in sequence order locally (`to_sequence_order`, overlap's `blocks`) and the all-to-all is not made
(multi_copy._Head).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..distributed.collectives import _chunk
from ..tensor_parallel.mappings import exchange_rows, scatter_to_region

__all__ = ["wanted", "enter", "to_chunk_layout", "to_rank_layout", "to_sequence_order", "split_chunks", "join_chunks",
           "SEQ_DIM"]

SEQ_DIM = 1  # HF hidden states are [batch, seq, hidden]


def split_chunks(h: Tensor, n: int) -> list[Tensor]:
    """n chunks of this rank's (sequence-parallel slice of the) sequence."""
    if n == 1:
        return [h]
    _check(h.shape[SEQ_DIM], n)
    return list(h.chunk(n, SEQ_DIM))


def join_chunks(chunks: list[Tensor]) -> Tensor:
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, SEQ_DIM)


def _check(length: int, n: int) -> None:
    if length % n:
        raise ValueError(f"fine_grain_interleave={n}: this rank's sequence length {length} (after the "
                         f"sequence-parallel / cp split) is not divisible by {n}; use a seq_length that is a multiple "
                         f"of {n} x model_parallel x context_parallel (x2 for a causal ring), or "
                         "fine_grain_interleave: 1")


def wanted(n: int, tp: int, sequence_parallel: bool, row_blocks: bool, layers: int, free_entry: bool) -> bool:
    """Whether a run of `layers` decomposable layers uses the chunk layout: several chunks over a sequence-parallel
    tp group, causal row-block attention (fine_grain._SharedLayer), and an entry or length that pays for the
    moves (module docstring)."""
    return n > 1 and tp > 1 and sequence_parallel and row_blocks and (free_entry or layers >= 2)


def _rank_blocks(tp: int, n: int) -> list[list[int]]:
    return [[r * n + k for k in range(n)] for r in range(tp)]


def _chunk_blocks(tp: int, n: int) -> list[list[int]]:
    return [[j * tp + r for j in range(n)] for r in range(tp)]


def _move_blocks(x: Tensor, group, src: list[list[int]], dst: list[list[int]]) -> Tensor:
    """x: this rank's blocks src[me] (equal lengths along the sequence, in that order) -> its blocks dst[me], in
    that order; one all-to-all (autograd: the grads travel back the same way)."""
    me, tp = dist.get_rank(group), len(src)
    held, want = src[me], dst[me]
    owner = {b: r for r, blocks in enumerate(dst) for b in blocks}
    source = {b: r for r, blocks in enumerate(src) for b in blocks}
    piece = x.shape[SEQ_DIM] // len(held)
    mine = x.movedim(SEQ_DIM, 0).split(piece)  # blocks along dim 0, the rows exchange_rows sends
    # sent in destination-rank order, each destination's blocks in its own order; received by source rank likewise
    sent = sorted(range(len(held)), key=lambda i: (owner[held[i]], dst[owner[held[i]]].index(held[i])))
    got_ids = sorted(want, key=lambda b: (source[b], want.index(b)))
    send = [piece * sum(owner[b] == d for b in held) for d in range(tp)]
    recv = [piece * sum(source[b] == s for b in want) for s in range(tp)]
    got = exchange_rows(torch.cat([mine[i] for i in sent]), send, recv, group).split(piece)
    return torch.cat([got[got_ids.index(b)] for b in want]).movedim(0, SEQ_DIM)


def to_chunk_layout(chunks: list[Tensor], group) -> list[Tensor]:
    """This rank's n chunks in the rank layout -> its n chunks in the chunk layout."""
    tp, n = dist.get_world_size(group), len(chunks)
    return split_chunks(_move_blocks(join_chunks(chunks), group, _rank_blocks(tp, n), _chunk_blocks(tp, n)), n)


def to_rank_layout(chunks: list[Tensor], group) -> list[Tensor]:
    """Inverse of to_chunk_layout."""
    tp, n = dist.get_world_size(group), len(chunks)
    return split_chunks(_move_blocks(join_chunks(chunks), group, _chunk_blocks(tp, n), _rank_blocks(tp, n)), n)


def _regroup(x: Tensor, outer: int, inner: int) -> Tensor:
    """x's sequence as outer x inner equal blocks, in (outer, inner) order -> the same blocks in (inner, outer)
    order."""
    return x.unflatten(SEQ_DIM, (outer, inner, -1)).transpose(SEQ_DIM, SEQ_DIM + 1).flatten(SEQ_DIM, SEQ_DIM + 2)


def to_sequence_order(gathered: Tensor, tp: int, n: int) -> Tensor:
    """The all-gather over tp of a chunk-layout output (rank r's n blocks j*tp + r, rank after rank) -> the
    sequence in order; a local permute (its backward the inverse one)."""
    return _regroup(gathered, tp, n)


def from_sequence_order(x: Tensor, tp: int, n: int) -> Tensor:
    """The inverse of to_sequence_order: the sequence in order -> rank r's n blocks j*tp + r, rank after rank."""
    return _regroup(x, n, tp)


def enter(h: Tensor, n: int, group, *, scatter: bool, chunked: bool,
          cut: Optional[Callable[[Tensor], Tensor]] = None) -> list[Tensor]:
    """A copy's hidden state -> its n chunks for a run of layers: h is the whole sequence when `scatter` (the
    model's layer 0 under sequence parallel; this is the scatter its own pre-hook would do, by `cut`, default the
    blocking scatter_to_region), else this rank's slice in the rank layout; the chunks are in the chunk layout
    when `chunked`."""
    if not scatter:
        hs = split_chunks(h, n)
        return to_chunk_layout(hs, group) if chunked else hs
    cut = cut or (lambda x: scatter_to_region(x, group, SEQ_DIM))
    if not chunked:
        return split_chunks(cut(h), n)
    tp = dist.get_world_size(group)
    _check(_chunk(h, group, SEQ_DIM), n)  # the clear errors of an uneven scatter or chunk split
    # blocks in (rank, chunk) order, so that rank r's slice is blocks j*tp + r, j = 0..n-1
    return split_chunks(cut(_regroup(h, n, tp)), n)
