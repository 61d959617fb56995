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

from .moe import MoEFamily

__all__ = ["DeepseekV3Family"]

_REPLICATED_ATTN = ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")
_SPLIT_ATTN = ("q_proj", "q_b_proj", "kv_b_proj")
_MTP_PARTS = ("enorm", "hnorm", "eh_proj", "shared_head.norm")


class DeepseekV3Family(MoEFamily):
    architectures = ("DeepseekV3ForCausalLM",)
    model_types = ("deepseek_v3",)
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
