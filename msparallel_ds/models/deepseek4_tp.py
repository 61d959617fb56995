"""Tensor (+ sequence, vocab) parallel plan for DeepSeek-V4 (HF DeepseekV4ForCausalLM; models/deepseek4.py).

Split by heads (exact: every head's attention is independent, and the output projection sums over heads):
    q_b_proj   column-parallel (its input, q_a_norm's output, is replicated: style colwise_gathered)
    sinks      one per head: split with the heads (the attention block's own parameter, style *_heads)
    o_a_proj   the grouped low-rank output projection: its o_groups groups are consecutive heads, so rank r keeps
               groups r*g/tp .. (r+1)*g/tp - 1 (style colwise_grouped; tp must divide o_groups)
    o_b_proj   row-parallel (input = the local groups' outputs): all-reduce, or reduce-scatter under SP
Replicated, every tp rank computing them in full (their grads are partial, each rank's heads using them, so summed
over tp; the block's input is copied / gathered once, whose backward sums the input grads):
    q_a_proj, q_a_norm      the query down projection (a latent all heads read; MLA's rule, models/deepseek.py)
    kv_proj, kv_norm        the one key=value head all query heads share (MQA): nothing per head to split
    compressor (kv_proj, gate_proj, kv_norm, position_bias)  one compressed kv head concatenated onto every head's
                            kv axis, as the sliding kv is
Replicated without a grad sum: the lightning indexer (compressor.indexer: its own compressor, q_b_proj over
index_n_heads, weights_proj). It picks the top-k compressed entries from a sum over its heads; split over tp, that
sum would need an all-reduce and a rounding difference could flip a pick, so every rank runs it whole on the same
(gathered) input and gets the same picks. No loss reaches it (its picks are indices), so it has no grad to sum.
(The indexer KL loss, MindFormers' dsa_indexer_loss_coeff, is refused with tp > 1 (models/deepseek4_indexer.py): its
target, the attention probabilities summed over all heads, would need an all-reduce over tp first.)
MindFormers 2.1's pynative DeepSeek-V4 (base_models/gpt/parallelize.py _dsv4_attention_layer_plan) splits only
q-up and gathers q back, running the whole CSA replicated, because its fused indexer-KL loss sums attention
probabilities over all heads before normalising; without that loss the head split here is exact.

MoE (every V4 layer): the MoE family's (models/moe.py) and MindFormers': each tp rank routes its own sequence
slice (without SP the block cuts it and gathers its output); the router and the shared experts are replicated on
that slice (grads summed over tp), the routed experts go over ep (Megatron / MindFormers fold tp into ep), and the
block's `input_ids` keyword is cut to the slice too, for the hash routers (MindFormers: ShardTensor(1) on it).
Hyper-connections (attn_hc, ffn_hc, hc_head) act on the whole hidden of every stream: replicated, run on the full
sequence without SP (identical full grads, nothing to sum) and on the sequence slice with SP (grads summed, like
the norms; MindFormers: SequenceParallel on attn_hc / ffn_hc). Vocab parallel: embedding and head as Llama's.
"""
from __future__ import annotations

from typing import Any

__all__ = ["v4_heads", "v4_set_local_heads", "v4_tp_plan"]

_REPLICATED_ATTN = ("q_a_proj", "q_a_norm", "kv_proj", "kv_norm", "compressor", "compressor.kv_proj",
                    "compressor.gate_proj", "compressor.kv_norm")
_MOE_REPLICATED = ("gate", "shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj")
_SP_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "attn_hc", "ffn_hc")


def v4_heads(config: Any, tp: int) -> tuple[int, int, bool]:
    """(query heads, kv heads = 1, kv replicated) or an error naming the numbers and the key to change."""
    h, groups = config.num_attention_heads, config.o_groups
    for key, n, what in (("num_attention_heads", h, "the heads"), ("o_groups", groups, "the output projection's "
                                                                           "head groups")):
        if n % tp:
            raise ValueError(f"DeepSeek-V4: model.{key}={n} is not divisible by the tensor-parallel size tp={tp} "
                             f"(parallelism.tensor_parallel / parallel_config.model_parallel): {what} are split over "
                             f"tp; pick a tensor_parallel that divides {n}")
    return h, 1, True


def v4_tp_plan(prefix: str, moe_layers: list[int], *, sequence_parallel: bool, vocab_parallel: bool) -> dict:
    """Module pattern -> style (tensor_parallel/apply.py); the first match wins."""
    layers = f"{prefix}.layers"
    attn = f"{layers}.*.self_attn"
    plan = {attn: "sequence_gather_input_heads" if sequence_parallel else "copy_input_heads"}
    plan.update({f"{attn}.{name}": "replicated_with_grad_allreduce" for name in _REPLICATED_ATTN})
    plan.update({f"{attn}.q_b_proj": "colwise_gathered", f"{attn}.o_a_proj": "colwise_grouped",
                 f"{attn}.o_b_proj": "rowwise"})
    block, inner = ("sequence_parallel_block", "sequence_parallel") if sequence_parallel else \
        ("token_slice_block", "replicated_with_grad_allreduce")
    for i in moe_layers:
        plan[f"{layers}.{i}.mlp"] = block
        plan.update({f"{layers}.{i}.mlp.{name}": inner for name in _MOE_REPLICATED})
    if sequence_parallel:
        plan.update({f"{layers}.*.{name}": "sequence_parallel" for name in _SP_LAYER_PARTS})
        plan[f"{layers}.0"] = "sequence_scatter_input"
        plan[f"{prefix}.hc_head"] = "sequence_parallel"
        plan[f"{prefix}.norm"] = "sequence_parallel"
        if not vocab_parallel:  # a vocab-parallel head gathers by itself (backward reduce-scatter)
            plan["lm_head"] = "sequence_gather_input_replicated"
    if vocab_parallel:
        plan[f"{prefix}.embed_tokens"] = "vocab_embedding"
        plan["lm_head"] = "vocab_lm_head"
    return plan


def v4_set_local_heads(layers, config: Any, tp: int) -> None:
    """This rank's head count on each attention (eager attention broadcasts the one kv head to num_key_value_groups
    query heads and reads the local sinks)."""
    local = config.num_attention_heads // tp
    for layer in layers:
        layer.self_attn.num_heads = local
        layer.self_attn.num_key_value_groups = local
