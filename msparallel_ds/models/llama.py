"""The Llama family adapter: HF Llama, Qwen2, Qwen3 and Mistral (same decoder shape; Qwen3 adds q/k norms).

    layer = input_layernorm -> self_attn.{q,k,v}_proj -> [q_norm/k_norm] -> RoPE -> attention -> self_attn.o_proj
            -> residual -> post_attention_layernorm -> mlp.{gate,up}_proj -> act_fn -> mlp.down_proj -> residual

TP plan: the config's own `base_model_tp_plan` (q/k/v, gate/up colwise; o, down rowwise; Qwen3's q/k norms
replicated_with_grad_allreduce) under the base model prefix, k/v switched to colwise_kv_replicated when tp > kv
heads, plus sequence-parallel and vocab-parallel entries (styles: tensor_parallel/apply.py).
"""
from __future__ import annotations

import importlib
from typing import Any, Optional

from torch import Tensor, nn

from .base import DecoderAdapter, LayerParts
from .stage import StageModule

__all__ = ["LlamaFamily"]

_BLOCKS = ("self_attn", "mlp")  # a layer's two TP blocks (SP: each gathers the sequence once)


class LlamaFamily(DecoderAdapter):
    architectures = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM")
    model_types = ("llama", "qwen2", "mistral", "qwen3")
    sequence_parallel_children = ("input_layernorm", "post_attention_layernorm")
    # MindFormers (Llama/Qwen cell names) for each HF submodule of one decoder layer
    mindformers_names = {
        "self_attn": ["attention"], "mlp": ["feed_forward"],
        "input_layernorm": ["attention_norm", "attention_norm.norm"],
        "post_attention_layernorm": ["ffn_norm", "ffn_norm.norm"],
        "self_attn.q_proj": ["attention.wq", "attention.w_qkv"],
        "self_attn.k_proj": ["attention.wk", "attention.w_qkv"],
        "self_attn.v_proj": ["attention.wv", "attention.w_qkv"], "self_attn.o_proj": ["attention.wo"],
        "self_attn.q_norm": ["attention.q_norm"], "self_attn.k_norm": ["attention.k_norm"],
        "mlp.gate_proj": ["feed_forward.w1", "feed_forward.w_gate_hidden"],
        "mlp.up_proj": ["feed_forward.w3", "feed_forward.w_gate_hidden"], "mlp.down_proj": ["feed_forward.w2"],
        "mlp.act_fn": ["feed_forward.w1.activation", "feed_forward.activate", "feed_forward.w1.activation.silu"],
    }

    # ------------------------------------------------------------------------------------------ structure
    def layer_items(self, part: nn.Module) -> list[tuple[int, nn.Module]]:
        if isinstance(part, StageModule):
            return [(int(i), layer) for i, layer in part.body.layers.items()]
        return list(enumerate(self.base(part).layers))

    def output_head(self, part: nn.Module) -> Optional[nn.Module]:
        return getattr(part, "lm_head", None)

    # ------------------------------------------------------------------------------------------ tensor parallel
    def heads(self, config: Any, tp: int) -> tuple[int, int, bool]:
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

    def tp_plan(self, config: Any, tp: int, *, sequence_parallel: bool = False,
                vocab_parallel: bool = False) -> dict[str, str]:
        _, _, replicate_kv = self.heads(config, tp)
        base_plan = getattr(config, "base_model_tp_plan", None) or {}
        if not base_plan:
            raise ValueError(f"{config.architectures or config.model_type}'s config has no base_model_tp_plan")
        prefix = self.prefix + "."
        plan = {}
        for pattern, style in base_plan.items():
            if style == "colwise" and replicate_kv and pattern.rsplit(".", 1)[-1] in ("k_proj", "v_proj"):
                style = "colwise_kv_replicated"
            plan[prefix + pattern] = style
        if sequence_parallel:
            plan.update({f"{prefix}layers.*.{b}": "sequence_gather_input" for b in _BLOCKS})
            plan.update({f"{prefix}layers.*.{c}": "sequence_parallel" for c in self.sequence_parallel_children})
            plan[prefix + "layers.0"] = "sequence_scatter_input"
            plan[prefix + "norm"] = "sequence_parallel"
            if not vocab_parallel:  # a vocab-parallel head gathers by itself (backward reduce-scatter)
                plan["lm_head"] = "sequence_gather_input_replicated"
        if vocab_parallel:
            plan[prefix + "embed_tokens"] = "vocab_embedding"
            plan["lm_head"] = "vocab_lm_head"
        return plan

    def set_local_heads(self, part: nn.Module, config: Any, tp: int) -> None:
        """HF attention reshapes with -1 heads; only `num_key_value_groups` (repeat_kv in eager/sdpa) and, in older
        versions, the head counts need this rank's numbers."""
        n_heads, n_kv, replicate_kv = self.heads(config, tp)
        local_q, local_kv = n_heads // tp, (1 if replicate_kv else n_kv // tp)
        for _, layer in self.layer_items(part):
            attn = layer.self_attn
            attn.num_key_value_groups = local_q // local_kv
            for attr, value in (("num_heads", local_q), ("num_key_value_heads", local_kv)):
                if hasattr(attn, attr):
                    setattr(attn, attr, value)

    # ------------------------------------------------------------------------------------------ interleave
    def layer_parts(self, layer: nn.Module) -> Optional[LayerParts]:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return None
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return None
        return LayerParts(input_norm=layer.input_layernorm, qkv=(attn.q_proj, attn.k_proj, attn.v_proj),
                          attention=lambda q, k, v, kw: _attention(attn, q, k, v, kw), attn_out=attn.o_proj,
                          post_norm=layer.post_attention_layernorm, ffn_in=(mlp.gate_proj, mlp.up_proj),
                          act=mlp.act_fn, ffn_out=mlp.down_proj)

    def layer_index(self, layer: nn.Module, default: int) -> int:
        return getattr(getattr(layer, "self_attn", None), "layer_idx", default)

    # ------------------------------------------------------------------------------------------ pipeline
    def make_stage(self, model: nn.Module, layer_ids, *, first: bool, last: bool) -> StageModule:
        return StageModule.cut(model, layer_ids, first=first, last=last)


def _hf_module(attn: nn.Module):
    """The family's HF modeling module (apply_rotary_pos_emb, eager_attention_forward)."""
    model_type = attn.config.model_type
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


def _attention(attn: nn.Module, q: Tensor, k: Tensor, v: Tensor, kw: dict) -> Tensor:
    """HF's attention block between the projections: heads, q/k norm (Qwen3), RoPE, the model's attention
    function (eager / sdpa / our cp backend); [b, s, h*d] in and out."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    hf = _hf_module(attn)
    shape = (*q.shape[:-1], -1, attn.head_dim)
    q, k, v = q.view(shape), k.view(shape), v.view(shape)
    if getattr(attn, "q_norm", None) is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    cos, sin = kw["position_embeddings"]
    q, k = hf.apply_rotary_pos_emb(q, k, cos, sin)
    fn = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, hf.eager_attention_forward)
    extra = {k_: v_ for k_, v_ in kw.items() if k_ not in ("position_embeddings", "attention_mask", "use_cache",
                                                           "past_key_values", "cache_position")}
    window = getattr(attn, "sliding_window", getattr(attn.config, "sliding_window", None))
    out, _ = fn(attn, q, k, v, kw.get("attention_mask"), dropout=attn.attention_dropout if attn.training else 0.0,
                scaling=attn.scaling, sliding_window=window, **extra)
    return out.reshape(*out.shape[:2], -1).contiguous()
