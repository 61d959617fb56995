"""pet_config LoRA on a HF model, with HF peft, before parallelize: only the LoRA weights train.

    model = apply_lora(model, cfg.pet)      # msp.initialize does this when the YAML has model_config.pet_config

MindFormers' LoRA (pet/tuners/lora_adapter.py, parallel_core/training_graph/tensor_parallel/lora_layers.py):
y = base(x) + B(A(dropout(x))) * lora_alpha / lora_rank; A initialised 'normal' (MindSpore's Normal: sigma 0.01),
B 'zero'; every other weight frozen. peft's LoRA is the same sum and scaling; its default A init (Kaiming-uniform)
is replaced here by N(0, 0.01) drawn from a fixed generator, so every rank (and a rerun) starts from the same A.
The target cells come from the model family's adapter (MindFormers cell names -> HF module names). peft injects its
layers in place (inject_adapter_in_model, no PeftModel wrapper), so the model keeps its HF structure for
parallelize, pipeline split and the engines.

Where MindFormers has separate cells that HF fuses into one projection (GPT-2's attention.dense1/2/3 = q/k/v, one
HF c_attn), a LoRA on the fused weight would be another function (one A shared by q, k and v, a B over all three);
the adapter names those column blocks instead (lora_block_targets) and BlockLora gives each its own A, B and dropout,
as MindFormers' separate LoRADense cells have: y[:, block] += B(A(dropout(x))) * alpha / rank, other columns as they
were.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["BlockLora", "apply_lora", "lora_applied", "merged_state_dict", "require_lora"]

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
    from .models import adapter_for

    if lora_applied(model):
        return model
    adapter = adapter_for(model)
    pattern, exclude = settings.target_modules, settings.exclude_layers
    targets = adapter.lora_targets(model, pattern, exclude)
    blocks = adapter.lora_block_targets(model, pattern, exclude)
    if not targets and not blocks:
        raise ValueError(f"model.model_config.pet_config.target_modules={pattern!r} matches no linear cell of this "
                         f"{type(model).__name__} (exclude_layers={list(exclude)}); MindFormers cell names it knows: "
                         f"{sorted(_cell_names(adapter))}; fix the regex")
    if targets:
        from peft import LoraConfig, inject_adapter_in_model

        config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                            target_modules=targets, bias="none", fan_in_fan_out=adapter.lora_fan_in_fan_out)
        model = inject_adapter_in_model(config, model)
    for name, cells in blocks.items():
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, attr, BlockLora(getattr(owner, attr), cells, settings.rank, settings.alpha, settings.dropout,
                                       fan_in_fan_out=adapter.lora_fan_in_fan_out))
    gen = torch.Generator().manual_seed(INIT_SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.requires_grad_(".lora_" in name)
            if ".lora_A." in name:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * INIT_STD)
            elif ".lora_B." in name:
                param.zero_()
    return model


class BlockLora(nn.Module):
    """LoRA on column blocks of one fused projection: `cells` = ((name, first output column, width), ...), each
    block with its own A [rank, in], B [width, rank] and dropout (MindFormers' separate LoRADense cells). The base
    layer is kept as `base_layer` (a Linear, or a HF Conv1D with fan_in_fan_out: weight [in, out])."""

    def __init__(self, base: nn.Module, cells, rank: int, alpha: float, dropout: float, *, fan_in_fan_out: bool):
        super().__init__()
        w = base.weight
        n_in = w.shape[0] if fan_in_fan_out else w.shape[1]
        self.base_layer, self.fan_in_fan_out, self.scaling = base, fan_in_fan_out, alpha / rank
        self.blocks = tuple(sorted(((str(n), int(start), int(width)) for n, start, width in cells), key=lambda c: c[1]))
        self.lora_A = nn.ModuleDict({n: nn.Linear(n_in, rank, bias=False) for n, _, _ in self.blocks})
        self.lora_B = nn.ModuleDict({n: nn.Linear(rank, width, bias=False) for n, _, width in self.blocks})
        self.lora_dropout = nn.ModuleDict({n: nn.Dropout(dropout) if dropout else nn.Identity()
                                           for n, _, _ in self.blocks})
        self.to(dtype=w.dtype, device=w.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        cuts, at = [], 0
        for _, start, width in self.blocks:
            cuts += [start - at, width]
            at = start + width
        pieces = list(y.split(cuts + [y.shape[-1] - at], dim=-1))
        for i, (name, _, _) in enumerate(self.blocks):
            delta = self.lora_B[name](self.lora_A[name](self.lora_dropout[name](x))) * self.scaling
            pieces[2 * i + 1] = pieces[2 * i + 1] + delta.to(y.dtype)
        return torch.cat(pieces, dim=-1)

    def delta_weight(self, a: dict, b: dict) -> torch.Tensor:
        """The merged update of the base weight (its layout) from the blocks' A / B tensors (name -> tensor)."""
        w = self.base_layer.weight
        out_dim = w.shape[1] if self.fan_in_fan_out else w.shape[0]
        delta = torch.zeros(out_dim, a[self.blocks[0][0]].shape[1], dtype=torch.float32)
        for name, start, width in self.blocks:
            delta[start:start + width] = (b[name].float() @ a[name].float()) * self.scaling
        return delta.t() if self.fan_in_fan_out else delta


def _cell_names(adapter) -> set[str]:
    names = [*adapter.mindformers_names.values(), *adapter.mindformers_top_names.values()]
    return {cell.rpartition(".")[2] for cells in names for cell in cells}


def merged_state_dict(model: nn.Module, full: dict) -> dict:
    """A full state dict of a LoRA model (base_layer / lora_A / lora_B keys) as the plain HF model's: each adapted
    weight merged, W + B @ A * alpha / rank (transposed for a Conv1D; per column block for BlockLora), under its
    original name; so engine.save_pretrained writes a checkpoint plain HF loads with the trained behaviour."""
    from peft.tuners.lora import LoraLayer

    out = {k: v for k, v in full.items() if ".lora_" not in k}
    for name, module in model.named_modules():
        key = f"{name}.base_layer.weight"
        if isinstance(module, BlockLora):
            a = {n: full[f"{name}.lora_A.{n}.weight"] for n, _, _ in module.blocks}
            b = {n: full[f"{name}.lora_B.{n}.weight"] for n, _, _ in module.blocks}
            w = out.pop(key)
            out[f"{name}.weight"] = (w.float() + module.delta_weight(a, b)).to(w.dtype)
            continue
        if not isinstance(module, LoraLayer):
            continue
        for adapter in module.active_adapters:
            a, b = full[f"{name}.lora_A.{adapter}.weight"], full[f"{name}.lora_B.{adapter}.weight"]
            delta = (b.float() @ a.float()) * module.scaling[adapter]
            w = out.pop(key)
            out[f"{name}.weight"] = (w.float() + (delta.t() if getattr(module, "fan_in_fan_out", False)
                                                  else delta)).to(w.dtype)
    return {k.replace(".base_layer.", "."): v for k, v in out.items()}
