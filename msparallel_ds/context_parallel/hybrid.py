"""Hybrid (USP-style) context parallelism: Ulysses over cp_ulysses inside ring attention over cp_ring.

Token layout (sharding.py): ring rank r owns zigzag chunks r and 2R-1-r, split contiguously over the U Ulysses
ranks. The Ulysses all-to-all therefore hands each rank its ring rank's whole zigzag segment for h/U heads (and
h_kv/U kv heads, or one replicated kv head), which is exactly ring attention's input; the ring runs over cp_ring
with those heads and the inverse all-to-all restores the sequence-sharded output. Ulysses (fast, intra-node links)
sits inside ring (overlappable P2P, across nodes), matching the mesh order in DESIGN.md.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch.distributed as dist
from torch import Tensor

from .kernels import Backend
from .ulysses import local_attention, resolve_backend, ulysses_wrap

__all__ = ["hybrid_attention"]


def _groups(layout_or_groups: Any):
    """(ring_group, ulysses_group) from a ParallelLayout or a pair of process groups."""
    if hasattr(layout_or_groups, "group"):
        return layout_or_groups.group("cp_ring"), layout_or_groups.group("cp_ulysses")
    try:
        ring_group, ulysses_group = layout_or_groups
    except (TypeError, ValueError):
        raise TypeError("hybrid_attention takes a ParallelLayout or a (ring_group, ulysses_group) pair, got "
                        f"{type(layout_or_groups).__name__}") from None
    return ring_group, ulysses_group


def hybrid_attention(q: Tensor, k: Tensor, v: Tensor, layout_or_groups: Any, *, causal: bool, scale: float,
                     backend: Union[None, str, Backend] = None,
                     before_send: Optional[Callable[[], None]] = None) -> Tensor:
    """q [b, h, s_local, d], k [b, h_kv, s_local, d], v [b, h_kv, s_local, d_v] in the hybrid zigzag layout;
    returns [b, h, s_local, d_v].

    Any (cp_ring, cp_ulysses) pair works: U = 1 is plain ring, R = 1 is plain Ulysses. before_send() runs
    before the first collective.
    """
    ring_group, ulysses_group = _groups(layout_or_groups)
    be = resolve_backend(backend, q)
    if dist.get_world_size(ring_group) == 1:
        def inner(q_, k_, v_):  # the segment is the whole sequence: one local block
            return local_attention(q_, k_, v_, causal=causal, scale=scale, backend=be)
    else:
        from .ring import ring_attention

        def inner(q_, k_, v_):
            return ring_attention(q_, k_, v_, ring_group, causal=causal, scale=scale, backend=be)
    return ulysses_wrap(q, k, v, ulysses_group, inner, before_send)
