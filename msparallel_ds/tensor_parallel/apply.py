"""Apply a tensor (and vocab, sequence) parallel plan to a model part: module pattern -> style (DESIGN style 3).

    plan = tp_plan(model, layout, vocab_parallel=True)   # the family adapter's table (msparallel_ds.models)
    tp_parallelize(model, layout, vocab_parallel=True)   # swaps the matched modules in place, returns model

The plan comes from the model-family adapter (the HF config's own `base_model_tp_plan` under the base model
prefix, plus sequence- and vocab-parallel entries); `*` in a pattern is a layer index. This module knows only the
styles, never a model's module names:

| style                          | what it does                                                                   |
|--------------------------------|--------------------------------------------------------------------------------|
| colwise                        | nn.Linear -> ColumnParallelLinear (output features split, stays split)         |
| rowwise                        | nn.Linear -> RowParallelLinear (input is a column layer's split output)        |
| colwise_halves                 | colwise on a fused [gate; up] output: each half split (GLM's gate_up_proj)     |
| conv1d_colwise(_qkv), _rowwise | HF Conv1D (GPT-2) column / row parallel; _qkv: each third of c_attn split      |
| colwise_gathered               | colwise whose input its block already gathered (SP) or copied (copy_input):    |
|                                | no input collective here (MLA's up projections after replicated down ones)     |
| colwise_kv_replicated          | key/value projection when tp > kv heads: each rank keeps the kv head its query |
|                                | heads use; the full weight is kept and its grad all-reduced over tp            |
| replicated_with_grad_allreduce | weights replicated, grads partial per rank: summed over tp (Qwen3's q/k norms) |
| vocab_embedding                | nn.Embedding -> VocabParallelEmbedding (rows split over tp)                    |
| vocab_lm_head                  | output head -> ParallelLMHead: logits stay vocab-sharded [..., V/tp]           |
| sequence_parallel              | (SP) runs on this rank's sequence slice (norms): grads summed over tp          |
| sequence_scatter_input         | (SP) first decoder layer: keeps this rank's slice of hidden_states             |
| sequence_gather_input          | (SP) attention / MLP block: all-gathers hidden_states once for its colwise     |
|                                | layers (backward reduce-scatters); its rowwise layer reduce-scatters back      |
| sequence_gather_input_replicated | (SP) output head -> ReplicatedLMHead (the same replicated weights): all-   |
|                                  | gathers its input; backward keeps this rank's slice                        |
| sequence_gather_replicated     | (SP) a replicated module run on the whole sequence (GPT-2's ln_f, whose model   |
|                                | reshapes to the full length after it): all-gathers its input; backward keeps   |
|                                | this rank's slice                                                              |
| vocab_lm_head_full_sequence    | vocab_lm_head whose input is the whole sequence already (after the above)      |
| copy_input                     | (no SP) a block whose inner layers take partial grads: identity forward, its   |
|                                | input grad all-reduced once in backward (Megatron's f, for the whole block)    |
| token_slice_block              | (no SP) a MoE block: runs on this rank's sequence slice (split in, all-gather  |
|                                | out), its replicated weights' grads summed over tp                             |
|                                | (with its `input_ids` keyword cut alike: DeepSeek-V4's hash routers read it)  |
| sequence_parallel_block        | (SP) a MoE block on the sequence slice: sequence_parallel, and its `input_ids` |
|                                | keyword cut to the slice (MindFormers: PrepareModuleInput ShardTensor(1))      |
| copy_input_heads,              | copy_input / sequence_gather_input of an attention block that holds per-head   |
| sequence_gather_input_heads    | parameters of its own (DeepSeek-V4's sinks): those are split over tp, dim 0    |
| colwise_grouped                | a block-diagonal grouped linear (DeepSeek-V4's o_a_proj) whose groups follow  |
|                                | the heads: its rows are split group-wise in place, n_groups becomes the local  |
|                                | count, its input (already head-split) is regrouped; no collective              |

Parameters are cut by the shard spec (tensor_parallel/spec.py), which derives from the same styles. The adapter
then sets the attention modules' local head counts. On a whole model, vocab parallel also replaces the model's
`loss_function` by the vocab-parallel causal-LM loss, so `model(input_ids, labels=...).loss` equals the unsharded
loss; or call `vocab_parallel_causal_lm_loss(logits_shard, labels, layout)`.

Sequence parallel (Megatron SP, MindFormers use_seq_parallel): the residual stream between the blocks is split
along the sequence over tp. The split happens at the first decoder layer's input, not at the embedding, so the HF
model still builds position_ids, RoPE and masks for the full sequence; each attention/MLP block does one
all-gather (shared by its colwise layers) and its rowwise layer one reduce-scatter; the output head gathers the
sequence back. Per layer that is Megatron's traffic: 2 all-gathers + 2 reduce-scatters forward and backward.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ..distributed.collectives import split_along
from ..labels import IGNORE_INDEX
from ..models import DecoderAdapter, adapter_for
from .conv1d import CONV1D_STYLES, ParallelConv1D
from .layers import ColumnParallelLinear, FusedColumnParallelLinear, ReplicatedKVLinear, RowParallelLinear
from .mappings import copy_to_region, gather_from_region, gather_from_sequence_region, scatter_to_region
from .replicated import mark
from .spec import STYLE_PARAM_SHARDS, compile_pattern, style_of
from .vocab import ParallelLMHead, ReplicatedLMHead, VocabParallelEmbedding, vocab_parallel_cross_entropy

if TYPE_CHECKING:
    from ..distributed.layout import ParallelLayout

__all__ = ["STYLES", "apply_tp", "tp_parallelize", "tp_plan", "vocab_parallel_causal_lm_loss"]

STYLES = ("colwise", "rowwise", "colwise_gathered", "colwise_kv_replicated", "replicated_with_grad_allreduce",
          "vocab_embedding", "vocab_lm_head", "sequence_parallel", "sequence_scatter_input", "sequence_gather_input",
          "sequence_gather_input_replicated", "copy_input", "token_slice_block", "colwise_halves", *CONV1D_STYLES,
          "sequence_gather_replicated", "vocab_lm_head_full_sequence", "sequence_parallel_block", "copy_input_heads",
          "sequence_gather_input_heads", "colwise_grouped")
TOKEN_KEYWORDS = ("input_ids",)  # token-aligned keyword inputs a sequence-sliced block gets cut alike
SEQ_DIM = 1  # HF hidden states are [batch, seq, hidden]


def tp_plan(model: nn.Module, layout: ParallelLayout, *, sequence_parallel: bool = False,
            vocab_parallel: bool = False) -> dict[str, str]:
    """The module-pattern -> style table that tp_parallelize applies (full module names, `*` = layer index)."""
    return adapter_for(model).tp_plan(model.config, layout.size("tp"), sequence_parallel=sequence_parallel,
                                      vocab_parallel=vocab_parallel)


# ---------------------------------------------------------------------------------------------- apply
def _map_hidden_input(module: nn.Module, fn) -> None:
    """Apply fn to the module's hidden_states input (first positional argument or keyword), as a pre-hook: it
    runs inside an enclosing layer's recompute, and leaves parameter names alone."""
    def hook(mod, args, kwargs):
        if args:
            return (fn(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}

    module.register_forward_pre_hook(hook, with_kwargs=True)


def _slice_token_keywords(module: nn.Module, group) -> None:
    """Cut the block's token-aligned keyword inputs (TOKEN_KEYWORDS, no gradient) to this rank's sequence slice,
    as its hidden_states are (DeepSeek-V4's hash routers index a table by the input ids of the tokens they route)."""
    def hook(mod, args, kwargs):
        cut = {k: split_along(kwargs[k], group, SEQ_DIM) for k in TOKEN_KEYWORDS if torch.is_tensor(kwargs.get(k))}
        return (args, {**kwargs, **cut}) if cut else None

    module.register_forward_pre_hook(hook, with_kwargs=True)


def _split_block(module: nn.Module, group) -> None:
    """tp without sequence parallel, a block that must see each tp rank's own tokens (a MoE block: MindFormers
    routes dp*cp*tp token shards whether or not SP is on): its replicated weights' grads are summed over tp, its
    input is split over the sequence (backward: all-gather) and its output all-gathered (backward: split)."""
    mark(module, group)
    _map_hidden_input(module, lambda x: scatter_to_region(x, group, SEQ_DIM))
    _slice_token_keywords(module, group)

    def gather(mod, args, out):
        if isinstance(out, tuple):
            return (gather_from_region(out[0], group, SEQ_DIM), *out[1:])
        return gather_from_region(out, group, SEQ_DIM)

    module.register_forward_hook(gather)


def _split_own(module: nn.Module, group, shard) -> None:
    """Replace the module's own parameters by this rank's part (`shard`: Megatron's attributes on the new ones)."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    for name, p in list(module._parameters.items()):
        if p is not None:
            module._parameters[name] = shard.parameter(shard.local(p.data, tp, rank).clone(), p.requires_grad)


def _grouped(name: str, module: nn.Module, group) -> None:
    """colwise_grouped: the weight's rows are n_groups blocks; rank r keeps blocks r*g/tp .. (r+1)*g/tp - 1, whose
    inputs are the heads it holds. The caller reshapes its local heads by the global group count, so the input is
    regrouped into the local count (the same memory, hence exact) before the module's own forward."""
    tp, groups = dist.get_world_size(group), getattr(module, "n_groups", None)
    if not isinstance(groups, int) or groups % tp:
        raise ValueError(f"tp plan: {name} (colwise_grouped) has n_groups={groups}, which the tensor-parallel size "
                         f"tp={tp} must divide")
    _split_own(module, group, STYLE_PARAM_SHARDS["colwise_grouped"]["weight"])
    module.n_groups = groups // tp

    def regroup(mod, args):
        return (args[0].reshape(*args[0].shape[:-2], mod.n_groups, -1), *args[1:])

    module.register_forward_pre_hook(regroup)


def _set(part: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(part.get_submodule(parent) if parent else part, child, new)


def _replacement(name: str, style: str, module: nn.Module, group, sp: bool, n_kv: int) -> nn.Module:
    expected = "Conv1D" if style in CONV1D_STYLES else "Embedding" if style == "vocab_embedding" else "Linear"
    if type(module).__name__ != expected:
        raise TypeError(f"tp plan: {name} ({type(module).__name__}) matched style {style!r}, which expects "
                        f"{expected}")
    if style in CONV1D_STYLES:
        return ParallelConv1D(module, style, group, sequence_parallel=sp, input_is_gathered=sp)
    if style == "colwise_halves":
        return FusedColumnParallelLinear.from_linear(module, group, input_is_gathered=sp)
    if style in ("colwise", "colwise_gathered"):
        return ColumnParallelLinear.from_linear(module, group, input_is_gathered=sp or style == "colwise_gathered")
    if style == "rowwise":
        return RowParallelLinear.from_linear(module, group, input_is_parallel=True, sequence_parallel=sp)
    if style == "colwise_kv_replicated":
        return ReplicatedKVLinear(module, group, n_kv, input_is_gathered=sp)
    if style == "vocab_embedding":
        return VocabParallelEmbedding.from_embedding(module, group)
    if style == "sequence_gather_input_replicated":
        return ReplicatedLMHead(module, group, SEQ_DIM)
    if style == "vocab_lm_head_full_sequence":
        return ParallelLMHead.from_linear(module, group, sequence_parallel=False)
    return ParallelLMHead.from_linear(module, group, sequence_parallel=sp)  # vocab_lm_head


def apply_tp(part: nn.Module, layout: ParallelLayout, adapter: DecoderAdapter, plan: dict[str, str]) -> None:
    """Shard `part` (a whole model or a pipeline stage, HF parameter names) in place over layout.group("tp") by
    `plan`. Every tp rank must hold the same weights (same seed / checkpoint) and feed the same input_ids."""
    bad = {p: s for p, s in plan.items() if s not in STYLES}
    if bad:
        raise ValueError(f"unsupported tp styles {bad}; supported: {', '.join(STYLES)}")
    tp, group = layout.size("tp"), layout.group("tp")
    _, n_kv, _ = adapter.heads(part.config, tp)
    sp = any(s.startswith("sequence_") for s in plan.values())
    compiled = [(compile_pattern(p), s) for p, s in plan.items()]
    matched = set()
    for name, module in list(part.named_modules()):
        style = style_of(compiled, name)
        if style is None:
            continue
        matched.add(style)
        if style.endswith("_heads"):
            _split_own(module, group, STYLE_PARAM_SHARDS[style]["*"])
        if style in ("replicated_with_grad_allreduce", "sequence_parallel"):
            mark(module, group)  # grads summed over tp (replicated.py)
        elif style == "sequence_scatter_input":
            _map_hidden_input(module, lambda x: scatter_to_region(x, group, SEQ_DIM))
        elif style in ("sequence_gather_input", "sequence_gather_input_heads"):
            _map_hidden_input(module, lambda x: gather_from_sequence_region(x, group, SEQ_DIM))
        elif style == "sequence_gather_replicated":
            _map_hidden_input(module, lambda x: gather_from_region(x, group, SEQ_DIM))
        elif style in ("copy_input", "copy_input_heads"):
            _map_hidden_input(module, lambda x: copy_to_region(x, group))
        elif style == "token_slice_block":
            _split_block(module, group)
        elif style == "sequence_parallel_block":
            mark(module, group)
            _slice_token_keywords(module, group)
        elif style == "colwise_grouped":
            _grouped(name, module, group)
        else:
            _set(part, name, _replacement(name, style, module, group, sp, n_kv))
    if not matched:
        raise ValueError(f"tp plan matched no module of {type(part).__name__}: {plan}")
    adapter.set_local_heads(part, part.config, tp)
    if any(s.startswith("vocab_lm_head") for s in plan.values()) and hasattr(part, "loss_function"):  # a whole causal LM, not a stage
        if getattr(part.config, "tie_word_embeddings", False):
            part.get_output_embeddings().weight = part.get_input_embeddings().weight  # same rows, same matrix
        part.loss_function = _VocabParallelLoss(group)


def tp_parallelize(model: nn.Module, layout: ParallelLayout, *, sequence_parallel: bool = False,
                   vocab_parallel: bool = False, plan: dict[str, str] | None = None) -> nn.Module:
    """Shard a whole HF causal LM in place over layout.group("tp") by `plan` (default: tp_plan(...)); returns it.
    Every tp rank must hold the same weights (same seed / checkpoint) and feed the same input_ids."""
    adapter = adapter_for(model)
    tp = layout.size("tp")
    if plan is None:
        plan = adapter.tp_plan(model.config, tp, sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel)
    else:
        adapter.heads(model.config, tp)
    if tp > 1:
        apply_tp(model, layout, adapter, plan)
    return model


# ---------------------------------------------------------------------------------------------- vocab-parallel loss
def vocab_parallel_causal_lm_loss(logits: Tensor, labels: Tensor, group, *, ignore_index: int = IGNORE_INDEX,
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

    def __call__(self, logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=IGNORE_INDEX,
                 shift_labels=None, **kwargs):
        return vocab_parallel_causal_lm_loss(logits, labels, self.group, ignore_index=ignore_index,
                                             shift_labels=shift_labels, num_items_in_batch=num_items_in_batch)
