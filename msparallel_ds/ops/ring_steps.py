"""The zigzag ring's step sequence on top of a step-kernel namespace, without communication.

`kern` is msparallel_ds.ops.attention (the fused CUDA kernels) or msparallel_ds.ops.reference (pure torch, any
device): both expose new_state / forward_step / finalize / backward_preprocess / backward_step. The forward keeps
one fp32 running state for all steps and rounds once (finalize); the backward reuses the final (out, lse) and one
delta for every step, accumulates dq in fp32 in place and gives each source block its fp32 (dk, dv), which the
real ring sends back to the block's owner (ring.py). `simulate_ring` runs every rank's steps one after another on
one device (tests and benchmarks/ring_kernels.py).
"""
from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch
from torch import Tensor

from ..context_parallel import sharding
from .modes import ring_schedule

__all__ = ["ring_backward", "ring_forward", "simulate_ring"]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def ring_forward(q: Tensor, kvs: Sequence[tuple[Tensor, Tensor]], rank: int, *, causal: bool, scale: float,
                 kern: ModuleType, out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """(out, lse) of ring rank `rank`: its q [b, h, s, d] against kvs[src] = (k, v) of every ring rank src, in the
    order the ring delivers them. out in out_dtype (default q.dtype), lse fp32."""
    state = kern.new_state(q)
    for src, mode in ring_schedule(rank, len(kvs), causal):
        k, v = kvs[src]
        kern.forward_step(q, k, v, state, mode, scale)
    return kern.finalize(state, out_dtype or q.dtype)


def ring_backward(dout: Tensor, q: Tensor, kvs: Sequence[tuple[Tensor, Tensor]], out: Tensor, lse: Tensor,
                  rank: int, *, causal: bool, scale: float,
                  kern: ModuleType) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
    """dq of ring rank `rank` (fp32) and, for every source rank, this rank's fp32 share of that block's (dk, dv)."""
    delta = kern.backward_preprocess(out, dout)
    acc = _acc(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    grads: list = [None] * len(kvs)
    for src, mode in ring_schedule(rank, len(kvs), causal):
        k, v = kvs[src]
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        kern.backward_step(dout, q, k, v, lse, delta, dq, dk, dv, mode, scale)
        grads[src] = (dk, dv)
    return dq, grads


def simulate_ring(q: Tensor, k: Tensor, v: Tensor, dout: Tensor | None, ring: int, *, causal: bool, scale: float,
                  kern: ModuleType) -> dict[str, Tensor]:
    """Full-sequence q [b, h, S, d], k/v [b, h_kv, S, d] cut into `ring` zigzag shards (sharding.py), every rank's
    steps run in turn; returns out, lse and (with dout) dq, dk, dv, all back in global token order."""
    shards = [[sharding.shard(x, 2, ring, 1, r, 0) for x in (q, k, v)] for r in range(ring)]
    kvs = [(s[1], s[2]) for s in shards]
    outs, lses = zip(*(ring_forward(shards[r][0], kvs, r, causal=causal, scale=scale, kern=kern)
                       for r in range(ring)))
    res = {"out": sharding.unshard(list(outs), 2, ring, 1), "lse": sharding.unshard(list(lses), 2, ring, 1)}
    if dout is None:
        return res
    dqs, dks, dvs = [], [None] * ring, [None] * ring
    for r in range(ring):
        do_r = sharding.shard(dout, 2, ring, 1, r, 0)
        dq, grads = ring_backward(do_r, shards[r][0], kvs, outs[r], lses[r], r, causal=causal, scale=scale,
                                  kern=kern)
        dqs.append(dq)
        for src, (dk, dv) in enumerate(grads):  # what the dK/dV ring would deliver to src
            dks[src] = dk if dks[src] is None else dks[src] + dk
            dvs[src] = dv if dvs[src] is None else dvs[src] + dv
    res.update(dq=sharding.unshard(dqs, 2, ring, 1), dk=sharding.unshard(dks, 2, ring, 1),
               dv=sharding.unshard(dvs, 2, ring, 1))
    return res
