"""One pipeline stage of a HF decoder, under the HF parameter names (`model.embed_tokens`, `model.layers.<global
index>`, `model.norm`, `lm_head`), so state-dict keys, TP plan patterns and the shard spec are the full model's.

forward(input_ids | hidden, position_ids=[b, s], **layer_kwargs) -> hidden | logits: each stage rebuilds RoPE and
the causal masks from position_ids (passed to every stage as a keyword), so only the hidden state crosses stage
boundaries. The first stage embeds, the last applies the final norm and lm_head and returns logits.
Multi-token prediction (models.mtp) runs on the last stage: it holds the MTP layers (under their HF names
`model.layers.{N+k}`, after the decoder's N) and the word embedding's copy (pipeline.shared), gets depth k's shifted
ids as the keyword `mtp_ids` [b, D, s] and returns (logits, depth 1 logits, ..., depth D logits).
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

__all__ = ["StageModule", "attention_masks"]


def attention_masks(config, hidden: Tensor, position_ids: Tensor, layers) -> dict:
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

    def __init__(self, embed_tokens: Optional[nn.Module], layers: dict[int, nn.Module], norm: Optional[nn.Module],
                 rotary_emb: nn.Module):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleDict({str(i): layer for i, layer in sorted(layers.items())})
        self.norm = norm
        self.rotary_emb = rotary_emb


class StageModule(nn.Module):
    """One pipeline stage (see the module docstring). `interleaved`: the layers' multi-copy runner, when the
    stage runs micro_batch_interleave_num / fine_grain_interleave (msparallel_ds.interleave), else None."""

    def __init__(self, config, prefix: str, body: _Body, lm_head: Optional[nn.Module], *, first: bool, last: bool):
        super().__init__()
        self.config, self.is_first, self.is_last, self.prefix = config, first, last, prefix
        n = config.num_hidden_layers
        self.layer_ids = [int(i) for i in body.layers if int(i) < n]  # decoder layers; MTP layers come after them
        self.add_module(prefix, body)
        self.lm_head = lm_head
        self._runner: Optional[list] = None  # a plain list: the runner must not register the layers again
        self.mtp = None  # models.mtp.StageMTP on a last stage running multi-token prediction

    @classmethod
    def cut(cls, model: nn.Module, layer_ids, *, first: bool, last: bool, mtp: int = 0) -> StageModule:
        """Layers `layer_ids` of a HF causal LM, with the embedding if `first`, the norm and lm_head if `last`; a
        last stage with `mtp` MTP layers holds them and the embedding too (its copy of the first stage's)."""
        prefix = model.base_model_prefix
        base = model.get_submodule(prefix)
        ids = list(layer_ids) + (list(range(model.config.num_hidden_layers, len(base.layers))) if last and mtp else [])
        body = _Body(base.embed_tokens if first or (last and mtp) else None, {i: base.layers[i] for i in ids},
                     base.norm if last else None, base.rotary_emb)
        return cls(model.config, prefix, body, model.lm_head if last else None, first=first, last=last)

    @classmethod
    def merged(cls, stages: list[StageModule]) -> StageModule:
        """One module holding every module of `stages` under the HF names (a pipeline rank's view of its chunks,
        for state dicts and the optimizer); built after the stages were parallelized, so it sees their modules."""
        head = next((s for s in stages if s.is_first), None)
        tail = next((s for s in stages if s.is_last), None)
        layers = {int(i): layer for s in stages for i, layer in s.body.layers.items()}
        embed = (head or tail).body.embed_tokens if head or tail else None  # a last stage's copy (MTP) too
        body = _Body(embed, layers, tail.body.norm if tail else None, stages[0].body.rotary_emb)
        return cls(stages[0].config, stages[0].prefix, body, tail.lm_head if tail else None, first=head is not None,
                   last=tail is not None)

    @property
    def body(self) -> _Body:
        return getattr(self, self.prefix)

    @property
    def interleaved(self):
        return self._runner[0] if self._runner else None

    @interleaved.setter
    def interleaved(self, runner) -> None:
        self._runner = None if runner is None else [runner]

    def forward(self, x: Tensor, position_ids: Tensor, mtp_ids: Optional[Tensor] = None, **kwargs):
        body = self.body
        hidden = body.embed_tokens(x) if self.is_first else x
        layers = [body.layers[str(i)] for i in self.layer_ids]
        masks = attention_masks(self.config, hidden, position_ids, layers)
        position_embeddings = body.rotary_emb(hidden, position_ids=position_ids)
        common = dict(position_embeddings=position_embeddings, position_ids=position_ids, use_cache=False, **kwargs)
        if self.interleaved is not None:
            hidden = self.interleaved(hidden, attention_mask=masks["full_attention"], **common)
        else:
            for layer in layers:
                hidden = layer(hidden, attention_mask=masks[getattr(layer, "attention_type", "full_attention")],
                               **common)
        if not self.is_last:
            return hidden
        out = body.norm(hidden)
        logits = self.lm_head(out)
        if self.mtp is None:
            return logits
        ctx = dict(attention_mask=masks["full_attention"], position_embeddings=position_embeddings,
                   position_ids=position_ids, **kwargs)
        hs = self.mtp.run(out, hidden, body.embed_tokens, mtp_ids.unbind(1), ctx)
        return (logits, *(self.lm_head(h) for h in hs))
