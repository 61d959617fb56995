"""The DeepSeek-V3 family (HF DeepseekV3ForCausalLM): Multi-head Latent Attention (MLA) + DeepSeek's MoE.

    attention = q_a_proj -> q_a_layernorm -> q_b_proj (or q_proj without q_lora_rank)  ->  heads [nope | rope]
                kv_a_proj_with_mqa -> [kv latent -> kv_a_layernorm -> kv_b_proj -> heads [k_nope | v] | k_rope]
                RoPE on the rope parts (k_rope is one head shared by all) -> attention -> o_proj
    mlp       = the first `first_k_dense_replace` layers dense (gate/up/down); then a MoE block: sigmoid router
                `mlp.gate` (e_score_correction_bias, group-limited top-k, routed_scaling_factor), routed `experts`
                and `shared_experts`

Tensor parallel (HF's own plan covers only the MLP, so the attention part is written here; Megatron-Core's MLA
split): heads go over tp: q_b_proj / q_proj / kv_b_proj column-parallel, o_proj row-parallel. The down
projections and their norms (q_a_proj, kv_a_proj_with_mqa, q_a_layernorm, kv_a_layernorm) are replicated: every tp
rank computes them on the whole sequence, and since the rank's heads see only part of each latent's use, their
gradients are partial, summed over tp. The attention block takes its input once for all of them: sequence
parallel all-gathers it (backward reduce-scatter); without SP it is copied (backward all-reduce) — that one
collective also sums the partial input gradients, so the up projections do no input collective of their own
(style colwise_gathered). The MoE block is the MoE family's (models/moe.py).
"""
from __future__ import annotations

from typing import Any

from ..checkpoint.weight_map import ConcatSized, Experts, FusedGateUp, Rename, State, WeightOp, at
from .base import MCORE_TOP
from .moe import MoEFamily

__all__ = ["DeepseekV3Family"]

_REPLICATED_ATTN = ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")
_SPLIT_ATTN = ("q_proj", "q_b_proj", "kv_b_proj")
_MTP_PARTS = ("enorm", "hnorm", "eh_proj", "shared_head.norm")


class DeepseekV3Family(MoEFamily):
    architectures = ("DeepseekV3ForCausalLM",)
    model_types = ("deepseek_v3",)
    mindformers_mtp = True
    router_score = "sigmoid"  # the aux loss's probabilities: sigmoid scores normalised over the experts
    mindformers_names = {  # + MindFormers' MLA cell names (legacy deepseek3 / mcore MultiLatentAttention)
        **MoEFamily.mindformers_names,
        "self_attn.q_a_proj": ["attention.q2l_proj", "self_attention.linear_q_down_proj"],
        "self_attn.q_a_layernorm": ["attention.lq_norm", "self_attention.q_layernorm"],
        "self_attn.q_b_proj": ["attention.l2q_proj", "self_attention.linear_q_up_proj"],
        "self_attn.q_proj": ["attention.q_proj", "self_attention.linear_q_proj"],
        "self_attn.kv_a_proj_with_mqa": ["attention.kv2l", "self_attention.linear_kv_down_proj"],
        "self_attn.kv_a_layernorm": ["attention.lkv_norm", "self_attention.kv_layernorm"],
        "self_attn.kv_b_proj": ["attention.lkv2kv", "self_attention.linear_kv_up_proj"],
        "self_attn.o_proj": ["attention.wo", "self_attention.linear_proj"],
        "mlp.shared_experts": ["feed_forward.shared_experts", "mlp.shared_experts"],
    }

    def mindformers_weights(self, config: Any, *, legacy: bool, qkv_interleaved: bool = True,
                            fc1_interleaved: bool = True) -> list[WeightOp]:
        """MindFormers 2.1 mcore names (TrainingDeepseekV3ForCausalLM: GPTModel with MLA, grouped-gemm MoE and an
        MTP block; names and shapes read off the instantiated cell, tests/fixtures/mindspore/make_moe_fixtures.py)."""
        if legacy:
            raise ValueError("deepseek_v3: the legacy (use_legacy: true, DeepseekV3Config of research/deepseek3) "
                             "MindFormers names are not mapped; import with a 2.x mcore YAML (use_legacy: false)")
        return mcore_deepseek_ops(config, fc1_interleaved)

    def moe_layers(self, config: Any) -> list[int]:
        """MoE layers from first_k_dense_replace on, MTP layers (models.mtp: after the decoder's) included."""
        if not self.num_experts(config):
            return []
        mtp = getattr(config, "num_nextn_predict_layers", 0) or 0
        return list(range(config.first_k_dense_replace or 0, config.num_hidden_layers + mtp))

    def tp_plan(self, config: Any, tp: int, *, sequence_parallel: bool = False,
                vocab_parallel: bool = False) -> dict[str, str]:
        plan = super().tp_plan(config, tp, sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel)
        attn = f"{self.prefix}.layers.*.self_attn"
        mla = {attn: "sequence_gather_input" if sequence_parallel else "copy_input"}
        mla.update({f"{attn}.{name}": "replicated_with_grad_allreduce" for name in _REPLICATED_ATTN})
        mla.update({f"{attn}.{name}": "colwise_gathered" for name in _SPLIT_ATTN})
        mla[f"{attn}.o_proj"] = "rowwise"
        if sequence_parallel:  # MTP layers' own parts run on the sequence slice, like the norms (models.mtp)
            mla.update({f"{self.prefix}.layers.*.{name}": "sequence_parallel" for name in _MTP_PARTS})
        return {**mla, **{p: s for p, s in plan.items() if p not in mla}}


_MF, _HF = "decoder.layers.{L}.", "model.layers.{L}."


def _mla_down_sizes(cfg: Any) -> list[int]:
    q = cfg.q_lora_rank or cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    return [q, cfg.kv_lora_rank + cfg.qk_rope_head_dim]


def _layer_ops(config: Any, fc1_interleaved: bool) -> list[WeightOp]:
    """One decoder layer. MLA (multi_latent_attention.py: MLASelfAttention, and with mla_qkv_concat, default True,
    its fused form: linear_qkv = [q_down | kv_down] rows, :390-393, split at :533-541; q heads [nope | rope] and
    kv_up heads [k_nope | v] as HF's). Dense MLP / shared experts: linear_fc1 = gate|up, interleaved row by row while
    use_interleaved_weight_layout_mlp (moe_module_specs.py:40, gpt_layer_specs.py:46). Routed experts: GroupedMLP
    weight1/weight2 (moe/ffn.py:79-86, swiglu halves per expert). Router: weight, expert_bias (HF
    e_score_correction_bias); its expert_load / fi_accu counters are training state."""
    a, attn = _MF + "self_attention.", _HF + "self_attn."
    split, fused = False, True
    q_down = "q_a_proj" if config.q_lora_rank else "q_proj"  # no q_lora_rank: one q projection, no q norm
    ops = [Rename(_MF + "input_layernorm.weight", _HF + "input_layernorm.weight"),
           Rename(_MF + "pre_mlp_layernorm.weight", _HF + "post_attention_layernorm.weight"),
           Rename(a + "linear_proj.weight", attn + "o_proj.weight"),
           Rename(a + "q_layernorm.weight", attn + "q_a_layernorm.weight"),
           WeightOp((a + "linear_q_down_proj.weight",), (attn + "q_a_proj.weight",), split),
           WeightOp((a + "linear_q_up_proj.weight",), (attn + "q_b_proj.weight",), split),
           WeightOp((a + "linear_q_proj.weight",), (attn + "q_proj.weight",), split),
           WeightOp((a + "linear_kv_down_proj.weight",), (attn + "kv_a_proj_with_mqa.weight",), split),
           WeightOp((a + "kv_layernorm.weight",), (attn + "kv_a_layernorm.weight",), split),
           WeightOp((a + "linear_kv_up_proj.weight",), (attn + "kv_b_proj.weight",), split),
           ConcatSized((a + "linear_qkv.weight",), (attn + f"{q_down}.weight", attn + "kv_a_proj_with_mqa.weight"),
                       fused, _mla_down_sizes),
           WeightOp((a + "linear_qb.weight",), (attn + "q_b_proj.weight",), fused),
           WeightOp((a + "k_layernorm.weight",), (attn + "kv_a_layernorm.weight",), fused),
           WeightOp((a + "linear_kvb.weight",), (attn + "kv_b_proj.weight",), fused)]
    for mlp, hf in (("mlp.", "mlp."), ("mlp.shared_experts.", "mlp.shared_experts.")):
        ops += [FusedGateUp((_MF + mlp + "linear_fc1.weight",),
                            (_HF + hf + "gate_proj.weight", _HF + hf + "up_proj.weight"), None, fc1_interleaved),
                Rename(_MF + mlp + "linear_fc2.weight", _HF + hf + "down_proj.weight")]
    return ops + [Rename(_MF + "mlp.router.weight", _HF + "mlp.gate.weight"),
                  Rename(_MF + "mlp.router.expert_bias", _HF + "mlp.gate.e_score_correction_bias"),
                  State(_MF + "mlp.router.expert_load"), State(_MF + "mlp.router.fi_accu"),
                  Experts((_MF + "mlp.experts.weight1",), (_HF + "mlp.experts.gate_up_proj",)),
                  Experts((_MF + "mlp.experts.weight2",), (_HF + "mlp.experts.down_proj",))]


def mcore_deepseek_ops(config: Any, fc1_interleaved: bool) -> list[WeightOp]:
    """The whole model: embedding, decoder layers, final norm, head, and per MTP depth k (multi_token_prediction.py:
    mtp.layers.k.{enorm, hnorm, eh_proj, transformer_layer, final_layernorm}; the embedding and output layer are the
    model's) the HF layer N + k that models/mtp.py holds (shared_head.norm = its final_layernorm). MTP ops come first:
    an HF layer N + k must not also match the decoder layers' patterns."""
    layer = _layer_ops(config, fc1_interleaved)
    n = config.num_hidden_layers
    mtp: list[WeightOp] = []
    for k in range(getattr(config, "num_nextn_predict_layers", 0) or 0):
        mf, hf = f"mtp.layers.{k}.", f"model.layers.{n + k}."
        mtp += [Rename(mf + "enorm.weight", hf + "enorm.weight"), Rename(mf + "hnorm.weight", hf + "hnorm.weight"),
                Rename(mf + "eh_proj.weight", hf + "eh_proj.weight"),
                Rename(mf + "final_layernorm.weight", hf + "shared_head.norm.weight")]
        mtp += [at(op, mf + "transformer_layer.", hf) for op in layer]
    return mtp + layer + list(MCORE_TOP)
