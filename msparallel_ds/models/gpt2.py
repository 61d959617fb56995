"""The GPT-2 family adapter (HF GPT2LMHeadModel): learned positions, LayerNorm, Conv1D projections, tied head.

    transformer.wte + transformer.wpe -> drop -> h.N: ln_1 -> attn.c_attn ([q | k | v] fused, Conv1D) -> heads
    -> attention -> attn.c_proj -> residual -> ln_2 -> mlp.c_fc -> gelu -> mlp.c_proj -> residual -> ln_f -> lm_head

TP plan (HF's Conv1D stores W as [in, out]; styles conv1d_*: tensor_parallel/conv1d.py): c_attn column-parallel
per third (each of q, k, v split by heads: conv1d_colwise_qkv), c_fc column-parallel, both c_proj row-parallel;
SP and vocab parallel as the Llama family's, under the base model `transformer` and its layer list `h`. The
attention's split size and head count become this rank's. cp runs through the HF attention interface (GPT-2 has
no RoPE; its learned positions are looked up from the global position_ids the cp batch carries).
Pipeline: a stage holds wte/wpe on the first stage and ln_f/lm_head on the last (Gpt2Stage). A tied head
(tie_word_embeddings, GPT-2's default) is the word embedding shared across the first and last stage
(pipeline.shared: the last stage's copy, grads summed over the embedding group). The fine-grain and multi-copy
interleave do not run GPT-2 (its blocks are not the decomposed shape; refused with the keys named).

MindFormers (1.3.2 models/gpt2): GPT2Config YAML keys -> HF gpt2 config (gpt2_hf_config); checkpoint names
(convert_weight.py: backbone.blocks.N.attention.dense1/2/3 = c_attn's q/k/v transposed, projection / output.mapping /
output.projection as stored, layernorm1/2 gamma/beta) both ways.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
from torch import Tensor, nn

from ..checkpoint.weight_map import Rename, WeightOp
from .base import DecoderAdapter
from .stage import StageModule

__all__ = ["Gpt2Family", "Gpt2Stage", "gpt2_hf_config"]

_BLOCKS = ("attn", "mlp")
# HF module in a layer -> the MindFormers linear cells it holds (GPTTransformerDecoderLayer: attention, output)
_LORA_CELLS = {"attn.c_attn": ("attention.dense1", "attention.dense2", "attention.dense3"),
               "attn.c_proj": ("attention.projection",), "mlp.c_fc": ("output.mapping",),
               "mlp.c_proj": ("output.projection",)}


class Gpt2Family(DecoderAdapter):
    architectures = ("GPT2LMHeadModel",)
    model_types = ("gpt2",)
    prefix = "transformer"
    layers_name = "h"
    sequence_parallel_children = ("ln_1", "ln_2")
    # MindFormers' GPTTransformerDecoderLayer cells (modules/transformer/transformer.py)
    mindformers_names = {"attn": ["attention"], "mlp": ["output"], "ln_1": ["layernorm1"], "ln_2": ["layernorm2"],
                         "attn.c_attn": ["attention.dense1", "attention.dense2", "attention.dense3"],
                         "attn.c_proj": ["attention.projection"], "mlp.c_fc": ["output.mapping"],
                         "mlp.c_proj": ["output.projection"], "mlp.act": ["output.mapping.activation"]}

    lora_fan_in_fan_out = True  # Conv1D: W is [in, out]

    def layer_items(self, part: nn.Module) -> list[tuple[int, nn.Module]]:
        if isinstance(part, StageModule):
            return [(int(i), layer) for i, layer in part.body.h.items()]
        return list(enumerate(self.base(part).h))

    def output_head(self, part: nn.Module) -> Optional[nn.Module]:
        return getattr(part, "lm_head", None)

    def heads(self, config: Any, tp: int) -> tuple[int, int, bool]:
        h = config.num_attention_heads
        if h % tp:
            raise ValueError(f"num_attention_heads={h} is not divisible by the tensor-parallel size tp={tp} "
                             f"(model_parallel): pick a model_parallel that divides {h}")
        return h, h, False

    def tp_plan(self, config: Any, tp: int, *, sequence_parallel: bool = False,
                vocab_parallel: bool = False) -> dict[str, str]:
        self.heads(config, tp)
        layers = f"{self.prefix}.h.*."
        plan = {layers + "attn.c_attn": "conv1d_colwise_qkv", layers + "attn.c_proj": "conv1d_rowwise",
                layers + "mlp.c_fc": "conv1d_colwise", layers + "mlp.c_proj": "conv1d_rowwise"}
        if sequence_parallel:
            plan.update({layers + b: "sequence_gather_input" for b in _BLOCKS})
            plan.update({layers + c: "sequence_parallel" for c in self.sequence_parallel_children})
            plan[f"{self.prefix}.h.0"] = "sequence_scatter_input"
            # GPT2Model reshapes ln_f's output to the full sequence length: ln_f and the head run on the whole
            # sequence (its input gathered; backward keeps this rank's slice), replicated like the Llama head
            plan[f"{self.prefix}.ln_f"] = "sequence_gather_replicated"
        if vocab_parallel:
            plan[f"{self.prefix}.wte"] = "vocab_embedding"
            plan["lm_head"] = "vocab_lm_head_full_sequence" if sequence_parallel else "vocab_lm_head"
        return plan

    def set_local_heads(self, part: nn.Module, config: Any, tp: int) -> None:
        for _, layer in self.layer_items(part):
            attn = layer.attn
            attn.num_heads = config.num_attention_heads // tp
            attn.split_size = attn.embed_dim // tp

    def install_interleave(self, part: nn.Module, runner) -> None:
        raise ValueError("micro_batch_interleave_num / model.model_config.fine_grain_interleave > 1: GPT-2's blocks "
                         "are not run by the multi-copy interleave; set both to 1 for GPT-2 models")

    def interleave_of(self, part: nn.Module):
        return None

    def make_stage(self, model: nn.Module, layer_ids, *, first: bool, last: bool) -> StageModule:
        return Gpt2Stage.cut(model, layer_ids, first=first, last=last)

    def merge_stages(self, stages: list) -> nn.Module:
        return Gpt2Stage.merged(stages)

    def mindformers_weights(self, config: Any, *, legacy: bool, qkv_interleaved: bool = True,
                            fc1_interleaved: bool = True) -> list[WeightOp]:
        return _gpt2_ops()

    # ------------------------------------------------------------------------------------------ LoRA
    def _lora_cells(self, model: nn.Module, pattern: str, exclude) -> list[tuple[int, str, str]]:
        """(layer, HF module in the layer, MindFormers cell) of each linear cell MindFormers' LoRA replaces. Its walk
        (pet/tuners/lora_adapter.py recursive_replace_dense_cell, from GPT2LMHeadModel.backbone) re.matches each
        cell's own name: an excluded cell, or a matched one that is no Dense/Linear, is not entered; so the path
        blocks -> N -> attention|output -> dense1.. must pass before the linear cell itself is tried."""
        found = []
        for i, _ in self.layer_items(model):
            for hf, cells in _LORA_CELLS.items():
                for cell in cells:
                    *path, own = ("blocks", str(i), *cell.split("."))
                    if any(re.match(x, n) for x in exclude for n in (*path, own)):
                        continue
                    if not any(re.match(pattern, n) for n in path) and re.match(pattern, own):
                        found.append((i, hf, own))
        return found

    def lora_targets(self, model: nn.Module, pattern: str, exclude: tuple[str, ...] = ()) -> list[str]:
        return [f"{self.prefix}.h.{i}.{hf}" for i, hf, _ in self._lora_cells(model, pattern, exclude)
                if hf != "attn.c_attn"]

    def lora_block_targets(self, model: nn.Module, pattern: str, exclude: tuple[str, ...] = ()) -> dict:
        """attention.dense1/2/3 are separate q/k/v Linears in MindFormers (modules/transformer/transformer.py
        MultiHeadAttention :1512-1535, :1629-1631), HF's c_attn columns [q | k | v]: one LoRA per matched block."""
        h = model.config.n_embd
        out: dict[str, tuple] = {}
        for i, hf, own in self._lora_cells(model, pattern, exclude):
            if hf == "attn.c_attn":
                key = f"{self.prefix}.h.{i}.attn.c_attn"
                out[key] = out.get(key, ()) + ((own, (int(own[-1]) - 1) * h, h),)
        return out


class _Body(nn.Module):
    def __init__(self, wte, wpe, drop, h: dict, ln_f):
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop
        self.h = nn.ModuleDict({str(i): layer for i, layer in sorted(h.items())})
        self.ln_f = ln_f

    @property
    def layers(self) -> nn.ModuleDict:  # StageModule's name for the decoder layers
        return self.h


class Gpt2Stage(StageModule):
    """One pipeline stage of GPT2LMHeadModel under the HF names (transformer.wte/wpe/h.N/ln_f, lm_head)."""

    @classmethod
    def cut(cls, model: nn.Module, layer_ids, *, first: bool, last: bool) -> Gpt2Stage:
        base = model.transformer
        body = _Body(base.wte if first else None, base.wpe if first else None, base.drop,
                     {i: base.h[i] for i in layer_ids}, base.ln_f if last else None)
        return cls(model.config, "transformer", body, model.lm_head if last else None, first=first, last=last)

    @classmethod
    def merged(cls, stages: list) -> Gpt2Stage:
        head = next((s for s in stages if s.is_first), None)
        tail = next((s for s in stages if s.is_last), None)
        layers = {int(i): layer for s in stages for i, layer in s.body.h.items()}
        body = _Body(head.body.wte if head else None, head.body.wpe if head else None, stages[0].body.drop,
                     layers, tail.body.ln_f if tail else None)
        return cls(stages[0].config, "transformer", body, tail.lm_head if tail else None, first=head is not None,
                   last=tail is not None)

    def forward(self, x: Tensor, position_ids: Tensor, **kwargs) -> Tensor:
        from .stage import attention_masks

        body = self.body
        hidden = body.drop(body.wte(x) + body.wpe(position_ids)) if self.is_first else x
        layers = list(body.h.values())
        mask = attention_masks(self.config, hidden, position_ids, layers)["full_attention"]
        for layer in layers:
            hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, use_cache=False, **kwargs)
        if not self.is_last:
            return hidden
        return self.lm_head(body.ln_f(hidden))


# ---------------------------------------------------------------------------------------------- MindFormers
@dataclass(frozen=True)
class _ConvQKV(WeightOp):
    """HF c_attn ([in, 3h] Conv1D weight, or its [3h] bias) <-> MindFormers dense1/2/3 (q, k, v): the weight
    split in three along its output columns and transposed ([h, in], convert_weight.py :152), the bias split."""

    transpose: bool = True

    def to_hf(self, ts, cfg):
        return [torch.cat([t.t() if self.transpose else t for t in ts], -1).contiguous()]

    def to_mf(self, ts, cfg):
        return [(t.t() if self.transpose else t).contiguous() for t in torch.chunk(ts[0], 3, -1)]


def _gpt2_ops() -> list[WeightOp]:
    mf, hf = "backbone.blocks.{L}.", "transformer.h.{L}."
    ops = [Rename("backbone.embedding.word_embedding.embedding_table", "transformer.wte.weight"),
           Rename("backbone.embedding.position_embedding.embedding_table", "transformer.wpe.weight"),
           Rename("backbone.layernorm.gamma", "transformer.ln_f.weight"),
           Rename("backbone.layernorm.beta", "transformer.ln_f.bias"),
           _ConvQKV(tuple(f"{mf}attention.dense{i}.weight" for i in (1, 2, 3)), (hf + "attn.c_attn.weight",)),
           _ConvQKV(tuple(f"{mf}attention.dense{i}.bias" for i in (1, 2, 3)), (hf + "attn.c_attn.bias",), None,
                    False)]
    for ms_name, hf_name in (("layernorm1.gamma", "ln_1.weight"), ("layernorm1.beta", "ln_1.bias"),
                             ("layernorm2.gamma", "ln_2.weight"), ("layernorm2.beta", "ln_2.bias"),
                             ("attention.projection.weight", "attn.c_proj.weight"),
                             ("attention.projection.bias", "attn.c_proj.bias"),
                             ("output.mapping.weight", "mlp.c_fc.weight"), ("output.mapping.bias", "mlp.c_fc.bias"),
                             ("output.projection.weight", "mlp.c_proj.weight"),
                             ("output.projection.bias", "mlp.c_proj.bias")):
        ops.append(Rename(mf + ms_name, hf + hf_name))
    return ops


# MindFormers' activation names (modules/activation.py _activation) -> HF ACT2FN: GELU() is the tanh-approximated
# GELU (approximate=True), FastGelu is x * sigmoid(1.702 x); MindSpore 2.7's nn.GELU() / ops.fast_gelu equal HF's
# gelu_new / quick_gelu to the last bit on [-4, 4] (measured)
_ACTIVATIONS = {"gelu": "gelu_new", "fast_gelu": "quick_gelu"}


def gpt2_hf_config(mc: Mapping) -> tuple[str, dict]:
    """(HF model_type "gpt2", kwargs) of a MindFormers GPT2Config `model_config` (mindformers 1.3.2
    models/gpt2/gpt2_config.py defaults; post_layernorm_residual and activations checked)."""
    def get(key, default):
        value = mc.get(key, default)
        return default if value is None or str(value) == "None" else value

    if bool(get("post_layernorm_residual", False)):
        raise ValueError(f"model.model_config.post_layernorm_residual={mc['post_layernorm_residual']!r} has no HF "
                         "gpt2 counterpart; only post_layernorm_residual: False imports")
    act = str(get("hidden_act", "gelu"))
    if act not in _ACTIVATIONS:
        raise ValueError(f"model.model_config.hidden_act={act!r} has no HF counterpart mapped here; "
                         f"GPT-2 imports {', '.join(_ACTIVATIONS)}")
    hidden = int(get("hidden_size", 768))
    seq = int(get("max_position_embeddings", get("seq_length", 1024)))
    kw = {"vocab_size": int(get("vocab_size", 50257)), "n_embd": hidden, "n_layer": int(get("num_layers", 12)),
          "n_head": int(get("num_heads", 12)), "n_inner": hidden * int(get("expand_ratio", 4)), "n_positions": seq,
          "embd_pdrop": float(get("embedding_dropout_prob", 0.1)),
          "resid_pdrop": float(get("hidden_dropout_rate", 0.1)),
          "attn_pdrop": float(get("attention_dropout_rate", 0.1)), "activation_function": _ACTIVATIONS[act],
          "bos_token_id": get("bos_token_id", 50256), "eos_token_id": get("eos_token_id", 50256),
          "pad_token_id": get("pad_token_id", 50256), "tie_word_embeddings": True}
    return "gpt2", kw
