"""Count the torch.distributed collectives a block of code makes: calls and bytes per (op, group size).

Used by the benchmarks' profile passes (never in the timed steps: the wrapper itself costs a little Python per
call). Nested calls count once (the outermost torch.distributed entry point), so a wrapper that calls another
collective of torch.distributed is not counted twice. Bytes are the first tensor argument's (or a list's total),
the payload the caller hands over, not the bytes on the wire.
"""
from __future__ import annotations

from contextlib import contextmanager

OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
       "reduce_scatter_tensor", "reduce_scatter_single", "broadcast",
       "reduce", "all_to_all", "all_to_all_single", "barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv")


def _payload_bytes(args, kwargs) -> int:
    import torch

    for x in list(args) + list(kwargs.values()):
        if torch.is_tensor(x):
            return x.numel() * x.element_size()
        if isinstance(x, (list, tuple)) and x and all(torch.is_tensor(t) for t in x):
            return sum(t.numel() * t.element_size() for t in x)
    return 0


def _group_size(kwargs, args) -> int:
    import torch.distributed as dist

    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    try:
        return dist.get_world_size(group)
    except (RuntimeError, ValueError):
        return -1


@contextmanager
def count_collectives():
    """Yields a dict filled while the block runs: "op@group_size" -> [calls, bytes]."""
    from msparallel_ds.distributed.instruments import tapped_collectives

    counts: dict = {}

    def on_call(op, args, kwargs):
        entry = counts.setdefault(f"{op}@{_group_size(kwargs, args)}", [0, 0])
        entry[0] += 1
        entry[1] += _payload_bytes(args, kwargs)

    with tapped_collectives(on_call, OPS):
        yield counts
