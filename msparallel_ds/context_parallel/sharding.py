"""The token order every context-parallel algorithm uses (pure torch, no collectives).

The sequence is cut into 2R equal chunks; ring rank r owns chunks r and 2R-1-r (zigzag: every rank gets the same
amount of causal work), concatenated in that order so positions inside a rank's segment increase. The segment is then
split contiguously into U equal pieces and Ulysses rank u keeps piece u (after Ulysses' all-to-all the ring sees the
whole segment again). R = 1 is a plain contiguous split over U (pure Ulysses); U = 1 is pure zigzag ring; the
all-gather algorithm uses R = cp, U = 1. cp rank = r*U + u (Ulysses inside ring, DESIGN.md rank order).

Internally everything is expressed in "units" of S/(2RU) tokens (S/U when R = 1): each rank owns whole units, so
shard and unshard are one narrow+cat each, no gather of indices.
"""
from __future__ import annotations

import operator
from typing import Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["check_dim", "check_divisible", "shard_indices", "shard", "unshard", "permutation", "inverse_permutation",
           "pad_to_multiple", "required_multiple"]


def required_multiple(ring: int, ulysses: int) -> int:
    """What the sequence length must be a multiple of: 2*R*U for a zigzag ring, U for pure Ulysses."""
    if ring < 1 or ulysses < 1:
        raise ValueError(f"ring={ring} and ulysses={ulysses} must be positive integers")
    return 2 * ring * ulysses if ring > 1 else ulysses


def check_divisible(seq_len: int, ring: int, ulysses: int) -> None:
    """Raise a ValueError naming the numbers and the fix when seq_len cannot be sharded (never corrupt silently)."""
    m = required_multiple(ring, ulysses)
    if seq_len % m == 0 and seq_len > 0:
        return
    cp = ring * ulysses
    how = (f"2*ring*ulysses = {m} (zigzag over {cp} context-parallel ranks)" if ring > 1
           else f"ulysses = {m} (contiguous split over {cp} context-parallel ranks)")
    raise ValueError(f"sequence length {seq_len} is not divisible by {how}; "
                     f"pad to a multiple of {m} or pass pad=True")


def check_dim(x: Tensor, dim: int) -> int:
    """dim as a non-negative int for x, or a clear error (a float or bool dim is a TypeError naming the fix)."""
    try:
        if isinstance(dim, bool):
            raise TypeError
        dim = operator.index(dim)  # int, numpy/torch integer scalars; not float
    except TypeError:
        raise TypeError(f"dim={dim!r} ({type(dim).__name__}) must be an int: the sequence dimension of the "
                        f"{x.dim()}-D tensor of shape {tuple(x.shape)} (e.g. dim=1 for [batch, seq, ...])") from None
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for a {x.dim()}-D tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def _units(seq_len: int, ring: int, ulysses: int, ring_rank: int, ulysses_rank: int) -> tuple[list[int], int]:
    """(global unit ids owned by (ring_rank, ulysses_rank) in local order, unit size in tokens)."""
    check_divisible(seq_len, ring, ulysses)
    if not (0 <= ring_rank < ring and 0 <= ulysses_rank < ulysses):
        raise ValueError(f"ring_rank={ring_rank} / ulysses_rank={ulysses_rank} out of range for "
                         f"ring={ring}, ulysses={ulysses}")
    if ring == 1:
        return [ulysses_rank], seq_len // ulysses
    u = ulysses
    segment = [ring_rank * u + i for i in range(u)] + [(2 * ring - 1 - ring_rank) * u + i for i in range(u)]
    return segment[2 * ulysses_rank: 2 * ulysses_rank + 2], seq_len // (2 * ring * u)


def shard_indices(seq_len: int, ring: int, ulysses: int, ring_rank: int, ulysses_rank: int) -> Tensor:
    """Global positions owned by (ring_rank, ulysses_rank), in local order (int64)."""
    units, size = _units(seq_len, ring, ulysses, ring_rank, ulysses_rank)
    return torch.cat([torch.arange(i * size, (i + 1) * size) for i in units])


def permutation(seq_len: int, ring: int, ulysses: int) -> Tensor:
    """Global positions of every cp rank's shard, concatenated in cp-rank order (r*U + u)."""
    return torch.cat([shard_indices(seq_len, ring, ulysses, r, u) for r in range(ring) for u in range(ulysses)])


def inverse_permutation(seq_len: int, ring: int, ulysses: int) -> Tensor:
    """inv such that gathered.index_select(dim, inv) puts cp-rank-ordered shards back in global order."""
    perm = permutation(seq_len, ring, ulysses)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(seq_len)
    return inv


def shard(x: Tensor, dim: int, ring: int, ulysses: int, ring_rank: int, ulysses_rank: int) -> Tensor:
    """This rank's part of x along dim (autograd flows through it)."""
    dim = check_dim(x, dim)
    units, size = _units(x.shape[dim], ring, ulysses, ring_rank, ulysses_rank)
    return torch.cat([x.narrow(dim, i * size, size) for i in units], dim=dim)


def unshard(pieces: Union[Tensor, Sequence[Tensor]], dim: int, ring: int, ulysses: int) -> Tensor:
    """The full sequence from every cp rank's shard: a list in cp-rank order (r*U + u), or one tensor holding them
    concatenated along dim in that order (what an all-gather along dim returns)."""
    n = ring * ulysses
    if isinstance(pieces, Tensor) or len(pieces):
        dim = check_dim(pieces if isinstance(pieces, Tensor) else pieces[0], dim)
    if isinstance(pieces, Tensor):
        if pieces.shape[dim] % n:
            raise ValueError(f"gathered length {pieces.shape[dim]} along dim {dim} is not a multiple of the "
                             f"{n} context-parallel ranks")
        pieces = pieces.chunk(n, dim=dim)
    if len(pieces) != n:
        raise ValueError(f"expected {n} shards (ring={ring} x ulysses={ulysses}), got {len(pieces)}")
    seq_len = pieces[0].shape[dim] * n
    where = {}  # global unit id -> (piece, offset inside the piece)
    for r in range(ring):
        for u in range(ulysses):
            units, size = _units(seq_len, ring, ulysses, r, u)
            for j, g in enumerate(units):
                where[g] = (pieces[r * ulysses + u], j * size)
    return torch.cat([where[g][0].narrow(dim, where[g][1], size) for g in range(len(where))], dim=dim)


def pad_to_multiple(x: Tensor, dim: int, multiple: int, value: float = 0) -> Tensor:
    """x padded at the end of dim to a multiple of `multiple` with `value` (the explicit pad=True option)."""
    dim = check_dim(x, dim)
    extra = -x.shape[dim] % multiple
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - dim % x.dim() - 1) + [0, extra]
    return F.pad(x, pad, value=value)
