"""pet_config LoRA on a HF model, with HF peft, before parallelize: only the LoRA weights train.

    model = apply_lora(model, cfg.pet)      # msp.initialize does this when the YAML has model_config.pet_config

MindFormers' LoRA (pet/tuners/lora_adapter.py, parallel_core/training_graph/tensor_parallel/lora_layers.py):
y = base(x) + B(A(dropout(x))) * lora_alpha / lora_rank; A initialised 'normal' (MindSpore's Normal: sigma 0.01),
B 'zero'; every other weight frozen. peft's LoRA is the same sum and scaling; its default A init (Kaiming-uniform)
is replaced here by N(0, 0.01) drawn from a fixed generator, so every rank (and a rerun) starts from the same A.
The target cells come from the model family's adapter (MindFormers cell names -> HF module names). peft injects its
layers in place (inject_adapter_in_model, no PeftModel wrapper), so the model keeps its HF structure for
parallelize, pipeline split and the engines.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["apply_lora", "lora_applied", "merged_state_dict", "require_lora"]

INIT_STD = 0.01   # mindspore.common.initializer.Normal's default sigma ('normal')
INIT_SEED = 0


def lora_applied(model: nn.Module) -> bool:
    """Whether peft LoRA layers are in the model (without importing peft: save paths ask it of every model)."""
    return any(isinstance(getattr(m, "lora_A", None), nn.ModuleDict) for m in model.modules())


def require_lora(model: nn.Module, settings) -> None:
    """Under accelerate / the HF Trainer the optimizer exists before the model reaches us, so LoRA cannot be
    injected there: a pet_config without LoRA layers in the model is an error, not a silent full fine-tune."""
    if settings is not None and not lora_applied(model):
        raise ValueError("model.model_config.pet_config (pet_type: lora) is set but the model has no LoRA layers: "
                         "under accelerate / the HF Trainer apply it before building the optimizer, `model = "
                         "msparallel_ds.pet.apply_lora(model, msp.load_config(yaml).pet)`, or use msp.initialize "
                         "(it does so); or drop pet_config to train every weight")


def apply_lora(model: nn.Module, settings) -> nn.Module:
    """Inject LoRA (settings: config.pet.LoraSettings) into the modules pet_config.target_modules names; freeze
    the rest. A model that already holds peft layers is left as it is (applied once)."""
    from peft import LoraConfig, inject_adapter_in_model

    from .models import adapter_for

    if lora_applied(model):
        return model
    adapter = adapter_for(model)
    targets = adapter.lora_targets(model, settings.target_modules, settings.exclude_layers)
    if not targets:
        raise ValueError(f"model.model_config.pet_config.target_modules={settings.target_modules!r} matches no "
                         f"linear cell of this {type(model).__name__} (exclude_layers={list(settings.exclude_layers)}"
                         f"); MindFormers cell names it knows: {sorted(_cell_names(adapter))}; fix the regex")
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=targets, bias="none")
    model = inject_adapter_in_model(config, model)
    gen = torch.Generator().manual_seed(INIT_SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.requires_grad_(".lora_" in name)
            if ".lora_A." in name:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * INIT_STD)
            elif ".lora_B." in name:
                param.zero_()
    return model


def _cell_names(adapter) -> set[str]:
    names = [*adapter.mindformers_names.values(), *adapter.mindformers_top_names.values()]
    return {cell.rpartition(".")[2] for cells in names for cell in cells}


def merged_state_dict(model: nn.Module, full: dict) -> dict:
    """A full state dict of a LoRA model (base_layer / lora_A / lora_B keys) as the plain HF model's: each adapted
    weight merged, W + B @ A * alpha / rank, under its original name; so engine.save_pretrained writes a checkpoint
    plain HF loads with the trained behaviour."""
    from peft.tuners.lora import LoraLayer

    out = {k: v for k, v in full.items() if ".lora_" not in k}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        for adapter in module.active_adapters:
            key = f"{name}.base_layer.weight"
            a, b = full[f"{name}.lora_A.{adapter}.weight"], full[f"{name}.lora_B.{adapter}.weight"]
            w = out.pop(key)
            out[key.replace(".base_layer", "")] = (w.float() + (b.float() @ a.float()) * module.scaling[adapter]).to(
                w.dtype)
    return {k.replace(".base_layer.", "."): v for k, v in out.items()}
