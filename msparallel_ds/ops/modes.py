"""Which part of a (q block, k/v block) pair a ring step computes: the kernels' mask modes and the zigzag choice.

Mirrors ring.forward_step (context_parallel/ring.py) for the zigzag layout of sharding.py (ring rank r holds chunks
r and 2R-1-r, s/2 tokens each): at ring rank `rank`, the block that came from ring rank `src`
    not causal        FULL            every query against every key
    src == rank       CAUSAL          the own segment: causal diagonal (bottom-right aligned)
    src <  rank       KV_FIRST_HALF   every query against the FIRST half of src's keys (its chunk src; the second,
                                      chunk 2R-1-src, lies after both of ours)
    src >  rank       Q_SECOND_HALF   only the SECOND half of our queries (chunk 2R-1-rank) against all of src's
                                      keys; our first half (chunk rank) precedes both of src's chunks
so every rank computes one diagonal and R-1 half blocks, and nothing causality hides is computed. Pure Python.
"""
from __future__ import annotations

from enum import IntEnum

__all__ = ["Mode", "ring_schedule", "step_mode"]


class Mode(IntEnum):
    """The kernels' mask modes (same numbers as msp_ops::Mode in ops/ring_attn.h)."""
    FULL = 0
    CAUSAL = 1
    KV_FIRST_HALF = 2
    Q_SECOND_HALF = 3


def step_mode(src: int, rank: int, causal: bool) -> Mode:
    """The mode of the step at ring rank `rank` that processes the k/v block owned by ring rank `src`."""
    if not causal:
        return Mode.FULL
    if src == rank:
        return Mode.CAUSAL
    return Mode.KV_FIRST_HALF if src < rank else Mode.Q_SECOND_HALF


def ring_schedule(rank: int, size: int, causal: bool) -> list[tuple[int, Mode]]:
    """(src, mode) of each step at ring rank `rank` of `size`, in ring order: step t holds the block of
    (rank - t) mod size (K/V travel to the next rank every step, ring.py)."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a ring of {size}")
    return [((rank - t) % size, step_mode((rank - t) % size, rank, causal)) for t in range(size)]
