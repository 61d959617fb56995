"""Multi-token prediction for DeepSeek-V4 (HF DeepseekV4ForCausalLM), as MindFormers 2.1's pynative MTP block computes
it (pynative/transformers/multi_token_prediction.py, "mtp.py" below; gpt_model.py; gpt_layer_specs.py).

Depth k = 1..D has one MTP layer, a V4 decoder block (hyper-connections attn_hc / ffn_hc, attention, MoE) plus
`enorm`, `hnorm`, `eh_proj` (2h -> h, no bias), its own `hc_head` and `shared_head.norm` (MindFormers'
final_layernorm); the word embedding and lm_head are the main model's:

    h_0 = the decoder's output after its hc_head and final norm (transformer_block.py:378-388, gpt_model.py:370-388)
    x   = eh_proj([enorm(embed(ids << 1)), hnorm(h_{k-1})])                       (mtp.py:397-402, 460)
    h_k = shared_head.norm(hc_head(layer_k(x copied into the hc_mult streams)))      (mtp.py:404-433)
    loss: models.mtp's, mtp_loss_scaling_factor / D x each depth's token mean against the labels shifted by k + 1
          (mtp.py:655-690: the labels roll once more per depth, the rolled-in tail masked)

Every depth embeds the ids shifted by ONE: MindFormers 2.1's block passes each layer the original input_ids and
drops the rolled ids the layer returns (mtp.py:605-616, `hidden_states, _, _ = layer(...)`), unlike Megatron and
its own graph-mode block (ids << k). With D = 1 (every deepseek4 YAML) both agree. The MTP layer's router is top-k,
never hash (moe/router.py:95-101, is_mtp_layer); its attention is the type of compress_ratios[num_layers + k]
(deepseek_v4_hybrid_attention.py:70-71): 0 in all four deepseek4 YAMLs, so a sliding-window layer (HF's config
keeps only num_hidden_layers layer types, so this entry is not in it). Its hc_head is a learned HyperConnectionHead
like the decoder's (gpt_layer_specs.py:246-260, enable_hc_head defaults to enable_hyper_connections).

The MTP layers sit after the decoder's in the base model's `layers` (models.mtp: names `model.layers.{N+k}.*`, so
ep, the aux loss, the expert bias, recompute and the pipeline's last stage reach them as decoder layers). HF's V4
decoder loop runs every entry of `layers`, so an MTP layer called without `mtp=True` returns its input unchanged.
"""
from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

__all__ = ["MTP_ATTENTION", "make_mtp_layer", "run_mtp_depths"]

MTP_ATTENTION = "sliding_attention"  # compress_ratios[num_layers + k] = 0 in every MindFormers 2.1 deepseek4 YAML


def _layer_class():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer

    class DeepseekV4MTPLayer(DeepseekV4DecoderLayer):
        """A V4 decoder block run only as an MTP depth (run_mtp_depths calls it with mtp=True); HF's decoder loop,
        which calls every entry of `layers`, gets its input back."""

        run_depths = staticmethod(run_mtp_depths)  # models.mtp.run_depths hands its depths over to it

        def __call__(self, hidden_states, *args, mtp: bool = False, **kwargs):
            if not mtp:
                return hidden_states
            return super().__call__(hidden_states, *args, **kwargs)

    return DeepseekV4MTPLayer


_CLASS = []


def make_mtp_layer(model: nn.Module, k: int) -> nn.Module:
    """MTP depth k + 1's layer for a DeepseekV4ForCausalLM: layer index N + k, a top-k router, MTP_ATTENTION, and
    enorm / hnorm / eh_proj / hc_head / shared_head.norm (models.mtp.add_mtp_layers seeds and initialises it)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead, DeepseekV4RMSNorm

    if not _CLASS:
        _CLASS.append(_layer_class())
    config = model.config
    n, h, eps = config.num_hidden_layers, config.hidden_size, config.rms_norm_eps
    own = copy.copy(config)  # the layer reads its types at index N + k: one more entry each, for this layer only
    own.layer_types = list(config.layer_types[:n]) + [MTP_ATTENTION] * (k + 1)
    own.mlp_layer_types = list(config.mlp_layer_types[:n]) + ["moe"] * (k + 1)
    layer = _CLASS[0](own, n + k)
    layer.enorm = DeepseekV4RMSNorm(h, eps=eps).to(dtype=torch.float32)  # norms kept in float32, as V4's own
    layer.hnorm = DeepseekV4RMSNorm(h, eps=eps).to(dtype=torch.float32)
    layer.eh_proj = nn.Linear(2 * h, h, bias=False)
    layer.hc_head = DeepseekV4HyperHead(config).to(dtype=torch.float32)
    layer.shared_head = nn.Module()
    layer.shared_head.norm = DeepseekV4RMSNorm(h, eps=eps).to(dtype=torch.float32)
    return layer


def run_mtp_depths(layers, embed: nn.Module, h: Tensor, ids: list[Tensor], ctx: dict) -> list[Tensor]:
    """h_1 .. h_D (module docstring) from the decoder's normed output h; `ids`: depth k's shifted ids (models.mtp),
    of which every depth embeds the first (ids << 1, as MindFormers 2.1); `ctx`: the decoder layers' keywords."""
    ctx = {k: v for k, v in ctx.items() if k not in ("input_ids", "cache", "past_key_values", "use_cache")}
    e = embed(ids[0])
    outs = []
    for layer in layers:
        x = layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(h)], dim=-1))
        x = x.unsqueeze(2).expand(-1, -1, layer.hc_head.hc_mult, -1).contiguous()
        h = layer.shared_head.norm(layer.hc_head(layer(x, mtp=True, **ctx)))
        outs.append(h)
    return outs
