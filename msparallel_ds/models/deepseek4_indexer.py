"""DeepSeek-V4's lightning-indexer loss (MindFormers 2.1 `dsa_indexer_loss_coeff`) on HF DeepseekV4ForCausalLM.

MindFormers 2.1 trains the indexer of each compressed-sparse-attention (CSA) layer with its own loss; nothing else
reaches it (the top-k choice has no gradient). Read from pynative/transformers/experimental_attention_variant
(csa.py CompressedSparseAttention._construct_naive, the unfused path the deepseek4 YAMLs run with
apply_dsa_kernel_fusion: False; indexer.py CSAIndexer.construct + UnfusedCSAIndexerLoss), per CSA layer and micro-batch:

    s        = the indexer's scores [B, S, T] over the T compressed entries, -inf where an entry is in the query's
               future (entry >= (position + 1) // ratio); top = top-k(s, min(index_topk, T)) (values and indices)
    A        = softmax over T of the main attention logits q k^T x scale (scale = head_dim^-0.5, in q's dtype; q the
               attention's query after its norm and RoPE, k the compressed kv, both stop-gradient: csa.py:794-795),
               every entry outside `top` or in the future set to bf16's min; no sink; summed over heads,
               L1-normalised over T
    t        = A at `top`;  p = softmax(top values, -inf -> bf16 min)
    loss     = coeff x mean over (B, S) of sum_k t_k (log max(t_k / (sum t + 1e-9), 1e-9) - log(p_k + 1e-9))

The indexer's inputs (hidden states and the q low-rank residual) are detached (csa.py:764-766), so the loss trains the
indexer only (q_b_proj, weights_proj, its compressor). Each layer's term joins the loss like the routers' aux loss
(`_IndexerLossAutoScaler` gets the same backward scale as `_MoEAuxLossAutoScaler`: pynative/trainer/utils.py:94-105):
summed over CSA layers, averaged over micro-batches and dp ranks; here through moe.aux_loss.AuxLossScaler with the
engine's aux scale, so pipeline stages and ZeRO need nothing more, and its value is part of engine.last_aux_loss
(MindFormers logs it apart, averaged over layers). `dsa_indexer_use_sparse_loss` changes nothing on this path
(UnfusedCSAIndexerLoss stores it unused; the dense warm-up freeze is DSA-only: gpt_model.py:286-291).

Hooks on HF's modules, no copy of their forward: the attention's pre-hook keeps the RoPE tables, q_b_norm's output is
the query before RoPE, the scorer's output the indexer scores, the indexer's pre-hook detaches its inputs, and the
compressor's output hook computes the term and attaches it to the compressed kv.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from ..moe.aux_loss import AuxLoss, AuxLossScaler

__all__ = ["indexer_kl", "install_indexer_loss"]

BF16_MIN = -3.3895313892515355e38  # indexer.py:49, MindSpeed's finite mask fill
EPS = 1.0e-9


def indexer_kl(scores: Tensor, threshold: Tensor, query: Tensor, kv: Tensor, scale: float, top_k: int) -> Tensor:
    """The KL term of one CSA layer before its coefficient (module docstring). scores [B, S, T] (differentiable),
    threshold [B or 1, S] = (position + 1) // ratio, query [B, H, S, D] and kv [B, T, D] (no gradient)."""
    t = scores.shape[-1]
    future = (torch.arange(t, device=scores.device) >= threshold.unsqueeze(-1)).expand_as(scores)  # [B, S, T]
    top_values, top = scores.masked_fill(future, float("-inf")).topk(min(top_k, t), dim=-1)
    logits = torch.matmul(query, kv.transpose(-1, -2).unsqueeze(1)) * scale  # the model dtype, as MindSpeed
    unselected = torch.ones_like(future).scatter(-1, top, False)
    logits = logits.masked_fill((future | unselected).unsqueeze(1), BF16_MIN)
    target = torch.softmax(logits.float(), dim=-1).sum(1)
    target = target / target.sum(-1, keepdim=True).clamp_min(1.0e-12)
    target = target.gather(-1, top)
    predicted = torch.softmax(torch.where(torch.isfinite(top_values), top_values, BF16_MIN).float(), dim=-1)
    normalized = target / (target.sum(-1, keepdim=True) + EPS)
    return ((torch.log(normalized.clamp_min(EPS)) - torch.log(predicted + EPS)) * target).sum(-1).mean()


class _CsaLayerLoss:
    """The hooks of one CSA attention layer and what they hand each other within one forward."""

    def __init__(self, attn: nn.Module, aux: AuxLoss, coeff: float, shards: int):
        self.attn, self.aux, self.coeff, self.shards = attn, aux, coeff, shards
        self.compressor = attn.compressor
        self.state: dict[str, Any] = {}
        indexer = self.compressor.indexer
        attn.register_forward_pre_hook(self.keep_rope, with_kwargs=True)
        attn.q_b_norm.register_forward_hook(self.keep_query)
        indexer.register_forward_pre_hook(self.detach_inputs)
        indexer.scorer.register_forward_hook(self.keep_scores)
        self.compressor.register_forward_hook(self.attach)
        # ZeRO-3 gathers a module's own weights for its backward when a gradient reaches its outputs; the indexer's
        # are top-k indices, so its position_bias would be a released shard when the loss's gradient reaches it:
        # the attention (whose output the gradient crosses first) holds it as DeepSpeed's external parameter
        from deepspeed.runtime.zero.partition_parameters import register_external_parameter

        for p in indexer.parameters(recurse=False):
            register_external_parameter(attn, p)

    def keep_rope(self, attn, args, kwargs):
        pe = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
        self.state = {"rope": pe[attn.rope_layer_type] if isinstance(pe, dict) else pe}

    def keep_query(self, norm, args, out):
        self.state["query"] = out.detach()

    def detach_inputs(self, indexer, args):
        self.state["position_ids"] = args[2]
        return (args[0].detach(), args[1].detach(), *args[2:])

    def keep_scores(self, scorer, args, out):
        self.state["scores"] = out

    def attach(self, compressor, args, out):
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

        state, self.state = self.state, {}
        kv, bias = out
        scores = state.get("scores")
        if (not compressor.training or not torch.is_grad_enabled() or scores is None or kv.shape[2] == 0
                or kv.is_meta or kv.numel() == 0):
            return out
        cos, sin = state["rope"]
        query = apply_rotary_pos_emb(state["query"], cos, sin)  # as the attention does (HF forward)
        threshold = (state["position_ids"] + 1) // compressor.compress_rate
        kl = indexer_kl(scores, threshold, query, kv.detach().squeeze(1), self.attn.scaling,
                        compressor.indexer.index_topk)
        term = self.coeff * kl / self.shards  # this rank's share: the shares sum to the global mean
        return AuxLossScaler.apply(kv, term, self.aux.scale, self.aux.values), bias


def install_indexer_loss(part: nn.Module, adapter: Any, layout: Any, coeff: float,
                         aux: Optional[AuxLoss]) -> Optional[AuxLoss]:
    """Hook the indexer loss on every CSA layer of `part` when coeff > 0; returns the AuxLoss carrying its scale and
    values (`aux`, or a new one without router terms when the YAML sets no MoE aux loss)."""
    layers = [layer.self_attn for _, layer in adapter.layer_items(part)
              if getattr(getattr(layer.self_attn, "compressor", None), "indexer", None) is not None]
    if not coeff or not layers:
        return aux
    if layout.size("tp") > 1:  # the target sums attention over all heads; tp splits them (models/deepseek4_tp.py)
        raise ValueError(f"DeepSeek-V4: model.dsa_indexer_loss_coeff={coeff:g} with parallelism.tensor_parallel="
                         f"{layout.size('tp')} is not supported: the indexer loss's target sums the attention "
                         "probabilities over all heads, which tensor parallel splits over ranks, and the replicated "
                         "indexer's grads are not summed over tp; set tensor_parallel to 1, or "
                         "dsa_indexer_loss_coeff: 0 (the indexer is then not trained)")
    if aux is None:
        config = part.config
        aux = AuxLoss(layout, adapter.num_experts(config), config.num_experts_per_tok)
    shards = layout.size("dp_cp")
    for attn in layers:
        _CsaLayerLoss(attn, aux, float(coeff), shards)
    aux.others += len(layers)
    return aux
