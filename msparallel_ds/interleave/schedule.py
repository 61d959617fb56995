"""The copy scheduler: generators stepped round-robin, each step running up to the collective it starts.

Shared by multi-copy (one generator per copy) and fine-grain interleave (one per token chunk of a layer); the two
nest (a copy's layer runs its chunks with it).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from ..distributed.instruments import current_copy

__all__ = ["round_robin", "run"]


def round_robin(gens: Sequence, ids: Optional[Sequence] = None):
    """Generator: step each live generator in turn (one step = up to its next yield, under current_copy(id)),
    yielding after every step; returns their return values."""
    ids = list(range(len(gens))) if ids is None else list(ids)
    results: list = [None] * len(gens)
    live = list(range(len(gens)))
    while live:
        for i in list(live):
            with current_copy(ids[i]):
                try:
                    next(gens[i])
                except StopIteration as stop:
                    results[i] = stop.value
                    live.remove(i)
                    continue
            yield
    return results


def run(gen) -> Any:
    """Drive a generator to its end; its return value."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value
