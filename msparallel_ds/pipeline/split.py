"""Cut a HF decoder (Llama/Qwen2/Mistral family) into pipeline stage modules by MindFormers' layer rule.

Layer counts come from Plan.layers_per_stage ([vpp][pp] = num_layers // (pp*vpp) + offset, validated by
config.rules with errors naming `model.model_config.offset`). Global stage s (0 .. pp*vpp-1) runs consecutive layers:
interleaved / looped schedules put chunk c of pp rank r at s = c*pp + r (Megatron, torch's Interleaved1F1B);
zero_bubble_v puts chunk 0 at s = r and chunk 1 at s = 2pp-1-r (the V). offset[c][r] always means chunk c of pp rank
r, wherever that chunk sits in the order.

A StageModule keeps the HF module objects under the HF names (`model.embed_tokens`, `model.layers.<global index>`,
`model.norm`, `lm_head`): state-dict keys map 1:1 to the HF checkpoint. Each stage rebuilds RoPE and the causal mask
from position_ids (passed to every stage as a keyword), so only the hidden state crosses stage boundaries. The
first stage embeds, the last applies the final norm and lm_head and returns logits.
"""
from __future__ import annotations

from torch import Tensor, nn

__all__ = ["StageModule", "layer_ranges", "stage_chunks", "split_model"]


def stage_chunks(pp: int, vpp: int, rank: int, schedule: str | None) -> list[int]:
    """Global stage indices held by pp rank `rank`, in chunk order (chunk c -> list[c])."""
    if schedule == "zero_bubble_v":
        return [rank, 2 * pp - 1 - rank]
    return [rank + c * pp for c in range(vpp)]


def layer_ranges(counts: list[list[int]], schedule: str | None) -> list[range]:
    """[vpp][pp] layer counts -> the layer range of every global stage, in stage order."""
    vpp, pp = len(counts), len(counts[0])
    owner = {}  # global stage -> (chunk, rank)
    for r in range(pp):
        for c, s in enumerate(stage_chunks(pp, vpp, r, schedule)):
            owner[s] = (c, r)
    ranges, start = [], 0
    for s in range(pp * vpp):
        c, r = owner[s]
        ranges.append(range(start, start + counts[c][r]))
        start += counts[c][r]
    return ranges


def _attention_masks(config, hidden: Tensor, position_ids: Tensor, layers) -> dict:
    """The masks HF's decoder builds (one per attention type); computed for the full local sequence, which a
    sequence-parallel hidden state no longer shows, hence the stand-in tensor of the right shape."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    embeds = hidden.new_empty((position_ids.shape[0], position_ids.shape[1], 1))
    kw = dict(config=config, inputs_embeds=embeds, attention_mask=None, past_key_values=None,
              position_ids=position_ids)
    types = {getattr(layer, "attention_type", "full_attention") for layer in layers}
    masks = {"full_attention": create_causal_mask(**kw)}
    if "sliding_attention" in types:
        masks["sliding_attention"] = create_sliding_window_causal_mask(**kw)
    return masks


class _Body(nn.Module):
    """The base model's part of a stage, under the base model's attribute names."""

    def __init__(self, base: nn.Module, layer_ids, first: bool, last: bool):
        super().__init__()
        self.embed_tokens = base.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): base.layers[i] for i in layer_ids})
        self.norm = base.norm if last else None
        self.rotary_emb = base.rotary_emb


class StageModule(nn.Module):
    """One pipeline stage: forward(input_ids | hidden, position_ids=[b, s], **layer_kwargs) -> hidden | logits."""

    def __init__(self, model: nn.Module, layer_ids, *, first: bool, last: bool):
        super().__init__()
        prefix = model.base_model_prefix
        base = model.get_submodule(prefix)
        self.config, self.is_first, self.is_last, self.prefix = model.config, first, last, prefix
        self.layer_ids = list(layer_ids)
        self.add_module(prefix, _Body(base, self.layer_ids, first, last))
        self.lm_head = model.lm_head if last else None
        self.interleaved = None  # set by use_interleave: the layers run as copies / chunks (msparallel_ds.interleave)

    def use_interleave(self, n_copies: int, fine_grain: int) -> None:
        """micro_batch_interleave_num / fine_grain_interleave inside this stage: each pipeline micro-batch splits
        into n_copies copies whose tp/SP collectives overlap the other copies' compute (no math change)."""
        from ..interleave.multi_copy import InterleavedStack

        types = {getattr(layer, "attention_type", "full_attention") for layer in self.body.layers.values()}
        if len(types) > 1:
            raise ValueError(f"micro_batch_interleave_num / fine_grain_interleave: layers of several attention types "
                             f"{sorted(types)} (sliding-window layers) are not supported; set both to 1")
        # a plain list: the stack must not register the layers a second time under its own names
        self.interleaved = [InterleavedStack(nn.ModuleList(self.body.layers.values()), n_copies, fine_grain)]

    @property
    def body(self) -> _Body:
        return getattr(self, self.prefix)

    def forward(self, x: Tensor, position_ids: Tensor, **kwargs) -> Tensor:
        body = self.body
        hidden = body.embed_tokens(x) if self.is_first else x
        layers = list(body.layers.values())
        masks = _attention_masks(self.config, hidden, position_ids, layers)
        position_embeddings = body.rotary_emb(hidden, position_ids=position_ids)
        if self.interleaved:
            hidden = self.interleaved[0](hidden, attention_mask=masks["full_attention"],
                                         position_embeddings=position_embeddings, position_ids=position_ids,
                                         use_cache=False, **kwargs)
        for layer in layers if not self.interleaved else ():
            hidden = layer(hidden, attention_mask=masks[getattr(layer, "attention_type", "full_attention")],
                           position_embeddings=position_embeddings, position_ids=position_ids, use_cache=False,
                           **kwargs)
        if not self.is_last:
            return hidden
        return self.lm_head(body.norm(hidden))


def split_model(model: nn.Module, counts: list[list[int]], pp_rank: int, schedule: str | None
                ) -> tuple[list[StageModule], StageModule, list[int]]:
    """This pp rank's stages of `model` (tp/cp already applied), a view holding all its layers under HF names (for
    state dicts and the optimizer), and the global stage indices. The engine keeps only these; `model` itself (and
    the other ranks' layers) is no longer referenced by it."""
    if getattr(model.config, "tie_word_embeddings", False):
        raise ValueError("tie_word_embeddings=true with parallel_config.pipeline_stage > 1: the embedding (first "
                         "stage) and lm_head (last stage) would need a cross-stage gradient sum, which is not "
                         "implemented; untie them (model.config.tie_word_embeddings=False and a separate lm_head) "
                         "or use pipeline_stage: 1")
    vpp, pp = len(counts), len(counts[0])
    n_layers = len(model.get_submodule(model.base_model_prefix).layers)
    if sum(map(sum, counts)) != n_layers:
        raise ValueError(f"model.model_config.num_layers: the YAML's layer split {counts} covers "
                         f"{sum(map(sum, counts))} layers but the model has {n_layers}; set num_layers: {n_layers} "
                         "(and offsets summing to its remainder)")
    ranges = layer_ranges(counts, schedule)
    ids = stage_chunks(pp, vpp, pp_rank, schedule)
    last = pp * vpp - 1
    stages = [StageModule(model, ranges[s], first=s == 0, last=s == last) for s in ids]
    mine = sorted(i for s in ids for i in ranges[s])
    view = StageModule(model, mine, first=0 in ids, last=last in ids)
    return stages, view, ids
