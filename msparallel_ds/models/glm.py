"""The GLM family adapter: HF `glm` (GLM-4-9B and the ChatGLM2/3 lineage) and `glm4` (GLM-4-0414: two more norms).

    layer = input_layernorm -> self_attn.{q,k,v}_proj (q/k/v biases) -> RoPE on half the head dim (interleaved
            pairs) -> attention -> self_attn.o_proj [-> post_self_attn_layernorm (glm4)] -> residual
            -> post_attention_layernorm -> mlp.gate_up_proj ([gate; up] fused) -> chunk(2): up * silu(gate)
            -> mlp.down_proj [-> post_mlp_layernorm (glm4)] -> residual

TP plan (written here: HF's own gathers gate_up's whole output on every rank): q/k/v column-parallel per head
group (k/v replicated per group when tp > multi_query_group_num), o row-parallel, gate_up_proj column-parallel
per half (style colwise_halves: this rank holds [gate_r; up_r], so the model's chunk(2) pairs them with no
collective), down_proj row-parallel. glm4's post norms sit after the row layers' reduce(-scatter): on the
sequence slice under SP, like the other norms. Pipeline stages, cp (HF attention interface: RoPE is applied
before it, partial rotary included) and vocab parallel are the Llama family's. The fine-grain interleave runs GLM
layers whole (no LayerParts: the fused gate/up and glm4's post norms are not the step shape fine_grain runs).

MindFormers: ChatGLM2Config YAMLs (glm2, glm3, glm4-9b in 1.3.2 / 2.1.0) build ChatGLM2ForConditionalGeneration;
chatglm_hf_config maps their keys to a HF `glm` config (what cannot map is refused naming the key). Checkpoint
names (mindformers 1.3.2/2.1.0 models/glm2/convert_weight.py, glm2.py convert_name; 2.1.0 models/glm4/utils.py
weight_mapping for the mcore glm4 names) are mapped both ways by mindformers_weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from ..checkpoint.weight_map import FusedQKV, Rename, WeightOp
from .base import MCORE_TOP, LayerParts
from .llama import LlamaFamily, mcore_dense_ops
from .moe import MoEFamily

__all__ = ["Glm4MoeFamily", "GlmFamily", "chatglm_hf_config"]


class GlmFamily(LlamaFamily):
    architectures = ("GlmForCausalLM", "Glm4ForCausalLM")
    model_types = ("glm", "glm4")
    sequence_parallel_children = ("input_layernorm", "post_attention_layernorm", "post_self_attn_layernorm",
                                  "post_mlp_layernorm")
    # MindFormers cell names: ChatGLM2Block (glm2_transformer.py) and the mcore names of 2.x glm4
    mindformers_names = {
        "self_attn": ["self_attention"], "mlp": ["mlp"],
        "input_layernorm": ["input_layernorm"], "post_attention_layernorm": ["post_attention_layernorm",
                                                                             "pre_mlp_layernorm"],
        "self_attn.q_proj": ["self_attention.query_key_value", "self_attention.wq", "self_attention.linear_qkv",
                             "self_attention.linear_q"],
        "self_attn.k_proj": ["self_attention.query_key_value", "self_attention.wk", "self_attention.linear_qkv",
                             "self_attention.linear_k"],
        "self_attn.v_proj": ["self_attention.query_key_value", "self_attention.wv", "self_attention.linear_qkv",
                             "self_attention.linear_v"],
        "self_attn.o_proj": ["self_attention.dense", "self_attention.linear_proj"],
        "mlp.gate_up_proj": ["mlp.dense_h_to_4h", "mlp.linear_fc1"],
        "mlp.down_proj": ["mlp.dense_4h_to_h", "mlp.linear_fc2"],
        "mlp.activation_fn": ["mlp.activation_func", "mlp.activation_func.silu"],
    }

    def base_tp_plan(self, config: Any, tp: int) -> dict[str, str]:
        _, _, replicate_kv = self.heads(config, tp)
        kv = "colwise_kv_replicated" if replicate_kv else "colwise"
        return {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": kv,
                "layers.*.self_attn.v_proj": kv, "layers.*.self_attn.o_proj": "rowwise",
                "layers.*.mlp.gate_up_proj": "colwise_halves", "layers.*.mlp.down_proj": "rowwise"}

    def layer_parts(self, layer) -> Optional[LayerParts]:
        return None  # runs whole under the fine-grain interleave (see the module docstring)

    def mindformers_weights(self, config: Any, *, legacy: bool, qkv_interleaved: bool = True,
                            fc1_interleaved: bool = True) -> list[WeightOp]:
        """legacy: ChatGLM2ForConditionalGeneration's names; else 2.x mcore glm4 (models/glm4/utils.py)."""
        return _chatglm_ops() if legacy else _mcore_glm4_ops(qkv_interleaved)


@dataclass(frozen=True)
class _SplitHalves(WeightOp):
    """One HF [gate; up] tensor stored as two MindFormers tensors (2.1.0 glm2 mlp_concat: false, dense_left /
    dense_right: convert_weight.py mlp_split)."""

    def to_hf(self, ts, cfg):
        return [torch.cat(ts)]

    def to_mf(self, ts, cfg):
        return [t.contiguous() for t in torch.chunk(ts[0], 2)]


_HF = "model.layers.{L}."


def _chatglm_ops() -> list[WeightOp]:
    """mindformers 1.3.2 models/glm2/convert_weight.py (HF ChatGLM names, word_embeddings -> embedding_weight) and
    2.1.0 glm2.py convert_name / convert_weight.py attn_split, mlp_split (the split wq/wk/wv, dense_left/right
    forms); query_key_value is a plain [q; k; v] concat, dense_h_to_4h is [gate; up] as HF's gate_up_proj."""
    mf = "transformer.encoder.layers.{L}."
    ops = [Rename("transformer.embedding.embedding_weight", "model.embed_tokens.weight"),
           Rename("transformer.encoder.final_layernorm.weight", "model.norm.weight"),
           Rename("transformer.output_layer.weight", "lm_head.weight"),
           Rename(mf + "input_layernorm.weight", _HF + "input_layernorm.weight"),
           Rename(mf + "post_attention_layernorm.weight", _HF + "post_attention_layernorm.weight"),
           Rename(mf + "self_attention.dense.weight", _HF + "self_attn.o_proj.weight"),
           Rename(mf + "mlp.dense_h_to_4h.weight", _HF + "mlp.gate_up_proj.weight"),
           _SplitHalves((mf + "mlp.dense_left.weight", mf + "mlp.dense_right.weight"),
                        (_HF + "mlp.gate_up_proj.weight",), False),
           Rename(mf + "mlp.dense_4h_to_h.weight", _HF + "mlp.down_proj.weight")]
    for kind in ("weight", "bias"):
        ops.append(FusedQKV((f"{mf}self_attention.query_key_value.{kind}",),
                            tuple(f"{_HF}self_attn.{x}_proj.{kind}" for x in "qkv"), True, False))
        ops += [WeightOp((f"{mf}self_attention.w{x}.{kind}",), (f"{_HF}self_attn.{x}_proj.{kind}",), False)
                for x in "qkv"]
    return ops


def _mcore_glm4_ops(qkv_interleaved: bool) -> list[WeightOp]:
    """mindformers 2.1.0 models/glm4/utils.py weight_mapping: plain renames (linear_fc1 is HF's gate_up_proj as
    it is); the fused linear_qkv form as the other mcore models'."""
    mf = "decoder.layers.{L}."
    return mcore_dense_ops(qkv_interleaved, False, mlp=False) + [
        Rename(mf + "mlp.linear_fc1.weight", _HF + "mlp.gate_up_proj.weight"),
        Rename(mf + "mlp.linear_fc2.weight", _HF + "mlp.down_proj.weight"),
        Rename(mf + "post_self_attn_layernorm.weight", _HF + "post_self_attn_layernorm.weight"),
        Rename(mf + "post_mlp_layernorm.weight", _HF + "post_mlp_layernorm.weight")]


# ---------------------------------------------------------------------------------------------- ChatGLM2Config YAML
def _refuse(key: str, value, rule: str, fix: str) -> ValueError:
    return ValueError(f"model.model_config.{key}={value!r} {rule}; {fix}")


def chatglm_hf_config(mc: Mapping) -> tuple[str, dict]:
    """(HF model_type "glm", config kwargs) of a MindFormers ChatGLM2Config `model_config` (mindformers 1.3.2
    models/glm2/glm2_config.py defaults; the model: glm2.py, glm2_transformer.py, glm2_modules.py). ChatGLM2/3 and
    GLM-4-9B are HF's `glm` architecture: multi-query groups, q/k/v biases, RoPE on the first half of each head as
    interleaved pairs with base 10000 * rope_ratio (FreqsMgr), RMSNorm, [gate; up] SwiGLU, untied output layer
    (tests/test_glm_reference.py runs a forward written from that source against GlmForCausalLM)."""
    def get(key, default):
        value = mc.get(key, default)
        return default if value is None or str(value) == "None" else value

    for key, want, why in (("rmsnorm", True, "(LayerNorm) has no HF glm counterpart"),
                           ("apply_residual_connection_post_layernorm", False, "has no HF glm counterpart"),
                           ("post_layer_norm", True, "(no final norm) has no HF glm counterpart"),
                           ("add_bias_linear", False, "(biases on dense / MLP) has no HF glm counterpart"),
                           ("apply_query_key_layer_scaling", True, "(unscaled q.k in the non-flash CoreAttention) "
                            "differs from HF glm's 1/sqrt(head_dim)"),
                           ("use_rearrange_rope", False, "(q/k rows rearranged for half-rotation RoPE) is not "
                            "HF glm's layout")):
        if bool(get(key, want)) != want:
            raise _refuse(key, mc.get(key), why, f"only {key}: {want} imports")
    if get("pre_seq_len", None):
        raise _refuse("pre_seq_len", mc["pre_seq_len"], "(P-Tuning v2 prefixes) is not supported",
                      "train without prefixes (pre_seq_len: None)")
    heads = int(get("num_attention_heads", 32))
    hidden = int(get("hidden_size", 4096))
    head_dim = int(get("kv_channels", hidden // heads))
    kv = int(get("multi_query_group_num", 2)) if bool(get("multi_query_attention", True)) else heads
    vocab = int(get("padded_vocab_size", get("vocab_size", 65024)))
    eos = get("eos_token_id", 2)
    kw = {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": int(get("ffn_hidden_size", 13696)),
          "num_hidden_layers": int(get("num_layers", 28)), "num_attention_heads": heads,
          "num_key_value_heads": kv, "head_dim": head_dim, "partial_rotary_factor": 0.5,
          "rms_norm_eps": float(get("layernorm_epsilon", 1e-5)), "attention_bias": bool(get("add_qkv_bias", True)),
          "attention_dropout": float(get("attention_dropout", 0.0)),
          "rope_theta": 10000.0 * float(get("rope_ratio", 1)),
          "max_position_embeddings": int(get("seq_length", 2048)), "hidden_act": "silu",
          "pad_token_id": get("pad_token_id", 0), "eos_token_id": list(eos) if isinstance(eos, (list, tuple)) else eos,
          "tie_word_embeddings": False}
    return "glm", kw


class Glm4MoeFamily(MoEFamily):
    """HF glm4_moe (GLM-4.5): the attention of the Llama family (q/k/v with biases, partial RoPE, optional q/k
    norms), dense MLPs on the first `first_k_dense_replace` layers, then DeepSeek-V3's MoE block: sigmoid router
    `mlp.gate` with e_score_correction_bias, group-limited top-k and routed_scaling_factor, fused routed `experts`
    (over ep) and `shared_experts` (replicated over tp, on the SP slice) — the MoE family's plan and routing."""

    architectures = ("Glm4MoeForCausalLM",)
    model_types = ("glm4_moe",)
    router_score = "sigmoid"  # MindFormers' aux loss probabilities for a sigmoid router (as DeepSeek-V3)
    mindformers_names = {**MoEFamily.mindformers_names, **{
        k: v for k, v in GlmFamily.mindformers_names.items() if k.startswith("self_attn")},
        "mlp.shared_experts": ["mlp.shared_experts"]}

    def moe_layers(self, config: Any) -> list[int]:
        if not self.num_experts(config):
            return []
        return list(range(config.first_k_dense_replace or 0, config.num_hidden_layers))

    def mindformers_weights(self, config: Any, *, legacy: bool, qkv_interleaved: bool = True,
                            fc1_interleaved: bool = True) -> list[WeightOp]:
        """mindformers 2.1.0 models/glm4_moe/utils.py weight_mapping (Glm4MoePreTrainedModel, applied name by name
        by parallel_core/utils/model_mixin.py convert_name): HF's own layout under mcore names, q/k/v and gate/up
        split, one set of gating / hidden / linear_fc2 per routed expert (transformers 5 fuses them in
        experts.gate_up_proj [E, 2I, H] = [gate; up] per expert and experts.down_proj [E, H, I])."""
        if legacy:
            raise ValueError("glm4_moe: MindFormers has only the 2.x mcore names for GLM-4.5 (use_legacy: false)")
        if getattr(config, "use_qk_norm", False):
            raise ValueError("glm4_moe with use_qk_norm: true: mindformers 2.1.0's glm4_moe weight_mapping has no "
                             "q_norm / k_norm names; only use_qk_norm: false (GLM-4.5, GLM-4.5-Air) converts")
        return _mcore_glm4_moe_ops(self.num_experts(config))

    def base_tp_plan(self, config: Any, tp: int) -> dict[str, str]:
        plan = super().base_tp_plan(config, tp)
        if getattr(config, "use_qk_norm", False):  # per-head norms: every rank's heads use the same weights
            plan.update({"layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
                         "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce"})
        return plan


@dataclass(frozen=True)
class _PerExpert(WeightOp):
    """MindFormers' per-expert tensors (experts.E.gating ..., one name per expert and part) <-> one HF fused expert
    tensor: the experts stacked (dim 0), the parts ([gate; up]) joined along dim 1."""

    def to_hf(self, ts, cfg):
        parts = len(ts) // _experts(cfg)
        return [torch.cat([torch.stack(ts[i::parts]) for i in range(parts)], dim=1)]

    def to_mf(self, ts, cfg):
        parts = len(self.mf) // _experts(cfg)
        chunks = torch.chunk(ts[0], parts, dim=1)
        return [chunks[i][e].contiguous() for e in range(_experts(cfg)) for i in range(parts)]


def _experts(cfg) -> int:
    return int(cfg.n_routed_experts)


def _mcore_glm4_moe_ops(experts: int) -> list[WeightOp]:
    mf, hf = "decoder.layers.{L}.", _HF
    ops = [*MCORE_TOP,
           Rename(mf + "input_layernorm.weight", hf + "input_layernorm.weight"),
           Rename(mf + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight"),
           Rename(mf + "self_attention.linear_proj.weight", hf + "self_attn.o_proj.weight"),
           Rename(mf + "mlp.router.weight", hf + "mlp.gate.weight"),
           Rename(mf + "mlp.router.expert_bias", hf + "mlp.gate.e_score_correction_bias")]
    ops += [Rename(f"{mf}self_attention.linear_{x}.{kind}", f"{hf}self_attn.{x}_proj.{kind}")
            for x in "qkv" for kind in ("weight", "bias")]
    for part, hf_part in (("gating", "gate_proj"), ("hidden", "up_proj"), ("linear_fc2", "down_proj")):
        ops += [Rename(f"{mf}mlp.{part}.weight", f"{hf}mlp.{hf_part}.weight"),
                Rename(f"{mf}mlp.shared_experts.{part}.weight", f"{hf}mlp.shared_experts.{hf_part}.weight")]
    ops += [_PerExpert(tuple(f"{mf}mlp.experts.{e}.{part}.weight" for e in range(experts)
                             for part in ("gating", "hidden")), (hf + "mlp.experts.gate_up_proj",)),
            _PerExpert(tuple(f"{mf}mlp.experts.{e}.linear_fc2.weight" for e in range(experts)),
                       (hf + "mlp.experts.down_proj",))]
    return ops
