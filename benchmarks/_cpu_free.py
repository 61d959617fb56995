"""A CPU-free link for benchmarks/interleave.py: inside `cpu_free_collectives()` torch.distributed's collectives
move no bytes. Each one fills its output from this rank's own data (an all-gather repeats the local block, a
reduce-scatter or all-to-all keeps the local blocks, an all-reduce leaves the tensor as it is) and returns a
finished work. Under instruments.modelled_link the collectives still complete at their modelled times, so a step
costs its compute, its python and the link time its schedule leaves exposed, but nothing of gloo's threads: the
link of a GPU, whose copies run on their own engine. The values are wrong (every rank sees its own data), their
sizes and their finite range are right; it is for timing only, never for a result.

Only the step's own code should run inside: the benchmark's barriers and its max-over-ranks all-reduce stay real.
Counts the faked calls, so the caller can check that the patch reached the collectives.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch.distributed as dist


class _Done:
    """A finished work handle."""

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


def _ranked(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _gather_single(out, x, group=None, async_op=False):
    n, _ = _ranked(group)
    out.view(n, *x.shape).copy_(x.unsqueeze(0).expand(n, *x.shape))
    return _Done() if async_op else None


def _gather_list(outs, x, group=None, async_op=False):
    for o in outs:
        o.copy_(x)
    return _Done() if async_op else None


def _reduce_scatter_single(out, x, op=None, group=None, async_op=False):
    n, rank = _ranked(group)
    out.copy_(x.view(n, *out.shape)[rank])
    return _Done() if async_op else None


def _all_to_all_single(out, x, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    if out.shape == x.shape:  # even, or the chunk layout's moves: as many rows in as out
        out.copy_(x)
    else:
        out.zero_()
    return _Done() if async_op else None


def _all_reduce(t, op=None, group=None, async_op=False):
    return _Done() if async_op else None


_FAKES = {"all_gather_single": _gather_single, "all_gather_into_tensor": _gather_single,
          "all_gather": _gather_list, "reduce_scatter_single": _reduce_scatter_single,
          "reduce_scatter_tensor": _reduce_scatter_single, "all_to_all_single": _all_to_all_single,
          "all_reduce": _all_reduce}


@contextlib.contextmanager
def cpu_free_collectives(calls: Optional[dict] = None):
    """Patch torch.distributed's collectives (the library looks them up per call); yields `calls` (a new dict if
    None) with each faked call counted into it, {name: calls}, so one dict can add up several steps."""
    calls = {} if calls is None else calls
    saved = {name: getattr(dist, name) for name in _FAKES if hasattr(dist, name)}

    def counted(name, fake):
        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fake(*args, **kwargs)
        return call

    try:
        for name in saved:
            setattr(dist, name, counted(name, _FAKES[name]))
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
