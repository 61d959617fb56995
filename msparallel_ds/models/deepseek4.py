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
stages, full recompute of whole layers. MindFormers 2.1's routing (pynative transformers/moe/router.py) equals HF's on both
routers: weights = the chosen scores normalised (+1e-20) x routed_scaling_factor; the expert bias only chooses, and
hash layers ignore it (so they get no bias update here). Its seq_aux_loss (moe_utils.compute_routing_scores_for_aux_
loss) is per sequence, on scores normalised over the experts, with f from the top-k of those scores (not the routed
choice, so hash layers get it too): `aux_rule` below asks moe.aux_loss for exactly that.

Pipeline stages (DeepseekV4Stage) carry the whole residual, all hc streams, across the boundary, and the input ids to
every stage. Refused, each with the key to change: tensor parallel (the o_a_proj grouping, the single shared kv head,
the sinks and the compressor / indexer branches would all need their own splits; none is written), context
parallel (the compressors pool whole windows of the sequence and the indexer picks among all of them: a sequence
shard would change which entries exist) and multi-token prediction (HF V4 ignores `mtp.*` weights). MindFormers 2.1
weight names (import-mindspore / export-mindspore): models/deepseek4_names.py.
"""
from __future__ import annotations

from typing import Any, Optional

from torch import Tensor, nn

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

    def moe_layers(self, config: Any) -> list[int]:
        return list(range(config.num_hidden_layers)) if self.num_experts(config) else []

    @staticmethod
    def expert_bias_of(router: nn.Module) -> Optional[Tensor]:
        return getattr(router, "e_score_correction_bias", None)

    @staticmethod
    def fixed_routing(router: nn.Module) -> bool:
        """A hash router: experts come from the tid2eid table, an expert bias has nothing to choose."""
        return hasattr(router, "tid2eid")

    def tp_plan(self, config: Any, tp: int, *, sequence_parallel: bool = False,
                vocab_parallel: bool = False) -> dict[str, str]:
        raise _refused("parallel_config.model_parallel (parallelism.tensor_parallel)", tp,
                       "its attention has one kv head shared by all heads, per-head sinks, an output projection "
                       "grouped over o_groups and compressor / indexer branches, for which no tensor-parallel split "
                       "is written", "set it to 1 and use data_parallel_shard / expert_parallel")

    stage_token_ids = True  # the pipeline engine passes the micro-batch's input ids to every stage (hash routers)

    def make_stage(self, model: nn.Module, layer_ids, *, first: bool, last: bool) -> nn.Module:
        return DeepseekV4Stage.cut(model, layer_ids, first=first, last=last)

    def merge_stages(self, stages: list[nn.Module]) -> nn.Module:
        return DeepseekV4Stage.merged(stages)

    def check_options(self, layout: Any, options: Any) -> None:
        """Refuse, before anything is sharded, what this family does not run (module docstring)."""
        if layout.size("cp") > 1:
            raise _refused("parallel_config.context_parallel (parallelism.context_parallel)", layout.size("cp"),
                           "its compressors pool whole windows of the sequence and the lightning indexer picks among "
                           "all compressed entries, which a sequence shard would change", "set it to 1")
        if getattr(options, "mtp_depth", 0):
            raise _refused("model.num_nextn_predict_layers (mtp_depth)", options.mtp_depth,
                           "HF DeepseekV4ForCausalLM has no multi-token-prediction layers (it drops mtp.* weights)",
                           "set it to 0")
        inter = getattr(options, "interleave", None)
        if inter is not None and (inter.copies > 1 or inter.fine_grain > 1):
            raise _refused("micro_batch_interleave_num / fine_grain_interleave", (inter.copies, inter.fine_grain),
                           "the multi-copy runner does not pass the input ids the hash routers read", "set them to 1")

    def layer_parts(self, layer: nn.Module):
        return None

    def mindformers_weights(self, config: Any, *, legacy: bool, qkv_interleaved: bool = True,
                            fc1_interleaved: bool = True) -> list:
        """MindFormers 2.1 pynative names (models/deepseek4_names.py); the layouts are fixed (no interleave keys)."""
        from .deepseek4_names import mindformers_v4_ops

        depth = getattr(config, "num_nextn_predict_layers", 0) or 0
        if depth and not self.mindformers_mtp:
            raise _refused("model.num_nextn_predict_layers", depth, "its checkpoint holds mtp.layers.* tensors, which "
                           "HF DeepseekV4ForCausalLM has no place for and msparallel_ds does not train for V4 yet "
                           "(import would have to drop them)", "import / export a model saved with 0 MTP layers")
        return mindformers_v4_ops(config, depth)


class DeepseekV4Stage(StageModule):
    """A pipeline stage of DeepseekV4ForCausalLM under HF names. What crosses a stage boundary is the whole residual,
    all hc_mult streams as one [B, S, hc, D] tensor; the input ids reach every stage as the keyword `token_ids` (the
    hash routers read them). The first stage embeds and copies the embedding into the streams, the last collapses
    them (hc_head), applies the final norm and lm_head; each stage rebuilds the sliding-window mask and both RoPE
    tables ("main", "compress") from position_ids, as DeepseekV4Model.forward does."""

    @classmethod
    def cut(cls, model: nn.Module, layer_ids, *, first: bool, last: bool) -> StageModule:
        stage = super().cut(model, layer_ids, first=first, last=last)
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

    def forward(self, x: Tensor, position_ids: Tensor, token_ids: Optional[Tensor] = None, **kwargs) -> Tensor:
        from transformers.masking_utils import create_sliding_window_causal_mask

        body, config = self.body, self.config
        if self.is_first:
            x = body.embed_tokens(x).unsqueeze(2).expand(-1, -1, config.hc_mult, -1).contiguous()
        ref = x[:, :, 0]
        mask = create_sliding_window_causal_mask(config=config, inputs_embeds=ref, attention_mask=None, cache=None,
                                                 position_ids=position_ids)
        rope = {kind: body.rotary_emb(ref, position_ids=position_ids, layer_type=kind) for kind in ("main", "compress")}
        for layer in body.layers.values():
            x = layer(x, position_embeddings=rope, position_ids=position_ids, attention_mask=mask, input_ids=token_ids,
                      **kwargs)
        if not self.is_last:
            return x
        return self.lm_head(body.norm(body.hc_head(x)))
