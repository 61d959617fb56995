"""MindFormers 2.1 DeepSeek-V4 weight names <-> HF DeepseekV4ForCausalLM (and the YAML keys of its pynative model).

The names are those of the instantiated 2.1 cell (PyNativeDeepseekV4ForCausalLM: GPTModel with the dsv4_hybrid
attention, hyper-connections, MoE with hash / top-k routers, MTP; tests/fixtures/mindspore/make_v4_fixture.py
builds it and fills it through the model's own weight_converters, models/deepseek4/utils.py). The HF side is
transformers' conversion_mapping "deepseek_v4" applied to the same DeepSeek native names, so each op below is the
composition of the two published converters:

    MindFormers (decoder.layers.{L}.)            DeepSeek native (layers.{L}.)    HF (model.layers.{L}.)
    self_attention.linear_q_down_proj / q_layernorm / linear_q_up_proj      self_attn.q_a_proj / q_a_norm / q_b_proj
    self_attention.linear_kv_proj / kv_layernorm                            self_attn.kv_proj / kv_norm
    self_attention.linear_o_group_proj (no .weight) / linear_proj           self_attn.o_a_proj / o_b_proj
    self_attention.core_attention.attn_sink                                 self_attn.sinks
    ...core_attention.compressor.{ape, linear_wkv, linear_wgate, norm}      self_attn.compressor.{position_bias,
                                                                                kv_proj, gate_proj, kv_norm}
    ...core_attention.indexer.{linear_wq_b, linear_weights_proj}            ...compressor.indexer.{q_b_proj,
                                                                                scorer.weights_proj}
    ...core_attention.indexer.compressor.*                                  ...compressor.indexer.* (as above)
    mlp.router.weight / mlp.expert_bias / mlp.router.tid2eid (int32)        mlp.gate.weight / e_score_correction_bias
                                                                                / tid2eid (int64)
    mlp.experts.weight1 [E, H, 2I] (per expert [gate | up] halves)          mlp.experts.gate_up_proj [E, 2I, H]
    mlp.experts.weight2 [E, I, H]                                           mlp.experts.down_proj [E, H, I]
    mlp.shared_experts.linear_fc1 (gate / up rows interleaved: the pynative MLP always reads it so) / linear_fc2
    attn_hc / ffn_hc: mapping_proj.weight, bias, alpha_pre | alpha_post | alpha_res ([1] each)   attn_hc.fn, base,
                                                                                scale [3]
    decoder.hc_head.{hc_fn.weight, hc_base, hc_scale}, decoder.final_layernorm, embedding, output_layer

Cell tensors HF has no place for: mlp.tokens_per_expert (the expert-bias token counter, training state: dropped on
import, written as zeros on export), attn_hc / ffn_hc.rms_weight (the hyper-connection RMSNorm's gamma, frozen at 1:
HF's norm has none; import refuses any other value, export writes ones) and self_attention.q_rms_gamma (frozen at 1
and unused by the forward: dropped, written as ones). MindFormers' own converter leaves those three out, so import
takes checkpoints with or without them. Routed experts are also taken in the converter's 2-D [E*H, 2I] / [E*I, H].

MTP (mtp.layers.{k}.: enorm, hnorm, eh_proj = [e_proj | h_proj] columns, final_layernorm, hc_head, transformer_layer
without a compressor) maps to the HF layer N + k that models/mtp.py holds (shared_head.norm = final_layernorm,
hc_head kept; models/deepseek4_mtp.py builds that layer); a checkpoint's mtp.* tensors under a YAML without MTP
are refused as names the map does not know (nothing is dropped).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from ..checkpoint.weight_map import Frozen, FusedGateUp, Joined, Rename, State, WeightOp, WithConstants, at

__all__ = ["hf_config_keys", "mindformers_v4_ops"]

_MF, _HF = "decoder.layers.{L}.", "model.layers.{L}."
_NO_GAMMA = "HF DeepseekV4ForCausalLM's hyper-connection RMSNorm has no weight (MindFormers freezes this one at 1)"

# MindFormers 2.1 pynative YAML keys -> HF DeepseekV4Config fields (config_converter_deepseek_v4.py CONFIG_MAPPING)
# (not mhc_layernorm_epsilon: MindFormers' hyper-connection RMSNorm eps, where HF uses rms_norm_eps there)
_ALIASES = {"csa_window_size": "sliding_window", "num_residual_streams": "hc_mult",
            "mhc_sinkhorn_iterations": "hc_sinkhorn_iters", "activation_func_clamp_value": "swiglu_limit",
            "csa_compress_rotary_base": "compress_rope_theta", "moe_router_score_function": "scoring_func"}
# keys HF's DeepseekV4Config folds in itself (its legacy kwargs: per-layer compress_ratios 0 / 4 / 128 ->
# layer_types, num_hash_layers -> mlp_layer_types, qk_rope_head_dim -> partial_rotary_factor)
_FOLDED = ("compress_ratios", "num_hash_layers", "qk_rope_head_dim")


def hf_config_keys(mc: Mapping) -> dict:
    """HF config kwargs a MindFormers 2.1 deepseek4 `model:` section gives beyond HF's own field names."""
    if mc.get("csa_dense_mode"):  # csa.py:608: no indexer, every compressed entry attended; HF always builds one
        raise ValueError(f"model.csa_dense_mode={mc['csa_dense_mode']!r} is not supported: MindFormers 2.1's dense "
                         "mode drops the lightning indexer of the compressed sparse attention (ratio 4) layers and "
                         "attends to every compressed entry, while HF's DeepseekV4 always selects index_topk of them "
                         "through its indexer; set it to false (as every MindFormers 2.1 deepseek4 YAML does)")
    kw = {hf: mc[mf] for mf, hf in _ALIASES.items() if mc.get(mf) is not None and mc.get(hf) is None}
    kw.update({k: mc[k] for k in _FOLDED if mc.get(k) is not None})
    if mc.get("head_dim") is None and mc.get("v_head_dim"):  # one shared kv head of v_head_dim = qk_nope + rope
        kw["head_dim"] = mc["v_head_dim"]
    kw["rope_parameters"] = _rope(mc, kw.get("head_dim") or mc.get("head_dim"))
    ratios = kw.get("compress_ratios")
    if ratios is not None:
        n = mc.get("num_hidden_layers")
        bad = [r for r in ratios if r not in (0, 4, 128)]
        if bad or not isinstance(n, int) or len(ratios) < n:
            raise ValueError(f"model.compress_ratios={ratios}: MindFormers 2.1 takes one of 0 (sliding), 4 (compressed "
                             "sparse attention) or 128 (heavily compressed) per layer, num_hidden_layers "
                             f"({n}) of them plus one per MTP layer; write it so")
    return kw


def _rope(mc: Mapping, head_dim) -> Optional[dict]:
    """V4's two RoPE tables as MindFormers 2.1 builds them (deepseek_v4_hybrid_attention.py _build_rotary_pos_emb):
    sliding layers plain RoPE at rope_theta; compressed layers (ratio > 1) always YaRN at compress_rope_theta with
    rotary_scaling_factor, original_max_position_embeddings, beta_fast / beta_slow (TransformerConfig defaults 40,
    4096, 32, 1 when the YAML leaves them out) and no magnitude scaling (the attention passes mscale 1.0)."""
    rope = mc.get("qk_rope_head_dim")
    if not rope or not head_dim:
        return None
    partial = rope / head_dim
    theta = mc.get("rope_theta", mc.get("rotary_base", 10000.0))
    compress = {"rope_type": "yarn", "rope_theta": float(mc.get("compress_rope_theta", 160000)),
                "factor": float(mc.get("rotary_scaling_factor", 40.0)),
                "original_max_position_embeddings": int(mc.get("original_max_position_embeddings", 4096)),
                "beta_fast": float(mc.get("beta_fast", 32.0)), "beta_slow": float(mc.get("beta_slow", 1.0)),
                "attention_factor": 1.0, "partial_rotary_factor": partial}
    return {"main": {"rope_type": "default", "rope_theta": float(theta), "partial_rotary_factor": partial},
            "compress": compress}


@dataclass(frozen=True)
class StackedExperts(WeightOp):
    """Routed experts: MindFormers' [E, H, 2I] / [E, I, H] (or its converter's 2-D [E*H, 2I] / [E*I, H]) <-> HF's
    [E, 2I, H] / [E, H, I]: the same per-expert blocks transposed."""

    def to_hf(self, ts, cfg):
        (w,) = ts
        return [w.reshape(cfg.n_routed_experts, -1, w.shape[-1]).transpose(1, 2).contiguous()]

    def to_mf(self, ts, cfg):
        return [ts[0].transpose(1, 2).contiguous()]


@dataclass(frozen=True)
class IndexTable(WeightOp):
    """The hash router's token -> experts table: int32 in MindFormers, int64 (long) in HF."""

    def to_hf(self, ts, cfg):
        return [ts[0].to(torch.int64)]

    def to_mf(self, ts, cfg):
        return [ts[0].to(torch.int32)]


def _hc(mf: str, hf: str) -> list[WeightOp]:
    """One hyper-connection (attn_hc / ffn_hc): ScaleSplitConvertOp splits HF's scale [3] into alpha_pre / _post /
    _res."""
    alphas = tuple(f"{mf}alpha_{k}" for k in ("pre", "post", "res"))
    ones = WithConstants((mf + "mapping_proj.weight", mf + "rms_weight"), (hf + "fn",), None,
                         lambda t, cfg: [t.new_ones(t.shape[1])])
    return [ones, Rename(mf + "mapping_proj.weight", hf + "fn"), Frozen((mf + "rms_weight",), (), None, 1.0, _NO_GAMMA),
            Rename(mf + "bias", hf + "base"), Joined(alphas, (hf + "scale",), None, 0)]


def _compressor(mf: str, hf: str) -> list[WeightOp]:
    return [Rename(mf + "ape", hf + "position_bias"), Rename(mf + "linear_wkv.weight", hf + "kv_proj.weight"),
            Rename(mf + "linear_wgate.weight", hf + "gate_proj.weight"), Rename(mf + "norm.weight", hf + "kv_norm.weight")]


def _layer_ops() -> list[WeightOp]:
    a, attn = _MF + "self_attention.", _HF + "self_attn."
    core, comp = a + "core_attention.", attn + "compressor."
    m, mlp = _MF + "mlp.", _HF + "mlp."
    counters = WithConstants((m + "router.weight", m + "tokens_per_expert"), (mlp + "gate.weight",), None,
                             lambda t, cfg: [t.new_zeros(t.shape[0])])
    gamma = WithConstants((a + "linear_q_up_proj.weight", a + "q_rms_gamma"), (attn + "q_b_proj.weight",), None,
                          lambda t, cfg: [t.new_ones(cfg.head_dim)])
    return [Rename(_MF + "input_layernorm.weight", _HF + "input_layernorm.weight"),
            Rename(_MF + "pre_mlp_layernorm.weight", _HF + "post_attention_layernorm.weight"),
            Rename(a + "linear_q_down_proj.weight", attn + "q_a_proj.weight"),
            Rename(a + "q_layernorm.weight", attn + "q_a_norm.weight"),
            gamma, Rename(a + "linear_q_up_proj.weight", attn + "q_b_proj.weight"),
            Frozen((a + "q_rms_gamma",), (), None, None),
            Rename(a + "linear_kv_proj.weight", attn + "kv_proj.weight"),
            Rename(a + "kv_layernorm.weight", attn + "kv_norm.weight"),
            Rename(a + "linear_o_group_proj", attn + "o_a_proj.weight"),
            Rename(a + "linear_proj.weight", attn + "o_b_proj.weight"),
            Rename(core + "attn_sink", attn + "sinks"),
            *_compressor(core + "compressor.", comp),
            *_compressor(core + "indexer.compressor.", comp + "indexer."),
            Rename(core + "indexer.linear_wq_b.weight", comp + "indexer.q_b_proj.weight"),
            Rename(core + "indexer.linear_weights_proj.weight", comp + "indexer.scorer.weights_proj.weight"),
            counters, Rename(m + "router.weight", mlp + "gate.weight"), State(m + "tokens_per_expert"),
            Rename(m + "expert_bias", mlp + "gate.e_score_correction_bias"),
            IndexTable((m + "router.tid2eid",), (mlp + "gate.tid2eid",)),
            StackedExperts((m + "experts.weight1",), (mlp + "experts.gate_up_proj",)),
            StackedExperts((m + "experts.weight2",), (mlp + "experts.down_proj",)),
            FusedGateUp((m + "shared_experts.linear_fc1.weight",),
                        (mlp + "shared_experts.gate_proj.weight", mlp + "shared_experts.up_proj.weight"), None, True),
            Rename(m + "shared_experts.linear_fc2.weight", mlp + "shared_experts.down_proj.weight"),
            *_hc(_MF + "attn_hc.", _HF + "attn_hc."), *_hc(_MF + "ffn_hc.", _HF + "ffn_hc.")]


def _head(mf: str, hf: str) -> list[WeightOp]:
    return [Rename(mf + "hc_fn.weight", hf + "hc_fn"), Rename(mf + "hc_base", hf + "hc_base"),
            Rename(mf + "hc_scale", hf + "hc_scale")]


def mindformers_v4_ops(config: Any, mtp_depth: int = 0) -> list[WeightOp]:
    """The whole model's ops (module docstring); MTP depth k's ops (HF layer N + k) first, as DeepSeek-V3's: an HF
    layer N + k must not also match the decoder layers' patterns."""
    layer, n = _layer_ops(), config.num_hidden_layers
    mtp: list[WeightOp] = []
    for k in range(mtp_depth):
        mf, hf = f"mtp.layers.{k}.", f"model.layers.{n + k}."
        mtp += [Rename(mf + "enorm.weight", hf + "enorm.weight"), Rename(mf + "hnorm.weight", hf + "hnorm.weight"),
                Rename(mf + "eh_proj.weight", hf + "eh_proj.weight"),
                Rename(mf + "final_layernorm.weight", hf + "shared_head.norm.weight"),
                *_head(mf + "hc_head.", hf + "hc_head.")]
        mtp += [at(op, mf + "transformer_layer.", hf) for op in layer]
    return mtp + layer + _head("decoder.hc_head.", "model.hc_head.") + [
        Rename("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        Rename("decoder.final_layernorm.weight", "model.norm.weight"),
        Rename("output_layer.weight", "lm_head.weight")]
