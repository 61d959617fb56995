"""Public context-parallel entry points: attention in HF/flash layout, and sequence (un)sharding.

    out = context_parallel_attention(q, k, v, layout)   # q [b, s_local, h, d], k/v [b, s_local, h_kv, d / d_v]
    x_local = shard_sequence(x, layout, dim=1); x = unshard_sequence(x_local, layout, dim=1)

The algorithm defaults to the plan's (MindFormers context_parallel_algo: colossalai_cp -> "allgather", or "ring"
with use_ring_attention; ulysses_cp -> "ulysses"; hybrid_cp -> "hybrid"). Token layout per algorithm (sharding.py):
ulysses: contiguous pieces over cp; ring/hybrid: zigzag over cp_ring (2*cp_ring chunks, ring rank r holds r and
2*cp_ring-1-r), each ring segment split contiguously over cp_ulysses; allgather: zigzag over the whole cp group.
A layout without context parallelism (cp == 1) is an error for the attention (use the model's own attention);
shard_sequence/unshard_sequence are the identity there.

Packed sequences: doc_ids=shard_sequence(full_doc_ids, layout, algo=...) (e.g. cumsum(position_ids == 0), or the
`doc_ids` entry of batch.shard_batch) gives document-causal attention across the cp split with allgather and
ulysses (and hybrid when cp_ring == 1, which is Ulysses); ring/hybrid over cp_ring > 1 do not support it yet.
"""
from __future__ import annotations

import math
import struct
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from .kernels import Backend
from .sharding import check_dim

if TYPE_CHECKING:
    from ..distributed.layout import ParallelLayout

__all__ = ["context_parallel_attention", "shard_sequence", "unshard_sequence", "resolve_algo", "inputs_agreed", "ALGOS"]

ALGOS = ("allgather", "ring", "ulysses", "hybrid")
# MindFormers spellings, so a value copied from the YAML works too (colossalai_cp alone means all-gather K/V)
_ALIASES = {"colossalai_cp": "allgather", "all_gather": "allgather", "ulysses_cp": "ulysses",
            "hybrid_cp": "hybrid", "hybird_cp": "hybrid"}


def _check_layout(layout: Any) -> None:
    if not all(hasattr(layout, a) for a in ("size", "rank", "group")):
        raise TypeError(f"layout must be a ParallelLayout (msparallel_ds.init_parallel(cfg)), got "
                        f"{type(layout).__name__}")


def resolve_algo(layout: ParallelLayout, algo: Optional[str] = None) -> str:
    """The algorithm to run: `algo`, else the plan's cp_algo, else ring (cp_ulysses == 1) / hybrid; checked
    against the layout's cp_ring x cp_ulysses mesh."""
    _check_layout(layout)
    ring, uly = layout.size("cp_ring"), layout.size("cp_ulysses")
    if algo is None:
        algo = getattr(getattr(layout, "plan", None), "cp_algo", None)
        if algo is None:
            algo = "ring" if uly == 1 else "hybrid"
    if not isinstance(algo, str):
        raise TypeError(f"algo must be a string, one of {ALGOS}; got {algo!r}")
    name = _ALIASES.get(algo.lower(), algo.lower())
    if name not in ALGOS:
        raise ValueError(f"unknown context-parallel algo {algo!r}; use one of {', '.join(ALGOS)} "
                         f"(or the MindFormers names {', '.join(_ALIASES)})")
    if name == "ring" and uly > 1:
        raise ValueError(f"algo='ring' runs over cp_ring, but this layout splits cp={ring * uly} as cp_ring={ring} x "
                         f"cp_ulysses={uly}: use algo='hybrid' (or 'allgather'), or build the layout with "
                         f"ulysses_degree_in_cp=1 / context_parallel_algo colossalai_cp")
    if name == "ulysses" and ring > 1:
        raise ValueError(f"algo='ulysses' runs over cp_ulysses, but this layout splits cp={ring * uly} as "
                         f"cp_ring={ring} x cp_ulysses={uly}: use algo='hybrid' (or 'allgather'), or build the "
                         f"layout with context_parallel_algo ulysses_cp")
    return name


def _split(layout: ParallelLayout, algo: str) -> tuple[int, int, int, int]:
    """(ring, ulysses, ring_rank, ulysses_rank) of this rank's token layout for sharding.py."""
    if algo == "allgather":  # zigzag over the flattened cp group
        return layout.size("cp"), 1, layout.rank("cp"), 0
    return layout.size("cp_ring"), layout.size("cp_ulysses"), layout.rank("cp_ring"), layout.rank("cp_ulysses")


def _validate(q: Any, k: Any, v: Any) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, s_local, heads, head_dim]; got shape {tuple(t.shape)}")
    if not q.dtype.is_floating_point:
        raise TypeError(f"q must be a floating-point tensor, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}: cast them first")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    b, s, h, d = q.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must have the same shape [batch, s_local, kv_heads] (only the head_dim may "
                         f"differ, e.g. DeepSeek MLA); got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != b or k.shape[1] != s:
        raise ValueError(f"q has batch={b}, s_local={s} but k/v have batch={k.shape[0]}, s_local={k.shape[1]}: "
                         "shard q, k and v the same way (same inputs to shard_sequence)")
    if k.shape[3] != d:
        who = "k/v have" if v.shape[3] == k.shape[3] else "k has"
        raise ValueError(f"head_dim differs: q has {d}, {who} {k.shape[3]} (k must have q's head_dim; only v may "
                         f"have its own)")
    h_kv = k.shape[2]
    if h_kv == 0 or h % h_kv:
        raise ValueError(f"num_heads={h} must be a multiple of num_kv_heads={h_kv} (GQA/MQA groups)")
    if b == 0 or s == 0 or d == 0 or v.shape[3] == 0:
        raise ValueError(f"empty input: q shape {tuple(q.shape)}, v shape {tuple(v.shape)}")


def _validate_doc_ids(doc_ids: Any, q: Tensor, layout: ParallelLayout, name: str) -> str:
    """Checks doc_ids; returns the algorithm that runs them (hybrid without a ring is Ulysses, same token layout)."""
    if not isinstance(doc_ids, Tensor):
        raise TypeError(f"doc_ids must be a torch.Tensor [batch, s_local] of document ids, got "
                        f"{type(doc_ids).__name__}")
    if doc_ids.dtype.is_floating_point or doc_ids.dtype.is_complex or doc_ids.dtype == torch.bool:
        raise TypeError(f"doc_ids must be an integer tensor (torch.long), got {doc_ids.dtype}")
    if tuple(doc_ids.shape) != tuple(q.shape[:2]):
        raise ValueError(f"doc_ids must have shape [batch, s_local] = {tuple(q.shape[:2])} like q, got "
                         f"{tuple(doc_ids.shape)}: pass this rank's shard, shard_sequence(doc_ids, layout, "
                         f"algo={name!r}) of the full [batch, seq] ids")
    if name == "hybrid" and layout.size("cp_ring") == 1:
        return "ulysses"
    if name in ("ring", "hybrid"):
        raise ValueError(f"packed sequences (doc_ids) are not implemented for algo={name!r} (cp_ring="
                         f"{layout.size('cp_ring')}); use algo='allgather' or algo='ulysses' (MindFormers "
                         f"colossalai_cp without use_ring_attention, or ulysses_cp)")
    return name


def _check_inputs(q: Any, k: Any, v: Any, layout: ParallelLayout, causal: bool, softmax_scale: Any,
                  algo: Optional[str], doc_ids: Any) -> tuple[str, float]:
    """This rank's checks (no collective): (the algorithm that runs, the softmax scale)."""
    _validate(q, k, v)
    name = resolve_algo(layout, algo)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    from .sharding import check_divisible
    from .ulysses import check_ulysses_heads

    cp = layout.size("cp")
    ring, uly, _, _ = _split(layout, name)
    check_ulysses_heads(q.shape[2], k.shape[2], uly)
    try:  # this rank's length implies the full one; a wrong local length means the inputs were not sharded
        check_divisible(q.shape[1] * cp, ring, uly)
    except ValueError as e:
        raise ValueError(f"context_parallel_attention(algo={name!r}): s_local={q.shape[1]} x cp={cp} = "
                         f"{q.shape[1] * cp} tokens: {e} (shard q, k, v with shard_sequence(x, layout, "
                         f"algo={name!r}))") from None
    if doc_ids is not None:
        name = _validate_doc_ids(doc_ids, q, layout, name)
    return name, scale


_AGREED = "_msp_cp_inputs_agreed"  # layout attribute: set while the engine's step stands for the per-call check


@contextmanager
def inputs_agreed(layout: ParallelLayout, agreed: bool = True) -> Iterator[None]:
    """Within the block, context_parallel_attention on `layout` skips its per-call peer check (one all-gather per
    call) when `agreed`: the engines enter it for a step whose batch the cp peers were verified to share
    (loss.check_batch_and_count), so every attention call of that step gets the same shapes, dtypes and options on
    every cp rank (the same model, the same rows); the inputs' local check still runs. Direct calls outside an
    engine step keep the per-call check."""
    before = getattr(layout, _AGREED, False)
    setattr(layout, _AGREED, before or agreed)
    try:
        yield
    finally:
        setattr(layout, _AGREED, before)


_PEER_FIELDS = ("batch", "s_local", "num_heads", "num_kv_heads", "head_dim", "v_head_dim", "dtype", "causal",
                "softmax_scale", "algo", "doc_ids given")


def _start_peer_check(layout: ParallelLayout, q: Any, k: Any, v: Any, causal: bool, scale: float,
                      name: Optional[str], doc_ids: Any, error: Optional[Exception]) -> Callable[[], None]:
    """Start one all-gather of [ok, *_PEER_FIELDS] over cp; the returned verdict() waits for it and raises a
    ValueError on every rank whose own inputs passed when any cp peer's differ or were rejected (a rank that
    rejected its own raises its own error after it). verdict() must run before the attention's first collective
    (peers that disagree on shapes would hang or abort it); until then its latency hides behind local work."""
    from ..distributed.collectives import dtype_code, start_gather_ints

    if error is None:
        b, s, h, d = q.shape
        meta = [1, b, s, h, k.shape[2], d, v.shape[3], dtype_code(q.dtype), int(bool(causal)),
                struct.unpack("<q", struct.pack("<d", scale))[0], ALGOS.index(name) if name in ALGOS else -1,
                int(doc_ids is not None)]
    else:
        meta = [0] * (len(_PEER_FIELDS) + 1)
    device = q.device if isinstance(q, Tensor) else torch.device(getattr(layout, "device_type", "cpu"))
    wait = start_gather_ints(meta, layout.group("cp"), device)
    return lambda: _verdict(layout, wait(), error)


def _verdict(layout: ParallelLayout, rows: list[list[int]], error: Optional[Exception]) -> None:
    if error is not None:
        return
    ranks = dist.get_process_group_ranks(layout.group("cp"))
    rejected = [f"cp rank {i} (global rank {ranks[i]})" for i, r in enumerate(rows) if not r[0]]
    if rejected:
        problem = f"{', '.join(rejected)} rejected its inputs (see the error on that rank)"
    else:
        problem = "; ".join(
            f"cp rank {i} (global rank {ranks[i]}) has {_peer_values(r, rows[0])}" for i, r in enumerate(rows)
            if r != rows[0])
        if not problem:
            return
    raise ValueError(f"context_parallel_attention: the cp ranks were called with different inputs: {problem}. "
                     f"Every cp rank must pass its shard_sequence part of the same q, k, v (same batch, heads, "
                     f"head_dim, dtype), with the same causal, softmax_scale, algo and doc_ids on all or none.")


def _peer_values(row: list[int], ref: list[int]) -> str:
    def show(field: str, x: int) -> str:
        if field == "softmax_scale":
            return repr(struct.unpack("<d", struct.pack("<q", x))[0])
        if field == "dtype":
            return next((str(t) for t in (torch.float32, torch.bfloat16, torch.float16, torch.float64)
                         if dtype_code(t) == x), "?")
        if field == "algo":
            return ALGOS[x] if 0 <= x < len(ALGOS) else "?"
        return str(bool(x)) if field in ("causal", "doc_ids given") else str(x)

    from ..distributed.collectives import dtype_code

    return ", ".join(f"{f}={show(f, a)} where cp rank 0 has {show(f, b)}"
                     for f, a, b in zip(_PEER_FIELDS, row[1:], ref[1:]) if a != b)


def context_parallel_attention(q: Tensor, k: Tensor, v: Tensor, layout: ParallelLayout, causal: bool = True,
                               softmax_scale: Optional[float] = None, algo: Optional[str] = None,
                               backend: Union[None, str, Backend] = None, doc_ids: Optional[Tensor] = None) -> Tensor:
    """Attention over the whole (cp-sharded) sequence. q [b, s_local, h, d], k [b, s_local, h_kv, d], v
    [b, s_local, h_kv, d_v] (d_v may differ from d: DeepSeek MLA), each this rank's tokens as given by
    shard_sequence(..., algo) (same algo); returns [b, s_local, h, d_v] (a transposed view of the [b, h, s, d_v]
    result). Differentiable; softmax_scale defaults to 1/sqrt(d) (the query's head dim).
    `backend` forces a block kernel (kernels.BACKENDS name).

    doc_ids (packed rows): integer [b, s_local], sharded like q, of document ids that are non-decreasing along the
    full row; a query then sees only its own document's keys (causal: at positions <= its own). algo allgather or
    ulysses (hybrid with cp_ring == 1).

    Before its first collective every cp rank all-gathers a few ints (its input check's verdict, batch, s_local,
    heads, kv heads, head_dims, dtype, causal, scale, algo, doc_ids or not), so inputs that differ between cp ranks
    (or a rank that rejected its inputs) are one clear error on every cp rank instead of a hang or a backend abort.
    Ulysses and hybrid start it async and wait for it once their first send buffer is built.
    `layout.check_cp_agreement = False` skips that tiny collective (one per call); inside an engine's step
    (inputs_agreed) the step's batch agreement stands for it."""
    _check_layout(layout)
    cp = layout.size("cp")
    if cp == 1:
        raise ValueError("context_parallel_attention needs a layout with context_parallel > 1, this one has cp=1: "
                         "use the model's own attention (or set parallel_config.context_parallel)")
    error, name, scale = None, None, 0.0
    try:
        name, scale = _check_inputs(q, k, v, layout, causal, softmax_scale, algo, doc_ids)
    except (TypeError, ValueError) as e:
        error = e
    verdict = None
    if getattr(layout, "check_cp_agreement", True) and not getattr(layout, _AGREED, False) and dist.is_initialized():
        verdict = _start_peer_check(layout, q, k, v, causal, scale, name, doc_ids, error)
    if error is not None:
        if verdict is not None:
            verdict()
        raise error
    kw = dict(causal=causal, scale=scale, backend=backend)
    if name in ("ulysses", "hybrid"):  # (with doc_ids it is ulysses, which waits before its doc-id gather)
        kw["before_send"] = verdict  # waited once the first all-to-all's send buffer is built
    elif verdict is not None:
        verdict()
    if doc_ids is not None:
        kw["doc_ids"] = doc_ids.to(q.device)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # the one transpose to the kernels' [b, h, s, d]
    if name == "allgather":
        from .allgather import allgather_attention

        out = allgather_attention(qh, kh, vh, layout.group("cp"), **kw)
    elif name == "ring":
        from .ring import ring_attention

        out = ring_attention(qh, kh, vh, layout.group("cp_ring"), **kw)
    elif name == "ulysses":
        from .ulysses import ulysses_attention

        out = ulysses_attention(qh, kh, vh, layout.group("cp_ulysses"), **kw)
    else:
        from .hybrid import hybrid_attention

        out = hybrid_attention(qh, kh, vh, layout, **kw)
    return out.transpose(1, 2)


def _dim(x: Tensor, dim: int) -> int:
    if not isinstance(x, Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    return check_dim(x, dim)  # a float / bool / out-of-range dim: one clear error


def shard_sequence(x: Tensor, layout: ParallelLayout, dim: int = 1, algo: Optional[str] = None, *, pad: bool = False,
                   pad_value: float = 0) -> Tensor:
    """This cp rank's tokens of x along `dim` (the layout `algo` expects; default: the plan's algo).

    A length the layout cannot split evenly is a ValueError, never a silent truncation; with pad=True x is first
    padded at the END of dim with pad_value (use the ignore index for labels) to the next valid length. Padding at
    the end is invisible to real tokens under causal attention; non-causal attention would see the pad keys.
    """
    dim = _dim(x, dim)
    name = resolve_algo(layout, algo)
    if layout.size("cp") == 1:
        return x
    from .sharding import check_divisible, pad_to_multiple, required_multiple, shard

    ring, uly, r, u = _split(layout, name)
    if pad:
        x = pad_to_multiple(x, dim, required_multiple(ring, uly), pad_value)
    check_divisible(x.shape[dim], ring, uly)
    return shard(x, dim, ring, uly, r, u)


def unshard_sequence(x_local: Tensor, layout: ParallelLayout, dim: int = 1, algo: Optional[str] = None) -> Tensor:
    """The full sequence from every cp rank's shard (all_gather over cp, then the inverse permutation).
    Collective: every cp rank must call it. The result carries no autograd history (it is for outputs/metrics)."""
    dim = _dim(x_local, dim)
    name = resolve_algo(layout, algo)
    cp = layout.size("cp")
    if cp == 1:
        return x_local
    from .sharding import unshard

    ring, uly, _, _ = _split(layout, name)
    xc = x_local.detach().contiguous()
    parts = [torch.empty_like(xc) for _ in range(cp)]
    dist.all_gather(parts, xc, group=layout.group("cp"))  # list in cp-rank order r*U + u, what unshard takes
    return unshard(parts, dim, ring, uly)
