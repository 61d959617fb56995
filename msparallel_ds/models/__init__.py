"""Model-family adapters: the only place that knows HF submodule names (see models/base.py).

    adapter = adapter_for(model)            # a HF causal LM or one of its pipeline stages
    adapter = adapter_for_config(config)    # from a HF config alone (convert-checkpoint: no model is built)

A new family is one adapter (a DecoderAdapter subclass) added to ADAPTERS, plus its tests.
"""
from __future__ import annotations

from typing import Any, Optional

from torch import nn

from .base import DecoderAdapter, InterleavedLayers, LayerParts
from .deepseek import DeepseekV3Family
from .deepseek4 import DeepseekV4Family
from .glm import Glm4MoeFamily, GlmFamily
from .gpt2 import Gpt2Family
from .llama import LlamaFamily
from .moe import MoEFamily
from .stage import StageModule

__all__ = ["ADAPTERS", "DecoderAdapter", "DeepseekV3Family", "DeepseekV4Family", "Glm4MoeFamily", "GlmFamily", "Gpt2Family",
           "InterleavedLayers", "LayerParts", "MoEFamily", "StageModule", "SUPPORTED_ARCHITECTURES", "adapter_for",
           "adapter_for_config", "family_name", "unsupported_advice"]

ADAPTERS: tuple[DecoderAdapter, ...] = (LlamaFamily(), MoEFamily(), DeepseekV3Family(), DeepseekV4Family(),
                                          GlmFamily(), Glm4MoeFamily(), Gpt2Family())
SUPPORTED_ARCHITECTURES = tuple(a for adapter in ADAPTERS for a in adapter.architectures)


# families of MindFormers' real configs that have no adapter (matched in the architecture / model_type / config)
_KNOWN_WITHOUT_ADAPTER = {"telechat": "TeleChat", "cogvlm": "CogVLM2", "whisper": "Whisper", "baichuan": "Baichuan",
                          "internlm": "InternLM"}
NEEDS_ADAPTER = ("parallel_config.model_parallel > 1", "parallel_config.use_seq_parallel",
                 "parallel_config.pipeline_stage > 1", "parallel_config.expert_parallel > 1",
                 "recompute_config.recompute as per-stage counts", "recompute_config.select_recompute",
                 "recompute_config.select_comm_recompute", "micro_batch_interleave_num > 1",
                 "model.model_config.fine_grain_interleave > 1", "swap_config.layer_swap")
RUNS_WITHOUT = ("parallel_config.data_parallel", "ZeRO (parallel.enable_parallel_optimizer, optimizer_level)",
                "parallel_config.context_parallel (the model's attention through HF's attention interface)",
                "recompute_config.recompute: true (the model's own HF gradient checkpointing)")


def family_name(*names: Any) -> Optional[str]:
    """The MindFormers family a model / config name belongs to, among those known to have no adapter."""
    text = " ".join(str(n) for n in names if n).lower()
    return next((fam for key, fam in _KNOWN_WITHOUT_ADAPTER.items() if key in text), None)


def unsupported_advice(name: Any, model_type: Any) -> str:
    family = family_name(name, model_type)
    what = f"{family} ({name}, model_type={model_type!r})" if family else f"{name} (model_type={model_type!r})"
    return (f"{what} has no model-family adapter in msparallel_ds (supported: {', '.join(SUPPORTED_ARCHITECTURES)}). "
            f"Without one, these run: {'; '.join(RUNS_WITHOUT)}. These need an adapter: {'; '.join(NEEDS_ADAPTER)}: "
            "set them off (model_parallel: 1, pipeline_stage: 1, ...) or add an adapter in msparallel_ds/models")


def _unsupported(name: str, model_type: Any) -> ValueError:
    return ValueError(f"unsupported architecture {unsupported_advice(name, model_type)}")


def adapter_for(model: nn.Module) -> DecoderAdapter:
    """The adapter of a HF causal LM (by class name and model_type) or of a pipeline stage cut from one."""
    if isinstance(model, StageModule):
        return adapter_for_config(model.config)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    name = type(model).__name__
    for adapter in ADAPTERS:
        if adapter.matches(name, model_type):
            return adapter
    raise _unsupported(name, model_type)


def adapter_for_config(config: Any) -> DecoderAdapter:
    for adapter in ADAPTERS:
        if adapter.config_matches(config):
            return adapter
    archs = getattr(config, "architectures", None) or [type(config).__name__]
    raise _unsupported(archs[0], getattr(config, "model_type", None))
