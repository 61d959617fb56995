"""The Llama family adapter: HF Llama, Qwen2, Qwen3 and Mistral (same decoder shape; Qwen3 adds q/k norms).

    layer = input_layernorm -> self_attn.{q,k,v}_proj -> [q_norm/k_norm] -> RoPE -> attention -> self_attn.o_proj
            -> residual -> post_attention_layernorm -> mlp.{gate,up}_proj -> act_fn -> mlp.down_proj -> residual

TP plan: the config's own `base_model_tp_plan` (q/k/v, gate/up colwise; o, down rowwise; Qwen3's q/k norms
replicated_with_grad_allreduce) under the base model prefix, k/v switched to colwise_kv_replicated when tp > kv
heads, plus sequence-parallel and vocab-parallel entries (styles: tensor_parallel/apply.py).
"""
from __future__ import annotations

import importlib
from typing import Any, Mapping, Optional

import torch
from torch import Tensor, nn

from ..checkpoint.rope import legacy_rope_parameters
from ..checkpoint.weight_map import FusedGateUp, FusedQKV, Rename, WeightOp
from .base import MCORE_TOP, DecoderAdapter, LayerParts
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
        "self_attn.q_proj": ["attention.wq", "attention.w_qkv", "self_attention.linear_qkv"],
        "self_attn.k_proj": ["attention.wk", "attention.w_qkv", "self_attention.linear_qkv"],
        "self_attn.v_proj": ["attention.wv", "attention.w_qkv", "self_attention.linear_qkv"],
        "self_attn.o_proj": ["attention.wo", "self_attention.linear_proj"],
        "self_attn.q_norm": ["attention.q_norm"], "self_attn.k_norm": ["attention.k_norm"],
        "mlp.gate_proj": ["feed_forward.w1", "feed_forward.w_gate_hidden", "mlp.linear_fc1"],
        "mlp.up_proj": ["feed_forward.w3", "feed_forward.w_gate_hidden", "mlp.linear_fc1"],
        "mlp.down_proj": ["feed_forward.w2", "mlp.linear_fc2"],
        "mlp.act_fn": ["feed_forward.w1.activation", "feed_forward.activate", "feed_forward.w1.activation.silu"],
    }
    mindformers_top_names = {"lm_head": ["lm_head", "output_layer"]}  # legacy / mcore

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

    def base_tp_plan(self, config: Any, tp: int) -> dict[str, str]:
        """The layers' plan under the base model: the config's own base_model_tp_plan, k/v replicated when
        tp > kv heads."""
        _, _, replicate_kv = self.heads(config, tp)
        base_plan = getattr(config, "base_model_tp_plan", None) or {}
        if not base_plan:
            raise ValueError(f"{config.architectures or config.model_type}'s config has no base_model_tp_plan")
        return {pattern: "colwise_kv_replicated" if style == "colwise" and replicate_kv
                and pattern.rsplit(".", 1)[-1] in ("k_proj", "v_proj") else style
                for pattern, style in base_plan.items()}

    def tp_plan(self, config: Any, tp: int, *, sequence_parallel: bool = False,
                vocab_parallel: bool = False) -> dict[str, str]:
        prefix = self.prefix + "."
        plan = {prefix + pattern: style for pattern, style in self.base_tp_plan(config, tp).items()}
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
                          heads=lambda q, k, v, kw: _heads(attn, q, k, v, kw),
                          attend=lambda q, k, v, kw, rows=None: _attend(attn, q, k, v, kw, rows),
                          row_blocks=lambda: _row_blocks(attn), attn_out=attn.o_proj,
                          post_norm=layer.post_attention_layernorm, ffn_in=(mlp.gate_proj, mlp.up_proj),
                          act=mlp.act_fn, ffn_out=mlp.down_proj)

    def layer_index(self, layer: nn.Module, default: int) -> int:
        return getattr(getattr(layer, "self_attn", None), "layer_idx", default)

    # ------------------------------------------------------------------------------------------ pipeline
    def make_stage(self, model: nn.Module, layer_ids, *, first: bool, last: bool, mtp: int = 0) -> StageModule:
        return StageModule.cut(model, layer_ids, first=first, last=last, mtp=mtp)

    # ------------------------------------------------------------------------------------------ MindFormers weights
    def mindformers_weights(self, config: Any, *, legacy: bool, qkv_interleaved: bool = True,
                            fc1_interleaved: bool = True) -> list[WeightOp]:
        """MindFormers checkpoint names <-> this family's HF names (checkpoint/weight_map.py). legacy: the
        LlamaForCausalLM cells of MindFormers <= 1.x and 2.x `use_legacy: true`; else the 2.x mcore GPT cells."""
        return legacy_ops(qkv_interleaved) if legacy else mcore_dense_ops(qkv_interleaved, fc1_interleaved)


_HF = "model.layers.{L}."
_QKV = ("q", "k", "v")


def legacy_ops(interleaved: bool) -> list[WeightOp]:
    """mindformers 2.1.0 models/llama/convert_weight.py:107-120 (name_replace, HF -> MindFormers names; q/k rows
    are not permuted: that permute, :70, is for Meta .pth files only). qkv_concat fuses w_qkv and w_gate_hidden:
    interleaved per kv group / row by row in 1.6 and 2.1 (utils/convert_utils.py:65-106, read by
    llama_transformer.py:478-487 and llama_layer.py:406-413), a plain concat in 1.3.2 (llama_transformer.py:321-322,
    llama_layer.py:353-354 there)."""
    mf = "model.layers.{L}."
    ops = [Rename("model.tok_embeddings.embedding_weight", "model.embed_tokens.weight"),
           Rename("model.norm_out.weight", "model.norm.weight"), Rename("lm_head.weight", "lm_head.weight"),
           Rename(mf + "attention.wo.weight", _HF + "self_attn.o_proj.weight"),
           Rename(mf + "attention.wo.bias", _HF + "self_attn.o_proj.bias"),  # attn_proj_has_bias
           Rename(mf + "feed_forward.w2.weight", _HF + "mlp.down_proj.weight"),
           Rename(mf + "attention_norm.weight", _HF + "input_layernorm.weight"),
           Rename(mf + "ffn_norm.weight", _HF + "post_attention_layernorm.weight"),
           FusedGateUp((mf + "feed_forward.w_gate_hidden.weight",),
                       (_HF + "mlp.gate_proj.weight", _HF + "mlp.up_proj.weight"), True, interleaved),
           WeightOp((mf + "feed_forward.w1.weight",), (_HF + "mlp.gate_proj.weight",), False),
           WeightOp((mf + "feed_forward.w3.weight",), (_HF + "mlp.up_proj.weight",), False)]
    for kind in ("weight", "bias"):  # Qwen-style YAMLs (qkv_has_bias) carry q/k/v biases
        ops.append(FusedQKV((f"{mf}attention.w_qkv.{kind}",), tuple(f"{_HF}self_attn.{x}_proj.{kind}" for x in _QKV),
                            True, interleaved))
        ops += [WeightOp((f"{mf}attention.w{x}.{kind}",), (f"{_HF}self_attn.{x}_proj.{kind}",), False) for x in _QKV]
    return ops


def mcore_dense_ops(qkv_interleaved: bool, fc1_interleaved: bool, *, mlp: bool = True) -> list[WeightOp]:
    """mindformers 2.1.0 models/qwen3/utils.py:51-119 (weight_converters) and models/qwen2/utils.py:30-43
    (weight_mapping: the split linear_q/k/v, gating/hidden forms). linear_qkv is interleaved per kv group
    (checkpoint/converter/convert_op.py QKVConvertOp, :471-523, QKVBiasConvertOp for its bias) unless
    use_contiguous_weight_layout_attention (parallel_core/transformer_config.py:221, default False); linear_fc1
    is interleaved row by row (ConcatConvertOp, :200-260) while use_interleaved_weight_layout_mlp (:234, default
    True)."""
    mf = "decoder.layers.{L}."
    ops = [*MCORE_TOP,
           Rename(mf + "self_attention.linear_proj.weight", _HF + "self_attn.o_proj.weight"),
           Rename(mf + "self_attention.q_layernorm.weight", _HF + "self_attn.q_norm.weight"),
           Rename(mf + "self_attention.k_layernorm.weight", _HF + "self_attn.k_norm.weight"),
           Rename(mf + "input_layernorm.weight", _HF + "input_layernorm.weight"),
           Rename(mf + "pre_mlp_layernorm.weight", _HF + "post_attention_layernorm.weight")]
    for kind in ("weight", "bias"):
        ops.append(FusedQKV((f"{mf}self_attention.linear_qkv.{kind}",),
                            tuple(f"{_HF}self_attn.{x}_proj.{kind}" for x in _QKV), True, qkv_interleaved))
        ops += [WeightOp((f"{mf}self_attention.linear_{x}.{kind}",), (f"{_HF}self_attn.{x}_proj.{kind}",), False)
                for x in _QKV]
    if mlp:
        ops += [Rename(mf + "mlp.linear_fc2.weight", _HF + "mlp.down_proj.weight"),
                FusedGateUp((mf + "mlp.linear_fc1.weight",), (_HF + "mlp.gate_proj.weight", _HF + "mlp.up_proj.weight"),
                            True, fc1_interleaved),
                WeightOp((mf + "mlp.gating.weight",), (_HF + "mlp.gate_proj.weight",), False),
                WeightOp((mf + "mlp.hidden.weight",), (_HF + "mlp.up_proj.weight",), False)]
    return ops


def _hf_module(attn: nn.Module):
    """The family's HF modeling module (apply_rotary_pos_emb, eager_attention_forward)."""
    model_type = attn.config.model_type
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


def _heads(attn: nn.Module, q: Tensor, k: Tensor, v: Tensor, kw: dict) -> tuple[Tensor, Tensor, Tensor]:
    """[b, s, h*d] projections -> [b, h, s, d] q, k, v: heads, q/k norm (Qwen3), RoPE."""
    hf = _hf_module(attn)
    shape = (*q.shape[:-1], -1, attn.head_dim)
    q, k, v = q.view(shape), k.view(shape), v.view(shape)
    if getattr(attn, "q_norm", None) is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    cos, sin = kw["position_embeddings"]
    q, k = hf.apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v


# attention functions that take a block of query rows with a dense mask (cp, flash and flex run whole sequences)
ROW_BLOCK_IMPLS = ("sdpa", "eager")


def _row_blocks(attn: nn.Module) -> bool:
    return attn.config._attn_implementation in ROW_BLOCK_IMPLS and getattr(attn, "is_causal", True)


def _block_mask(mask: Optional[Tensor], rows: tuple[int, int], q: Tensor, impl: str) -> Tensor:
    """The mask of query rows [a, b) against keys [0, b): the model's own mask cut to that block, or (HF passes
    none for plain causal sdpa) the causal one, boolean for sdpa, additive for eager."""
    a, b = rows
    if mask is not None:
        return mask[:, :, a:b, :b]
    seen = torch.arange(b, device=q.device)[None, :] <= torch.arange(a, b, device=q.device)[:, None]
    if impl != "sdpa":
        seen = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill_(~seen, torch.finfo(q.dtype).min)
    return seen[None, None]


def _attend(attn: nn.Module, q: Tensor, k: Tensor, v: Tensor, kw: dict,
            rows: Optional[tuple[int, int]] = None) -> Tensor:
    """The model's attention function (eager / sdpa / our cp backend) on [b, h, s, d] q/k/v -> [b, s, h*d].
    rows=(a, b) (only if _row_blocks): query rows a..b-1 against the keys 0..b-1 they can see; q holds the whole
    sequence or those rows only (fine-grain chunks in the chunk layout)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = attn.config._attn_implementation
    fn = ALL_ATTENTION_FUNCTIONS.get_interface(impl, _hf_module(attn).eager_attention_forward)
    mask = kw.get("attention_mask")
    if rows is not None:
        mask = _block_mask(mask, rows, q, impl)
        if q.shape[2] != rows[1] - rows[0]:
            q = q[:, :, rows[0]:rows[1]]
        k, v = k[:, :, :rows[1]], v[:, :, :rows[1]]
    extra = {k_: v_ for k_, v_ in kw.items() if k_ not in ("position_embeddings", "attention_mask", "use_cache",
                                                           "past_key_values", "cache_position")}
    window = getattr(attn, "sliding_window", getattr(attn.config, "sliding_window", None))
    out, _ = fn(attn, q, k, v, mask, dropout=attn.attention_dropout if attn.training else 0.0,
                scaling=attn.scaling, sliding_window=window, **extra)
    return out.reshape(*out.shape[:2], -1).contiguous()


# ---------------------------------------------------------------------------------------------- legacy YAML
def _legacy_error(key: str, value, rule: str, fix: str) -> ValueError:
    return ValueError(f"model.model_config.{key}={value!r} {rule}; {fix}")


def _legacy_ffn_size(mc: Mapping) -> int:
    """FeedForward's hidden dim (mindformers 2.1.0 models/llama/llama_layer.py:300-309)."""
    if mc.get("intermediate_size"):
        return int(mc["intermediate_size"])
    dim = 4 * int(mc["hidden_size"])
    if mc.get("ffn_dim_multiplier") is not None:
        dim = int((float(mc["ffn_dim_multiplier"]) + 0.01) * dim)
    dim = int(2 * dim / 3)
    m = int(mc.get("multiple_of", 256))
    return m * ((dim + m - 1) // m)


def legacy_hf_config(mc: Mapping, moe: Optional[Mapping] = None) -> tuple[str, dict]:
    """(HF model_type, config kwargs) of a MindFormers legacy `model_config` (type LlamaConfig; mindformers 2.1.0
    models/llama/llama_config.py:132-176): Llama, or Qwen2 when only q/k/v carry biases (qkv_has_bias)."""
    arch_type = str(mc.get("type", "LlamaConfig"))
    if arch_type.startswith("Deepseek"):  # research/deepseek2|3 (MindFormers <= 1.5): other cells, other names
        raise _legacy_error("type", arch_type, "(legacy DeepSeek, research/deepseek2 or deepseek3) is not mapped: "
                            "its cell names differ from the 2.x mcore ones msparallel_ds imports",
                            "import with a MindFormers 2.x mcore YAML of the model (use_legacy: false, model_type: "
                            "deepseek_v3; e.g. configs/deepseek3/pretrain_deepseek3_671b.yaml of the 2.1 wheel)")
    if arch_type != "LlamaConfig":
        raise _legacy_error("type", arch_type, "is not a legacy model msparallel_ds can import", "legacy imports "
                            "cover LlamaConfig models (Llama 2/3, Qwen 1.5/2/2.5 YAMLs); use a 2.x mcore YAML")
    qkv_bias, o_bias = bool(mc.get("qkv_has_bias", False)), bool(mc.get("attn_proj_has_bias", False))
    if o_bias and not qkv_bias:
        raise _legacy_error("attn_proj_has_bias", True, "without qkv_has_bias has no HF Llama/Qwen2 counterpart",
                            "only q/k/v biases (Qwen2) or all four (Llama attention_bias) import")
    model_type = "qwen2" if qkv_bias and not o_bias else "llama"  # Qwen2: q/k/v biases, none on o_proj
    heads = int(mc.get("num_heads", 32))
    kw = {"hidden_size": int(mc.get("hidden_size", 4096)), "num_hidden_layers": int(mc.get("num_layers", 32)),
          "num_attention_heads": heads, "num_key_value_heads": int(mc.get("n_kv_heads") or heads),
          "intermediate_size": _legacy_ffn_size({"hidden_size": 4096, **mc}),
          "vocab_size": int(mc.get("vocab_size", 32000)),
          "rms_norm_eps": float(mc.get("rms_norm_eps", 1e-5)), "rope_parameters": legacy_rope_parameters(mc),
          "max_position_embeddings": int(mc.get("max_position_embedding") or mc.get("seq_length") or 2048),
          "bos_token_id": mc.get("bos_token_id", 1), "eos_token_id": mc.get("eos_token_id", 2),
          "pad_token_id": mc.get("pad_token_id", 0), "tie_word_embeddings": bool(mc.get("tie_word_embeddings", False)),
          "hidden_act": "silu"}
    if model_type == "llama":
        kw["attention_bias"] = qkv_bias
    experts = int((moe or {}).get("expert_num", 1) or 1)
    if experts > 1:  # a legacy Llama with moe_config: MindFormers' Mixtral (research/mixtral) or Qwen2-MoE
        shared = float(moe.get("shared_expert_num", 0) or 0)
        _legacy_moe_checks(moe, qkv_bias and not shared)
        kw.pop("attention_bias", None)
        if not shared:
            model_type = "mixtral"
            kw.update(num_local_experts=experts, num_experts_per_tok=int(moe.get("num_experts_chosen", 1)))
            return model_type, kw
        # LlamaFeedForwardWithMoE (mindformers 1.3.2 models/llama/llama_layer.py:529-600, llama_transformer.py:
        # 643-693): every layer MoE, routed experts of intermediate_size, shared experts of
        # int(intermediate_size * shared_expert_num), gated by sigmoid(shared_experts_gate)
        inter = int(mc.get("intermediate_size") or 0)
        if not inter:
            raise _legacy_error("intermediate_size", mc.get("intermediate_size"), "is needed with moe_config."
                                "shared_expert_num (the shared experts' size is intermediate_size * shared_expert_num)",
                                "write the experts' intermediate_size")
        model_type = "qwen2_moe"
        kw.update(num_experts=experts, num_experts_per_tok=int(moe.get("num_experts_chosen", 1)),
                  moe_intermediate_size=inter, shared_expert_intermediate_size=int(inter * shared),
                  decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=qkv_bias,
                  norm_topk_prob=bool(moe.get("norm_topk_prob", True)))
    return model_type, kw


def _legacy_moe_checks(moe: Mapping, qkv_bias: bool) -> None:
    """What HF Mixtral (softmax, top-k renormalised, no biases) or, with shared experts, HF Qwen2-MoE (softmax,
    norm_topk_prob either way, gated shared expert) can hold of a moe_config (mindformers 2.1.0
    modules/transformer/moe.py:87-190 MoEConfig)."""
    def bad(key, value, rule, fix):
        return ValueError(f"moe_config.{key}={value!r} {rule}; {fix}")

    if float(moe.get("shared_expert_num", 0) or 0) and not moe.get("use_shared_expert_gating", False):
        raise bad("use_shared_expert_gating", moe.get("use_shared_expert_gating", False), "with shared_expert_num has "
                  "no HF Qwen2-MoE counterpart (its shared expert is always gated)",
                  "only gated shared experts (use_shared_expert_gating: true, Qwen2-MoE) import")
    if int(moe.get("num_experts_chosen", 1)) > 1 and moe.get("norm_topk_prob", True) is False \
            and not float(moe.get("shared_expert_num", 0) or 0):
        raise bad("norm_topk_prob", False, "has no HF Mixtral counterpart (it renormalises the top-k weights)",
                  "import with norm_topk_prob: true only if the run used it")
    if float(moe.get("routed_scaling_factor", 1.0) or 1.0) != 1.0:
        raise bad("routed_scaling_factor", moe["routed_scaling_factor"], "has no HF Mixtral / Qwen2-MoE counterpart",
                  "only 1.0 imports")
    if qkv_bias:
        raise bad("expert_num", moe.get("expert_num"), "with model_config.qkv_has_bias has no HF Mixtral counterpart",
                  "Mixtral has no attention biases")
