"""The mixture-of-experts families: HF Qwen3-MoE, Qwen2-MoE and Mixtral (a Llama-shaped decoder whose MLP is, on
its MoE layers, a sparse block: router `mlp.gate` [E, H] -> top-k -> `mlp.experts` with fused expert tensors
gate_up_proj [E, 2I, H] and down_proj [E, H, I]; Qwen2-MoE adds a gated `shared_expert`).

Attention, norms, embedding and head are the Llama family's (models/llama.py). What differs:
- the experts are split over the ep group, not over tp (MindFormers mcore / Megatron-Core: EP folds tp in), so the
  HF tp plan's expert entries are dropped and `ep_plan` marks them (style ep_experts, shard spec: expert dim 0);
- with tp > 1 the MoE block runs on this rank's sequence slice: under sequence parallel no all-gather before it;
  without it (mcore MindFormers allows that; only the legacy moe_config is refused, tools/check_rules.py:169-176)
  the block cuts the slice and all-gathers its output (style token_slice_block); the router and shared experts
  are replicated over tp with their grads summed over tp (style sequence_parallel), like the norms;
- dense layers (mlp_only_layers, decoder_sparse_step) keep the Llama MLP plan.
"""
from __future__ import annotations

from typing import Any, Optional

from torch import Tensor, nn

from ..checkpoint.weight_map import Experts, Joined, Rename, WeightOp
from .base import LayerParts
from .llama import LlamaFamily, legacy_ops, mcore_dense_ops

__all__ = ["MoEFamily"]

# submodules of a MoE block that are replicated over tp (everything but the routed experts)
_REPLICATED_IN_BLOCK = ("gate", "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj",
                        "shared_expert_gate", "shared_experts.gate_proj", "shared_experts.up_proj",
                        "shared_experts.down_proj")  # Qwen2-MoE's shared_expert(_gate), DeepSeek's shared_experts


class MoEFamily(LlamaFamily):
    architectures = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")
    model_types = ("qwen3_moe", "qwen2_moe", "mixtral")
    mindformers_names = {  # + legacy (feed_forward.*) and mcore (mlp.*) cell names of the MoE block's parts
        **LlamaFamily.mindformers_names,
        "mlp.gate": ["feed_forward.router", "feed_forward.router.dense", "mlp.router"],
        "mlp.experts": ["feed_forward.routed_experts", "feed_forward.ffn", "mlp.experts"],
        "mlp.shared_expert": ["feed_forward.shared_experts", "mlp.shared_experts"],
        "mlp.shared_expert_gate": ["feed_forward.shared_experts_gate", "mlp.shared_experts_gate"],
    }

    # ------------------------------------------------------------------------------------------ experts
    @staticmethod
    def num_experts(config: Any) -> int:
        for key in ("num_experts", "num_local_experts", "n_routed_experts"):
            value = getattr(config, key, None)
            if value:
                return int(value)
        return 0

    def moe_layers(self, config: Any) -> list[int]:
        """Indices of the decoder layers whose MLP is a sparse MoE block (HF's own rule per family)."""
        n = config.num_hidden_layers
        if not self.num_experts(config):
            return []
        if config.model_type == "mixtral":
            return list(range(n))
        dense = set(getattr(config, "mlp_only_layers", None) or ())
        step = getattr(config, "decoder_sparse_step", 1) or 1
        return [i for i in range(n) if i not in dense and (i + 1) % step == 0]

    def experts_of(self, layer: nn.Module) -> Optional[nn.Module]:
        """The layer's routed-experts module, or None on a dense layer."""
        return getattr(getattr(layer, "mlp", None), "experts", None)

    def set_experts(self, layer: nn.Module, experts: nn.Module) -> None:
        """Put `experts` (the expert-parallel stand-in) where the layer's routed experts are."""
        layer.mlp.experts = experts

    def router_of(self, layer: nn.Module) -> Optional[nn.Module]:
        """The layer's router (returns router_logits, routing weights, top-k indices), or None on a dense layer."""
        return layer.mlp.gate if self.experts_of(layer) is not None else None

    @staticmethod
    def expert_bias_of(router: nn.Module) -> Optional[Tensor]:
        """The router's expert-choice bias buffer (aux-loss-free balancing; DeepSeek-V3), or None."""
        return getattr(router, "e_score_correction_bias", None)

    def ep_plan(self, config: Any) -> dict[str, str]:
        """Module pattern -> style for expert parallel: the routed experts of every MoE layer."""
        return {f"{self.prefix}.layers.{i}.mlp.experts": "ep_experts" for i in self.moe_layers(config)}

    # ------------------------------------------------------------------------------------------ tensor parallel
    def tp_plan(self, config: Any, tp: int, *, sequence_parallel: bool = False,
                vocab_parallel: bool = False) -> dict[str, str]:
        moe = self.moe_layers(config)
        plan = super().tp_plan(config, tp, sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel)
        plan = {p: s for p, s in plan.items() if ".experts" not in p}  # experts: ep, never tp (mcore folding)
        if not moe:
            return plan
        layers = f"{self.prefix}.layers"
        # the block runs on this rank's sequence slice; without SP it cuts the slice itself and gathers its output
        # (each tp rank routes its own tokens either way, as MindFormers' dp*cp*tp router shards do)
        block, inner = ("sequence_parallel", "sequence_parallel") if sequence_parallel else \
            ("token_slice_block", "replicated_with_grad_allreduce")  # (a sequence_* style would mean SP is on)
        first = {f"{layers}.{i}.mlp": block for i in moe}
        first.update({f"{layers}.{i}.mlp.{name}": inner for i in moe for name in _REPLICATED_IN_BLOCK})
        return {**first, **plan}  # first match wins: these precede the dense layers' `layers.*.mlp` entries

    # ------------------------------------------------------------------------------------------ checkpoints
    def checkpoint_sources(self, name: str, config: Any, experts: range) -> Optional[list[list[str]]]:
        """HF's original (hub) format stores one matrix per expert (transformers fuses them on load and splits them
        on save): for a fused expert tensor `name`, per expert in `experts` the keys whose rows concatenate (dim 0)
        into that expert's slice; None for any other name. Mixtral's original keys live under block_sparse_moe with
        w1 (gate), w3 (up), w2 (down)."""
        base, _, attr = name.rpartition(".")
        if not base.endswith(".mlp.experts") or attr not in ("gate_up_proj", "down_proj"):
            return None
        if config.model_type == "mixtral":
            base = base[: -len(".mlp.experts")] + ".block_sparse_moe.experts"
            parts = ("w1", "w3") if attr == "gate_up_proj" else ("w2",)
        else:
            parts = ("gate_proj", "up_proj") if attr == "gate_up_proj" else ("down_proj",)
        return [[f"{base}.{e}.{part}.weight" for part in parts] for e in experts]

    def mindformers_weights(self, config: Any, *, legacy: bool, qkv_interleaved: bool = True,
                            fc1_interleaved: bool = True) -> list[WeightOp]:
        """mcore MoE cells (mindformers 2.1.0 models/qwen3_moe/utils.py:51-115): the router is `mlp.router`, the
        routed experts are stacked in weight1 / weight2 (Experts); dense layers keep the mcore MLP names."""
        if legacy:
            return _legacy_mixtral_ops(config, qkv_interleaved)
        if config.model_type != "qwen3_moe":
            raise ValueError(f"{config.model_type}: only Qwen3-MoE's MindFormers mcore names are mapped (shared "
                             "experts and Mixtral's block names are not)")
        mf, hf = "decoder.layers.{L}.mlp.", "model.layers.{L}.mlp."
        return mcore_dense_ops(qkv_interleaved, fc1_interleaved) + [
            Rename(mf + "router.weight", hf + "gate.weight"),
            Experts((mf + "experts.weight1",), (hf + "experts.gate_up_proj",)),
            Experts((mf + "experts.weight2",), (hf + "experts.down_proj",))]

    def checkpoint_alias(self, name: str, config: Any) -> Optional[str]:
        """The original-format key of a non-expert tensor stored under another name (Mixtral's block_sparse_moe)."""
        if config.model_type == "mixtral" and ".mlp." in name:
            return name.replace(".mlp.", ".block_sparse_moe.", 1)
        return None

    # ------------------------------------------------------------------------------------------ interleave
    def layer_parts(self, layer: nn.Module) -> Optional[LayerParts]:
        return None if self.experts_of(layer) is not None else super().layer_parts(layer)


def _legacy_mixtral_ops(config: Any, qkv_interleaved: bool) -> list[WeightOp]:
    """Legacy (moe_config) Mixtral: MindFormers research/mixtral/convert_weight.py name_replace + its expert stacking
    (feed_forward.router.dense <- block_sparse_moe.gate; ffn.w1 / w2 / w3 = torch.stack of the experts' w1 (gate),
    w2 (down), w3 (up), [E, I, H] / [E, H, I]); attention and norms as legacy Llama. With shared experts
    (shared_expert_num, Qwen2-MoE) the layer's feed_forward is LlamaFeedForwardWithMoE (mindformers 1.3.2
    models/llama/llama_layer.py:529-600): the routed MoE under `routed_experts`, a LlamaFeedForward
    `shared_experts` (w1 / w3 / w2) and the `shared_experts_gate` Dense [1, H]."""
    if config.model_type not in ("mixtral", "qwen2_moe"):
        raise ValueError(f"{config.model_type}: only Mixtral's and Qwen2-MoE's MindFormers legacy MoE names are "
                         "mapped (DeepSeek's are not)")
    mf, hf = "model.layers.{L}.feed_forward.", "model.layers.{L}.mlp."
    routed = mf + ("routed_experts." if config.model_type == "qwen2_moe" else "")
    ops = [op for op in legacy_ops(qkv_interleaved) if not any(".mlp." in n for n in op.hf)] + [
        Rename(routed + "router.dense.weight", hf + "gate.weight"),
        Joined((routed + "ffn.w1.weight", routed + "ffn.w3.weight"), (hf + "experts.gate_up_proj",), None, 1),
        Rename(routed + "ffn.w2.weight", hf + "experts.down_proj")]
    if config.model_type == "qwen2_moe":
        shared = hf + "shared_expert."
        ops += [Rename(mf + "shared_experts.w1.weight", shared + "gate_proj.weight"),
                Rename(mf + "shared_experts.w3.weight", shared + "up_proj.weight"),
                Rename(mf + "shared_experts.w2.weight", shared + "down_proj.weight"),
                Rename(mf + "shared_experts_gate.weight", hf + "shared_expert_gate.weight")]
    return ops
