"""DecoderAdapter: what the parallel code needs to know about one family of HF decoder models.

Every fact about a family's module names lives in its adapter (models/<family>.py): where the decoder layers,
embedding, final norm and lm_head sit, the TP plan, which modules run on the sequence slice under sequence
parallel, MindFormers' cell names for recompute patterns, how a layer decomposes into the steps of the
fine-grain interleave, and how a pipeline stage is cut. The generic code (tensor_parallel, recompute, interleave,
pipeline, checkpoint) asks the adapter and never names a HF submodule itself.

A "part" is what parallelize runs on: the whole HF causal LM, or one pipeline stage (models.stage.StageModule),
which keeps the HF parameter names so the same TP plan patterns and the same shard spec apply to both.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch import Tensor, nn

from ..checkpoint.weight_map import Rename
from .stage import StageModule

# mcore (MindFormers 2.x) top-level tensors, the same in every family: word embedding, final norm, output layer.
MCORE_TOP = (Rename("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
             Rename("decoder.final_layernorm.weight", "model.norm.weight"),
             Rename("output_layer.weight", "lm_head.weight"))

__all__ = ["DecoderAdapter", "InterleavedLayers", "LayerParts"]


@dataclass(frozen=True)
class LayerParts:
    """One decoder layer in the shape fine_grain.decoder_steps runs it: norm -> q/k/v -> attention -> o ->
    residual -> norm -> gate/up -> act -> down -> residual. Between the projections: `heads(q, k, v,
    layer_kwargs)` ([b, s, h*d] -> [b, h, s, d]: q/k norm, RoPE), then `attend(q, k, v, layer_kwargs, rows=None)`
    (-> [b, s, h*d]); rows=(a, b) runs query rows a..b-1 against keys 0..b-1 only, which the model's attention
    function allows when `row_blocks()` (causal, no cp); q then holds the whole sequence or only those rows, and
    `heads` may be given a block of rows with layer_kwargs' position_embeddings cut to it."""

    input_norm: nn.Module
    qkv: tuple[nn.Module, nn.Module, nn.Module]
    heads: Callable[[Tensor, Tensor, Tensor, dict], tuple[Tensor, Tensor, Tensor]]
    attend: Callable[..., Tensor]
    row_blocks: Callable[[], bool]
    attn_out: nn.Module                      # the attention output projection (row-parallel under tp)
    post_norm: nn.Module
    ffn_in: tuple[nn.Module, nn.Module]      # gate and up projections (column-parallel)
    act: Callable[[Tensor], Tensor]
    ffn_out: nn.Module                       # the MLP output projection (row-parallel)


class DecoderAdapter:
    """A family of HF decoder-only causal LMs; subclasses fill in the class attributes and the family's parts."""

    architectures: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()
    prefix = "model"                               # base model attribute (HF base_model_prefix)
    sequence_parallel_children: tuple[str, ...] = ()  # children of a layer that run on the SP sequence slice
    layers_name = "layers"  # the decoder-layer list's attribute on the base model (GPT-2: h)
    mindformers_names: dict[str, list[str]] = {}  # HF name inside a layer -> MindFormers cell names
    mindformers_top_names: dict[str, list[str]] = {}  # the same for modules outside the layers (the head)
    mindformers_mtp = False  # MindFormers checkpoints hold MTP layers (num_nextn_predict_layers; models/mtp.py)
    lora_fan_in_fan_out = False                    # LoRA targets store W as [in, out] (HF Conv1D)

    # ------------------------------------------------------------------------------------------ which models
    def matches(self, architecture: str, model_type: Optional[str]) -> bool:
        return architecture in self.architectures and model_type in self.model_types

    def config_matches(self, config: Any) -> bool:
        archs = getattr(config, "architectures", None) or []
        return getattr(config, "model_type", None) in self.model_types and (
            not archs or any(a in self.architectures for a in archs))

    # ------------------------------------------------------------------------------------------ structure
    def base(self, part: nn.Module) -> nn.Module:
        return part.get_submodule(self.prefix)

    def layer_items(self, part: nn.Module) -> list[tuple[int, nn.Module]]:
        """(global layer index, layer) of every decoder layer the part holds, in order."""
        raise NotImplementedError

    def layers(self, part: nn.Module) -> list[nn.Module]:
        return [layer for _, layer in self.layer_items(part)]

    def output_head(self, part: nn.Module) -> Optional[nn.Module]:
        raise NotImplementedError

    def attention_types(self, part: nn.Module) -> set[str]:
        return {getattr(layer, "attention_type", "full_attention") for layer in self.layers(part)}

    # ------------------------------------------------------------------------------------------ tensor parallel
    def heads(self, config: Any, tp: int) -> tuple[int, int, bool]:
        raise NotImplementedError

    def tp_plan(self, config: Any, tp: int, *, sequence_parallel: bool = False,
                vocab_parallel: bool = False) -> dict[str, str]:
        raise NotImplementedError

    def set_local_heads(self, part: nn.Module, config: Any, tp: int) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------ interleave
    def layer_parts(self, layer: nn.Module) -> Optional[LayerParts]:
        """The layer's parts for the fine-grain steps, or None if it is not of the family's shape."""
        return None

    def layer_index(self, layer: nn.Module, default: int) -> int:
        return default

    def install_interleave(self, part: nn.Module, runner) -> None:
        """Run the part's decoder layers through `runner` (msparallel_ds.interleave's multi-copy stack)."""
        if isinstance(part, StageModule):
            part.interleaved = runner
            return
        base = self.base(part)
        if isinstance(base.layers, InterleavedLayers):
            base.layers.runner = runner
        else:
            base.layers = InterleavedLayers(base.layers, runner)

    def interleave_of(self, part: nn.Module):
        """The installed runner, or None."""
        if isinstance(part, StageModule):
            return part.interleaved
        return getattr(self.base(part).layers, "runner", None)

    # ------------------------------------------------------------------------------------------ pipeline
    def make_stage(self, model: nn.Module, layer_ids, *, first: bool, last: bool) -> nn.Module:
        raise NotImplementedError

    def merge_stages(self, stages: list[nn.Module]) -> nn.Module:
        return StageModule.merged(stages)

    def parameter_order(self, names) -> list[str]:
        """Parameter names in the HF model's order. A pipeline checkpoint lists each pp rank's stages in turn, so
        with virtual stages its decoder layers come out as 0, 2, 1, 3: they go back, ascending, into the slots the
        layers occupy; other names keep their places."""
        rx = re.compile(rf"{re.escape(self.prefix)}\.{self.layers_name}\.(\d+)\.")
        names = list(names)
        slots = [i for i, n in enumerate(names) if rx.match(n)]
        ordered = sorted(slots, key=lambda i: (int(rx.match(names[i]).group(1)), i))
        out = list(names)
        for slot, i in zip(slots, ordered):
            out[slot] = names[i]
        return out

    def mindformers_weights(self, config: Any, *, legacy: bool, qkv_interleaved: bool = True,
                            fc1_interleaved: bool = True) -> list:
        """The family's MindFormers <-> HF weight map (checkpoint/weight_map.py ops)."""
        raise ValueError(f"{type(self).__name__}: no MindFormers weight-name map for this family yet")

    def lora_targets(self, model: nn.Module, pattern: str, exclude: tuple[str, ...] = ()) -> list[str]:
        """Full names of the Linear modules MindFormers' LoRA would replace for `pattern` (pet_config.target_modules):
        it `re.match`es each cell's own name (pet/tuners/lora_adapter.py:65-67), so a module is a target when the last
        part of one of its MindFormers names matches and no exclude_layers regex does. Fused MindFormers cells
        (w_qkv, linear_fc1) stand for each HF projection they hold."""
        found = []
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            head, sep, rest = name.partition(".layers.")
            inner = rest.partition(".")[2] if sep else name
            cells = (self.mindformers_names if sep else self.mindformers_top_names).get(inner, [])
            own = {cell.rpartition(".")[2] for cell in cells}
            if any(re.match(pattern, c) for c in own) and not any(re.match(x, c) for x in exclude for c in own):
                found.append(name)
        return found

    def lora_block_targets(self, model: nn.Module, pattern: str, exclude: tuple[str, ...] = ()) -> dict:
        """Fused HF projections whose column blocks are separate MindFormers cells matched by `pattern`:
        {module name: ((cell name, first column, width), ...)} (pet.BlockLora puts one LoRA on each block)."""
        return {}

    def layer_count(self, model: nn.Module) -> int:
        return len(getattr(self.base(model), self.layers_name))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(self.architectures)})"


class InterleavedLayers(nn.ModuleList):
    """A HF base model's `layers` while its layers run interleaved: the same modules under the same names, so
    parameters, state-dict keys and hooks are untouched. HF's decoder loop (`for layer in self.layers[:n]`) gets
    one entry, the runner, which splits the batch into copies and runs every layer on them; indexing, len and
    iteration see the layers as before."""

    def __init__(self, layers: nn.ModuleList, runner):
        super().__init__(layers)
        self._runner = [runner]  # a plain list: the runner holds the layers, which must not register twice

    @property
    def runner(self):
        return self._runner[0]

    @runner.setter
    def runner(self, runner) -> None:
        self._runner = [runner]

    def __getitem__(self, idx):
        if isinstance(idx, slice) and range(len(self))[idx] == range(len(self)):
            return [self._runner[0]]
        return super().__getitem__(idx)
