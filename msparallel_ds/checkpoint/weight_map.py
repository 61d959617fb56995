"""Name and layout maps between MindFormers checkpoints and HF models: a family's map is a list of ops.

    ops = adapter.mindformers_weights(hf_config, legacy=True)   # models/<family>.py declares them
    hf = to_hf(ops, mf_tensors, hf_config)                      # raises MappingError naming every problem
    mf = to_mf(ops, hf_tensors, hf_config, fused=True)

An op names its MindFormers tensors and the HF tensors they become, with `{L}` for a layer index, and knows the
layout transform between them (MindFormers 2.1.0's own conversion rules, cited where each op is used). Both
directions are exact inverses, so export -> import is the identity. Every name of the source must be consumed by
some op (else it is "unknown"), and every name of the target model must be produced ("missing").
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch
from torch import Tensor

__all__ = ["Concat", "ConcatSized", "Experts", "Frozen", "Joined", "FusedGateUp", "FusedQKV", "MappingError", "Rename",
           "State", "WeightOp", "WithConstants", "at", "to_hf", "to_mf"]


class MappingError(ValueError):
    """Names or shapes of a checkpoint that do not fit the model; the message lists every one."""


@dataclass(frozen=True)
class WeightOp:
    """MindFormers tensors `mf` <-> HF tensors `hf` (patterns; `{L}` is a layer index). `fused` ops are the
    MindFormers form written by export when the YAML fuses (qkv_concat / mcore); unfused ops otherwise."""

    mf: tuple[str, ...]
    hf: tuple[str, ...]
    fused: Optional[bool] = None  # None: written in both cases

    def to_hf(self, ts: list[Tensor], cfg: Any) -> list[Tensor]:
        return ts

    def to_mf(self, ts: list[Tensor], cfg: Any) -> list[Tensor]:
        return ts


def Rename(mf: str, hf: str) -> WeightOp:  # noqa: N802 (reads like the other op constructors)
    return WeightOp((mf,), (hf,))


def State(mf: str) -> WeightOp:  # noqa: N802
    """A MindFormers training-state tensor with no HF counterpart (e.g. a router's token counters): import takes it
    and drops it; export does not write it (MindFormers starts it at zero)."""
    return WeightOp((mf,), ())


@dataclass(frozen=True)
class Frozen(WeightOp):
    """A MindFormers tensor held at a constant (e.g. a norm's gamma frozen at 1) with no HF counterpart: import
    checks it equals `value` (None: any, e.g. a constant the forward never reads; `why` says why another value
    cannot be imported) and drops it; export writes it through a WithConstants op."""

    value: Optional[float] = 1.0
    why: str = ""

    def to_hf(self, ts, cfg):
        if self.value is not None and not bool(torch.all(ts[0] == self.value)):
            raise ValueError(f"holds values other than {self.value}: {self.why}")
        return []


@dataclass(frozen=True)
class WithConstants(WeightOp):
    """Export only (import skips it; plain ops take its names there, so checkpoints without the constants import
    too): the HF tensor written as mf[0] plus MindFormers tensors with no HF counterpart at their start values,
    `consts(tensor, cfg)` (e.g. a router's token counters at zero, a frozen gamma at one)."""

    consts: Optional[Callable[[Tensor, Any], list]] = None

    def to_mf(self, ts, cfg):
        return [ts[0], *self.consts(ts[0], cfg)]


def at(op: WeightOp, mf_prefix: str, hf_prefix: str) -> WeightOp:
    """The op of one layer at other prefixes: `{L}`-patterns' "decoder.layers.{L}." / "model.layers.{L}." parts
    replaced (e.g. an MTP layer's transformer layer, whose MindFormers and HF indices differ)."""
    def sub(names, prefix):
        return tuple(n.replace(n[: n.index("{L}.") + 4], prefix) if "{L}." in n else n for n in names)

    return replace(op, mf=sub(op.mf, mf_prefix), hf=sub(op.hf, hf_prefix))


def _heads(cfg: Any) -> tuple[int, int, int]:
    h = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or h
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // h
    return h, kv, d


@dataclass(frozen=True)
class FusedQKV(WeightOp):
    """One fused q|k|v weight (or bias). interleaved: per kv group g, [q_g (h/kv heads); k_g; v_g] rows
    (MindFormers 2.1.0 mcore QKVConvertOp and legacy qkv_concat_hf2mg); else contiguous [q; k; v]."""

    interleaved: bool = True

    def to_hf(self, ts, cfg):
        (w,) = ts
        h, kv, d = _heads(cfg)
        if not self.interleaved:
            return list(torch.split(w, [h * d, kv * d, kv * d]))
        g = w.reshape(kv, (h // kv + 2) * d, *w.shape[1:])
        q, k, v = torch.split(g, [h // kv * d, d, d], dim=1)
        return [t.reshape(-1, *w.shape[1:]).contiguous() for t in (q, k, v)]

    def to_mf(self, ts, cfg):
        q, k, v = ts
        h, kv, d = _heads(cfg)
        if not self.interleaved:
            return [torch.cat([q, k, v])]
        rest = q.shape[1:]
        parts = [q.reshape(kv, h // kv * d, *rest), k.reshape(kv, d, *rest), v.reshape(kv, d, *rest)]
        return [torch.cat(parts, dim=1).reshape(-1, *rest)]


@dataclass(frozen=True)
class FusedGateUp(WeightOp):
    """One fused gate|up weight. interleaved: gate rows 0::2, up rows 1::2 (MindFormers 2.1.0 mcore
    ConcatConvertOp with use_interleaved_weight_layout_mlp, legacy ffn_concat_hf2mg); else [gate; up]."""

    interleaved: bool = True

    def to_hf(self, ts, cfg):
        (w,) = ts
        if self.interleaved:
            return [w[0::2].contiguous(), w[1::2].contiguous()]
        return [t.contiguous() for t in torch.chunk(w, 2)]

    def to_mf(self, ts, cfg):
        gate, up = ts
        if self.interleaved:
            return [torch.stack([gate, up], dim=1).reshape(-1, *gate.shape[1:])]
        return [torch.cat([gate, up])]


@dataclass(frozen=True)
class Concat(WeightOp):
    """Several HF tensors concatenated along `dim` in one MindFormers tensor (equal sizes)."""

    dim: int = 0

    def to_hf(self, ts, cfg):
        return [t.contiguous() for t in torch.chunk(ts[0], len(self.hf), dim=self.dim)]

    def to_mf(self, ts, cfg):
        return [torch.cat(ts, dim=self.dim)]


@dataclass(frozen=True)
class ConcatSized(WeightOp):
    """Several HF tensors of different sizes concatenated along dim 0 in one MindFormers tensor; `sizes(cfg)` gives
    their row counts (e.g. MindFormers' fused MLA down projection [q_a | kv_a])."""

    sizes: Optional[Callable[[Any], list[int]]] = None

    def to_hf(self, ts, cfg):
        return [t.contiguous() for t in torch.split(ts[0], self.sizes(cfg))]

    def to_mf(self, ts, cfg):
        return [torch.cat(ts)]


@dataclass(frozen=True)
class Joined(WeightOp):
    """Several MindFormers tensors concatenated along `dim` in one HF tensor (equal sizes): the inverse of Concat,
    e.g. legacy Mixtral's stacked ffn.w1 / ffn.w3 [E, I, H] -> transformers 5's gate_up_proj [E, 2I, H]."""

    dim: int = 0

    def to_hf(self, ts, cfg):
        return [torch.cat(ts, dim=self.dim)]

    def to_mf(self, ts, cfg):
        return [t.contiguous() for t in torch.chunk(ts[0], len(self.mf), dim=self.dim)]


@dataclass(frozen=True)
class Experts(WeightOp):
    """MindFormers' stacked routed experts (mcore GroupedMLP, ExpertsConvertOp in checkpoint/converter/
    convert_op.py): weight1 [E*H, 2I] = per expert [H, gate|up], weight2 [E*I, H]; HF (transformers 5) holds
    the fused [E, 2I, H] and [E, H, I] expert tensors, i.e. the same blocks transposed."""

    def to_hf(self, ts, cfg):
        (w,) = ts
        e = _num_experts(cfg)
        return [w.reshape(e, -1, w.shape[-1]).transpose(1, 2).contiguous()]

    def to_mf(self, ts, cfg):
        (w,) = ts
        return [w.transpose(1, 2).reshape(-1, w.shape[1]).contiguous()]


def _num_experts(cfg: Any) -> int:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(cfg, key, None):
            return int(getattr(cfg, key))
    raise MappingError("the model config names no expert count (num_experts / num_local_experts)")


# ---------------------------------------------------------------------------------------------- matching
def _regex(pattern: str) -> re.Pattern:
    return re.compile(re.escape(pattern).replace(re.escape("{L}"), r"(?P<L>\d+)") + r"\Z")


def _groups(ops, names, side: str, fused: Optional[bool]):
    """[(op, {L: layer or None}, [source names])] for every instance of an op found among `names`, plus the names
    no op takes. An instance with only some of its names present is an error (listed by the caller)."""
    taken: set[str] = set()
    found, partial = [], []
    for op in ops:
        if fused is not None and op.fused is not None and op.fused != fused:
            continue
        if side == "mf" and isinstance(op, WithConstants):
            continue
        pats = getattr(op, side)
        hits: dict[Optional[str], dict[int, str]] = {}
        for i, pat in enumerate(pats):
            rx = _regex(pat)
            for n in names:
                m = rx.match(n)
                if m:
                    hits.setdefault(m.groupdict().get("L"), {})[i] = n
        for layer, got in hits.items():
            if len(got) < len(pats):
                have = [got[i] for i in sorted(got)]
                lacking = [_fill(p, layer) for j, p in enumerate(pats) if j not in got]
                partial.append(f"{', '.join(have)} without {', '.join(lacking)}")
                continue
            srcs = [got[i] for i in range(len(pats))]
            if taken.intersection(srcs):
                continue
            taken.update(srcs)
            found.append((op, layer, srcs))
    return found, [n for n in names if n not in taken], partial


def _fill(pattern: str, layer: Optional[str]) -> str:
    return pattern if layer is None else pattern.replace("{L}", layer)


def _convert(ops, tensors: dict[str, Tensor], cfg, *, forward: bool, fused: Optional[bool],
             origin: Optional[dict] = None) -> dict[str, Tensor]:
    src_side, dst_side = ("mf", "hf") if forward else ("hf", "mf")
    found, unknown, partial = _groups(ops, list(tensors), src_side, fused)
    problems = [f"unknown name {n} (no {'HF' if forward else 'MindFormers'} counterpart in this family's map)"
                for n in unknown] + [f"incomplete: {p}" for p in partial]
    out: dict[str, Tensor] = {}
    for op, layer, srcs in found:
        fn = op.to_hf if forward else op.to_mf
        try:
            res = fn([tensors[s] for s in srcs], cfg)
        except (RuntimeError, ValueError) as e:  # a shape the layout transform cannot take
            shapes = ", ".join(f"{s} {tuple(tensors[s].shape)}" for s in srcs)
            problems.append(f"cannot convert {shapes}: {e}")
            continue
        for pat, t in zip(getattr(op, dst_side), res):
            name = _fill(pat, layer)
            if name in out:
                problems.append(f"{name} is produced twice (the checkpoint holds both a fused and a split form?)")
            out[name] = t
            if origin is not None:
                origin[name] = srcs
    if problems:
        raise MappingError("; ".join(problems))
    return out


def to_hf(ops, tensors: dict[str, Tensor], cfg, *, origin: Optional[dict] = None) -> dict[str, Tensor]:
    """MindFormers names -> HF names (every fused or split form the map knows is accepted); `origin`, if given,
    gets each HF name's MindFormers source names."""
    return _convert(ops, tensors, cfg, forward=True, fused=None, origin=origin)


def to_mf(ops, tensors: dict[str, Tensor], cfg, *, fused: bool) -> dict[str, Tensor]:
    """HF names -> MindFormers names, in the fused or split form."""
    return _convert(ops, tensors, cfg, forward=False, fused=fused)
