"""The DeepSeek-V4 family (HF DeepseekV4ForCausalLM; MindFormers 2.1 configs/deepseek4).

    layer     = hyper-connections: the residual is `hc_mult` streams [B, S, hc, D]; attn_hc / ffn_hc mix them in
                (Sinkhorn-projected doubly-stochastic maps) and collapse them to one input of the block
    attention = q_a_proj -> q_a_norm -> q_b_proj (heads), one shared kv head (kv_proj, kv_norm), per-head sinks,
                o_a_proj (grouped over o_groups) -> o_b_proj; sliding window plus, per layer type, a compressor
                (compressed sparse attention with a lightning indexer choosing the top-k compressed entries, or
                heavily compressed attention) whose entries are concatenated onto the kv axis
    mlp       = on every layer a MoE block: `mlp.gate` a top-k router (sqrtsoftplus scores + e_score_correction_bias
                for the choice) or, on the first num_hash_layers, a hash router (experts fixed by the `tid2eid`
                table of the input ids, weights from the scores); routed `experts` and `shared_experts`

What runs: data parallel / ZeRO, expert parallel (the MoE family's ep plan: every layer's routed experts), pipeline
stages, full recompute of whole layers, tensor (+ sequence, vocab) parallel (models/deepseek4_tp.py: heads split,
the shared kv head, compressors and lightning indexer replicated). MindFormers 2.1's routing (pynative transformers/
moe/router.py) equals HF's on both routers: weights = the chosen scores normalised (+1e-20) x routed_scaling_factor;
the expert bias only chooses, and
hash layers ignore it (so they get no bias update here). Its seq_aux_loss (moe_utils.compute_routing_scores_for_aux_
loss) is per sequence, on scores normalised over the experts, with f from the top-k of those scores (not the routed
choice, so hash layers get it too): `aux_rule` below asks moe.aux_loss for exactly that.

Pipeline stages (DeepseekV4Stage) carry the whole residual, all hc streams, across the boundary, and the input ids to
every stage. Refused, each with the key to change: a tensor-parallel size not dividing the heads and o_groups,
context parallel (the compressors pool whole windows of the sequence and the indexer picks among all of them: a sequence
shard would change which entries exist), and MTP or the indexer loss with tensor parallel. Multi-token prediction
(num_nextn_predict_layers) runs MindFormers 2.1's V4 MTP block: models/deepseek4_mtp.py. MindFormers 2.1 weight
names (import-mindspore / export-mindspore): models/deepseek4_names.py.
"""
from __future__ import annotations

from typing import Any, Optional

from torch import Tensor, nn

from .deepseek4_mtp import make_mtp_layer
from .deepseek4_tp import v4_heads, v4_set_local_heads, v4_tp_plan
from .moe import MoEFamily
from .stage import StageModule

__all__ = ["DeepseekV4Family", "DeepseekV4Stage"]


def _refused(key: str, value: Any, why: str, fix: str) -> ValueError:
    return ValueError(f"{key}={value} is not supported for DeepSeek-V4 (DeepseekV4ForCausalLM): {why}; {fix}")


class DeepseekV4Family(MoEFamily):
    architectures = ("DeepseekV4ForCausalLM",)
    model_types = ("deepseek_v4",)
    router_score = "sqrtsoftplus"
    # MindFormers 2.1 pynative aux loss: f from the top-k of the normalised scores, per sequence (module docstring)
    aux_rule = {"choice": "scores", "per_sequence": True}
    mindformers_names = {}  # LoRA cell names: none mapped (the weight map: mindformers_weights)
    mindformers_mtp = True  # mtp.layers.k <-> HF layer N + k (models/deepseek4_names.py, models/deepseek4_mtp.py)

    def moe_layers(self, config: Any) -> list[int]:
        """Every layer, the MTP layers (models.deepseek4_mtp: after the decoder's) included."""
        n = config.num_hidden_layers + (getattr(config, "num_nextn_predict_layers", 0) or 0)
        return list(range(n)) if self.num_experts(config) else []

    make_mtp_layer = staticmethod(make_mtp_layer)  # models.mtp.add_mtp_layers builds V4's MTP layers with it

    @staticmethod
    def expert_bias_of(router: nn.Module) -> Optional[Tensor]:
        return getattr(router, "e_score_correction_bias", None)

    @staticmethod
    def fixed_routing(router: nn.Module) -> bool:
        """A hash router: experts come from the tid2eid table, an expert bias has nothing to choose."""
        return hasattr(router, "tid2eid")

    # tensor parallel: heads split, the shared kv / compressor / indexer replicated (models/deepseek4_tp.py says why)
    def heads(self, config: Any, tp: int) -> tuple[int, int, bool]:
        return v4_heads(config, tp)

    def tp_plan(self, config: Any, tp: int, *, sequence_parallel: bool = False,
                vocab_parallel: bool = False) -> dict[str, str]:
        self.heads(config, tp)
        return v4_tp_plan(self.prefix, self.moe_layers(config), sequence_parallel=sequence_parallel,
                          vocab_parallel=vocab_parallel)

    def set_local_heads(self, part: nn.Module, config: Any, tp: int) -> None:
        v4_set_local_heads(self.layers(part), config, tp)

    stage_token_ids = True  # the pipeline engine passes the micro-batch's input ids to every stage (hash routers)

    def make_stage(self, model: nn.Module, layer_ids, *, first: bool, last: bool, mtp: int = 0) -> nn.Module:
        return DeepseekV4Stage.cut(model, layer_ids, first=first, last=last, mtp=mtp)

    def merge_stages(self, stages: list[nn.Module]) -> nn.Module:
        return DeepseekV4Stage.merged(stages)

    def check_options(self, layout: Any, options: Any) -> None:
        """Refuse, before anything is sharded, what this family does not run (module docstring)."""
        if layout.size("cp") > 1:
            raise _refused("parallel_config.context_parallel (parallelism.context_parallel)", layout.size("cp"),
                           "its compressors pool whole windows of the sequence and the lightning indexer picks among "
                           "all compressed entries, which a sequence shard would change", "set it to 1")
        if getattr(options, "mtp_depth", 0) and getattr(options, "mtp_legacy", False):
            raise _refused("use_legacy", True, "multi-token prediction runs MindFormers 2.1's pynative V4 MTP block; "
                           "the legacy (pre-2.x) MTP order does not exist for V4", "set use_legacy: false")
        if getattr(options, "mtp_depth", 0) and layout.size("tp") > 1:
            raise _refused("model.num_nextn_predict_layers with parallelism.tensor_parallel", layout.size("tp"),
                           "the V4 MTP layer has no tensor-parallel plan yet (its eh_proj / enorm / hnorm / hc_head "
                           "inputs would need the decoder's sequence and vocab splits undone)",
                           "set tensor_parallel to 1 with MTP, or num_nextn_predict_layers to 0")
        inter = getattr(options, "interleave", None)
        if inter is not None and (inter.copies > 1 or inter.fine_grain > 1):
            raise _refused("micro_batch_interleave_num / fine_grain_interleave", (inter.copies, inter.fine_grain),
                           "the multi-copy runner does not pass the input ids the hash routers read", "set them to 1")

    def install_losses(self, part: nn.Module, layout: Any, options: Any, aux: Any) -> Any:
        """MindFormers 2.1's lightning-indexer loss (dsa_indexer_loss_coeff) on every CSA layer (deepseek4_indexer)."""
        from .deepseek4_indexer import install_indexer_loss

        return install_indexer_loss(part, self, layout, getattr(options, "indexer_loss_coeff", 0.0), aux)

    def layer_parts(self, layer: nn.Module):
        return None

    def mindformers_weights(self, config: Any, *, legacy: bool, qkv_interleaved: bool = True,
                            fc1_interleaved: bool = True) -> list:
        """MindFormers 2.1 pynative names (models/deepseek4_names.py); the layouts are fixed (no interleave keys)."""
        from .deepseek4_names import mindformers_v4_ops

        return mindformers_v4_ops(config, getattr(config, "num_nextn_predict_layers", 0) or 0)


class DeepseekV4Stage(StageModule):
    """A pipeline stage of DeepseekV4ForCausalLM under HF names. What crosses a stage boundary is the whole residual,
    all hc_mult streams as one [B, S, hc, D] tensor; the input ids reach every stage as the keyword `token_ids` (the
    hash routers read them). The first stage embeds and copies the embedding into the streams, the last collapses
    them (hc_head), applies the final norm and lm_head; each stage rebuilds the sliding-window mask and both RoPE
    tables ("main", "compress") from position_ids, as DeepseekV4Model.forward does."""

    @classmethod
    def cut(cls, model: nn.Module, layer_ids, *, first: bool, last: bool, mtp: int = 0) -> StageModule:
        stage = super().cut(model, layer_ids, first=first, last=last, mtp=mtp)
        if last:
            stage.body.hc_head = model.get_submodule(model.base_model_prefix).hc_head
        return stage

    @classmethod
    def merged(cls, stages: list[StageModule]) -> StageModule:
        out = super().merged(stages)
        tail = next((s for s in stages if s.is_last), None)
        if tail is not None:
            out.body.hc_head = tail.body.hc_head
        return out

    def forward(self, x: Tensor, position_ids: Tensor, token_ids: Optional[Tensor] = None,
                mtp_ids: Optional[Tensor] = None, **kwargs) -> Tensor:
        from transformers.masking_utils import create_sliding_window_causal_mask

        body, config = self.body, self.config
        if self.is_first:
            x = body.embed_tokens(x).unsqueeze(2).expand(-1, -1, config.hc_mult, -1).contiguous()
        ref = x.new_empty((x.shape[0], position_ids.shape[-1], 1))  # the full length (an SP stage holds a slice)
        mask = create_sliding_window_causal_mask(config=config, inputs_embeds=ref, attention_mask=None, cache=None,
                                                 position_ids=position_ids)
        rope = {kind: body.rotary_emb(ref, position_ids=position_ids, layer_type=kind) for kind in ("main", "compress")}
        for layer in body.layers.values():  # MTP layers (last stage) pass x through: run below
            x = layer(x, position_embeddings=rope, position_ids=position_ids, attention_mask=mask, input_ids=token_ids,
                      **kwargs)
        if not self.is_last:
            return x
        out = body.norm(body.hc_head(x))
        if self.mtp is None:
            return self.lm_head(out)
        ctx = dict(position_embeddings=rope, position_ids=position_ids, attention_mask=mask, **kwargs)
        hs = self.mtp.run(out, x, body.embed_tokens, mtp_ids.unbind(1), ctx)  # (logits, depth 1 .. D logits)
        return (self.lm_head(out), *(self.lm_head(h) for h in hs))
