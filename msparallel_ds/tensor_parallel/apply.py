"""Apply tensor (and vocab) parallel to a HF decoder model by a declarative plan (DESIGN style 3).

    plan = tp_plan(model, layout, vocab_parallel=True)   # {"model.layers.*.self_attn.q_proj": "colwise", ...}
    tp_parallelize(model, layout, vocab_parallel=True)   # swaps the matched modules in place, returns model

The plan starts from the model config's own `base_model_tp_plan` (patterns relative to the base model, `*` = a
layer index), prefixed with the base model's attribute name, plus our own entries:

| style                          | what it does                                                                   |
|--------------------------------|--------------------------------------------------------------------------------|
| colwise                        | nn.Linear -> ColumnParallelLinear (output features split, stays split)         |
| rowwise                        | nn.Linear -> RowParallelLinear (input is a column layer's split output)        |
| colwise_kv_replicated          | k/v proj when tp > kv heads: each rank keeps the one kv head its q heads use;  |
|                                | the full weight is kept and its grad all-reduced over tp (sum of replicas)     |
| replicated_with_grad_allreduce | weights replicated, grads partial per rank: summed over tp (Qwen3 q/k_norm)    |
| vocab_embedding                | nn.Embedding -> VocabParallelEmbedding (rows split over tp)                    |
| vocab_lm_head                  | lm_head -> ParallelLMHead: logits stay vocab-sharded [..., V/tp]               |
| sequence_parallel              | (SP) runs on this rank's sequence slice (norms): grads summed over tp          |
| sequence_scatter_input         | (SP) first decoder layer: keeps this rank's slice of hidden_states             |
| sequence_gather_input          | (SP) attention / MLP block: all-gathers hidden_states once for its colwise     |
|                                | layers (backward reduce-scatters); its rowwise layer reduce-scatters back      |
| sequence_gather_input_replicated | (SP) replicated lm_head: all-gathers its input (backward keeps this slice) |

Attention modules reshape with -1 heads, so only q/k/v/o are sharded; `num_key_value_groups` (read by the eager
and sdpa attention functions for repeat_kv) is set to local q heads / local kv heads. With vocab_parallel the
model's `loss_function` is replaced by the vocab-parallel causal-LM loss, so `model(input_ids, labels=...).loss`
equals the unsharded loss; or call `vocab_parallel_causal_lm_loss(logits_shard, labels, layout)`.

Sequence parallel (Megatron SP, MindFormers use_seq_parallel): the residual stream between the blocks is split
along the sequence over tp. The split happens at the first decoder layer's input, not at the embedding, so the HF
model still builds position_ids, RoPE and masks for the full sequence; each attention/MLP block does one
all-gather (shared by its colwise layers) and its rowwise layer one reduce-scatter; the lm_head gathers the
sequence back. Per layer that is Megatron's traffic: 2 all-gathers + 2 reduce-scatters forward and backward.
"""
from __future__ import annotations

import re

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .comm import (all_reduce, copy_to_region, gather_from_region, gather_from_sequence_region,
                   scatter_to_region)
from .layers import ColumnParallelLinear, RowParallelLinear
from .vocab import ParallelLMHead, VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ReplicatedKVLinear",
    "tp_parallelize",
    "tp_plan",
    "vocab_parallel_causal_lm_loss",
]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM")
_SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "qwen3")
_STYLES = ("colwise", "rowwise", "colwise_kv_replicated", "replicated_with_grad_allreduce", "vocab_embedding",
           "vocab_lm_head", "sequence_parallel", "sequence_scatter_input", "sequence_gather_input",
           "sequence_gather_input_replicated")
SEQ_DIM = 1  # HF hidden states are [batch, seq, hidden]


# ---------------------------------------------------------------------------------------------- the plan
def _check_supported(model: nn.Module) -> None:
    name = type(model).__name__
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if name not in SUPPORTED_ARCHITECTURES or model_type not in _SUPPORTED_MODEL_TYPES:
        raise ValueError(f"tp_parallelize: unsupported architecture {name} (model_type={model_type!r}); supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}. Other models: keep model_parallel: 1, or add their "
                         f"plan here")


def _heads(config, tp: int) -> tuple[int, int, bool]:
    """(n_heads, n_kv_heads, replicate_kv), or a clear error naming the numbers."""
    h = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or h
    if h % tp:
        raise ValueError(f"num_attention_heads={h} is not divisible by the tensor-parallel size tp={tp} "
                         f"(model_parallel): pick a model_parallel that divides {h}")
    if kv % tp == 0:
        return h, kv, False
    if tp % kv == 0:
        return h, kv, True
    raise ValueError(f"num_key_value_heads={kv} and the tensor-parallel size tp={tp} (model_parallel): neither "
                     f"divides the other, so kv heads can be neither split nor replicated evenly; pick a "
                     f"model_parallel that divides {kv} or a multiple of {kv} that divides "
                     f"num_attention_heads={h}")


def tp_plan(model: nn.Module, layout, *, sequence_parallel: bool = False,
            vocab_parallel: bool = False) -> dict[str, str]:
    """The module-pattern -> style table that tp_parallelize applies (full module names, `*` = layer index)."""
    _check_supported(model)
    tp = layout.size("tp")
    _, _, replicate_kv = _heads(model.config, tp)
    base_plan = getattr(model.config, "base_model_tp_plan", None) or {}
    if not base_plan:
        raise ValueError(f"{type(model).__name__}'s config has no base_model_tp_plan")
    prefix = model.base_model_prefix + "."
    plan = {}
    for pattern, style in base_plan.items():
        if style == "colwise" and replicate_kv and pattern.rsplit(".", 1)[-1] in ("k_proj", "v_proj"):
            style = "colwise_kv_replicated"
        plan[prefix + pattern] = style
    if sequence_parallel:
        plan.update(_sequence_parallel_entries(model, base_plan, prefix, vocab_parallel))
    if vocab_parallel:
        plan[prefix + "embed_tokens"] = "vocab_embedding"
        plan["lm_head"] = "vocab_lm_head"
    bad = {p: s for p, s in plan.items() if s not in _STYLES}
    if bad:
        raise ValueError(f"unsupported tp styles {bad}; supported: {', '.join(_STYLES)}")
    return plan


def _sequence_parallel_entries(model: nn.Module, base_plan: dict, prefix: str, vocab_parallel: bool) -> dict:
    """SP entries derived from the TP table: the parents of the sharded linears are the blocks that gather the
    sequence; every other child of a decoder layer that holds parameters (the norms) runs on the slice."""
    blocks = sorted({p.rsplit(".", 1)[0] for p, s in base_plan.items() if s in ("colwise", "rowwise")})
    entries = {prefix + b: "sequence_gather_input" for b in blocks}
    layer0 = model.get_submodule(prefix + "layers.0")
    block_children = {b.split(".")[-1] for b in blocks}
    for child, module in layer0.named_children():
        if child not in block_children and any(True for _ in module.parameters()):
            entries[prefix + "layers.*." + child] = "sequence_parallel"
    entries[prefix + "layers.0"] = "sequence_scatter_input"
    entries[prefix + "norm"] = "sequence_parallel"
    if not vocab_parallel:  # a ParallelLMHead gathers by itself (backward reduce-scatter)
        entries["lm_head"] = "sequence_gather_input_replicated"
    return entries


def _compile(pattern: str) -> re.Pattern:
    return re.compile(r"\d+".join(re.escape(part) for part in pattern.split("*")))


# ---------------------------------------------------------------------------------------------- kv replication
class ReplicatedKVLinear(nn.Module):
    """k_proj / v_proj when tp > kv heads (tp % kv == 0): tp rank r computes kv head r // (tp/kv), the one its q
    heads use. The full weight (and bias) is kept on every rank under nn.Linear's names; forward narrows it through
    copy_to_region, so backward sums the replicas' partial grads over tp: every rank ends with the full grad."""

    def __init__(self, linear: nn.Linear, group, n_kv_heads: int, *, input_is_gathered: bool = False):
        super().__init__()
        self.group, self.tp, self.tp_rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.input_is_gathered = input_is_gathered  # SP: the block's all-gather sums the input grad
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.head_dim = linear.out_features // n_kv_heads
        self.kv_head = self.tp_rank // (self.tp // n_kv_heads)
        self.weight = nn.Parameter(linear.weight.detach().clone(), requires_grad=linear.weight.requires_grad)
        self.bias = (None if linear.bias is None else
                     nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad))

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_gathered:
            x = copy_to_region(x, self.group)  # column-style input: its grad is partial per rank
        start = self.kv_head * self.head_dim
        w = copy_to_region(self.weight, self.group).narrow(0, start, self.head_dim)
        b = None if self.bias is None else copy_to_region(self.bias, self.group).narrow(0, start, self.head_dim)
        return F.linear(x, w, b)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, tp={self.tp}, "
                f"kv_head={self.kv_head}, head_dim={self.head_dim}")


# ---------------------------------------------------------------------------------------------- apply
def _grad_allreduce(module: nn.Module, group) -> None:
    for p in module.parameters(recurse=False):
        if p.requires_grad and not getattr(p, "tp_grad_allreduce", False):
            p.tp_grad_allreduce = True
            p.register_hook(lambda g, group=group: all_reduce(g, group))


def _map_hidden_input(module: nn.Module, fn) -> None:
    """Apply fn to the module's hidden_states input (first positional argument or keyword), as a pre-hook: it
    runs inside an enclosing layer's recompute, and leaves parameter names alone."""
    def hook(mod, args, kwargs):
        if args:
            return (fn(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}

    module.register_forward_pre_hook(hook, with_kwargs=True)


def _set(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def tp_parallelize(model: nn.Module, layout, *, sequence_parallel: bool = False,
                   vocab_parallel: bool = False, plan: dict[str, str] | None = None) -> nn.Module:
    """Shard `model` in place over layout.group("tp") by `plan` (default: tp_plan(...)); returns the model.
    Every tp rank must hold the same weights (same seed / checkpoint) and feed the same input_ids."""
    _check_supported(model)
    plan = tp_plan(model, layout, sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel) \
        if plan is None else plan
    tp, group = layout.size("tp"), layout.group("tp")
    if tp == 1:
        return model
    n_heads, n_kv, replicate_kv = _heads(model.config, tp)
    sp = any(s.startswith("sequence_") for s in plan.values())
    compiled = [(_compile(p), s) for p, s in plan.items()]
    matched = set()
    for name, module in list(model.named_modules()):
        style = next((s for rx, s in compiled if rx.fullmatch(name)), None)
        if style is None:
            continue
        matched.add(style)
        if style in ("replicated_with_grad_allreduce", "sequence_parallel"):
            _grad_allreduce(module, group)
            continue
        if style == "sequence_scatter_input":
            _map_hidden_input(module, lambda x: scatter_to_region(x, group, SEQ_DIM))
            module.msp_sequence_scatter_group = group  # for schedules that bypass the layer's call (interleave)
            continue
        if style == "sequence_gather_input":
            _map_hidden_input(module, lambda x: gather_from_sequence_region(x, group, SEQ_DIM))
            continue
        if style == "sequence_gather_input_replicated":
            _map_hidden_input(module, lambda x: gather_from_region(x, group, SEQ_DIM))
            continue
        expected = nn.Embedding if style == "vocab_embedding" else nn.Linear
        if type(module) is not expected:
            raise TypeError(f"tp plan: {name} ({type(module).__name__}) matched style {style!r}, which expects "
                            f"{expected.__name__}")
        if style == "colwise":
            new = ColumnParallelLinear.from_linear(module, group, input_is_gathered=sp)
        elif style == "rowwise":
            new = RowParallelLinear.from_linear(module, group, input_is_parallel=True, sequence_parallel=sp)
        elif style == "colwise_kv_replicated":
            new = ReplicatedKVLinear(module, group, n_kv, input_is_gathered=sp)
        elif style == "vocab_embedding":
            new = VocabParallelEmbedding.from_embedding(module, group)
        else:  # vocab_lm_head
            new = ParallelLMHead.from_linear(module, group, sequence_parallel=sp)
        _set(model, name, new)
    if not matched:
        raise ValueError(f"tp plan matched no module of {type(model).__name__}: {plan}")

    local_q, local_kv = n_heads // tp, (1 if replicate_kv else n_kv // tp)
    for module in model.modules():
        if hasattr(module, "num_key_value_groups") and hasattr(module, "q_proj"):
            module.num_key_value_groups = local_q // local_kv
            for attr, value in (("num_heads", local_q), ("num_key_value_heads", local_kv)):
                if hasattr(module, attr):  # older HF attention modules keep these
                    setattr(module, attr, value)

    if vocab_parallel:
        if getattr(model.config, "tie_word_embeddings", False):
            model.lm_head.weight = model.get_input_embeddings().weight  # same rows of the same matrix
        model.loss_function = _VocabParallelLoss(group)
    model.tp_layout = layout
    return model


# ---------------------------------------------------------------------------------------------- vocab-parallel loss
def vocab_parallel_causal_lm_loss(logits: Tensor, labels: Tensor, group, *, ignore_index: int = -100,
                                  shift_labels: Tensor | None = None, num_items_in_batch=None) -> Tensor:
    """HF's ForCausalLMLoss (shift labels left, mean over non-ignored tokens, or sum / num_items_in_batch) on
    vocab-sharded logits [..., V/tp]. `group`: layout.group("tp") (a layout is accepted too)."""
    if hasattr(group, "group") and callable(group.group):
        group = group.group("tp")
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    loss = vocab_parallel_cross_entropy(logits, shift_labels.to(logits.device), group, ignore_index,
                                        "sum" if num_items_in_batch is not None else "mean")
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
    return loss


class _VocabParallelLoss:
    """Stands in for the model's loss_function (called as loss_function(logits=, labels=, vocab_size=, ...))."""

    def __init__(self, group):
        self.group = group

    def __call__(self, logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                 shift_labels=None, **kwargs):
        return vocab_parallel_causal_lm_loss(logits, labels, self.group, ignore_index=ignore_index,
                                             shift_labels=shift_labels, num_items_in_batch=num_items_in_batch)
