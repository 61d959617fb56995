"""The one shard spec: which parameter is split over which group (tp, or ep for experts), along which dim, derived
from the parallel plan's styles.

Rule (Megatron's, written only here): rank r of a group of T holds `full.chunk(T, dim)[r]` of a split parameter;
every other parameter is a full replica on each rank of the group. A fused parameter of `parts` equal blocks along
dim (GLM's [gate; up], GPT-2's [q; k; v]) is split block by block: rank r holds the concatenation of every block's
chunk r (Megatron's partition_stride). A Shard names its group ("tp", or "ep" for the
routed experts of a MoE layer, split along the expert dim). The TP layers cut their shards with it, and the weight
gather, the checkpoints (save, load, convert-checkpoint), save_pretrained and from_pretrained read the same entries,
so a parameter's layout is decided once, by the style its module has in the TP or EP plan:

| style                  | weight          | bias            |
|------------------------|-----------------|-----------------|
| colwise(_gathered)     | split, dim 0    | split, dim 0    |
| colwise_halves         | split, dim 0, each of 2 fused parts (GLM's gate_up_proj) |
| conv1d_colwise(_qkv)   | split, dim 1 (3 parts: GPT-2's c_attn) | split, dim 0 |
| conv1d_rowwise         | split, dim 0    | replicated      |
| rowwise                | split, dim 1    | replicated      |
| vocab_embedding        | vocab, dim 0    | -               |
| vocab_lm_head(_full_sequence) | vocab, dim 0 | vocab, dim 0  |
| colwise_kv_replicated  | kv_replicated   | kv_replicated   |
| colwise_grouped        | split, dim 0 (whole groups) | split, dim 0 |
| copy_input_heads, sequence_gather_input_heads | the block's own parameters: split, dim 0 (per-head vectors) |
| ep_experts (over ep)   | every 3-D expert tensor: expert, dim 0  |
| anything else          | replicated      | replicated      |

The spec is a pure function of (plan, parameter names): convert-checkpoint derives it from a saved model config
without building a model or starting processes.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

__all__ = ["EXPERT_SHARD", "REPLICATED", "STYLE_PARAM_SHARDS", "Shard", "ShardSpec", "compile_pattern"]


@dataclass(frozen=True)
class Shard:
    """How one parameter is laid out over its group (layout dim `group`): `dim` is None for a full replica on every
    rank."""

    dim: Optional[int] = None
    kind: str = "replicated"  # split | vocab | kv_replicated | expert | replicated
    group: str = "tp"         # the layout dim the parameter is split over ("ep" for experts)
    parts: int = 1            # fused blocks along dim, each split on its own (partition_stride)

    @property
    def is_split(self) -> bool:
        return self.dim is not None

    def local(self, full: Tensor, tp: int, rank: int) -> Tensor:
        """This rank's part of the full tensor (a view; the whole tensor when not split or tp == 1)."""
        if not self.is_split or tp == 1:
            return full
        if self.parts == 1:
            return full.chunk(tp, self.dim)[rank]
        return torch.cat([block.chunk(tp, self.dim)[rank] for block in full.chunk(self.parts, self.dim)], self.dim)

    def full_shape(self, local_shape, tp: int) -> tuple[int, ...]:
        shape = tuple(local_shape)
        if not self.is_split:
            return shape
        return shape[:self.dim] + (shape[self.dim] * tp,) + shape[self.dim + 1:]

    def index(self, local_shape, tp: int, rank: int) -> tuple[slice, ...]:
        """The slices of the full tensor this rank holds (for safetensors' get_slice; one block: see indices)."""
        return self.indices(local_shape, tp, rank)[0]

    def indices(self, local_shape, tp: int, rank: int) -> list[tuple[slice, ...]]:
        """One index per fused block: the full tensor's slices whose concatenation along dim is this rank's part."""
        index = [slice(None)] * len(local_shape)
        if not self.is_split:
            return [tuple(index)]
        n = local_shape[self.dim] // self.parts
        out = []
        for block in range(self.parts):
            start = (block * tp + rank) * n
            index[self.dim] = slice(start, start + n)
            out.append(tuple(index))
        return out

    def gather(self, local: Tensor, group) -> Tensor:
        """The full tensor from every rank's part (a collective over `group`, the process group of self.group)."""
        if not self.is_split:
            return local
        from ..distributed.collectives import all_gather_along

        full = all_gather_along(local, group, self.dim)
        if self.parts == 1:
            return full
        pieces = full.chunk(full.shape[self.dim] // local.shape[self.dim] * self.parts, self.dim)  # rank-major
        tp = len(pieces) // self.parts
        return torch.cat([pieces[r * self.parts + b] for b in range(self.parts) for r in range(tp)], self.dim)

    def parameter(self, data: Tensor, requires_grad: bool = True) -> torch.nn.Parameter:
        """A Parameter over `data` carrying Megatron's attributes when split (DeepSpeed counts such a parameter's
        shards once each in the gradient norm, replicated ones on tp rank 0 only)."""
        p = torch.nn.Parameter(data, requires_grad=requires_grad)
        if self.is_split and self.group == "tp":
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, self.dim, self.parts
        return p


REPLICATED = Shard()
EXPERT_SHARD = Shard(0, "expert", "ep")
_SPLIT0, _SPLIT1, _VOCAB0, _KV = Shard(0, "split"), Shard(1, "split"), Shard(0, "vocab"), Shard(None, "kv_replicated")
_HALVES0, _THIRDS0, _THIRDS1 = Shard(0, "split", parts=2), Shard(0, "split", parts=3), Shard(1, "split", parts=3)
# TP plan style -> {parameter attribute -> Shard}; a style or attribute not listed is replicated
STYLE_PARAM_SHARDS: dict[str, dict[str, Shard]] = {
    "colwise": {"weight": _SPLIT0, "bias": _SPLIT0},
    "colwise_gathered": {"weight": _SPLIT0, "bias": _SPLIT0},
    "rowwise": {"weight": _SPLIT1, "bias": REPLICATED},
    "colwise_halves": {"weight": _HALVES0, "bias": _HALVES0},
    "conv1d_colwise": {"weight": _SPLIT1, "bias": _SPLIT0},  # HF Conv1D: weight [in, out]
    "conv1d_colwise_qkv": {"weight": _THIRDS1, "bias": _THIRDS0},
    "conv1d_rowwise": {"weight": _SPLIT0, "bias": REPLICATED},
    "vocab_embedding": {"weight": _VOCAB0},
    "vocab_lm_head": {"weight": _VOCAB0, "bias": _VOCAB0},
    "vocab_lm_head_full_sequence": {"weight": _VOCAB0, "bias": _VOCAB0},
    "colwise_kv_replicated": {"weight": _KV, "bias": _KV},
    "colwise_grouped": {"weight": _SPLIT0, "bias": _SPLIT0},  # row blocks = groups of heads (V4's o_a_proj)
    "copy_input_heads": {"*": _SPLIT0},  # the block's own per-head parameters (V4's attention sinks)
    "sequence_gather_input_heads": {"*": _SPLIT0},
    "ep_experts": {"*": EXPERT_SHARD},  # every parameter of a HF experts module (the fused 3-D expert tensors)
}


def compile_pattern(pattern: str) -> re.Pattern:
    """A TP plan pattern (`*` = a layer index) as a regex over full module names."""
    return re.compile(r"\d+".join(re.escape(part) for part in pattern.split("*")))


def style_of(compiled: list[tuple[re.Pattern, str]], module_name: str) -> Optional[str]:
    return next((style for rx, style in compiled if rx.fullmatch(module_name)), None)


class ShardSpec(Mapping):
    """Parameter name -> Shard for every parameter of a model part (names as in named_parameters)."""

    def __init__(self, entries: Mapping[str, Shard]):
        self._entries = dict(entries)

    @classmethod
    def from_plan(cls, plan: Mapping[str, str], names: Iterable[str]) -> ShardSpec:
        compiled = [(compile_pattern(p), s) for p, s in plan.items()]
        entries = {}
        for name in names:
            module, _, attr = name.rpartition(".")
            style = style_of(compiled, module)
            rule = STYLE_PARAM_SHARDS.get(style, {})
            entries[name] = rule.get(attr, rule.get("*", REPLICATED))
        return cls(entries)

    @classmethod
    def of_module(cls, module: torch.nn.Module) -> ShardSpec:
        """The spec a parallelized module's TP layers were cut by, read back from the Megatron attributes they put on
        their parameters (for the standalone save/load helpers that get a model and no spec)."""
        entries = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            split = getattr(p, "tensor_model_parallel", False)
            expert = getattr(p, "expert_parallel", False)  # set by moe.apply on ep-sharded expert tensors
            parts = getattr(p, "partition_stride", 1)
            entries[name] = EXPERT_SHARD if expert else Shard(p.partition_dim, "split", parts=parts) if split \
                else REPLICATED
        return cls(entries)

    def __getitem__(self, name: str) -> Shard:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, name: str, default: Shard = REPLICATED) -> Shard:  # noqa: D401 - Mapping.get with our default
        return self._entries.get(name, default)

    def split_names(self, group: Optional[str] = None) -> list[str]:
        """Names of split parameters (over `group` only, when given)."""
        return [n for n, s in self._entries.items() if s.is_split and group in (None, s.group)]

    def __repr__(self) -> str:
        return (f"ShardSpec({len(self)} parameters, {len(self.split_names('tp'))} split over tp, "
                f"{len(self.split_names('ep'))} over ep)")
