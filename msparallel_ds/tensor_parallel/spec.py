"""The one shard spec: which parameter is split over which group (tp, or ep for experts), along which dim, derived
from the parallel plan's styles.

Rule (Megatron's, written only here): rank r of a group of T holds `full.chunk(T, dim)[r]` of a split parameter;
every other parameter is a full replica on each rank of the group. A Shard names its group ("tp", or "ep" for the
routed experts of a MoE layer, split along the expert dim). The TP layers cut their shards with it, and the weight
gather, the checkpoints (save, load, convert-checkpoint), save_pretrained and from_pretrained read the same entries,
so a parameter's layout is decided once, by the style its module has in the TP or EP plan:

| style                  | weight          | bias            |
|------------------------|-----------------|-----------------|
| colwise(_gathered)     | split, dim 0    | split, dim 0    |
| rowwise                | split, dim 1    | replicated      |
| vocab_embedding        | vocab, dim 0    | -               |
| vocab_lm_head          | vocab, dim 0    | vocab, dim 0    |
| colwise_kv_replicated  | kv_replicated   | kv_replicated   |
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

    @property
    def is_split(self) -> bool:
        return self.dim is not None

    def local(self, full: Tensor, tp: int, rank: int) -> Tensor:
        """This rank's part of the full tensor (a view; the whole tensor when not split or tp == 1)."""
        return full.chunk(tp, self.dim)[rank] if self.is_split and tp > 1 else full

    def full_shape(self, local_shape, tp: int) -> tuple[int, ...]:
        shape = tuple(local_shape)
        if not self.is_split:
            return shape
        return shape[:self.dim] + (shape[self.dim] * tp,) + shape[self.dim + 1:]

    def index(self, local_shape, tp: int, rank: int) -> tuple[slice, ...]:
        """The slices of the full tensor this rank holds (for safetensors' get_slice)."""
        index = [slice(None)] * len(local_shape)
        if self.is_split:
            n = local_shape[self.dim]
            index[self.dim] = slice(rank * n, (rank + 1) * n)
        return tuple(index)

    def gather(self, local: Tensor, group) -> Tensor:
        """The full tensor from every rank's part (a collective over `group`, the process group of self.group)."""
        if not self.is_split:
            return local
        from ..distributed.collectives import all_gather_along

        return all_gather_along(local, group, self.dim)

    def parameter(self, data: Tensor, requires_grad: bool = True) -> torch.nn.Parameter:
        """A Parameter over `data` carrying Megatron's attributes when split (DeepSpeed counts such a parameter's
        shards once each in the gradient norm, replicated ones on tp rank 0 only)."""
        p = torch.nn.Parameter(data, requires_grad=requires_grad)
        if self.is_split and self.group == "tp":
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, self.dim, 1
        return p


REPLICATED = Shard()
EXPERT_SHARD = Shard(0, "expert", "ep")
_SPLIT0, _SPLIT1, _VOCAB0, _KV = Shard(0, "split"), Shard(1, "split"), Shard(0, "vocab"), Shard(None, "kv_replicated")
# TP plan style -> {parameter attribute -> Shard}; a style or attribute not listed is replicated
STYLE_PARAM_SHARDS: dict[str, dict[str, Shard]] = {
    "colwise": {"weight": _SPLIT0, "bias": _SPLIT0},
    "colwise_gathered": {"weight": _SPLIT0, "bias": _SPLIT0},
    "rowwise": {"weight": _SPLIT1, "bias": REPLICATED},
    "vocab_embedding": {"weight": _VOCAB0},
    "vocab_lm_head": {"weight": _VOCAB0, "bias": _VOCAB0},
    "colwise_kv_replicated": {"weight": _KV, "bias": _KV},
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
            entries[name] = EXPERT_SHARD if expert else Shard(p.partition_dim, "split") if split else REPLICATED
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
