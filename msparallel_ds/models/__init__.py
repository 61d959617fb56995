"""Model-family adapters: the only place that knows HF submodule names (see models/base.py).

    adapter = adapter_for(model)            # a HF causal LM or one of its pipeline stages
    adapter = adapter_for_config(config)    # from a HF config alone (convert-checkpoint: no model is built)

A new family is one adapter (a DecoderAdapter subclass) added to ADAPTERS, plus its tests.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from .base import DecoderAdapter, InterleavedLayers, LayerParts
from .deepseek import DeepseekV3Family
from .glm import Glm4MoeFamily, GlmFamily
from .gpt2 import Gpt2Family
from .llama import LlamaFamily
from .moe import MoEFamily
from .stage import StageModule

__all__ = ["ADAPTERS", "DecoderAdapter", "DeepseekV3Family", "Glm4MoeFamily", "GlmFamily", "Gpt2Family",
           "InterleavedLayers", "LayerParts", "MoEFamily", "StageModule", "SUPPORTED_ARCHITECTURES", "adapter_for",
           "adapter_for_config"]

ADAPTERS: tuple[DecoderAdapter, ...] = (LlamaFamily(), MoEFamily(), DeepseekV3Family(), GlmFamily(),
                                          Glm4MoeFamily(), Gpt2Family())
SUPPORTED_ARCHITECTURES = tuple(a for adapter in ADAPTERS for a in adapter.architectures)


def _unsupported(name: str, model_type: Any) -> ValueError:
    return ValueError(f"unsupported architecture {name} (model_type={model_type!r}); supported: "
                      f"{', '.join(SUPPORTED_ARCHITECTURES)}. Other models: keep model_parallel: 1 and "
                      "pipeline_stage: 1, or add an adapter in msparallel_ds/models")


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
